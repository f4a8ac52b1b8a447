// Config sections shared by the learner's jobs (sft/, opd/): the student model, the learner's
// common train fields, optimizer and schedule, run directory, checkpoints, logging, ranks. Each
// struct lists its fields for lm/util/config.h; ValidateSharedSections checks them the same
// way for both jobs. The choice fields are enums, their words listed once by their Choices.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lm/text/chat.h"
#include "lm/util/config.h"
#include "lm/util/limits.h"

namespace trainer {

// The config's bounds (lm/util/limits.h), as trainer::limits::kMaxTokens etc.
namespace limits = ::lm::limits;

// model.chat_format: qwen3 (no default system message) | qwen2 (lm::ChatFormat::Qwen2()).
enum class ChatFormatName { kQwen3, kQwen2 };
inline const lm::ConfigChoices<ChatFormatName>& Choices(ChatFormatName) {
  static const lm::ConfigChoices<ChatFormatName> c{{"qwen3", ChatFormatName::kQwen3},
                                                   {"qwen2", ChatFormatName::kQwen2}};
  return c;
}
lm::ChatFormat ChatFormatOf(ChatFormatName name);

// The student: an HF model directory (usually an SFT checkpoint's model/ for OPD).
struct StudentModelConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::string, path);       // HF model directory of the student (required)
  OPD_FIELD(std::string, tokenizer);  // tokenizer.json or a directory; default: `path`
  OPD_FIELD(ChatFormatName, chat_format) = ChatFormatName::kQwen3;
  OPD_CONFIG_FIELDS_END;
};

// train.precision: auto (bf16-mixed on CUDA, fp32 on the CPU) | fp32 | bf16-mixed: bf16 compute
// copies of the matrices, fp32 masters and AdamW state (trainer/common/mixed_precision.h resolves
// auto for the device).
enum class PrecisionSetting { kAuto, kFp32, kBf16Mixed };
inline const lm::ConfigChoices<PrecisionSetting>& Choices(PrecisionSetting) {
  static const lm::ConfigChoices<PrecisionSetting> c{{"auto", PrecisionSetting::kAuto},
                                                     {"fp32", PrecisionSetting::kFp32},
                                                     {"bf16-mixed", PrecisionSetting::kBf16Mixed}};
  return c;
}

// The `train:` fields every learner job has; each job's train section derives from this and adds
// (OPD_CONFIG_BASE) and adds its batching.
struct LearnerTrainConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  // auto (cuda when available) | cpu | cuda | cuda:N; cuda is cuda:LOCAL_RANK under a launcher
  OPD_FIELD(std::string, device) = "auto";
  OPD_FIELD(PrecisionSetting, precision) = PrecisionSetting::kAuto;
  OPD_FIELD(int64_t, threads) = 0;  // intra-op CPU threads; 0: LibTorch's default
  // skipped NaN/Inf steps in a row before giving up
  OPD_FIELD(int64_t, max_consecutive_nonfinite) = 10;
  OPD_FIELD(int64_t, seed) = 0;  // torch's RNG (saved and restored with checkpoints)
  // recompute each decoder layer in the backward
  OPD_FIELD(bool, activation_checkpointing) = false;
  OPD_CONFIG_FIELDS_END;
};

// AdamW + cosine schedule + clipping (trainer/common/optim.h). Defaults: the paper's SFT recipe.
struct OptimConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(double, lr) = 1e-5;           // peak learning rate
  OPD_FIELD(double, min_lr) = 1e-6;       // the cosine ends here
  OPD_FIELD(int64_t, warmup_steps) = 0;   // linear warm-up to `lr` over this many steps
  OPD_FIELD(double, weight_decay) = 0.1;  // not applied to 1-D parameters (norms) and biases
  OPD_FIELD(double, beta1) = 0.9;
  OPD_FIELD(double, beta2) = 0.95;
  OPD_FIELD(double, eps) = 1e-8;
  OPD_FIELD(double, max_grad_norm) = 1.0;  // global L2 norm clipping; <= 0 disables it
  OPD_CONFIG_FIELDS_END;
};

// run.resume: auto continues from the latest checkpoint if there is one; never refuses to start
// in a run directory with checkpoints.
enum class ResumeMode { kAuto, kNever };
inline const lm::ConfigChoices<ResumeMode>& Choices(ResumeMode) {
  static const lm::ConfigChoices<ResumeMode> c{{"auto", ResumeMode::kAuto},
                                               {"never", ResumeMode::kNever}};
  return c;
}

