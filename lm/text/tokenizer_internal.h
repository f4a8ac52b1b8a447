// What the tokenizer's units share and nothing else includes: the compiled pre-tokenizer regex
// (built by tokenizer_load.cc, run by tokenizer_encode.cc) and the string_view bridge.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lm/text/tokenizer.h"

namespace lm {

// The pre-tokenizer regex, compiled by PCRE2 (JIT when available) from the tokenizer files'
// Oniguruma pattern.
struct Tokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;

  Regex() = default;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code); }

  // Translates `onig_pattern` to PCRE2 syntax and compiles it; errors name the offset.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view onig_pattern);
};

// Debian's Abseil has its own string_view type; this bridges std::string_view to it.
inline absl::string_view Av(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

}  // namespace lm
