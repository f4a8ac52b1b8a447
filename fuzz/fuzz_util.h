// Helpers shared by the fuzz targets (built only by fuzz/CMakeLists.txt, with clang's libFuzzer).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "tests/byte_level.h"

namespace fuzz {

// An invariant of the code under test: a violation aborts, which libFuzzer reports as a crash
// with the input that caused it.
#define FUZZ_CHECK(cond, ...)                                                              \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, "  %s\n", std::string(__VA_ARGS__).c_str());                    \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

// Errors from a loader must say where: the message starts with the label it was given.
inline void CheckNamed(const absl::Status& s, std::string_view label) {
  FUZZ_CHECK(!s.ok(), "an error was expected");
  const std::string_view message(s.message().data(), s.message().size());
  FUZZ_CHECK(message.substr(0, label.size()) == label, std::string(message));
}

using testing_util::ByteLevelSpelling;

// A tiny loadable tokenizer.json: the 256 byte tokens, a few merges, ChatML added tokens.
inline std::string TinyTokenizerJson() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteLevelSpelling(b)] = b;
  vocab["he"] = 256;
  vocab["ll"] = 257;
  vocab["hell"] = 258;
  vocab[ByteLevelSpelling(' ') + "h"] = 259;
  const nlohmann::json merges = {"h e", "l l", "he ll", ByteLevelSpelling(' ') + " h"};
  const nlohmann::json added = {{{"id", 260}, {"content", "<|im_start|>"}, {"special", true}},
                                {{"id", 261}, {"content", "<|im_end|>"}, {"special", true}},
                                {{"id", 262}, {"content", "<think>"}, {"special", false}}};
  const nlohmann::json j = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}}};
  return j.dump();
}

}  // namespace fuzz
