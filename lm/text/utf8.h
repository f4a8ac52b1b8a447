// UTF-8 helpers for the tokenizer and the data readers. The code point helpers are inline: the
// encoder and the NFC check run them on every character.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace lm::utf8 {

// U+FFFD, what invalid input becomes.
inline constexpr char kReplacement[] = "\xEF\xBF\xBD";

// Index of the first byte of the first invalid sequence, or npos when `s` is valid UTF-8.
size_t FindInvalid(std::string_view s);
// Appends `bytes` decoded the way Rust's from_utf8_lossy does (each maximal invalid subpart ->
// U+FFFD). With `final_chunk` false an incomplete character at the end is not emitted; the return
// value is how many bytes were consumed.
size_t AppendLossy(std::string_view bytes, bool final_chunk, std::string* out);

// Appends the UTF-8 encoding of `cp` (a Unicode scalar value).
inline void AppendCodepoint(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes the code point at s[i] of valid UTF-8 and advances i. Never reads or steps past the
// end of `s`, even when i is not at a character boundary.
inline char32_t NextCodepoint(std::string_view s, size_t* i) {
  const auto b = static_cast<uint8_t>(s[*i]);
  if (b < 0x80) {
    ++*i;
    return b;
  }
  const size_t n = std::min<size_t>(b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : 1, s.size() - *i - 1);
  char32_t cp = b & (0x3F >> n);
  for (size_t k = 1; k <= n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[*i + k]) & 0x3F);
  *i += n + 1;
  return cp;
}

// True when every byte of `s` is below 0x80 (eight bytes at a time).
inline bool IsAscii(std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    if (w & 0x8080808080808080ULL) return false;
  }
  for (; i < s.size(); ++i)
    if (static_cast<uint8_t>(s[i]) & 0x80) return false;
  return true;
}

}  // namespace lm::utf8
