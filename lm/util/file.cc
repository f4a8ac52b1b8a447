#include "lm/util/file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace lm {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat(path, ": cannot open (", std::strerror(errno), ")"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return ss.str();
}

absl::Status SyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return absl::InternalError(absl::StrCat(path, ": open for sync: ", std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some filesystems refuse fsync on directories; the data files themselves were synced.
  if (rc != 0 && !std::filesystem::is_directory(path))
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
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": rename failed: ", ec.message()));
  return absl::OkStatus();
}

}  // namespace lm
