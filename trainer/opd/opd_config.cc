#include "trainer/opd/opd_config.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "lm/util/config.h"
#include "lm/util/limits.h"
#include "lm/util/status.h"
#include "rpc/http_teacher.h"

namespace trainer {
namespace {

absl::Status Bad(const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": ", what));
}

// Below lm::kMinTemperature logits / T stops being finite in fp32 (1e-45 gave NaN log-probs);
// above lm::kMaxTemperature it is a typo (lm/util/limits.h says why).
absl::Status Temperature(const std::string& key, double t) {
  return lm::validate::InRange(key, t, lm::kMinTemperature, lm::kMaxTemperature);
}

absl::Status ValidatePlateau(const std::string& key, const PlateauConfig& p) {
  // The window is read even when the rule is off (the tracker keeps window + 1 values).
  RETURN_IF_ERROR(lm::validate::IntInRange(key + ".window", p.window, 1, limits::kMaxSteps));
  // 0 could never fire (a change is never < 0): the stage would run forever.
  if (p.enabled)
    RETURN_IF_ERROR(lm::validate::Above(key + ".min_rel_improvement", p.min_rel_improvement, 0));
  RETURN_IF_ERROR(lm::validate::AtLeast(key + ".min_rel_improvement", p.min_rel_improvement, 0));
  RETURN_IF_ERROR(lm::validate::InHalfOpen(key + ".ema_beta", p.ema_beta, 0, 1));
  RETURN_IF_ERROR(lm::validate::InRange(key + ".z", p.z, 0, 10));
  return lm::validate::IntInRange(key + ".min_steps", p.min_steps, 0, limits::kMaxSteps);
}

absl::Status ValidateHeldout(const OpdConfig& c) {
  const OpdHeldoutConfig& h = c.heldout;
  for (size_t i = 0; i < c.stages.size(); ++i) {
    if (c.stages[i].plateau.metric == PlateauMetric::kHeldout && h.sources.empty())
      return Bad(absl::StrCat("stages[", i, "].plateau.metric"),
                 "'heldout' needs held-out prompts (heldout.sources)");
  }
  if (h.sources.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(ValidateSources("heldout.sources", h.sources));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("heldout.num_prompts", h.num_prompts, 1, limits::kMaxBatch));
  return lm::validate::IntInRange("heldout.every", h.every, 1, limits::kMaxSteps);
}

