// The config of `opd-trainer sft`: configs/sft/*.yaml decode into SftConfig
// (lm/util/config.h). Defaults are the Marco-MoE paper's SFT recipe: AdamW (weight decay
// 0.1, betas 0.9/0.95), lr 1e-5 cosine to 1e-6, one epoch, 512 sequences per step, context 8192,
// the router load-balancing loss at the model's own coefficient.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lm/data/sft_dataset.h"
#include "lm/util/config.h"
#include "trainer/common/sections.h"

namespace lm {
// data.overlong: the dataset's own enum. Its words are declared here, in lm, where
// argument-dependent lookup looks for them; lm knows nothing of configs.
inline const lm::ConfigChoices<OverlongPolicy>& Choices(OverlongPolicy) {
  static const lm::ConfigChoices<OverlongPolicy> c{{"truncate", OverlongPolicy::kTruncate},
                                                   {"drop", OverlongPolicy::kDrop}};
  return c;
}
}  // namespace lm

namespace trainer {

struct SftSourceConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::string, name);                // default: the first file's name
  OPD_FIELD(std::vector<std::string>, files);  // .jsonl files or directories of them
  OPD_FIELD(double, weight) = 1.0;             // relative sampling weight in the mixture
  OPD_CONFIG_FIELDS_END;
};

struct SftDataConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::vector<SftSourceConfig>, train);  // required
  OPD_FIELD(std::vector<SftSourceConfig>, eval);   // held-out conversations; none: no evaluation
  OPD_FIELD(int64_t, max_seq_len) = 8192;          // packed sequence length (the max context)
  // truncate | drop conversations above max_seq_len
  OPD_FIELD(lm::OverlongPolicy, overlong) = lm::OverlongPolicy::kTruncate;
  OPD_FIELD(bool, shuffle) = true;
  OPD_FIELD(int64_t, seed) = 0;             // data order
  OPD_FIELD(bool, skip_bad_lines) = false;  // else a malformed line is an error naming file:line
  OPD_CONFIG_FIELDS_END;
};

struct SftTrainConfig : LearnerTrainConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_CONFIG_BASE(LearnerTrainConfig);
  OPD_FIELD(double, epochs) = 1.0;              // passes over the training conversations
  OPD_FIELD(int64_t, max_steps) = 0;            // > 0: exactly this many steps (overrides epochs)
  OPD_FIELD(int64_t, global_batch_size) = 512;  // packed sequences per optimizer step
  // sequences per forward/backward (gradient accumulation)
  OPD_FIELD(int64_t, micro_batch_size) = 1;
  OPD_FIELD(double, aux_loss_coef) = -1;  // router load-balancing loss weight; < 0: the model's
  OPD_CONFIG_FIELDS_END;
};

struct SftEvalConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(int64_t, every) = 200;  // steps between held-out evaluations (0: only at start and end)
  // cap on packed eval sequences (0: one pass over the eval data)
  OPD_FIELD(int64_t, max_sequences) = 0;
  OPD_FIELD(int64_t, micro_batch_size) = 0;  // 0: train.micro_batch_size
  OPD_CONFIG_FIELDS_END;
};

// Test and debugging hooks; all off by default.
struct SftDebugConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  // <run>/debug/batches.jsonl: every micro-batch's documents
  OPD_FIELD(bool, dump_batches) = false;
  OPD_FIELD(std::vector<int64_t>, nan_steps);  // 1-based steps whose loss is poisoned with NaN
  OPD_FIELD(int64_t, step_sleep_ms) = 0;  // pause after each step (makes kill tests deterministic)
  OPD_FIELD(int64_t, kill_rank) = -1;  // this rank SIGKILLs itself in step kill_at_step, after its
  OPD_FIELD(int64_t, kill_at_step) = 0;  // first backward (a rank lost mid-step)
  OPD_CONFIG_FIELDS_END;
};

struct SftConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(StudentModelConfig, model);
  OPD_FIELD(SftDataConfig, data);
  OPD_FIELD(SftTrainConfig, train);
  OPD_FIELD(OptimConfig, optim);
  OPD_FIELD(SftEvalConfig, eval);
  OPD_FIELD(CheckpointConfig, checkpoint);
  OPD_FIELD(LoggingConfig, logging);
  OPD_FIELD(RunConfig, run);
  OPD_FIELD(DistConfig, dist);
  OPD_FIELD(SftDebugConfig, debug);
  OPD_CONFIG_FIELDS_END;
};

// Checks that need no files: required fields, ranges, divisibility (a choice field's word was
// checked when the config was decoded). The error names the key.
absl::Status ValidateSftConfig(const SftConfig& c);

// A list of JSONL sources (data.train, data.eval, prompts.sources) under `key`.
absl::Status ValidateSources(const std::string& key, const std::vector<SftSourceConfig>& sources);

}  // namespace trainer
