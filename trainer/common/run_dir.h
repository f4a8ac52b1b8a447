// The run directory of a training job:
//
//   <dir>/config.yaml        the resolved config (every field, defaults included)
//   <dir>/train.log          every log line of the job (appended across restarts)
//   <dir>/metrics.jsonl      one JSON object per step (and per evaluation)
//   <dir>/tensorboard/       TensorBoard event files
//   <dir>/checkpoints/       step_000100/ ... (trainer/common/checkpoint.h)
//   <dir>/debug/             optional debug dumps
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainer {

class RunDir {
 public:
  // Creates the directory tree and adds <dir>/train.log as a log sink.
  static absl::StatusOr<RunDir> Open(const std::string& dir);

  const std::string& path() const { return path_; }
  std::string checkpoints() const { return path_ + "/checkpoints"; }
  std::string tensorboard() const { return path_ + "/tensorboard"; }
  std::string debug() const { return path_ + "/debug"; }
  std::string metrics_jsonl() const { return path_ + "/metrics.jsonl"; }
  std::string log_file() const { return path_ + "/train.log"; }
  std::string config_file() const { return path_ + "/config.yaml"; }

  // Writes the resolved config to config.yaml (atomically).
  absl::Status SaveConfig(const std::string& yaml) const;

 private:
  explicit RunDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace trainer
