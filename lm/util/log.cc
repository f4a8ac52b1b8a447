#include "lm/util/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <string>

namespace lm::log {
namespace {

// Logs go to stderr: stdout belongs to the programs' data output (JSON lines).
spdlog::logger& Logger() {
  static const bool installed = [] {
    spdlog::set_default_logger(spdlog::stderr_color_mt("opd"));
    return true;
  }();
  (void)installed;
  return *spdlog::default_logger_raw();
}

// Install the stderr logger before main(), so direct spdlog users (no torch) get it too.
const bool kInstalled = (Logger(), true);

}  // namespace

void Info(std::string_view msg) {
  Logger().info("{}", msg);
}
void Warn(std::string_view msg) {
  Logger().warn("{}", msg);
}
void Error(std::string_view msg) {
  Logger().error("{}", msg);
}
void Debug(std::string_view msg) {
  Logger().debug("{}", msg);
}

void SetRank(int rank, int world_size) {
  if (world_size <= 1) return;
  Logger().set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] [rank " + std::to_string(rank) + "/" +
                       std::to_string(world_size) + "] %v");
  if (rank != 0) Logger().set_level(spdlog::level::warn);
}

bool AddFileSink(const std::string& path) {
  try {
    auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path);
    Logger().sinks().push_back(sink);
    return true;
  } catch (const spdlog::spdlog_ex&) {
    return false;
  }
}

}  // namespace lm::log
