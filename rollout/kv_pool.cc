#include "rollout/kv_pool.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/util/status.h"

namespace rollout {

absl::StatusOr<std::optional<double>> ParseKvCacheGb(const std::string& flag, double max_gib) {
  if (flag == "auto") return std::optional<double>();
  double gib = 0;
  if (!absl::SimpleAtod(flag, &gib) || !std::isfinite(gib) || gib <= 0 || gib > max_gib)
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-cache-gb=", flag, " is neither auto nor a size in GiB in (0, ", max_gib, "]"));
  return std::optional<double>(gib);
}

absl::StatusOr<KvPoolChoice> ChooseKvPool(const lm::ModelConfig& c,
                                          lm::plan::RolloutSettings settings,
                                          std::optional<double> gib, int64_t device_bytes) {
  using lm::plan::FormatGiB;
  KvPoolChoice out;
  if (gib.has_value()) {
    out.bytes = static_cast<int64_t>(*gib * lm::plan::kGiB);
    settings.kv_cache_bytes = out.bytes;
    if (device_bytes > 0) RETURN_IF_ERROR(lm::plan::CheckRolloutFits(c, settings, device_bytes));
    out.why = absl::StrCat("--kv-cache-gb ", FormatGiB(out.bytes));
    return out;
  }
  if (device_bytes <= 0) {
    out.bytes = kCpuDefaultKvBytes;
    out.why = absl::StrCat("--kv-cache-gb auto without a device size (--device-memory-gb): ",
                           FormatGiB(out.bytes));
    return out;
  }
  settings.kv_cache_bytes = 0;
  out.bytes = lm::plan::RolloutKvPoolBytes(c, settings, device_bytes);
  // The pool must hold at least one block past the null one and the state slots; else the
  // terms before it do not fit, and the check names the one that does not.
  settings.kv_cache_bytes = out.bytes > 0 ? out.bytes : 1;
  const int64_t one_block =
      lm::plan::KvBytesPerToken(c, settings.weight_bytes) * settings.block_size;
  const int64_t state =
      lm::plan::StateBytesPerSequence(c, settings.weight_bytes) * settings.max_running;
  if (out.bytes < state + 2 * one_block) {
    settings.kv_cache_bytes = state + 2 * one_block;
    RETURN_IF_ERROR(lm::plan::CheckRolloutFits(c, settings, device_bytes));
  }
  const lm::plan::MemoryPlan others = [&] {
    lm::plan::DeviceSpec d;
    d.memory_bytes = device_bytes;
    settings.kv_cache_bytes = out.bytes;
    return lm::plan::PlanRollout(c, settings, d).memory;
  }();
  std::string terms;
  for (const auto& t : others.terms) {
    if (t.name.rfind("KV pool", 0) == 0) continue;
    absl::StrAppend(&terms, terms.empty() ? "" : ", ", t.name, " ", FormatGiB(t.bytes));
  }
  out.why = absl::StrCat("--kv-cache-gb auto: ", FormatGiB(out.bytes), " of a ",
                         FormatGiB(device_bytes), " device after ", terms);
  return out;
}

}  // namespace rollout
