#include "trainer/common/sections.h"

#include "absl/strings/str_cat.h"
#include "lm/util/config.h"
#include "lm/util/status.h"

namespace trainer {
namespace {

absl::Status CheckOptim(const OptimConfig& o) {
  RETURN_IF_ERROR(lm::validate::Above("optim.lr", o.lr, 0));
  RETURN_IF_ERROR(lm::validate::InRange("optim.min_lr", o.min_lr, 0, o.lr));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("optim.warmup_steps", o.warmup_steps, 0, limits::kMaxSteps));
  RETURN_IF_ERROR(lm::validate::AtLeast("optim.weight_decay", o.weight_decay, 0));
  RETURN_IF_ERROR(lm::validate::InHalfOpen("optim.beta1", o.beta1, 0, 1));
  RETURN_IF_ERROR(lm::validate::InHalfOpen("optim.beta2", o.beta2, 0, 1));
  RETURN_IF_ERROR(lm::validate::Above("optim.eps", o.eps, 0));
  return lm::validate::Finite("optim.max_grad_norm", o.max_grad_norm);  // <= 0: no clipping
}

absl::Status CheckLearnerTrain(const LearnerTrainConfig& t) {
  if (t.device.rfind("cuda:", 0) != 0 || t.device.size() == 5 ||
      t.device.find_first_not_of("0123456789", 5) != std::string::npos)
    RETURN_IF_ERROR(
        lm::validate::OneOf("train.device", t.device, {"auto", "cpu", "cuda", "cuda:N"}));
  RETURN_IF_ERROR(lm::validate::IntInRange("train.threads", t.threads, 0, limits::kMaxThreads));
  // train.seed: any int64 (used as its uint64 bits).
  return lm::validate::IntInRange("train.max_consecutive_nonfinite", t.max_consecutive_nonfinite, 1,
                                  limits::kMaxSteps);
}

absl::Status CheckDist(const DistConfig& c) {
  RETURN_IF_ERROR(
      lm::validate::AboveAtMost("dist.timeout_s", c.timeout_s, 0, limits::kMaxTimeoutS));
  RETURN_IF_ERROR(lm::validate::AboveAtMost("dist.stall_timeout_s", c.stall_timeout_s, 0,
                                            limits::kMaxTimeoutS));
  return lm::validate::AboveAtMost("dist.bucket_mb", c.bucket_mb, 0, limits::kMaxBucketMb);
}

}  // namespace

absl::Status ValidateSharedSections(const StudentModelConfig& model,
                                    const LearnerTrainConfig& train, const OptimConfig& optim,
                                    const CheckpointConfig& checkpoint,
                                    const LoggingConfig& logging, const RunConfig& run,
                                    const DistConfig& dist) {
  RETURN_IF_ERROR(
      lm::validate::Required("model.path", model.path, "the student's HF model directory"));
  RETURN_IF_ERROR(CheckLearnerTrain(train));
  RETURN_IF_ERROR(CheckOptim(optim));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("checkpoint.every", checkpoint.every, 0, limits::kMaxSteps));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("checkpoint.keep_last", checkpoint.keep_last, 0, limits::kMaxInt32));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("logging.log_every", logging.log_every, 1, limits::kMaxSteps));
  RETURN_IF_ERROR(lm::validate::Required("run.dir", run.dir, "the run directory"));
  return CheckDist(dist);
}

lm::ChatFormat ChatFormatOf(ChatFormatName name) {
  return name == ChatFormatName::kQwen2 ? lm::ChatFormat::Qwen2() : lm::ChatFormat::Qwen3();
}

}  // namespace trainer
