#include "trainer/opd/opd_config.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"
#include "trainer/common/config.h"
#include "trainer/opd/opd_loss.h"

namespace trainer {
namespace {

absl::Status Bad(const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": ", what));
}

absl::Status ValidatePlateau(const std::string& key, const PlateauConfig& p) {
  if (p.enabled) {
    RETURN_IF_ERROR(validate::IntAtLeast(key + ".window", p.window, 1));
    // 0 could never fire (a change is never < 0): the stage would run forever.
    RETURN_IF_ERROR(validate::Above(key + ".min_rel_improvement", p.min_rel_improvement, 0));
  }
  RETURN_IF_ERROR(validate::Finite(key + ".min_rel_improvement", p.min_rel_improvement));
  RETURN_IF_ERROR(validate::InHalfOpen(key + ".ema_beta", p.ema_beta, 0, 1));
  return validate::IntAtLeast(key + ".min_steps", p.min_steps, 0);
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
    RETURN_IF_ERROR(validate::IntAtLeast(key + ".max_steps", s.max_steps, 0));
    if (s.max_steps == 0 && !s.plateau.enabled) {
      return Bad(key, "needs a convergence rule: max_steps > 0 and/or plateau.enabled");
    }
    RETURN_IF_ERROR(ValidatePlateau(key + ".plateau", s.plateau));
  }
  return absl::OkStatus();
}

// The learner's log-probs (and with them the importance ratio, its truncation or clip, and the
// logged sampler/learner mismatch) are the full softmax at the rollout temperature, while the
// sampler reports log-probs renormalised over the top-k / top-p set it drew from. Refusing the
// filters is the correct choice, not only the simple one: computing the learner's log-probs
// under the same filter would train the filtered policy (whose support moves with the logits
// and has no gradient), and the tokens a filter removes are never sampled, so no ratio can
// correct the reverse-KL estimate for them. On-policy distillation samples from the policy it
// trains. (top_k >= vocabulary would be harmless but is refused too: the vocabulary is not
// known here, and 0 says "off" plainly.)
absl::Status ValidateRollout(const OpdRolloutConfig& r) {
  if (r.endpoints.empty())
    return Bad("rollout.endpoints", "at least one rollout worker is required");
  RETURN_IF_ERROR(validate::IntAtLeast("rollout.samples_per_prompt", r.samples_per_prompt, 1));
  RETURN_IF_ERROR(validate::IntAtLeast("rollout.max_new_tokens", r.max_new_tokens, 1));
  RETURN_IF_ERROR(validate::Above("rollout.temperature", r.temperature, 0));
  if (!(r.top_p == 1.0)) {
    return Bad("rollout.top_p",
               absl::StrCat("must be 1.0 for OPD, got ", r.top_p,
                            ": the learner's log-probs are over the whole vocabulary, so a "
                            "nucleus filter would bias the importance ratio"));
  }
  if (r.top_k != 0) {
    return Bad("rollout.top_k",
               absl::StrCat("must be 0 (off) for OPD, got ", r.top_k,
                            ": the learner's log-probs are over the whole vocabulary, so a "
                            "top-k filter would bias the importance ratio"));
  }
  if (r.weight_sync != "grpc" && r.weight_sync != "collective" && r.weight_sync != "auto")
    return Bad("rollout.weight_sync",
               absl::StrCat("'", r.weight_sync, "': use grpc, collective or auto"));
  RETURN_IF_ERROR(validate::Above("rollout.weight_sync_timeout_s", r.weight_sync_timeout_s, 0));
  RETURN_IF_ERROR(
      validate::IntAtLeast("rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb, 1));
  return validate::Above("rollout.timeout_s", r.timeout_s, 0);
}

absl::Status ValidateTrain(const OpdTrainConfig& t) {
  RETURN_IF_ERROR(validate::IntAtLeast("train.prompts_per_step", t.prompts_per_step, 1));
  RETURN_IF_ERROR(validate::IntAtLeast("train.micro_batch_tokens", t.micro_batch_tokens, 1));
  RETURN_IF_ERROR(validate::Above("train.teacher_timeout_s", t.teacher_timeout_s, 0));
  return validate::Above("train.score_deadline_s", t.score_deadline_s, 0);
}

absl::Status ValidateLoss(const OpdLossConfig& l) {
  RETURN_IF_ERROR(validate::OneOf("loss.form", l.form, {"sampled", "topk"}));
  if (auto s = ParseCorrection(l.correction); !s.ok())
    return Bad("loss.correction", std::string(s.status().message()));
  if (auto s = ParseTopKDivergence(l.divergence); !s.ok())
    return Bad("loss.divergence", std::string(s.status().message()));
  if (l.form == "topk") RETURN_IF_ERROR(validate::IntAtLeast("loss.top_k", l.top_k, 1));
  RETURN_IF_ERROR(validate::Above("loss.kl_coef", l.kl_coef, 0));
  RETURN_IF_ERROR(validate::Above("loss.tis_cap", l.tis_cap, 0));
  RETURN_IF_ERROR(validate::InHalfOpen("loss.clip_low", l.clip_low, 0, 1));  // ratio >= 1 - low
  RETURN_IF_ERROR(validate::AtLeast("loss.clip_high", l.clip_high, 0));
  RETURN_IF_ERROR(validate::InRange("loss.alpha", l.alpha, 0, 1));
  if (auto s = ParseNormalization(l.normalization); !s.ok())
    return Bad("loss.normalization", std::string(s.status().message()));
  RETURN_IF_ERROR(validate::InRange("loss.kl_discount", l.kl_discount, 0, 1));
  return validate::Above("loss.teacher_temperature", l.teacher_temperature, 0);
}

absl::Status ValidateDebug(const OpdDebugConfig& d) {
  for (size_t i = 0; i < d.nan_steps.size(); ++i)
    RETURN_IF_ERROR(
        validate::IntAtLeast(absl::StrCat("debug.nan_steps[", i, "]"), d.nan_steps[i], 1));
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOpdConfig(const OpdConfig& c) {
  RETURN_IF_ERROR(
      ValidateSharedSections(c.model, c.train, c.optim, c.checkpoint, c.logging, c.run, c.dist));
  if (c.prompts.sources.empty())
    return Bad("prompts.sources", "at least one prompt source is required");
  RETURN_IF_ERROR(ValidateSources("prompts.sources", c.prompts.sources));
  RETURN_IF_ERROR(validate::IntAtLeast("prompts.max_prompt_len", c.prompts.max_prompt_len, 1));
  RETURN_IF_ERROR(ValidateRollout(c.rollout));
  RETURN_IF_ERROR(ValidateTrain(c.train));
  RETURN_IF_ERROR(ValidateStages(c));
  RETURN_IF_ERROR(ValidateLoss(c.loss));
  RETURN_IF_ERROR(ValidateAuthConfig(c.auth, c.admin.listen));
  return ValidateDebug(c.debug);
}

std::vector<std::string> OpdConfigWarnings(const OpdConfig& c) {
  std::vector<std::string> out;
  if (c.loss.teacher_temperature != c.rollout.temperature) {
    out.push_back(absl::StrCat(
        "loss.teacher_temperature (", c.loss.teacher_temperature,
        ") differs from rollout.temperature (", c.rollout.temperature,
        "): the teacher is scored at another temperature than the student samples and learns "
        "at, so the reverse KL cannot reach 0 even for a student equal to its teacher"));
  }
  return out;
}

}  // namespace trainer
