// The config of `opd-trainer opd`: configs/opd/*.yaml decode into OpdConfig
// (lm/util/config.h). Defaults are the Marco-MoE paper's OPD recipe: 512 prompts per step, 2
// samples per prompt, prompts <= 2048 tokens, responses <= 8192, temperature 1.0, top-p 1.0,
// constant lr 1e-6, AdamW as in SFT, the sampled-token reverse-KL loss.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lm/generate/sampling.h"
#include "lm/util/config.h"
#include "trainer/common/auth_config.h"
#include "trainer/common/sections.h"
#include "trainer/sft/sft_config.h"

namespace trainer {

// The choice fields' enums (lm/util/config.h), used as they are by the code they configure.

// rollout.weight_sync: how weights reach the workers (trainer/opd/weight_push.h).
enum class WeightSyncMode { kGrpc, kCollective, kAuto };
inline const lm::ConfigChoices<WeightSyncMode>& Choices(WeightSyncMode) {
  static const lm::ConfigChoices<WeightSyncMode> c{{"grpc", WeightSyncMode::kGrpc},
                                                   {"collective", WeightSyncMode::kCollective},
                                                   {"auto", WeightSyncMode::kAuto}};
  return c;
}

// stages[].plateau.metric: what the convergence rule watches. auto: the held-out evaluations when
// a held-out set is given (the training KL is another batch's every step, too noisy to judge a
// plateau at a small lr), else the training KL.
enum class PlateauMetric { kAuto, kTrain, kHeldout };
inline const lm::ConfigChoices<PlateauMetric>& Choices(PlateauMetric) {
  static const lm::ConfigChoices<PlateauMetric> c{{"auto", PlateauMetric::kAuto},
                                                  {"train", PlateauMetric::kTrain},
                                                  {"heldout", PlateauMetric::kHeldout}};
  return c;
}

// A stage's plateau metric once `auto` is resolved against the config's held-out set (per-domain
// rules watch each domain's training KL).
inline PlateauMetric ResolvedPlateauMetric(PlateauMetric m, bool heldout_set, bool per_domain) {
  if (m != PlateauMetric::kAuto) return m;
  return heldout_set && !per_domain ? PlateauMetric::kHeldout : PlateauMetric::kTrain;
}

// loss.form, loss.correction, loss.divergence, loss.normalization (trainer/opd/opd_loss.h).
enum class LossForm { kSampled, kTopK };
inline const lm::ConfigChoices<LossForm>& Choices(LossForm) {
  static const lm::ConfigChoices<LossForm> c{{"sampled", LossForm::kSampled},
                                             {"topk", LossForm::kTopK}};
  return c;
}

enum class Correction { kNone, kTruncatedIs, kPpoClip };
inline const lm::ConfigChoices<Correction>& Choices(Correction) {
  static const lm::ConfigChoices<Correction> c{{"none", Correction::kNone},
                                               {"tis", Correction::kTruncatedIs},
                                               {"ppo", Correction::kPpoClip}};
  return c;
}

enum class TopKDivergence { kForward, kReverse, kMixed };
inline const lm::ConfigChoices<TopKDivergence>& Choices(TopKDivergence) {
  static const lm::ConfigChoices<TopKDivergence> c{{"forward", TopKDivergence::kForward},
                                                   {"reverse", TopKDivergence::kReverse},
                                                   {"mixed", TopKDivergence::kMixed}};
  return c;
}

enum class Normalization { kToken, kSequence };
inline const lm::ConfigChoices<Normalization>& Choices(Normalization) {
  static const lm::ConfigChoices<Normalization> c{{"token", Normalization::kToken},
                                                  {"sequence", Normalization::kSequence}};
  return c;
}

// stages[].on_domain_down: what a step does when every replica of a domain's pool is down.
enum class DomainDownPolicy { kFail, kDefaultPool };
inline const lm::ConfigChoices<DomainDownPolicy>& Choices(DomainDownPolicy) {
  static const lm::ConfigChoices<DomainDownPolicy> c{
      {"fail", DomainDownPolicy::kFail}, {"default_pool", DomainDownPolicy::kDefaultPool}};
  return c;
}

struct OpdPromptsConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  // JSONL prompts (messages without the final assistant turn, or "prompt")
  OPD_FIELD(std::vector<SftSourceConfig>, sources);
  OPD_FIELD(int64_t, max_prompt_len) = 2048;  // longer prompts are dropped and counted
  OPD_FIELD(bool, shuffle) = true;
  OPD_FIELD(int64_t, seed) = 0;
  OPD_FIELD(bool, skip_bad_lines) = false;
  OPD_CONFIG_FIELDS_END;
};

