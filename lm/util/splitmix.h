// SplitMix64, the 64-bit mixer the deterministic streams of the library are built from (the data
// mixture's draws and shuffles, the sampler's per-sample seeds, each OPD step's sampling seed): a
// pure function of its input, so those streams are the same on every platform and compiler
// (unlike std::uniform_*_distribution).
#pragma once

#include <cstdint>

namespace lm {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The one way seeds are combined: a seed derived from a seed and one or more values (a run's
// seed and a step; a request's seed, a prompt and a sample), so that nearby inputs give unrelated
// streams. h = SplitMix64(seed), then h = SplitMix64(h ^ value) for each value in order:
// MixSeed(s, a) = SplitMix64(SplitMix64(s) ^ a), MixSeed(s, a, b) = SplitMix64(MixSeed(s, a) ^ b).
// Every stream the project pins (sampled tokens, data order, a resumed step's seed) is one of
// these, so the bits never depend on who mixes.
template <class... Values>
inline uint64_t MixSeed(uint64_t seed, Values... values) {
  static_assert(sizeof...(Values) > 0, "MixSeed mixes a seed with at least one value");
  uint64_t h = SplitMix64(seed);
  ((h = SplitMix64(h ^ static_cast<uint64_t>(values))), ...);
  return h;
}

}  // namespace lm
