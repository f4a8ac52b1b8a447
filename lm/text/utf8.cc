#include "lm/text/utf8.h"

namespace lm::utf8 {
namespace {

// Length of the valid UTF-8 sequence starting at s[i]. Returns 0 when it is invalid, with
// `*consumed` the length of the maximal invalid subpart (>= 1) and `*truncated` set when the
// sequence was a valid prefix cut off by the end of `s`.
size_t ValidSequenceLength(std::string_view s, size_t i, size_t* consumed, bool* truncated) {
  const auto b = static_cast<uint8_t>(s[i]);
  *truncated = false;
  if (b < 0x80) return 1;
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b == 0xE0) {
    need = 2, lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    need = 2;
  } else if (b == 0xED) {
    need = 2, hi = 0x9F;  // no surrogates
  } else if (b == 0xF0) {
    need = 3, lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 3;
  } else if (b == 0xF4) {
    need = 3, hi = 0x8F;
  } else {
    *consumed = 1;
    return 0;
  }
  size_t j = i + 1;
  for (size_t k = 0; k < need; ++k, ++j) {
    if (j >= s.size()) {
      *truncated = true;
      *consumed = j - i;
      return 0;
    }
    const auto c = static_cast<uint8_t>(s[j]);
    if (c < lo || c > hi) {
      *consumed = j - i;
      return 0;
    }
    lo = 0x80, hi = 0xBF;
  }
  return need + 1;
}

}  // namespace

size_t FindInvalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (!(static_cast<uint8_t>(s[i]) & 0x80)) {
      if (i + 8 <= s.size()) {
        uint64_t w;
        std::memcpy(&w, s.data() + i, 8);
        if (!(w & 0x8080808080808080ULL)) {
          i += 8;
          continue;
        }
      }
      ++i;
      continue;
    }
    size_t consumed;
    bool truncated;
    const size_t n = ValidSequenceLength(s, i, &consumed, &truncated);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

size_t AppendLossy(std::string_view bytes, bool final_chunk, std::string* out) {
  size_t i = 0, run = 0;  // bytes[run, i) is valid and not yet copied
  while (i < bytes.size()) {
    size_t consumed;
    bool truncated;
    const size_t n = ValidSequenceLength(bytes, i, &consumed, &truncated);
    if (n > 0) {
      i += n;
      continue;
    }
    out->append(bytes.data() + run, i - run);
    if (truncated && !final_chunk) return i;  // hold back the incomplete character
    out->append(kReplacement);
    i += consumed;
    run = i;
  }
  out->append(bytes.data() + run, i - run);
  return i;
}

}  // namespace lm::utf8