// The rollout section: the sampling settings (lm::SamplingParams' fields: samples_per_prompt,
// temperature, top_p, top_k, max_new_tokens, seed, with the paper's defaults below; top_p must
// stay 1.0 (off) and top_k 0, see ValidateOpdConfig; each step samples with seed mixed with its
// data position, trainer/opd/sample_source.h) and where the workers are and how they get weights.
struct OpdRolloutConfig : lm::SamplingParams {
  OpdRolloutConfig() {
    samples_per_prompt = 2;
    max_new_tokens = 8192;
  }
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_CONFIG_BASE(lm::SamplingParams);
  OPD_FIELD(std::vector<std::string>, endpoints);  // rollout workers (host:port); required
  OPD_FIELD(double, timeout_s) = 3600;             // deadline of one Generate call
  // How weights reach the workers: grpc (streamed), collective (broadcast over a c10d group
  // per worker, gRPC as the control plane) or auto (collective where the group forms, else
  // gRPC with a warning). See trainer/opd/weight_push.h.
  OPD_FIELD(WeightSyncMode, weight_sync) = WeightSyncMode::kGrpc;
  // the learner's address as the workers reach it ("": 127.0.0.1 for loopback workers, else
  // hostname)
  OPD_FIELD(std::string, weight_sync_host);
  OPD_FIELD(double, weight_sync_timeout_s) = 120;  // group rendezvous and each broadcast
  OPD_FIELD(int64_t, weight_sync_bucket_mb) = 64;  // broadcast bucket (one cast buffer per worker)
  // Routing replay (R3, slime's --use-rollout-routing-replay): the workers return the experts
  // every MoE layer picked for each fed token, and the learner's forward and backward route
  // through exactly those (with its own fp32 gate weights). Qwen3-MoE students only.
  OPD_FIELD(bool, routing_replay) = false;
  OPD_CONFIG_FIELDS_END;
};

struct PlateauConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(bool, enabled) = false;
  OPD_FIELD(int64_t, window) = 20;  // W steps
  // stop when the smoothed reverse KL improved < 2% over W
  OPD_FIELD(double, min_rel_improvement) = 0.02;
  OPD_FIELD(double, ema_beta) = 0.9;
  OPD_FIELD(int64_t, min_steps) = 0;
  // What the rule watches: train (each step's batch KL, smoothed), heldout (the `heldout`
  // section's evaluations; window counts evaluations; noise-aware, trainer/opd/convergence.h), or
  // auto (heldout when the config has a held-out set, else train).
  OPD_FIELD(PlateauMetric, metric) = PlateauMetric::kAuto;
  // heldout: the improvement must be below the threshold by z standard errors
  OPD_FIELD(double, z) = 2.0;
  // With the stage's `domains`: each domain's training KL has its own rule (these settings), and
  // the stage has converged once every domain's has (metric train only).
  OPD_FIELD(bool, per_domain) = false;
  OPD_CONFIG_FIELDS_END;
};

// A fixed held-out prompt set, sampled and scored by the running stage's teachers every `every`
// steps: `opd/heldout_reverse_kl` in the metrics, and what a stage's plateau.metric: heldout
// watches. Off without sources.
struct OpdHeldoutConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::vector<SftSourceConfig>, sources);  // JSONL prompts, as prompts.sources
  OPD_FIELD(int64_t, num_prompts) = 64;  // the first N prompts of the sources (in file order)
  OPD_FIELD(int64_t, every) = 10;        // steps between evaluations
  OPD_FIELD(int64_t, seed) = 0;          // sampling seed: the same at every evaluation
  OPD_CONFIG_FIELDS_END;
};

// A data domain's own teacher pool in a stage. A prompt's domain is its line's "domain" field,
// or else its source's name; prompts of a domain no entry names go to the stage's `teachers`.
struct OpdDomainTeachersConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::string, domain);                 // required, unique in the stage
  OPD_FIELD(std::vector<std::string>, teachers);  // its replicas (host:port); required
  OPD_CONFIG_FIELDS_END;
};

struct OpdStageConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::string, name);  // required, unique
  // the default pool's replicas (host:port); required
  OPD_FIELD(std::vector<std::string>, teachers);
  OPD_FIELD(std::vector<OpdDomainTeachersConfig>, domains);  // pools by data domain (optional)
  // When every replica of a domain's pool is down: fail (wait for one to come back until
  // train.score_deadline_s, then end the step) or default_pool (score that domain's samples on
  // the stage's default pool meanwhile, logged and counted as opd/domain_fallbacks).
  OPD_FIELD(DomainDownPolicy, on_domain_down) = DomainDownPolicy::kFail;
  OPD_FIELD(int64_t, max_steps) = 0;  // step budget (0: none; then the plateau rule must be on)
  OPD_FIELD(PlateauConfig, plateau);
  OPD_CONFIG_FIELDS_END;
};

struct OpdLossConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  // sampled (per-token reverse KL, policy gradient) | topk
  OPD_FIELD(LossForm, form) = LossForm::kSampled;
  // none | tis (truncated importance ratio) | ppo (clip)
  OPD_FIELD(Correction, correction) = Correction::kTruncatedIs;
  OPD_FIELD(double, kl_coef) = 1.0;
  OPD_FIELD(double, tis_cap) = 2.0;
  OPD_FIELD(double, clip_low) = 0.2;
  OPD_FIELD(double, clip_high) = 0.28;
  OPD_FIELD(int64_t, top_k) = 64;  // topk form: teacher support size
  // topk form: forward | reverse | mixed
  OPD_FIELD(TopKDivergence, divergence) = TopKDivergence::kMixed;
  OPD_FIELD(double, alpha) = 0.5;                // mixed: alpha * forward + (1 - alpha) * reverse
  OPD_FIELD(double, teacher_temperature) = 1.0;  // explicit scoring temperature
  // token (mean over the step's tokens) | sequence
  OPD_FIELD(Normalization, normalization) = Normalization::kToken;
  OPD_FIELD(double, kl_discount) = 0.0;  // gamma over the rest of a response's KL, in [0, 1]
  OPD_CONFIG_FIELDS_END;
};