// A pool's endpoints: distinct, an external server's well formed, and none a vLLM server when
// the teacher temperature is not 1 (vLLM cannot apply one to prompt log-probs: refused here, not
// when the stage first scores).
absl::Status ValidateTeachers(const std::string& key, const std::vector<std::string>& teachers,
                              double teacher_temperature) {
  if (teachers.empty()) return Bad(key, "at least one teacher endpoint is required");
  RETURN_IF_ERROR(lm::validate::DistinctNonEmpty(key, teachers));
  for (size_t t = 0; t < teachers.size(); ++t) {
    const std::string tkey = absl::StrCat(key, "[", t, "]");
    if (!opd::rpc::IsHttpTeacherEndpoint(teachers[t])) continue;
    auto address = opd::rpc::ParseHttpTeacherAddress(teachers[t]);
    if (!address.ok()) return Bad(tkey, std::string(address.status().message()));
    if (address->kind == opd::rpc::HttpTeacherKind::kVllm && teacher_temperature != 1.0) {
      return Bad(tkey, absl::StrCat("'", teachers[t],
                                    "' is a vLLM server, which cannot apply "
                                    "loss.teacher_temperature ",
                                    teacher_temperature,
                                    " to prompt log-probs: use temperature 1 or an opd-teacher "
                                    "endpoint"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateDomains(const std::string& key, const OpdStageConfig& s,
                             double teacher_temperature) {
  std::set<std::string> domains;
  for (size_t d = 0; d < s.domains.size(); ++d) {
    const auto& dom = s.domains[d];
    const std::string dkey = absl::StrCat(key, ".domains[", d, "]");
    if (dom.domain.empty()) return Bad(dkey + ".domain", "required");
    if (!domains.insert(dom.domain).second)
      return Bad(dkey + ".domain", absl::StrCat("duplicate domain '", dom.domain, "'"));
    RETURN_IF_ERROR(ValidateTeachers(dkey + ".teachers", dom.teachers, teacher_temperature));
  }
  if (s.plateau.per_domain) {
    if (s.domains.empty()) return Bad(key + ".plateau.per_domain", "needs the stage's domains");
    if (s.plateau.metric == PlateauMetric::kHeldout)
      return Bad(key + ".plateau.per_domain", "watches the training KL: use metric train");
    if (!s.plateau.enabled) return Bad(key + ".plateau.per_domain", "needs plateau.enabled");
  }
  return absl::OkStatus();
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
    RETURN_IF_ERROR(ValidateTeachers(key + ".teachers", s.teachers, c.loss.teacher_temperature));
    // The job sums the stages' budgets: bounded, the sum cannot overflow.
    RETURN_IF_ERROR(
        lm::validate::IntInRange(key + ".max_steps", s.max_steps, 0, limits::kMaxSteps));
    if (s.max_steps == 0 && !s.plateau.enabled) {
      return Bad(key, "needs a convergence rule: max_steps > 0 and/or plateau.enabled");
    }
    RETURN_IF_ERROR(ValidatePlateau(key + ".plateau", s.plateau));
    RETURN_IF_ERROR(ValidateDomains(key, s, c.loss.teacher_temperature));
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
  RETURN_IF_ERROR(lm::validate::DistinctNonEmpty("rollout.endpoints", r.endpoints));
  // The sampler takes both as int32; samples_per_prompt also multiplies the step's prompts, whose
  // samples are all held at once.
  RETURN_IF_ERROR(lm::validate::IntInRange("rollout.samples_per_prompt", r.samples_per_prompt, 1,
                                           limits::kMaxBatch));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("rollout.max_new_tokens", r.max_new_tokens, 1, limits::kMaxTokens));
  RETURN_IF_ERROR(Temperature("rollout.temperature", r.temperature));
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
  RETURN_IF_ERROR(lm::validate::AboveAtMost("rollout.weight_sync_timeout_s",
                                            r.weight_sync_timeout_s, 0, limits::kMaxTimeoutS));
  RETURN_IF_ERROR(lm::validate::IntInRange("rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb,
                                           1, limits::kMaxBucketMb));
  // rollout.seed: any int64 (used as its uint64 bits).
  return lm::validate::AboveAtMost("rollout.timeout_s", r.timeout_s, 0, limits::kMaxTimeoutS);
}

absl::Status ValidateTrain(const OpdTrainConfig& t) {
  RETURN_IF_ERROR(
      lm::validate::IntInRange("train.prompts_per_step", t.prompts_per_step, 1, limits::kMaxBatch));
  RETURN_IF_ERROR(lm::validate::IntInRange("train.micro_batch_tokens", t.micro_batch_tokens, 1,
                                           limits::kMaxTokens));
  RETURN_IF_ERROR(lm::validate::AboveAtMost("train.teacher_timeout_s", t.teacher_timeout_s, 0,
                                            limits::kMaxTimeoutS));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("train.score_calls_per_pool", t.score_calls_per_pool, 1, 64));
  RETURN_IF_ERROR(lm::validate::IntInRange("train.score_call_tokens", t.score_call_tokens, 0,
                                           limits::kMaxTokens));
  return lm::validate::AboveAtMost("train.score_deadline_s", t.score_deadline_s, 0,
                                   limits::kMaxTimeoutS);
}

absl::Status ValidateLoss(const OpdLossConfig& l) {
  // Unused (and never sent) by the sampled form; k ids of a vocabulary (bounded as token counts).
  if (l.form == LossForm::kTopK)
    RETURN_IF_ERROR(lm::validate::IntInRange("loss.top_k", l.top_k, 1, limits::kMaxTokens));
  RETURN_IF_ERROR(lm::validate::Above("loss.kl_coef", l.kl_coef, 0));
  RETURN_IF_ERROR(lm::validate::Above("loss.tis_cap", l.tis_cap, 0));
  RETURN_IF_ERROR(lm::validate::InHalfOpen("loss.clip_low", l.clip_low, 0, 1));  // ratio >= 1 - low
  RETURN_IF_ERROR(lm::validate::AtLeast("loss.clip_high", l.clip_high, 0));
  RETURN_IF_ERROR(lm::validate::InRange("loss.alpha", l.alpha, 0, 1));
  RETURN_IF_ERROR(lm::validate::InRange("loss.kl_discount", l.kl_discount, 0, 1));
  if (l.form == LossForm::kTopK) {
    // The top-k form is an exact divergence over the teacher's top-k buckets at every position:
    // nothing is sampled in it, so a sampling correction or a discount over the rest of a
    // response has no meaning there. Refused rather than ignored (the defaults pass: they are
    // what the sampled form does when nothing is set).
    const OpdLossConfig defaults;
    if (l.correction == Correction::kPpoClip)
      return Bad("loss.correction", "ppo applies to the sampled form only (loss.form: topk)");
    if (l.kl_discount != 0)
      return Bad("loss.kl_discount", "applies to the sampled form only (loss.form: topk)");
    if (l.tis_cap != defaults.tis_cap)
      return Bad("loss.tis_cap", "applies to the sampled form only (loss.form: topk)");
    if (l.clip_low != defaults.clip_low || l.clip_high != defaults.clip_high)
      return Bad("loss.clip_low/clip_high", "apply to the sampled form only (loss.form: topk)");
  }
  return Temperature("loss.teacher_temperature", l.teacher_temperature);
}

absl::Status ValidateSteps(const std::string& key, const std::vector<int64_t>& steps) {
  for (size_t i = 0; i < steps.size(); ++i)
    RETURN_IF_ERROR(
        lm::validate::IntInRange(absl::StrCat(key, "[", i, "]"), steps[i], 1, limits::kMaxSteps));
  return absl::OkStatus();
}

absl::Status ValidateDebug(const OpdDebugConfig& d) {
  RETURN_IF_ERROR(ValidateSteps("debug.nan_steps", d.nan_steps));
  RETURN_IF_ERROR(ValidateSteps("debug.fail_push_steps", d.fail_push_steps));
  RETURN_IF_ERROR(ValidateSteps("debug.throw_while_learning_steps", d.throw_while_learning_steps));
  RETURN_IF_ERROR(ValidateSteps("debug.fail_stage_starts", d.fail_stage_starts));
  RETURN_IF_ERROR(lm::validate::IntInRange("debug.fail_rank", d.fail_rank, -1, 1 << 20));
  return ValidateSteps("debug.throw_after_update_steps", d.throw_after_update_steps);
}

}  // namespace

absl::Status ValidateOpdConfig(const OpdConfig& c) {
  RETURN_IF_ERROR(
      ValidateSharedSections(c.model, c.train, c.optim, c.checkpoint, c.logging, c.run, c.dist));
  if (c.prompts.sources.empty())
    return Bad("prompts.sources", "at least one prompt source is required");
  RETURN_IF_ERROR(ValidateSources("prompts.sources", c.prompts.sources));
  // The prompt dataset takes it as an int32. prompts.seed: any int64 (its uint64 bits).
  RETURN_IF_ERROR(lm::validate::IntInRange("prompts.max_prompt_len", c.prompts.max_prompt_len, 1,
                                           limits::kMaxTokens));
  RETURN_IF_ERROR(ValidateRollout(c.rollout));
  RETURN_IF_ERROR(ValidateTrain(c.train));
  RETURN_IF_ERROR(ValidateStages(c));
  RETURN_IF_ERROR(ValidateHeldout(c));
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
