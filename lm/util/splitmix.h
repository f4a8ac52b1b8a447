// SplitMix64, the 64-bit mixer the deterministic streams of the library are built from (the data
// mixture's draws and shuffles, the sampler's per-sample seeds): a pure function of its input, so
// those streams are the same on every platform and compiler (unlike std::uniform_*_distribution).
#pragma once

#include <cstdint>

namespace lm {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// A seed derived from two values (a run's seed and a step, a step's seed and a prompt): the one
// way seeds are combined, so that nearby inputs give unrelated streams.
inline uint64_t MixSeed(uint64_t seed, uint64_t value) {
  return SplitMix64(SplitMix64(seed) ^ value);
}

}  // namespace lm
