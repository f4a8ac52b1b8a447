#include "trainer/common/run_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
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
  return WriteFileAtomic(config_file(), yaml);
}

absl::Status SyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return absl::InternalError(absl::StrCat(path, ": open for sync: ", std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some filesystems refuse fsync on directories; the data files themselves were synced.
  if (rc != 0 && !fs::is_directory(path))
    return absl::InternalError(absl::StrCat(path, ": fsync: ", std::strerror(err)));
  return absl::OkStatus();
}

absl::Status WriteFileAtomic(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << contents;
    out.close();
    if (!out) return absl::InternalError(absl::StrCat(tmp, ": write failed"));
  }
  if (absl::Status s = SyncPath(tmp); !s.ok()) return s;
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": rename failed: ", ec.message()));
  return absl::OkStatus();
}

}  // namespace trainer
