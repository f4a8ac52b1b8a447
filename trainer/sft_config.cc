#include "trainer/sft_config.h"

#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace trainer {
namespace {

absl::Status Invalid(const std::string& key, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": ", why));
}

absl::Status OneOf(const std::string& key, const std::string& value,
                   std::initializer_list<const char*> allowed) {
  for (const char* a : allowed) {
    if (value == a) return absl::OkStatus();
  }
  return Invalid(key, absl::StrCat("'", value, "' is not one of ", absl::StrJoin(allowed, ", ")));
}

absl::Status CheckSources(const std::string& key, const std::vector<SftSourceConfig>& sources) {
  for (size_t i = 0; i < sources.size(); ++i) {
    const std::string k = absl::StrCat(key, "[", i, "]");
    if (sources[i].files.empty()) return Invalid(k + ".files", "no files given");
    if (!(sources[i].weight > 0)) return Invalid(k + ".weight", "must be > 0");
  }
  return absl::OkStatus();
}

absl::Status CheckOptim(const OptimConfig& o) {
  if (!(o.lr > 0)) return Invalid("optim.lr", "must be > 0");
  if (!(o.min_lr >= 0 && o.min_lr <= o.lr))
    return Invalid("optim.min_lr", "must be in [0, optim.lr]");
  if (o.warmup_steps < 0) return Invalid("optim.warmup_steps", "must be >= 0");
  if (!(o.weight_decay >= 0)) return Invalid("optim.weight_decay", "must be >= 0");
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return Invalid("optim.beta1", "must be in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return Invalid("optim.beta2", "must be in [0, 1)");
  if (!(o.eps > 0)) return Invalid("optim.eps", "must be > 0");
  return absl::OkStatus();
}

absl::Status CheckTrain(const SftTrainConfig& t) {
  if (t.global_batch_size <= 0) return Invalid("train.global_batch_size", "must be > 0");
  if (t.micro_batch_size <= 0) return Invalid("train.micro_batch_size", "must be > 0");
  if (t.global_batch_size % t.micro_batch_size != 0)
    return Invalid(
        "train.global_batch_size",
        absl::StrCat(t.global_batch_size, " is not divisible by train.micro_batch_size (",
                     t.micro_batch_size, "): every step must be whole micro-batches"));
  if (t.max_steps < 0) return Invalid("train.max_steps", "must be >= 0");
  if (t.max_steps == 0 && !(t.epochs > 0))
    return Invalid("train.epochs", "must be > 0 (or set train.max_steps)");
  if (t.threads < 0) return Invalid("train.threads", "must be >= 0");
  if (t.max_consecutive_nonfinite < 1)
    return Invalid("train.max_consecutive_nonfinite", "must be >= 1");
  return OneOf("train.device", t.device, {"auto", "cpu", "cuda"});
}

}  // namespace

absl::Status ValidateSftConfig(const SftConfig& c) {
  if (c.model.path.empty())
    return Invalid("model.path", "required (the student's HF model directory)");
  if (absl::Status s = OneOf("model.chat_format", c.model.chat_format, {"qwen3", "qwen2"}); !s.ok())
    return s;
  if (c.data.train.empty()) return Invalid("data.train", "required (at least one source)");
  if (absl::Status s = CheckSources("data.train", c.data.train); !s.ok()) return s;
  if (absl::Status s = CheckSources("data.eval", c.data.eval); !s.ok()) return s;
  if (c.data.max_seq_len < 8) return Invalid("data.max_seq_len", "must be >= 8");
  if (absl::Status s = OneOf("data.overlong", c.data.overlong, {"truncate", "drop"}); !s.ok())
    return s;
  if (absl::Status s = CheckTrain(c.train); !s.ok()) return s;
  if (absl::Status s = CheckOptim(c.optim); !s.ok()) return s;
  if (c.eval.every < 0) return Invalid("eval.every", "must be >= 0");
  if (c.eval.max_sequences < 0) return Invalid("eval.max_sequences", "must be >= 0");
  if (c.eval.micro_batch_size < 0) return Invalid("eval.micro_batch_size", "must be >= 0");
  if (c.checkpoint.every < 0) return Invalid("checkpoint.every", "must be >= 0");
  if (c.checkpoint.keep_last < 0)
    return Invalid("checkpoint.keep_last", "must be >= 0 (0 keeps all)");
  if (c.logging.log_every < 1) return Invalid("logging.log_every", "must be >= 1");
  if (c.run.dir.empty()) return Invalid("run.dir", "required (the run directory)");
  if (absl::Status s = OneOf("run.resume", c.run.resume, {"auto", "never"}); !s.ok()) return s;
  if (c.debug.step_sleep_ms < 0) return Invalid("debug.step_sleep_ms", "must be >= 0");
  return absl::OkStatus();
}

}  // namespace trainer
