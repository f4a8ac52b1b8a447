// Reading JSON-lines inputs for opd-ctl commands: one object per line, errors naming FILE:LINE.
#pragma once

#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace ctl {

// Calls `fn(object, "FILE:LINE")` for every non-empty line of `path` ("-": stdin).
inline absl::Status ForEachJsonLine(
    const std::string& path,
    const std::function<absl::Status(const nlohmann::json&, const std::string&)>& fn) {
  std::ifstream file;
  if (path != "-") {
    file.open(path);
    if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  }
  std::istream& in = path == "-" ? std::cin : file;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.empty()) continue;
    const std::string where = absl::StrCat(path, ":", lineno);
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
    }
    absl::Status st = fn(j, where);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(where, ": ", st.message()));
  }
  return absl::OkStatus();
}

// The "tokens" array of an input object as int32 ids (range checks are the server's).
inline absl::StatusOr<std::vector<int32_t>> TokensOf(const nlohmann::json& j) {
  if (!j.contains("tokens") || !j["tokens"].is_array()) {
    return absl::InvalidArgumentError("expected {\"tokens\": [ids...]}");
  }
  std::vector<int32_t> ids;
  for (const auto& t : j["tokens"]) {
    if (!t.is_number_integer()) return absl::InvalidArgumentError("token ids must be integers");
    const int64_t id = t.get<int64_t>();
    if (id < INT32_MIN || id > INT32_MAX)
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " out of range"));
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace ctl