// Where the run lives and whether it continues an earlier one.
struct RunConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::string, dir);  // run directory (created); required
  OPD_FIELD(ResumeMode, resume) = ResumeMode::kAuto;
  OPD_CONFIG_FIELDS_END;
};

struct CheckpointConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(int64_t, every) = 500;  // steps between checkpoints (0: only at the end and on a stop)
  // complete checkpoints kept; older ones are deleted (0: keep all)
  OPD_FIELD(int64_t, keep_last) = 3;
  OPD_FIELD(bool, at_end) = true;  // also after the last step (off for throwaway runs: benchmarks)
  OPD_CONFIG_FIELDS_END;
};

struct LoggingConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(int64_t, log_every) = 1;  // steps between plain log lines when stderr is not a terminal
  OPD_FIELD(bool, tensorboard) = true;  // event files under <run>/tensorboard
  OPD_CONFIG_FIELDS_END;
};

// dist.backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl.
enum class DistBackend { kAuto, kGloo, kNccl };
inline const lm::ConfigChoices<DistBackend>& Choices(DistBackend) {
  static const lm::ConfigChoices<DistBackend> c{
      {"auto", DistBackend::kAuto}, {"gloo", DistBackend::kGloo}, {"nccl", DistBackend::kNccl}};
  return c;
}

// dist.allgather_dtype: the dtype of the updated weights' all-gather (ZeRO-1): auto (follows
// train.precision: float32 for fp32, bfloat16 for bf16-mixed) | float32 | bfloat16. With bfloat16
// the fp32 masters stay sharded (trainer/common/zero1.h).
enum class AllGatherDtype { kAuto, kFloat32, kBfloat16 };
inline const lm::ConfigChoices<AllGatherDtype>& Choices(AllGatherDtype) {
  static const lm::ConfigChoices<AllGatherDtype> c{{"auto", AllGatherDtype::kAuto},
                                                   {"float32", AllGatherDtype::kFloat32},
                                                   {"bfloat16", AllGatherDtype::kBfloat16}};
  return c;
}

// dist.zero_stage: what the learner's ranks shard (trainer/common/zero1.h). 1: the optimizer (fp32
// masters, AdamW moments), with every rank summing its micro-batches' gradients in a full fp32
// buffer and reducing them once per step; 2: the gradients too, every backward's gradients
// reduce-scattered into each rank's 1/N slice (4P/N bytes instead of 4P + 4P/N, for one reduction
// per micro-batch round instead of one per step). auto: 1 when the learner's memory plan
// (lm/plan/plan.h) fits the device with it, else 2; 1 on the CPU and with one rank.
enum class ZeroStage { kAuto, kOne, kTwo };
inline const lm::ConfigChoices<ZeroStage>& Choices(ZeroStage) {
  static const lm::ConfigChoices<ZeroStage> c{
      {"auto", ZeroStage::kAuto}, {"1", ZeroStage::kOne}, {"2", ZeroStage::kTwo}};
  return c;
}

// Several learner ranks (data parallel over c10d; trainer/common/learner_group.h). The launcher's
// environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) says how many; these say
// how.
struct DistConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(DistBackend, backend) = DistBackend::kAuto;
  OPD_FIELD(double, timeout_s) = 600;  // a collective (or the rendezvous) fails after this long
  // After a phase of any length (OPD's sampling, scoring, held-out evaluation, push) ranks meet
  // outside the collectives and wait for each other while their heartbeats advance; a rank
  // whose heartbeat stops for this long ends every rank (lm/dist/rank_sync.h).
  OPD_FIELD(double, stall_timeout_s) = 300;
  OPD_FIELD(double, bucket_mb) = 32;  // gradient reduce-scatter / weight all-gather bucket size
  OPD_FIELD(AllGatherDtype, allgather_dtype) = AllGatherDtype::kAuto;
  OPD_FIELD(ZeroStage, zero_stage) = ZeroStage::kAuto;
  OPD_CONFIG_FIELDS_END;
};

// The sections both jobs share, checked the same way for both (each error names its key).
absl::Status ValidateSharedSections(const StudentModelConfig& model,
                                    const LearnerTrainConfig& train, const OptimConfig& optim,
                                    const CheckpointConfig& checkpoint,
                                    const LoggingConfig& logging, const RunConfig& run,
                                    const DistConfig& dist);

}  // namespace trainer
