// Whole files as strings, the one place the project reads and writes them: errors name the file,
// and a write replaces the file at once, so a reader sees the old contents or the new, never part.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lm {

// The file's bytes; NOT_FOUND "PATH: cannot open (reason)" or DATA_LOSS "PATH: read error".
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Writes `contents` to `path + ".tmp"`, flushes it to disk and renames it over `path`.
absl::Status WriteFileAtomic(const std::string& path, const std::string& contents);

// fsync of a file or directory (best effort for directories). Makes a rename durable.
absl::Status SyncPath(const std::string& path);

}  // namespace lm
