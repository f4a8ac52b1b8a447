// The paged engine's KV pool size (--kv-cache-gb), from the memory plan (lm/plan/plan.h).
//
// `auto` (the default) gives the pool what the device has left after the plan's other terms: the
// weights, one receive bucket of a collective weight push (an update never stages a second model
// on the device: rollout/weights.h), the prefill workspace and the stated reserve. The device's
// size is --device-memory-gb when given, else the CUDA driver's; a CPU worker without it keeps a
// fixed default pool (kCpuDefaultKvBytes), since the host's memory is shared with everything else
// on it. A number is taken as it is, and refused at start-up when the plan says it cannot fit the
// device (naming the term).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "lm/model/config.h"
#include "lm/plan/plan.h"

namespace rollout {

// A CPU worker's pool when nothing says how much memory it may take.
inline constexpr int64_t kCpuDefaultKvBytes = int64_t{4} << 30;

// --kv-cache-gb: "auto" (nullopt) or a size in GiB in (0, max_gib]; INVALID_ARGUMENT naming the
// flag otherwise.
absl::StatusOr<std::optional<double>> ParseKvCacheGb(const std::string& flag, double max_gib);

struct KvPoolChoice {
  int64_t bytes = 0;
  std::string why;  // one line for the log: how the size was reached
};

// The pool for `settings` (its kv_cache_bytes is ignored: `gib` says) on a device of
// `device_bytes` (0: unknown). RESOURCE_EXHAUSTED naming the term that does not fit when the
// device cannot hold the plan (auto: not even an empty pool and one sequence's blocks).
absl::StatusOr<KvPoolChoice> ChooseKvPool(const lm::ModelConfig& c,
                                          lm::plan::RolloutSettings settings,
                                          std::optional<double> gib, int64_t device_bytes);

}  // namespace rollout