struct OpdTrainConfig : LearnerTrainConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_CONFIG_BASE(LearnerTrainConfig);
  OPD_FIELD(int64_t, prompts_per_step) = 512;
  // learner forward/backward chunk (prompt + response tokens)
  OPD_FIELD(int64_t, micro_batch_tokens) = 16384;
  OPD_FIELD(bool, async) = false;  // one-step-off: sample step k+1 while learning step k
  // The step as a pipeline: each sample is scored as soon as it is sampled, and each micro-batch
  // learned as soon as its samples are scored (off: sample all, then score all, then learn all;
  // the same weights either way, trainer/opd/step_pipeline.h).
  OPD_FIELD(bool, pipeline) = true;
  // Scoring while sampling: Score calls in flight per teacher pool and rank, and the tokens one
  // call takes at most (whatever has arrived since the last call went out). 0: a micro-batch's
  // (micro_batch_tokens), so that the first micro-batch is learned while the next is scored.
  OPD_FIELD(int64_t, score_calls_per_pool) = 4;
  OPD_FIELD(int64_t, score_call_tokens) = 0;
  int64_t ScoreCallTokens() const {
    return score_call_tokens > 0 ? score_call_tokens : micro_batch_tokens;
  }
  OPD_FIELD(double, teacher_timeout_s) = 600;  // deadline of one Score call
  // deadline of a step's scoring, replica waits included
  OPD_FIELD(double, score_deadline_s) = 3600;
  OPD_CONFIG_FIELDS_END;
};

struct OpdAdminConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::string, listen);  // learner admin RPC (swap-teacher), e.g. 127.0.0.1:0; empty: off
  OPD_FIELD(std::string, port_file);  // when set, the bound port is written here (for port 0)
  // A non-loopback listen needs a shared secret unless this is set (calls stay refused without
  // one: this only allows the listen).
  OPD_FIELD(bool, insecure) = false;
  OPD_CONFIG_FIELDS_END;
};

// Test and debugging hooks; all off by default.
struct OpdDebugConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  // 1-based steps whose loss is poisoned with NaN (skipped)
  OPD_FIELD(std::vector<int64_t>, nan_steps);
  // 1-based steps whose weight push fails (UNAVAILABLE)
  OPD_FIELD(std::vector<int64_t>, fail_push_steps);
  // 1-based steps that throw after their update, as a torch error in the push or the logging would
  OPD_FIELD(std::vector<int64_t>, throw_after_update_steps);
  // 1-based steps that throw while learning, as a CUDA out-of-memory error on one rank would
  OPD_FIELD(std::vector<int64_t>, throw_while_learning_steps);
  // 1-based stages whose start fails (their teachers cannot be reached)
  OPD_FIELD(std::vector<int64_t>, fail_stage_starts);
  // The learner rank the two hooks above hit (-1: every rank)
  OPD_FIELD(int64_t, fail_rank) = -1;
  OPD_CONFIG_FIELDS_END;
};

// OPD's optimizer defaults: constant lr 1e-6 (min_lr = lr), otherwise AdamW as in SFT.
inline OptimConfig OpdOptimDefaults() {
  OptimConfig o;
  o.lr = 1e-6;
  o.min_lr = 1e-6;
  return o;
}

struct OpdConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(StudentModelConfig, model);  // the student (usually an SFT checkpoint's model/)
  OPD_FIELD(OpdPromptsConfig, prompts);
  OPD_FIELD(OpdHeldoutConfig, heldout);
  OPD_FIELD(OpdRolloutConfig, rollout);
  OPD_FIELD(std::vector<OpdStageConfig>, stages);
  OPD_FIELD(OpdLossConfig, loss);
  OPD_FIELD(OpdTrainConfig, train);
  OPD_FIELD(OptimConfig, optim) = OpdOptimDefaults();
  OPD_FIELD(CheckpointConfig, checkpoint);
  OPD_FIELD(LoggingConfig, logging);
  OPD_FIELD(RunConfig, run);
  OPD_FIELD(OpdAuthConfig, auth);
  OPD_FIELD(OpdAdminConfig, admin);
  OPD_FIELD(DistConfig, dist);
  OPD_FIELD(OpdDebugConfig, debug);
  OPD_CONFIG_FIELDS_END;
};

// Cross-field checks, each error naming the key (the sections shared with SFT through
// ValidateSharedSections, trainer/common/sections.h).
absl::Status ValidateOpdConfig(const OpdConfig& c);
// Settings that are allowed but probably not meant, one sentence each (the job logs them).
std::vector<std::string> OpdConfigWarnings(const OpdConfig& c);

}  // namespace trainer
