#include "trainer/opd_config.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "trainer/opd_loss.h"

namespace trainer {
namespace {

absl::Status Bad(const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": ", what));
}

absl::Status ValidateStages(const OpdConfig& c) {
  if (c.stages.empty()) return Bad("stages", "at least one stage is required");
  std::set<std::string> names;
  for (size_t i = 0; i < c.stages.size(); ++i) {
    const auto& s = c.stages[i];
    const std::string key = absl::StrCat("stages[", i, "]");
    if (s.name.empty()) return Bad(key + ".name", "required");
    if (!names.insert(s.name).second)
      return Bad(key + ".name", absl::StrCat("duplicate stage name '", s.name, "'"));
    if (s.teachers.empty())
      return Bad(key + ".teachers", "at least one teacher endpoint is required");
    if (s.max_steps < 0) return Bad(key + ".max_steps", "must be >= 0");
    if (s.max_steps == 0 && !s.plateau.enabled) {
      return Bad(key, "needs a convergence rule: max_steps > 0 and/or plateau.enabled");
    }
    if (s.plateau.enabled && s.plateau.window < 1)
      return Bad(key + ".plateau.window", "must be >= 1");
    if (s.plateau.ema_beta < 0 || s.plateau.ema_beta >= 1)
      return Bad(key + ".plateau.ema_beta", "must be in [0, 1)");
  }
  return absl::OkStatus();
}

absl::Status ValidateLoss(const OpdLossConfig& l) {
  if (l.form != "sampled" && l.form != "topk")
    return Bad("loss.form", absl::StrCat("'", l.form, "' (sampled | topk)"));
  if (auto s = opd::ParseCorrection(l.correction); !s.ok())
    return Bad("loss.correction", std::string(s.status().message()));
  if (auto s = opd::ParseTopKDivergence(l.divergence); !s.ok())
    return Bad("loss.divergence", std::string(s.status().message()));
  if (l.form == "topk" && l.top_k < 1) return Bad("loss.top_k", "must be >= 1 for the topk form");
  if (l.alpha < 0 || l.alpha > 1) return Bad("loss.alpha", "must be in [0, 1]");
  if (l.teacher_temperature <= 0) return Bad("loss.teacher_temperature", "must be > 0");
  if (l.tis_cap <= 0) return Bad("loss.tis_cap", "must be > 0");
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOpdConfig(const OpdConfig& c) {
  if (c.model.path.empty()) return Bad("model.path", "required (the student's HF model directory)");
  if (c.run.dir.empty()) return Bad("run.dir", "required");
  if (c.run.resume != "auto" && c.run.resume != "never") return Bad("run.resume", "auto | never");
  if (c.prompts.sources.empty())
    return Bad("prompts.sources", "at least one prompt source is required");
  if (c.prompts.max_prompt_len < 1) return Bad("prompts.max_prompt_len", "must be >= 1");
  if (c.rollout.endpoints.empty())
    return Bad("rollout.endpoints", "at least one rollout worker is required");
  if (c.rollout.samples_per_prompt < 1) return Bad("rollout.samples_per_prompt", "must be >= 1");
  if (c.rollout.max_new_tokens < 1) return Bad("rollout.max_new_tokens", "must be >= 1");
  if (c.rollout.temperature <= 0)
    return Bad("rollout.temperature", "must be > 0 (on-policy sampling)");
  if (c.train.prompts_per_step < 1) return Bad("train.prompts_per_step", "must be >= 1");
  if (c.train.micro_batch_tokens < 1) return Bad("train.micro_batch_tokens", "must be >= 1");
  if (c.train.device != "auto" && c.train.device != "cpu" && c.train.device != "cuda") {
    return Bad("train.device", "auto | cpu | cuda");
  }
  if (c.optim.lr <= 0) return Bad("optim.lr", "must be > 0");
  if (absl::Status s = ValidateStages(c); !s.ok()) return s;
  if (absl::Status s = ValidateAuthConfig(c.auth, c.admin.listen); !s.ok()) return s;
  return ValidateLoss(c.loss);
}

}  // namespace trainer
