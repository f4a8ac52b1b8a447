#include "lm/data/jsonl.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace lm {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// Per file, the first few skipped lines are logged one by one, then only the total.
constexpr int64_t kSkipWarningsPerFile = 10;

bool IsBlank(const std::string& line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// Parses one line; InvalidArgument with the reason when it is not a UTF-8 JSON object.
absl::StatusOr<json> ParseLine(const std::string& line) {
  const size_t bad = utf8::FindInvalid(line);
  if (bad != std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat("invalid UTF-8 at byte ", bad + 1));
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError("not a JSON object");
  return j;
}

}  // namespace

absl::Status ForEachJsonLine(const std::string& path, bool skip_bad_lines, JsonlStats* stats,
                             const std::function<absl::Status(const json&)>& fn) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  return ForEachJsonLine(in, path, skip_bad_lines, stats, fn);
}

absl::Status ForEachJsonLine(std::istream& in, const std::string& path, bool skip_bad_lines,
                             JsonlStats* stats,
                             const std::function<absl::Status(const json&)>& fn) {
  std::string line;
  int64_t line_no = 0, skipped = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (IsBlank(line)) {
      ++stats->blank;
      continue;
    }
    absl::StatusOr<json> j = ParseLine(line);
    absl::Status status = j.ok() ? fn(*j) : j.status();
    if (status.ok()) {
      ++stats->accepted;
      continue;
    }
    if (!absl::IsInvalidArgument(status)) return status;
    const std::string where = absl::StrCat(path, ":", line_no, ": ", status.message());
    if (!skip_bad_lines) return absl::InvalidArgumentError(where);
    ++stats->bad_skipped;
    if (++skipped <= kSkipWarningsPerFile) spdlog::warn("skipping malformed line {}", where);
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("read error in ", path));
  if (skipped > 0) spdlog::warn("{}: skipped {} malformed line(s) of {}", path, skipped, line_no);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ExpandDataFiles(const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<std::string> found;
      for (const auto& entry : fs::directory_iterator(p, ec))
        if (entry.is_regular_file() && entry.path().extension() == ".jsonl")
          found.push_back(entry.path().string());
      if (found.empty()) return absl::NotFoundError(absl::StrCat(p, ": no *.jsonl files"));
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(p, ec)) {
      files.push_back(p);
    } else {
      return absl::NotFoundError(absl::StrCat("no such data file or directory: ", p));
    }
  }
  return files;
}

absl::StatusOr<std::vector<ChatMessage>> ParseMessages(const json& messages, FinalTurn final_turn) {
  if (!messages.is_array()) return absl::InvalidArgumentError("\"messages\" is not an array");
  if (messages.empty()) return absl::InvalidArgumentError("\"messages\" is empty");
  std::vector<ChatMessage> out;
  out.reserve(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string at = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return absl::InvalidArgumentError(at + " is not an object");
    const auto role = m.find("role");
    const auto content = m.find("content");
    if (role == m.end() || !role->is_string())
      return absl::InvalidArgumentError(at + ".role is missing or not a string");
    if (content == m.end() || !content->is_string())
      return absl::InvalidArgumentError(at + ".content is missing or not a string");
    ChatMessage msg{role->get<std::string>(), content->get<std::string>()};
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant")
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".role is '", msg.role, "'; expected system, user or assistant"));
    if (IsBlank(msg.content)) return absl::InvalidArgumentError(at + ".content is empty");
    // After an optional system message: user, assistant, user, assistant, ...
    const size_t turn = out.size() - ((!out.empty() && out[0].role == "system") ? 1 : 0);
    const char* expected = msg.role == "system" ? nullptr : (turn % 2 == 0 ? "user" : "assistant");
    if (msg.role == "system" && i != 0)
      return absl::InvalidArgumentError(at + " is a system message after the first message");
    if (expected != nullptr && msg.role != expected)
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".role is '", msg.role, "' where '", expected, "' must come"));
    out.push_back(std::move(msg));
  }
  const std::string& last = out.back().role;
  const char* want = final_turn == FinalTurn::kAssistant ? "assistant" : "user";
  if (last != want)
    return absl::InvalidArgumentError(
        absl::StrCat("the last message is '", last, "'; expected '", want, "'"));
  return out;
}

absl::Status NormalizeSources(std::vector<DataSource>* sources) {
  if (sources->empty()) return absl::InvalidArgumentError("no data sources");
  for (DataSource& s : *sources) {
    if (s.files.empty()) return absl::InvalidArgumentError("a data source has no files");
    if (!(s.weight > 0) || !std::isfinite(s.weight))
      return absl::InvalidArgumentError(
          absl::StrCat("data source weight must be positive, got ", s.weight));
    if (s.name.empty()) s.name = fs::path(s.files[0]).filename().string();
  }
  return absl::OkStatus();
}

}  // namespace lm
