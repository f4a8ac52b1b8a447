#include "trainer/sft/sft_config.h"

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"
#include "trainer/common/config.h"

namespace trainer {
namespace {

absl::Status Invalid(const std::string& key, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": ", why));
}

absl::Status CheckTrain(const SftTrainConfig& t) {
  RETURN_IF_ERROR(validate::IntAtLeast("train.global_batch_size", t.global_batch_size, 1));
  RETURN_IF_ERROR(validate::IntAtLeast("train.micro_batch_size", t.micro_batch_size, 1));
  if (t.global_batch_size % t.micro_batch_size != 0)
    return Invalid(
        "train.global_batch_size",
        absl::StrCat(t.global_batch_size, " is not divisible by train.micro_batch_size (",
                     t.micro_batch_size, "): every step must be whole micro-batches"));
  RETURN_IF_ERROR(validate::IntAtLeast("train.max_steps", t.max_steps, 0));
  // Epochs only count without a step budget (then they must be > 0); a NaN never passes.
  if (t.max_steps == 0) RETURN_IF_ERROR(validate::Above("train.epochs", t.epochs, 0));
  RETURN_IF_ERROR(validate::Finite("train.epochs", t.epochs));
  return validate::Finite("train.aux_loss_coef", t.aux_loss_coef);  // < 0: the model's
}

}  // namespace

absl::Status ValidateSources(const std::string& key, const std::vector<SftSourceConfig>& sources) {
  for (size_t i = 0; i < sources.size(); ++i) {
    const std::string k = absl::StrCat(key, "[", i, "]");
    if (sources[i].files.empty()) return Invalid(k + ".files", "no files given");
    RETURN_IF_ERROR(validate::Above(k + ".weight", sources[i].weight, 0));
  }
  return absl::OkStatus();
}

absl::Status ValidateSftConfig(const SftConfig& c) {
  RETURN_IF_ERROR(
      ValidateSharedSections(c.model, c.train, c.optim, c.checkpoint, c.logging, c.run, c.dist));
  if (c.data.train.empty()) return Invalid("data.train", "required (at least one source)");
  RETURN_IF_ERROR(ValidateSources("data.train", c.data.train));
  RETURN_IF_ERROR(ValidateSources("data.eval", c.data.eval));
  RETURN_IF_ERROR(validate::IntAtLeast("data.max_seq_len", c.data.max_seq_len, 8));
  RETURN_IF_ERROR(validate::OneOf("data.overlong", c.data.overlong, {"truncate", "drop"}));
  RETURN_IF_ERROR(CheckTrain(c.train));
  RETURN_IF_ERROR(validate::IntAtLeast("eval.every", c.eval.every, 0));
  RETURN_IF_ERROR(validate::IntAtLeast("eval.max_sequences", c.eval.max_sequences, 0));
  RETURN_IF_ERROR(validate::IntAtLeast("eval.micro_batch_size", c.eval.micro_batch_size, 0));
  return validate::IntAtLeast("debug.step_sleep_ms", c.debug.step_sleep_ms, 0);
}

}  // namespace trainer
