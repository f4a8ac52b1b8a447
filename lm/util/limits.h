// The bounds every process checks its numbers against, in one place: the configs (YAML), the
// services' flags and requests, and opd-ctl's flags use these, never a copy.
#pragma once

#include <cstdint>
#include <limits>

namespace lm {

// The smallest softmax temperature accepted anywhere (0 stays greedy decoding where it is
// allowed). Logits are divided by the temperature in fp32, whose largest finite value is ~3.4e38:
// a temperature that underflows (1e-45 is a float denormal) turns logits of ~1e4 in magnitude into
// inf, inf - inf is NaN, and every log-prob with it. 1e-4 keeps logits / temperature below ~1e8,
// thirty orders of magnitude clear of overflow, while a lower temperature would only collapse the
// softmax to a one-hot anyway (greedy, better asked for as 0). Services compare the value as the
// float it travels as, so that float(1e-4) is accepted too.
inline constexpr double kMinTemperature = 1e-4;

// The largest temperature a config accepts (opd-ctl's flags use the same bound): past it every
// distribution a model produces is flattened to uniform, so a larger value is a typo (700 for
// 0.7), not a setting. It also keeps the value far inside the float it travels as.
inline constexpr double kMaxTemperature = 1000;

namespace limits {

// Upper bounds of the numbers a config, a flag or a request may carry. Each is far above any
// real setting; what it guards against is a typo running as something else (wrapped to 32 bits,
// overflowing a sum, hanging on an allocation) instead of failing at once with exit 2.

// Counts the jobs may hand to 32-bit interfaces: above this a cast would truncate.
inline constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
// Token counts (max_seq_len, max_prompt_len, max_new_tokens, micro_batch_tokens, top-k): 16M is
// far beyond any context or vocabulary (opd-ctl's token flags use the same bound), and inside the
// int32 the datasets and the sampler take (data.max_seq_len 4294967424 ran as 128).
inline constexpr int64_t kMaxTokens = int64_t{1} << 24;
// Step counts (budgets, intervals, windows): 2^31 - 1 steps is centuries of training, and it keeps
// sums over stages and `window + 1` far from int64 overflow.
inline constexpr int64_t kMaxSteps = kMaxInt32;
// Intra-op threads are created eagerly: 100000 hung the job creating them; 1024 is above the
// hardware threads of any host (the largest have a few hundred).
inline constexpr int64_t kMaxThreads = 1024;
// Sequences or prompts per step, all held in memory at once (the paper uses 512 = 2^9).
inline constexpr int64_t kMaxBatch = int64_t{1} << 20;
// Any deadline: a week is beyond any step, rendezvous or call; a longer one is a hang, not a
// deadline, and it keeps `now + timeout` far from overflow wherever it becomes a clock time.
inline constexpr double kMaxTimeoutS = 7 * 24 * 3600.0;
// Buffer sizes in MiB (1 TiB): the shift to bytes stays far inside int64.
inline constexpr int64_t kMaxBucketMb = int64_t{1} << 20;
// Memory sizes in GiB (64 TiB: above any device or host), in flags such as --kv-cache-gb.
inline constexpr double kMaxGiB = 65536;

}  // namespace limits
}  // namespace lm
