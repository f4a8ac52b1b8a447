// JSON-lines input shared by the SFT and prompt datasets: reading with validation (every bad line
// is an error naming file:line, or with skip_bad_lines a logged, counted skip) and the common
// chat format {"messages": [{"role": "system|user|assistant", "content": "..."}]}.
#pragma once

#include <cstdint>
#include <functional>
#include <istream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lm/text/chat.h"
#include "nlohmann/json_fwd.hpp"

namespace lm {

// A set of JSONL files sampled with a weight (one data source of a mixture).
struct DataSource {
  std::string name;                // for logs and stats; defaults to the first file's name
  std::vector<std::string> files;  // .jsonl files, or directories (their *.jsonl, sorted)
  double weight = 1.0;             // relative sampling weight, > 0
};

// Every line of the input is accounted for in one of these.
struct JsonlStats {
  int64_t accepted = 0;
  int64_t bad_skipped = 0;  // malformed lines skipped because of skip_bad_lines
  int64_t blank = 0;        // empty or whitespace-only lines (not data)
  void Add(const JsonlStats& o) {
    accepted += o.accepted;
    bad_skipped += o.bad_skipped;
    blank += o.blank;
  }
};

// Calls `fn` with the JSON object on each non-blank line of `path`. A line that is not UTF-8, not
// JSON, not an object, or that `fn` rejects with InvalidArgument is malformed: the result is an
// InvalidArgument "path:line: reason", or, with `skip_bad_lines`, a warning and a count. Any other
// error from `fn` is returned as it is.
absl::Status ForEachJsonLine(const std::string& path, bool skip_bad_lines, JsonlStats* stats,
                             const std::function<absl::Status(const nlohmann::json&)>& fn);

// The same over an open stream; `label` stands for the path in messages.
absl::Status ForEachJsonLine(std::istream& in, const std::string& label, bool skip_bad_lines,
                             JsonlStats* stats,
                             const std::function<absl::Status(const nlohmann::json&)>& fn);

// The files of a source: directories expanded to their *.jsonl files in name order.
absl::StatusOr<std::vector<std::string>> ExpandDataFiles(const std::vector<std::string>& paths);

// What the last message of a conversation must be.
enum class FinalTurn { kAssistant, kUser };

// Parses a "messages" array: roles system|user|assistant, system only first, user and assistant
// alternating from a user turn, non-blank string content, and the required final turn.
absl::StatusOr<std::vector<ChatMessage>> ParseMessages(const nlohmann::json& messages,
                                                       FinalTurn final_turn);

// Source names default to their first file's name; weights must be positive and finite.
absl::Status NormalizeSources(std::vector<DataSource>* sources);

}  // namespace lm
