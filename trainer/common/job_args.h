// The words every job sub-command of opd-trainer accepts: --config FILE, --set k=v (repeatable),
// --resume[=DIR].
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainer {

struct JobArgs {
  std::string config_path;
  std::vector<std::string> overrides;
  bool resume = false;      // --resume: a checkpoint must be found and resumed
  std::string resume_from;  // --resume=DIR: that checkpoint directory
};
absl::StatusOr<JobArgs> ParseJobArgs(const std::vector<std::string>& words);

}  // namespace trainer
