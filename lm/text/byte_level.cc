#include "lm/text/byte_level.h"

#include <array>
#include <cstdint>

#include "absl/strings/str_format.h"
#include "lm/text/utf8.h"

namespace lm {
namespace {

// Bytes that are printable Latin-1 map to themselves; the other 68 to U+0100.. in byte order.
struct ByteLevelMap {
  std::array<char32_t, 256> to_char{};
  std::array<int16_t, 324> to_byte{};  // char -> byte, -1 if the char is not in the map
  ByteLevelMap() {
    to_byte.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      to_char[b] = printable ? b : 256 + extra++;
      to_byte[to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelMap& ByteLevel() {
  static const ByteLevelMap map;
  return map;
}

}  // namespace

absl::StatusOr<std::string> ByteLevelToBytes(std::string_view token) {
  if (utf8::FindInvalid(token) != std::string_view::npos)
    return absl::InvalidArgumentError("token is not valid UTF-8");
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const char32_t cp = utf8::NextCodepoint(token, &i);
    const int b = cp < 324 ? ByteLevel().to_byte[cp] : -1;
    if (b < 0)
      return absl::InvalidArgumentError(absl::StrFormat(
          "token '%s' has U+%04X, outside the byte-level alphabet",
          absl::string_view(token.data(), token.size()), static_cast<uint32_t>(cp)));
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

std::string BytesToByteLevel(std::string_view bytes) {
  std::string token;
  for (char c : bytes) utf8::AppendCodepoint(ByteLevel().to_char[static_cast<uint8_t>(c)], &token);
  return token;
}

}  // namespace lm
