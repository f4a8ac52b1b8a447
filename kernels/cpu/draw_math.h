// The arithmetic of the keyed token draw (lm::SampleRows, lm/generate/sampler.h), compiled
// unchanged for the host (kernels/cpu/sampler_cpu.cc) and the device (kernels/cuda/sampler.cu),
// so that both compute the same bits: only integer operations and correctly rounded IEEE fp64
// operations (+, -, *, /, fma, floor, conversions), never the platform's exp or log, whose
// last bits differ between libm and CUDA, and no contraction of a * b + c into an fma (the host
// file is compiled with -ffp-contract=off; the device side uses the _rn intrinsics, which are
// never contracted).
//
//   Philox4x32-10 (Salmon et al., SC'11; at::philox_engine's rounds and constants): the
//   uniform of a draw is a pure function of (key, position), so a token does not depend on
//   which batch, step, device or process drew it.
//   Exp64/Log64: fp64 exp on (-inf, 709] and log on [1, 2^63], relative error ~1e-16.
//   Weights: q = round(exp(d) 2^S) as integers, S = 62 - ceil(log2 V), so that the sum of a
//   row's V weights stays below 2^62 and every sum, prefix and threshold is exact in uint64:
//   any summation order, on any device, gives the same total.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define OPD_DRAW_HD __host__ __device__ __forceinline__
#else
#define OPD_DRAW_HD inline
#endif

