#include "trainer/common/run_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "lm/util/file.h"
#include "lm/util/log.h"

namespace trainer {

namespace fs = std::filesystem;

absl::StatusOr<RunDir> RunDir::Open(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("run.dir is required");
  RunDir run(dir);
  for (const std::string& d : {run.path(), run.checkpoints(), run.tensorboard()}) {
    std::error_code ec;
    fs::create_directories(d, ec);
    if (ec) return absl::PermissionDeniedError(absl::StrCat(d, ": cannot create: ", ec.message()));
  }
  if (!lm::log::AddFileSink(run.log_file()))
    return absl::PermissionDeniedError(absl::StrCat(run.log_file(), ": cannot open the log file"));
  return run;
}

absl::Status RunDir::SaveConfig(const std::string& yaml) const {
  return lm::WriteFileAtomic(config_file(), yaml);
}

}  // namespace trainer
