// GPT-2's byte-level alphabet (bytes_to_unicode), written out independently of lm/text so that the
// tokenizer tests and the fuzz targets build their tokenizer.json fixtures against a second
// implementation. Header-only, no dependencies.
#pragma once

#include <string>

namespace testing_util {

// GPT-2's byte-level spelling of byte `b`, as UTF-8: printable bytes stand for themselves, the
// others map in order to U+0100 onwards.
inline std::string ByteLevelSpelling(int b) {
  const auto printable = [](int i) {
    return (i >= 33 && i <= 126) || (i >= 161 && i <= 172) || (i >= 174 && i <= 255);
  };
  int cp = b;
  if (!printable(b)) {
    cp = 256;
    for (int i = 0; i < b; ++i) cp += printable(i) ? 0 : 1;
  }
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

}  // namespace testing_util
