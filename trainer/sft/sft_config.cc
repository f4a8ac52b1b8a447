#include "trainer/sft/sft_config.h"

#include "absl/strings/str_cat.h"
#include "lm/util/config.h"
#include "lm/util/status.h"

namespace trainer {
namespace {

absl::Status Invalid(const std::string& key, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": ", why));
}

// ceil(epochs x conversations) draws must fit a uint64 for any real data set (< 1e13
// conversations); a million passes is beyond any schedule.
constexpr double kMaxEpochs = 1e6;
// Relative weights: any ratio up to 1e12 is expressible, and their sum (the mixture normaliser)
// stays finite however many sources there are.
constexpr double kMaxSourceWeight = 1e12;
// A debug pause: an hour is plenty, and milliseconds -> the clock's nanoseconds stays in int64.
constexpr int64_t kMaxStepSleepMs = 3600 * 1000;

absl::Status CheckTrain(const SftTrainConfig& t) {
  RETURN_IF_ERROR(lm::validate::IntInRange("train.global_batch_size", t.global_batch_size, 1,
                                           limits::kMaxBatch));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("train.micro_batch_size", t.micro_batch_size, 1, limits::kMaxBatch));
  if (t.global_batch_size % t.micro_batch_size != 0)
    return Invalid(
        "train.global_batch_size",
        absl::StrCat(t.global_batch_size, " is not divisible by train.micro_batch_size (",
                     t.micro_batch_size, "): every step must be whole micro-batches"));
  RETURN_IF_ERROR(lm::validate::IntInRange("train.max_steps", t.max_steps, 0, limits::kMaxSteps));
  // Epochs only count without a step budget (then they must be > 0); a NaN never passes.
  if (t.max_steps == 0) RETURN_IF_ERROR(lm::validate::Above("train.epochs", t.epochs, 0));
  RETURN_IF_ERROR(lm::validate::InRange("train.epochs", t.epochs, 0, kMaxEpochs));
  return lm::validate::Finite("train.aux_loss_coef", t.aux_loss_coef);  // < 0: the model's
}

absl::Status CheckSteps(const std::string& key, const std::vector<int64_t>& steps) {
  for (size_t i = 0; i < steps.size(); ++i)
    RETURN_IF_ERROR(
        lm::validate::IntInRange(absl::StrCat(key, "[", i, "]"), steps[i], 1, limits::kMaxSteps));
  return absl::OkStatus();
}

absl::Status CheckEval(const SftEvalConfig& e) {
  RETURN_IF_ERROR(lm::validate::IntInRange("eval.every", e.every, 0, limits::kMaxSteps));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("eval.max_sequences", e.max_sequences, 0, limits::kMaxInt32));
  return lm::validate::IntInRange("eval.micro_batch_size", e.micro_batch_size, 0,
                                  limits::kMaxBatch);
}

absl::Status CheckDebug(const SftDebugConfig& d) {
  RETURN_IF_ERROR(CheckSteps("debug.nan_steps", d.nan_steps));
  RETURN_IF_ERROR(
      lm::validate::IntInRange("debug.step_sleep_ms", d.step_sleep_ms, 0, kMaxStepSleepMs));
  RETURN_IF_ERROR(lm::validate::IntInRange("debug.kill_rank", d.kill_rank, -1, limits::kMaxInt32));
  return lm::validate::IntInRange("debug.kill_at_step", d.kill_at_step, 0, limits::kMaxSteps);
}

}  // namespace

absl::Status ValidateSources(const std::string& key, const std::vector<SftSourceConfig>& sources) {
  for (size_t i = 0; i < sources.size(); ++i) {
    const std::string k = absl::StrCat(key, "[", i, "]");
    if (sources[i].files.empty()) return Invalid(k + ".files", "no files given");
    RETURN_IF_ERROR(
        lm::validate::AboveAtMost(k + ".weight", sources[i].weight, 0, kMaxSourceWeight));
  }
  return absl::OkStatus();
}

absl::Status ValidateSftConfig(const SftConfig& c) {
  RETURN_IF_ERROR(
      ValidateSharedSections(c.model, c.train, c.optim, c.checkpoint, c.logging, c.run, c.dist));
  if (c.data.train.empty()) return Invalid("data.train", "required (at least one source)");
  RETURN_IF_ERROR(ValidateSources("data.train", c.data.train));
  RETURN_IF_ERROR(ValidateSources("data.eval", c.data.eval));
  // The datasets take max_seq_len as an int32: 4294967424 ran as 128.
  RETURN_IF_ERROR(
      lm::validate::IntInRange("data.max_seq_len", c.data.max_seq_len, 8, limits::kMaxTokens));
  // data.seed: any int64 (used as its uint64 bits).
  RETURN_IF_ERROR(CheckTrain(c.train));
  RETURN_IF_ERROR(CheckEval(c.eval));
  return CheckDebug(c.debug);
}

}  // namespace trainer
