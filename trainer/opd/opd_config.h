// The config of `opd-trainer opd`: configs/opd/*.yaml decode into OpdConfig
// (trainer/common/config.h). Defaults are the Marco-MoE paper's OPD recipe: 512 prompts per step, 2
// samples per prompt, prompts <= 2048 tokens, responses <= 8192, temperature 1.0, top-p 1.0,
// constant lr 1e-6, AdamW as in SFT, the sampled-token reverse-KL loss.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "trainer/common/auth_config.h"
#include "trainer/common/config.h"
#include "trainer/common/sections.h"
#include "trainer/sft/sft_config.h"

namespace trainer {

// The choice fields' enums (trainer/common/config.h), used as they are by the code they configure.

// rollout.weight_sync: how weights reach the workers (trainer/opd/weight_push.h).
enum class WeightSyncMode { kGrpc, kCollective, kAuto };
inline const ConfigChoices<WeightSyncMode>& Choices(WeightSyncMode) {
  static const ConfigChoices<WeightSyncMode> c{{"grpc", WeightSyncMode::kGrpc},
                                               {"collective", WeightSyncMode::kCollective},
                                               {"auto", WeightSyncMode::kAuto}};
  return c;
}

// stages[].plateau.metric: what the convergence rule watches.
enum class PlateauMetric { kTrain, kHeldout };
inline const ConfigChoices<PlateauMetric>& Choices(PlateauMetric) {
  static const ConfigChoices<PlateauMetric> c{{"train", PlateauMetric::kTrain},
                                              {"heldout", PlateauMetric::kHeldout}};
  return c;
}

// loss.form, loss.correction, loss.divergence, loss.normalization (trainer/opd/opd_loss.h).
enum class LossForm { kSampled, kTopK };
inline const ConfigChoices<LossForm>& Choices(LossForm) {
  static const ConfigChoices<LossForm> c{{"sampled", LossForm::kSampled},
                                         {"topk", LossForm::kTopK}};
  return c;
}

enum class Correction { kNone, kTruncatedIs, kPpoClip };
inline const ConfigChoices<Correction>& Choices(Correction) {
  static const ConfigChoices<Correction> c{{"none", Correction::kNone},
                                           {"tis", Correction::kTruncatedIs},
                                           {"ppo", Correction::kPpoClip}};
  return c;
}

enum class TopKDivergence { kForward, kReverse, kMixed };
inline const ConfigChoices<TopKDivergence>& Choices(TopKDivergence) {
  static const ConfigChoices<TopKDivergence> c{{"forward", TopKDivergence::kForward},
                                               {"reverse", TopKDivergence::kReverse},
                                               {"mixed", TopKDivergence::kMixed}};
  return c;
}

enum class Normalization { kToken, kSequence };
inline const ConfigChoices<Normalization>& Choices(Normalization) {
  static const ConfigChoices<Normalization> c{{"token", Normalization::kToken},
                                              {"sequence", Normalization::kSequence}};
  return c;
}

struct OpdPromptsConfig {
  std::vector<SftSourceConfig>
      sources;  // JSONL prompts (messages without the final assistant turn, or "prompt")
  int64_t max_prompt_len = 2048;  // longer prompts are dropped and counted
  bool shuffle = true;
  int64_t seed = 0;
  bool skip_bad_lines = false;
};

template <class V>
void VisitFields(V& v, OpdPromptsConfig& c) {
  v("sources", c.sources);
  v("max_prompt_len", c.max_prompt_len);
  v("shuffle", c.shuffle);
  v("seed", c.seed);
  v("skip_bad_lines", c.skip_bad_lines);
}

struct OpdRolloutConfig {
  std::vector<std::string> endpoints;  // rollout workers (host:port); required
  int64_t samples_per_prompt = 2;
  double temperature = 1.0;
  double top_p = 1.0;  // must stay 1.0 (off) and top_k 0: see ValidateOpdConfig
  int64_t top_k = 0;
  int64_t max_new_tokens = 8192;
  int64_t seed = 0;
  double timeout_s = 3600;  // deadline of one Generate call
  // How weights reach the workers: grpc (streamed), collective (broadcast over a c10d group
  // per worker, gRPC as the control plane) or auto (collective where the group forms, else
  // gRPC with a warning). See trainer/opd/weight_push.h.
  WeightSyncMode weight_sync = WeightSyncMode::kGrpc;
  std::string weight_sync_host;        // the learner's address as the workers reach it
                                       // ("": 127.0.0.1 for loopback workers, else hostname)
  double weight_sync_timeout_s = 120;  // group rendezvous and each broadcast
  int64_t weight_sync_bucket_mb = 64;  // broadcast bucket (one cast buffer per worker)
  // Routing replay (R3, slime's --use-rollout-routing-replay): the workers return the experts
  // every MoE layer picked for each fed token, and the learner's forward and backward route
  // through exactly those (with its own fp32 gate weights). Qwen3-MoE students only.
  bool routing_replay = false;
};

template <class V>
void VisitFields(V& v, OpdRolloutConfig& c) {
  v("endpoints", c.endpoints);
  v("samples_per_prompt", c.samples_per_prompt);
  v("temperature", c.temperature);
  v("top_p", c.top_p);
  v("top_k", c.top_k);
  v("max_new_tokens", c.max_new_tokens);
  v("seed", c.seed);
  v("timeout_s", c.timeout_s);
  v("weight_sync", c.weight_sync);
  v("weight_sync_host", c.weight_sync_host);
  v("weight_sync_timeout_s", c.weight_sync_timeout_s);
  v("weight_sync_bucket_mb", c.weight_sync_bucket_mb);
  v("routing_replay", c.routing_replay);
}

struct PlateauConfig {
  bool enabled = false;
  int64_t window = 20;                // W steps
  double min_rel_improvement = 0.02;  // stop when the smoothed reverse KL improved < 2% over W
  double ema_beta = 0.9;
  int64_t min_steps = 0;
  // What the rule watches: train (each step's batch KL, smoothed) or heldout (the `heldout`
  // section's evaluations; window counts evaluations; noise-aware, trainer/opd/convergence.h).
  PlateauMetric metric = PlateauMetric::kTrain;
  double z = 2.0;  // heldout: the improvement must be below the threshold by z standard errors
  // With the stage's `domains`: each domain's training KL has its own rule (these settings), and
  // the stage has converged once every domain's has (metric train only).
  bool per_domain = false;
};

template <class V>
void VisitFields(V& v, PlateauConfig& c) {
  v("enabled", c.enabled);
  v("window", c.window);
  v("min_rel_improvement", c.min_rel_improvement);
  v("ema_beta", c.ema_beta);
  v("min_steps", c.min_steps);
  v("metric", c.metric);
  v("z", c.z);
  v("per_domain", c.per_domain);
}

// A fixed held-out prompt set, sampled and scored by the running stage's teachers every `every`
// steps: `opd/heldout_reverse_kl` in the metrics, and what a stage's plateau.metric: heldout
// watches. Off without sources.
struct OpdHeldoutConfig {
  std::vector<SftSourceConfig> sources;  // JSONL prompts, as prompts.sources
  int64_t num_prompts = 64;              // the first N prompts of the sources (in file order)
  int64_t every = 10;                    // steps between evaluations
  int64_t seed = 0;                      // sampling seed: the same at every evaluation
};

template <class V>
void VisitFields(V& v, OpdHeldoutConfig& c) {
  v("sources", c.sources);
  v("num_prompts", c.num_prompts);
  v("every", c.every);
  v("seed", c.seed);
}

// A data domain's own teacher pool in a stage. A prompt's domain is its line's "domain" field,
// or else its source's name; prompts of a domain no entry names go to the stage's `teachers`.
struct OpdDomainTeachersConfig {
  std::string domain;                 // required, unique in the stage
  std::vector<std::string> teachers;  // its replicas (host:port); required
};

template <class V>
void VisitFields(V& v, OpdDomainTeachersConfig& c) {
  v("domain", c.domain);
  v("teachers", c.teachers);
}

struct OpdStageConfig {
  std::string name;                   // required, unique
  std::vector<std::string> teachers;  // the default pool's replicas (host:port); required
  std::vector<OpdDomainTeachersConfig> domains;  // pools by data domain (optional)
  int64_t max_steps = 0;  // step budget (0: none; then the plateau rule must be on)
  PlateauConfig plateau;
};

template <class V>
void VisitFields(V& v, OpdStageConfig& c) {
  v("name", c.name);
  v("teachers", c.teachers);
  v("domains", c.domains);
  v("max_steps", c.max_steps);
  v("plateau", c.plateau);
}

struct OpdLossConfig {
  LossForm form = LossForm::kSampled;  // sampled (per-token reverse KL, policy gradient) | topk
  // none | tis (truncated importance ratio) | ppo (clip)
  Correction correction = Correction::kTruncatedIs;
  double kl_coef = 1.0;
  double tis_cap = 2.0;
  double clip_low = 0.2;
  double clip_high = 0.28;
  int64_t top_k = 64;                                  // topk form: teacher support size
  TopKDivergence divergence = TopKDivergence::kMixed;  // topk form: forward | reverse | mixed
  double alpha = 0.5;                // mixed: alpha * forward + (1 - alpha) * reverse
  double teacher_temperature = 1.0;  // explicit scoring temperature
  // token (mean over the step's tokens) | sequence
  Normalization normalization = Normalization::kToken;
  double kl_discount = 0.0;  // gamma over the rest of a response's KL, in [0, 1]
};

template <class V>
void VisitFields(V& v, OpdLossConfig& c) {
  v("form", c.form);
  v("correction", c.correction);
  v("kl_coef", c.kl_coef);
  v("tis_cap", c.tis_cap);
  v("clip_low", c.clip_low);
  v("clip_high", c.clip_high);
  v("top_k", c.top_k);
  v("divergence", c.divergence);
  v("alpha", c.alpha);
  v("teacher_temperature", c.teacher_temperature);
  v("normalization", c.normalization);
  v("kl_discount", c.kl_discount);
}

struct OpdTrainConfig : LearnerTrainConfig {
  int64_t prompts_per_step = 512;
  int64_t micro_batch_tokens = 16384;  // learner forward/backward chunk (prompt + response tokens)
  bool async = false;                  // one-step-off: sample step k+1 while learning step k
  double teacher_timeout_s = 600;      // deadline of one Score call
  double score_deadline_s = 3600;      // deadline of a step's scoring, replica waits included
};

template <class V>
void VisitFields(V& v, OpdTrainConfig& c) {
  v("prompts_per_step", c.prompts_per_step);
  v("micro_batch_tokens", c.micro_batch_tokens);
  v("async", c.async);
  v("teacher_timeout_s", c.teacher_timeout_s);
  v("score_deadline_s", c.score_deadline_s);
  VisitLearnerFields(v, c);
}

struct OpdAdminConfig {
  std::string listen;     // learner admin RPC (swap-teacher), e.g. 127.0.0.1:0; empty: off
  std::string port_file;  // when set, the bound port is written here (for port 0)
  // A non-loopback listen needs a shared secret unless this is set (calls stay refused without
  // one: this only allows the listen).
  bool insecure = false;
};

template <class V>
void VisitFields(V& v, OpdAdminConfig& c) {
  v("listen", c.listen);
  v("port_file", c.port_file);
  v("insecure", c.insecure);
}

// Test and debugging hooks; all off by default.
struct OpdDebugConfig {
  std::vector<int64_t> nan_steps;        // 1-based steps whose loss is poisoned with NaN (skipped)
  std::vector<int64_t> fail_push_steps;  // 1-based steps whose weight push fails (UNAVAILABLE)
  // 1-based steps that throw after their update, as a torch error in the push or the logging would
  std::vector<int64_t> throw_after_update_steps;
};

template <class V>
void VisitFields(V& v, OpdDebugConfig& c) {
  v("nan_steps", c.nan_steps);
  v("fail_push_steps", c.fail_push_steps);
  v("throw_after_update_steps", c.throw_after_update_steps);
}

// OPD's optimizer defaults: constant lr 1e-6 (min_lr = lr), otherwise AdamW as in SFT.
inline OptimConfig OpdOptimDefaults() {
  OptimConfig o;
  o.lr = 1e-6;
  o.min_lr = 1e-6;
  return o;
}

struct OpdConfig {
  StudentModelConfig model;  // the student (usually an SFT checkpoint's model/)
  OpdPromptsConfig prompts;
  OpdHeldoutConfig heldout;
  OpdRolloutConfig rollout;
  std::vector<OpdStageConfig> stages;
  OpdLossConfig loss;
  OpdTrainConfig train;
  OptimConfig optim = OpdOptimDefaults();
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  RunConfig run;
  OpdAuthConfig auth;
  OpdAdminConfig admin;
  DistConfig dist;
  OpdDebugConfig debug;
};

template <class V>
void VisitFields(V& v, OpdConfig& c) {
  v("model", c.model);
  v("prompts", c.prompts);
  v("heldout", c.heldout);
  v("rollout", c.rollout);
  v("stages", c.stages);
  v("loss", c.loss);
  v("train", c.train);
  v("optim", c.optim);
  v("checkpoint", c.checkpoint);
  v("logging", c.logging);
  v("run", c.run);
  v("auth", c.auth);
  v("admin", c.admin);
  v("dist", c.dist);
  v("debug", c.debug);
}

// Cross-field checks, each error naming the key (the sections shared with SFT through
// ValidateSharedSections, trainer/common/sections.h).
absl::Status ValidateOpdConfig(const OpdConfig& c);
// Settings that are allowed but probably not meant, one sentence each (the job logs them).
std::vector<std::string> OpdConfigWarnings(const OpdConfig& c);

}  // namespace trainer
