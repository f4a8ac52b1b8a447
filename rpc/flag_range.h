// Range checks of numeric command-line flags, shared by every binary (opd-teacher, opd-rollout,
// opd-ctl): a value the type accepts but the program cannot use (--workers=0, --threads=100000,
// a port above 65535) is a bad flag, refused at start-up with exit 2 and a message naming the
// flag, its value and its range, instead of a server that refuses every call or a process that
// spawns thousands of threads.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "lm/util/limits.h"

namespace opd::rpc {

// The most threads one thread-count flag may ask for (--threads of every binary): lm/util/limits.h
// says why.
inline constexpr int kMaxThreads = static_cast<int>(lm::limits::kMaxThreads);

// OK when lo <= value <= hi; else INVALID_ARGUMENT "--flag=value is outside [lo, hi]". NaN is
// outside every range. T is the flag's type; the bounds convert to it (CheckFlagRange("--n", n, 1,
// 64) with an int64_t n).
template <class T>
absl::Status CheckFlagRange(absl::string_view flag, T value, std::common_type_t<T> lo,
                            std::common_type_t<T> hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, "=", value, " is outside [", lo, ", ", hi, "]"));
}

// The same for a value that must be above 0 (timeouts, sizes in GiB or MiB): (0, hi].
inline absl::Status CheckFlagPositive(absl::string_view flag, double value, double hi) {
  if (value > 0 && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, "=", value, " is outside (0, ", hi, "]"));
}

// The first error of `checks`, else OK: a program lists its flags' checks in one expression.
inline absl::Status FirstError(std::initializer_list<absl::Status> checks) {
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace opd::rpc
