// Logging facade. The implementation uses spdlog, but spdlog's fmt clashes with the fmt copy that
// LibTorch's headers carry, so torch code logs through these plain functions instead.
#pragma once

#include <string>
#include <string_view>

namespace lm::log {

void Info(std::string_view msg);
void Warn(std::string_view msg);
void Error(std::string_view msg);
void Debug(std::string_view msg);

// In a job of several ranks: every line names its rank, and ranks other than 0 log only warnings
// and errors (rank 0 speaks for the job; the others report what goes wrong on them).
void SetRank(int rank, int world_size);

// Also append every message to `path` (a run directory's log file). Returns false on failure.
bool AddFileSink(const std::string& path);

}  // namespace lm::log
