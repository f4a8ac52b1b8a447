// Packing of numeric arrays into proto `bytes` fields: little-endian float32 / int32, 4 bytes a
// value, no per-value framing (see proto/opd/v1/common.proto for why).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace opd::rpc {

static_assert(sizeof(float) == 4, "float32 wire format");
// Every platform we build for is little-endian; packing is then a plain copy.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire format is little-endian");

template <typename T>
void PackArray(const T* data, size_t n, std::string* out) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) == 4, "4-byte values only");
  out->resize(n * sizeof(T));
  if (n) std::memcpy(out->data(), data, n * sizeof(T));
}

template <typename T>
std::string PackArray(const std::vector<T>& v) {
  std::string out;
  PackArray(v.data(), v.size(), &out);
  return out;
}

// Unpacks `bytes` as an array of T; INVALID_ARGUMENT when the size is not a multiple of 4 or, if
// `expected` >= 0, not `expected` values. `what` names the field in the message.
template <typename T>
absl::StatusOr<std::vector<T>> UnpackArray(const std::string& bytes, int64_t expected,
                                           const char* what) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) == 4, "4-byte values only");
  if (bytes.size() % sizeof(T) != 0 ||
      (expected >= 0 && bytes.size() != static_cast<size_t>(expected) * sizeof(T))) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes.size(), " bytes, expected ",
                                                   expected < 0 ? 0 : expected, " x 4"));
  }
  std::vector<T> v(bytes.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

}  // namespace opd::rpc