namespace draw {

// ---- correctly rounded fp64 operations, never contracted ----
OPD_DRAW_HD double Mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
OPD_DRAW_HD double Add(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
OPD_DRAW_HD double Sub(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
OPD_DRAW_HD double Div(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
OPD_DRAW_HD double Fma(double a, double b, double c) {
#ifdef __CUDA_ARCH__
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
OPD_DRAW_HD double Floor(double a) {
#ifdef __CUDA_ARCH__
  return ::floor(a);
#else
  return std::floor(a);
#endif
}

OPD_DRAW_HD uint64_t BitsOf(double x) {
  uint64_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}
OPD_DRAW_HD double FromBits(uint64_t u) {
  double x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

// ---- 64 x 64 -> 128-bit products ----
struct U128 {
  uint64_t hi, lo;
};
OPD_DRAW_HD U128 Mul64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return U128{__umul64hi(a, b), a * b};
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return U128{static_cast<uint64_t>(p >> 64), static_cast<uint64_t>(p)};
#endif
}

// ---- Philox4x32-10 ----
struct Philox4 {
  uint32_t v[4];
};

OPD_DRAW_HD uint32_t MulHi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// The 10-round Philox4x32 block of `counter` under `key`, as at::philox_engine::rand computes it.
OPD_DRAW_HD Philox4 Philox(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = MulHi32(kM0, ctr.v[0]), lo0 = kM0 * ctr.v[0];
    const uint32_t hi1 = MulHi32(kM1, ctr.v[2]), lo1 = kM1 * ctr.v[2];
    ctr = Philox4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// The 53-bit uniform integer of the draw at `position` of the stream `key`: Philox with key
// (low, high 32 bits of `key`) and counter (low, high 32 bits of `position`, 0, 0) -- what
// at::philox_engine(key, /*subsequence=*/0, /*offset=*/position) returns first -- its first two
// words as one 64-bit integer, top 53 bits. The uniform in [0, 1) is this times 2^-53.
OPD_DRAW_HD uint64_t Uniform53(uint64_t key, uint64_t position) {
  const Philox4 out = Philox(
      Philox4{{static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32), 0u, 0u}},
      static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
  return ((static_cast<uint64_t>(out.v[0]) << 32) | out.v[1]) >> 11;
}

// ---- exp and log in fp64 from IEEE operations only ----

// ln 2 as a sum of two doubles (hi the double nearest ln 2, lo the rest).
constexpr double kLn2Hi = 0x1.62e42fefa39efp-1;
constexpr double kLn2Lo = 0x1.abc9e3b39803fp-56;

// exp(x): 2^n p(r), n = floor(x log2(e) + 1/2), r = x - n ln 2 (two fmas), p the degree-13
// Taylor polynomial (|r| <= 0.347: truncation < 4e-18). 0 below -708 (where the result would be
// subnormal; callers only need it to round to a zero weight) and for -inf.
OPD_DRAW_HD double Exp64(double x) {
  if (!(x > -708.0)) return 0.0;
  if (x > 709.0) x = 709.0;
  const double n = Floor(Add(Mul(x, 1.4426950408889634), 0.5));
  double r = Fma(-n, kLn2Hi, x);
  r = Fma(-n, kLn2Lo, r);
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = Fma(p, r, 1.0 / 479001600.0);
  p = Fma(p, r, 1.0 / 39916800.0);
  p = Fma(p, r, 1.0 / 3628800.0);
  p = Fma(p, r, 1.0 / 362880.0);
  p = Fma(p, r, 1.0 / 40320.0);
  p = Fma(p, r, 1.0 / 5040.0);
  p = Fma(p, r, 1.0 / 720.0);
  p = Fma(p, r, 1.0 / 120.0);
  p = Fma(p, r, 1.0 / 24.0);
  p = Fma(p, r, 1.0 / 6.0);
  p = Fma(p, r, 0.5);
  p = Fma(p, r, 1.0);
  p = Fma(p, r, 1.0);
  const int64_t e = static_cast<int64_t>(n) + 1023;  // in [2, 2045]: a normal power of two
  return Mul(p, FromBits(static_cast<uint64_t>(e) << 52));
}

// log(y) for y >= 1 (finite): y = 2^k f with f in [sqrt(1/2), sqrt(2)), log f = 2 atanh(s) with
// s = (f - 1) / (f + 1), |s| <= 0.172, as its odd series to s^25 (truncation < 1e-18).
OPD_DRAW_HD double Log64(double y) {
  const uint64_t bits = BitsOf(y);
  int64_t k = static_cast<int64_t>((bits >> 52) & 0x7ff) - 1023;
  double f = FromBits((bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull);  // [1, 2)
  if (f > 1.4142135623730951) {
    f = Mul(f, 0.5);
    k += 1;
  }
  const double s = Div(Sub(f, 1.0), Add(f, 1.0));
  const double z = Mul(s, s);
  double p = 1.0 / 25.0;
  p = Fma(p, z, 1.0 / 23.0);
  p = Fma(p, z, 1.0 / 21.0);
  p = Fma(p, z, 1.0 / 19.0);
  p = Fma(p, z, 1.0 / 17.0);
  p = Fma(p, z, 1.0 / 15.0);
  p = Fma(p, z, 1.0 / 13.0);
  p = Fma(p, z, 1.0 / 11.0);
  p = Fma(p, z, 1.0 / 9.0);
  p = Fma(p, z, 1.0 / 7.0);
  p = Fma(p, z, 1.0 / 5.0);
  p = Fma(p, z, 1.0 / 3.0);
  p = Fma(p, z, 1.0);
  const double log_f = Mul(Mul(2.0, s), p);
  const double kd = static_cast<double>(k);
  return Fma(kd, kLn2Hi, Fma(kd, kLn2Lo, log_f));
}

// ---- integer weights ----

// S: weights are exp(d) 2^S rounded; the sum of V of them (each <= 2^S) stays <= 2^62.
OPD_DRAW_HD int WeightBits(int64_t vocab) {
  int ceil_log2 = 0;
  while ((int64_t{1} << ceil_log2) < vocab) ++ceil_log2;
  return 62 - ceil_log2;
}

// round(exp(d) 2^S) for d <= 0 (d = (x - max) / temperature).
OPD_DRAW_HD uint64_t Weight(double d, int S) {
  const double scaled = Mul(Exp64(d), FromBits(static_cast<uint64_t>(1023 + S) << 52));
  return static_cast<uint64_t>(Add(scaled, 0.5));  // truncation of a non-negative value
}

// ceil(p * total) exactly, for p in (0, 1) and total < 2^63.
OPD_DRAW_HD uint64_t CeilFraction(double p, uint64_t total) {
  const uint64_t bits = BitsOf(p);
  const int field = static_cast<int>((bits >> 52) & 0x7ff);
  const uint64_t mant = (bits & 0x000fffffffffffffull) | (field ? 0x0010000000000000ull : 0);
  const int shift = 1075 - (field ? field : 1);  // p = mant 2^-shift, shift >= 53
  const U128 prod = Mul64(mant, total);
  if (shift >= 128) return (prod.hi | prod.lo) != 0 ? 1 : 0;
  uint64_t q, rem;
  if (shift >= 64) {
    q = prod.hi >> (shift - 64);
    rem = (shift == 64 ? 0 : prod.hi & ((uint64_t{1} << (shift - 64)) - 1)) | prod.lo;
  } else {
    q = (prod.lo >> shift) | (prod.hi << (64 - shift));
    rem = prod.lo & ((uint64_t{1} << shift) - 1);
  }
  return q + (rem != 0 ? 1 : 0);
}

// floor(u53 2^-53 total): the draw's target in [0, total).
OPD_DRAW_HD uint64_t Target(uint64_t u53, uint64_t total) {
  const U128 prod = Mul64(u53, total);
  return (prod.hi << 11) | (prod.lo >> 53);
}

// An order-preserving key of a float (larger float, larger key; NaN excluded by callers).
OPD_DRAW_HD uint32_t OrderKey(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float whose order key is `k`.
OPD_DRAW_HD float FromOrderKey(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

// The kept set of a row: key > tau, or key == tau at an index <= last_tie.
struct Cut {
  uint32_t tau = 0;
  int64_t last_tie = 0;
};
OPD_DRAW_HD bool Kept(const Cut& c, uint32_t key, int64_t i) {
  return key > c.tau || (key == c.tau && i <= c.last_tie);
}

}  // namespace draw
