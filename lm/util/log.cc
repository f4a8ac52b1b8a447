#include "lm/util/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/spdlog.h>

namespace lm::log {

void Info(std::string_view msg) { spdlog::info("{}", msg); }
void Warn(std::string_view msg) { spdlog::warn("{}", msg); }
void Error(std::string_view msg) { spdlog::error("{}", msg); }
void Debug(std::string_view msg) { spdlog::debug("{}", msg); }

bool AddFileSink(const std::string& path) {
  try {
    auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path);
    spdlog::default_logger()->sinks().push_back(sink);
    return true;
  } catch (const spdlog::spdlog_ex&) {
    return false;
  }
}

}  // namespace lm::log
