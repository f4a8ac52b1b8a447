// The config of `opd-trainer sft`: configs/sft/*.yaml decode into SftConfig
// (trainer/common/config.h). Defaults are the Marco-MoE paper's SFT recipe: AdamW (weight decay
// 0.1, betas 0.9/0.95), lr 1e-5 cosine to 1e-6, one epoch, 512 sequences per step, context 8192,
// the router load-balancing loss at the model's own coefficient.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lm/data/sft_dataset.h"
#include "trainer/common/config.h"
#include "trainer/common/sections.h"

namespace lm {
// data.overlong: the dataset's own enum. Its words are declared here, in lm, where
// argument-dependent lookup looks for them; lm knows nothing of configs.
inline const trainer::ConfigChoices<OverlongPolicy>& Choices(OverlongPolicy) {
  static const trainer::ConfigChoices<OverlongPolicy> c{{"truncate", OverlongPolicy::kTruncate},
                                                        {"drop", OverlongPolicy::kDrop}};
  return c;
}
}  // namespace lm

namespace trainer {

struct SftSourceConfig {
  std::string name;                // default: the first file's name
  std::vector<std::string> files;  // .jsonl files or directories of them
  double weight = 1.0;             // relative sampling weight in the mixture
};

template <class V>
void VisitFields(V& v, SftSourceConfig& c) {
  v("name", c.name);
  v("files", c.files);
  v("weight", c.weight);
}

struct SftDataConfig {
  std::vector<SftSourceConfig> train;  // required
  std::vector<SftSourceConfig> eval;   // held-out conversations; none: no evaluation
  int64_t max_seq_len = 8192;          // packed sequence length (the max context)
  // truncate | drop conversations above max_seq_len
  lm::OverlongPolicy overlong = lm::OverlongPolicy::kTruncate;
  bool shuffle = true;
  int64_t seed = 0;             // data order
  bool skip_bad_lines = false;  // else a malformed line is an error naming file:line
};

template <class V>
void VisitFields(V& v, SftDataConfig& c) {
  v("train", c.train);
  v("eval", c.eval);
  v("max_seq_len", c.max_seq_len);
  v("overlong", c.overlong);
  v("shuffle", c.shuffle);
  v("seed", c.seed);
  v("skip_bad_lines", c.skip_bad_lines);
}

struct SftTrainConfig : LearnerTrainConfig {
  double epochs = 1.0;              // passes over the training conversations
  int64_t max_steps = 0;            // > 0: exactly this many steps (overrides epochs)
  int64_t global_batch_size = 512;  // packed sequences per optimizer step
  int64_t micro_batch_size = 1;     // sequences per forward/backward (gradient accumulation)
  double aux_loss_coef = -1;        // router load-balancing loss weight; < 0: the model's
};

template <class V>
void VisitFields(V& v, SftTrainConfig& c) {
  v("epochs", c.epochs);
  v("max_steps", c.max_steps);
  v("global_batch_size", c.global_batch_size);
  v("micro_batch_size", c.micro_batch_size);
  v("aux_loss_coef", c.aux_loss_coef);
  VisitLearnerFields(v, c);
}

struct SftEvalConfig {
  int64_t every = 200;           // steps between held-out evaluations (0: only at start and end)
  int64_t max_sequences = 0;     // cap on packed eval sequences (0: one pass over the eval data)
  int64_t micro_batch_size = 0;  // 0: train.micro_batch_size
};

template <class V>
void VisitFields(V& v, SftEvalConfig& c) {
  v("every", c.every);
  v("max_sequences", c.max_sequences);
  v("micro_batch_size", c.micro_batch_size);
}

// Test and debugging hooks; all off by default.
struct SftDebugConfig {
  bool dump_batches = false;       // <run>/debug/batches.jsonl: every micro-batch's documents
  std::vector<int64_t> nan_steps;  // 1-based steps whose loss is poisoned with NaN
  int64_t step_sleep_ms = 0;       // pause after each step (makes kill tests deterministic)
  int64_t kill_rank = -1;          // this rank SIGKILLs itself in step kill_at_step, after its
  int64_t kill_at_step = 0;        // first backward (a rank lost mid-step)
};

template <class V>
void VisitFields(V& v, SftDebugConfig& c) {
  v("dump_batches", c.dump_batches);
  v("nan_steps", c.nan_steps);
  v("step_sleep_ms", c.step_sleep_ms);
  v("kill_rank", c.kill_rank);
  v("kill_at_step", c.kill_at_step);
}

struct SftConfig {
  StudentModelConfig model;
  SftDataConfig data;
  SftTrainConfig train;
  OptimConfig optim;
  SftEvalConfig eval;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  RunConfig run;
  DistConfig dist;
  SftDebugConfig debug;
};

template <class V>
void VisitFields(V& v, SftConfig& c) {
  v("model", c.model);
  v("data", c.data);
  v("train", c.train);
  v("optim", c.optim);
  v("eval", c.eval);
  v("checkpoint", c.checkpoint);
  v("logging", c.logging);
  v("run", c.run);
  v("dist", c.dist);
  v("debug", c.debug);
}

// Checks that need no files: required fields, ranges, divisibility (a choice field's word was
// checked when the config was decoded). The error names the key.
absl::Status ValidateSftConfig(const SftConfig& c);

// A list of JSONL sources (data.train, data.eval, prompts.sources) under `key`.
absl::Status ValidateSources(const std::string& key, const std::vector<SftSourceConfig>& sources);

}  // namespace trainer
