// Helpers every test binary shares (no LibTorch here; tensors are in tests/tensor_testing.h):
// fresh directories, files, JSON lines, shell commands, the largest difference of two float
// vectors, and a sample's response as token ids. Multi-process helpers live beside it:
// tests/child_process.h (a child process and its port file), tests/opd_task.h (the OPD task the
// learner tests share).
#pragma once

#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "lm/generate/sampling.h"
#include "nlohmann/json.hpp"

namespace testing_util {

// A new, empty directory under the system's temporary directory, named after `tag`.
inline std::filesystem::path TempDir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("opd_" + tag + "_XXXXXX")).string();
  const char* made = mkdtemp(tmpl.data());
  EXPECT_NE(made, nullptr) << "mkdtemp " << tmpl;
  return std::filesystem::path(made ? made : tmpl);
}

// The running test's own directory, emptied: OPD_BINARY_DIR/test_runs/<suite>/<test> (kept after
// the run, for its logs).
inline std::filesystem::path TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info->name();
  std::replace(name.begin(), name.end(), '/', '_');  // parameterised tests: Suite/Name/0
  std::string suite = info->test_suite_name();
  std::replace(suite.begin(), suite.end(), '/', '_');
  const auto dir = std::filesystem::path(OPD_BINARY_DIR) / "test_runs" / suite / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Every record of a JSON-lines file. Only the last line may fail to parse (a writer killed in the
// middle of it) and is then left out; any other line that does not parse fails the test.
inline std::vector<nlohmann::json> ReadJsonl(const std::filesystem::path& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(line);
  std::vector<nlohmann::json> out;
  for (size_t i = 0; i < lines.size(); ++i) {
    auto j = nlohmann::json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      EXPECT_EQ(i + 1, lines.size()) << path << ": line " << i + 1 << " is not JSON: " << lines[i];
      continue;
    }
    out.push_back(std::move(j));
  }
  return out;
}

// Runs `cmd` with /bin/sh; its exit status (-1 when it did not exit normally).
inline int Shell(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return rc != -1 && WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// A sample's response tokens, widened to the ids the references (greedy loops, HF fixtures)
// produce.
inline std::vector<int64_t> ResponseIds(const lm::Sample& s) {
  const auto r = s.response();
  return std::vector<int64_t>(r.begin(), r.end());
}

// Prompts as the generators take them (host token ids, int32) from the int64 sequences the
// fixtures and the references (PackedBatch::FromSequences) use.
inline std::vector<std::vector<int32_t>> HostIds(const std::vector<std::vector<int64_t>>& seqs) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& s : seqs) out.emplace_back(s.begin(), s.end());
  return out;
}

// A sequence to score (lm::Sample::ToScore) from a literal list of ids.
inline lm::Sample ToScore(std::vector<int32_t> tokens, int64_t response_start) {
  return lm::Sample::ToScore(std::move(tokens), response_start);
}

// Sequences to score from literal {tokens, response_start} pairs.
inline std::vector<lm::Sample> ToScore(
    std::initializer_list<std::pair<std::vector<int32_t>, int64_t>> seqs) {
  std::vector<lm::Sample> out;
  for (const auto& [tokens, start] : seqs) out.push_back(lm::Sample::ToScore(tokens, start));
  return out;
}

inline double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

}  // namespace testing_util
