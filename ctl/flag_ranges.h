// Range checks of opd-ctl's numeric flags (rpc/flag_range.h does the comparing): a value of the
// right type the command cannot use (--samples 0, --top-p 2, --batch -1) exits 2 naming the flag,
// its value and its range, as a malformed one does (ctl/args.h), before anything is loaded or
// sent.
#pragma once

#include <cstdint>
#include <iostream>
#include <string>

#include "absl/status/status.h"
#include "lm/util/limits.h"
#include "rpc/flag_range.h"

namespace ctl {

using opd::rpc::CheckFlagPositive;
using opd::rpc::CheckFlagRange;
using opd::rpc::FirstError;

// The bounds of lm/util/limits.h: 16M tokens in one sequence or vocabulary, a million samples of
// one prompt, the largest temperature.
using lm::kMaxTemperature;
using lm::limits::kMaxTokens;
inline constexpr int64_t kMillion = lm::limits::kMaxBatch;

// -1 when `st` is OK; else prints "opd-ctl <command>: <message>" and `usage` to stderr and returns
// 2, the exit code of a bad flag.
inline int RangeExitCode(const char* command, const absl::Status& st, const std::string& usage) {
  if (st.ok()) return -1;
  std::cerr << "opd-ctl " << command << ": " << st.message() << "\n" << usage;
  return 2;
}

}  // namespace ctl
