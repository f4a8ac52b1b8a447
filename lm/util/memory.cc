#include "lm/util/memory.h"

#include <malloc.h>

#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace lm {

void RetainFreedMemory() {
  // Blocks up to 1 GiB come from the heap instead of their own mapping...
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  // ...and the heap is never shrunk, so a freed buffer's pages stay mapped for the next one.
  mallopt(M_TRIM_THRESHOLD, -1);
  // Threads' own arenas are capped at 64 MiB each, so their larger blocks would be mmap()ed again
  // whatever the threshold; one arena keeps them all in the main heap. Contention is no concern:
  // a process here runs a handful of threads that allocate, each of them rarely.
  mallopt(M_ARENA_MAX, 1);
}

absl::StatusOr<int64_t> ParseMemAvailable(const std::string& meminfo) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemAvailable:")) continue;
    line = absl::StripAsciiWhitespace(line);
    const bool kib = absl::ConsumeSuffix(&line, "kB");
    int64_t n = 0;
    // The kernel prints kB; a value that would overflow in bytes is no value at all.
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &n) || n < 0 ||
        (kib && n > INT64_MAX / 1024))
      break;
    return kib ? n * 1024 : n;
  }
  return absl::NotFoundError("no MemAvailable line in /proc/meminfo");
}

absl::StatusOr<int64_t> AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  if (!in) return absl::NotFoundError("/proc/meminfo: cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseMemAvailable(ss.str());
}

std::string HumanBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    v /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", v, kUnits[unit]);
}

absl::Status CheckMemoryBudget(const std::string& what, int64_t needed, int64_t available) {
  if (needed <= available) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(what, ": needs ", HumanBytes(needed), " (", needed, " bytes) of memory, only ",
                   HumanBytes(available), " (", available, " bytes) available"));
}

absl::Status CheckHostMemory(const std::string& what, int64_t needed) {
  const absl::StatusOr<int64_t> available = AvailableMemoryBytes();
  if (!available.ok()) return absl::OkStatus();
  const absl::Status st = CheckMemoryBudget(what, needed, *available);
  if (st.ok()) return st;
  return absl::Status(st.code(), absl::StrCat(st.message(), " (MemAvailable in /proc/meminfo)"));
}

}  // namespace lm
