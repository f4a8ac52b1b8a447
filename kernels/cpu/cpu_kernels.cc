#include "kernels/cpu/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>

// The kernels are x86 (AVX2 + FMA); elsewhere HasAvx2Fma() is false and callers never reach them.
#if defined(__x86_64__) || defined(__i386__)
#define OPD_X86 1
#include <immintrin.h>
#endif

// Only these functions use AVX2/FMA instructions (per-function target, not a per-file -mavx2, so
// that no inline function shared with other files is compiled for AVX2 by accident).
#define OPD_AVX2 __attribute__((target("avx2,fma")))

namespace lm::cpu {
#ifdef OPD_X86
namespace {

constexpr int kRowBlock = 4;          // activation rows per tile: 4 x 2 accumulators + 3 operands
constexpr int64_t kWeightBlock = 64;  // weight rows kept in L2 while every row block passes

OPD_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R activation rows x C weight rows (C = 1 or 2): R * C dot products of length K. The next C
// weight rows are prefetched meanwhile: at decode the weights stream from DRAM, and the hardware
// prefetcher alone left half of the bandwidth unused (measured: 13.6 of 25.8 GB/s on 2 cores).
template <int R, int C>
OPD_AVX2 void Tile(const float* a, int64_t lda, const float* w, int64_t K, float* out,
                   int64_t ldo) {
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* next = w + C * K;
  for (int64_t k = 0; k < K; k += 8) {
    if ((k & 15) == 0) {
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(next + c * K + k), _MM_HINT_T0);
    }
    __m256 wv[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_loadu_ps(a + r * lda + k);
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(av, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) out[r * ldo + c] = HorizontalSum(acc[r][c]);
}

// Calls f(rows, r) for the row blocks [r, r + rows) that cover [0, m): full blocks of kMax rows,
// then one block of the remainder. `rows` is a std::integral_constant, so that each block size
// gets its own fully unrolled tile.
template <int R, class F>
OPD_AVX2 inline void RemainderBlock(int64_t rest, int64_t r, F& f) {
  if constexpr (R > 0) {
    if (rest == R) return f(std::integral_constant<int, R>{}, r);
    RemainderBlock<R - 1>(rest, r, f);
  }
}

template <int kMax, class F>
OPD_AVX2 inline void ForRowBlocks(int64_t m, F&& f) {
  int64_t r = 0;
  for (; r + kMax <= m; r += kMax) f(std::integral_constant<int, kMax>{}, r);
  RemainderBlock<kMax - 1>(m - r, r, f);
}

template <int R>
OPD_AVX2 void RowBlock(const float* a, int64_t lda, const float* w, int64_t n0, int64_t n1,
                       int64_t K, float* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) Tile<R, 2>(a, lda, w + n * K, K, out + n, ldo);
  if (n < n1) Tile<R, 1>(a, lda, w + n * K, K, out + n, ldo);
}

OPD_AVX2 void MatmulWeightTAvx2(const float* a, int64_t lda, int64_t m, const float* w, int64_t N,
                                int64_t K, float* out, int64_t ldo) {
  for (int64_t n0 = 0; n0 < N; n0 += kWeightBlock) {
    const int64_t n1 = std::min(N, n0 + kWeightBlock);
    ForRowBlocks<kRowBlock>(m, [&](auto rows, int64_t r) OPD_AVX2 {
      RowBlock<rows()>(a + r * lda, lda, w, n0, n1, K, out + r * ldo, ldo);
    });
  }
}

// R activation rows x one 16-wide panel: 2R accumulators, the panel row loaded once per k and
// each activation broadcast. `cols` < 16 only in the last panel (the rest is padding). The
// accumulators are named variables, not an array: GCC keeps an array of them in memory, and the
// stores after every FMA halved the kernel's speed.
template <int R>
OPD_AVX2 void PanelTile(const float* a, int64_t lda, const float* panel, int64_t K, float* out,
                        int64_t ldo, int64_t cols) {
  static_assert(R >= 1 && R <= 6);
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0,
         l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    auto step = [&](const float* row, __m256& lo, __m256& hi) OPD_AVX2 {
      const __m256 av = _mm256_broadcast_ss(row + k);
      lo = _mm256_fmadd_ps(av, w0, lo);
      hi = _mm256_fmadd_ps(av, w1, hi);
    };
    step(a, l0, h0);
    if constexpr (R > 1) step(a + lda, l1, h1);
    if constexpr (R > 2) step(a + 2 * lda, l2, h2);
    if constexpr (R > 3) step(a + 3 * lda, l3, h3);
    if constexpr (R > 4) step(a + 4 * lda, l4, h4);
    if constexpr (R > 5) step(a + 5 * lda, l5, h5);
  }
  const __m256 lo[6] = {l0, l1, l2, l3, l4, l5}, hi[6] = {h0, h1, h2, h3, h4, h5};
  for (int r = 0; r < R; ++r) {
    if (cols == kPanel) {
      _mm256_storeu_ps(out + r * ldo, lo[r]);
      _mm256_storeu_ps(out + r * ldo + 8, hi[r]);
    } else {
      alignas(32) float row[kPanel];
      _mm256_store_ps(row, lo[r]);
      _mm256_store_ps(row + 8, hi[r]);
      std::copy_n(row, cols, out + r * ldo);
    }
  }
}

OPD_AVX2 void MatmulPackedPanelsAvx2(const float* a, int64_t lda, int64_t m, const float* packed,
                                     int64_t N, int64_t K, int64_t p0, int64_t p1, float* out,
                                     int64_t ldo) {
  constexpr int kRows = 6;  // 12 accumulators + 2 panel registers + 1 broadcast = 15 of 16
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = packed + p * kPanel * K;
    const int64_t n = p * kPanel, cols = std::min(kPanel, N - n);
    ForRowBlocks<kRows>(m, [&](auto rows, int64_t r) OPD_AVX2 {
      PanelTile<rows()>(a + r * lda, lda, panel, K, out + r * ldo + n, ldo, cols);
    });
  }
}

OPD_AVX2 inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp(x): 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in
// two so that r is exact), e^r by Cephes' degree-7 polynomial. x is clamped to [-87.3, 88.3]: the
// results there (~1e-38, ~2e38) stand in for 0 and overflow, and 2^n stays a normal float.
OPD_AVX2 inline __m256 Exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// gate <- silu(gate) * up = gate / (1 + exp(-gate)) * up, 8 at a time.
OPD_AVX2 void SiluMulAvx2(float* gate, const float* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 e = Exp(_mm256_sub_ps(zero, g));
    _mm256_storeu_ps(
        gate + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + j)));
  }
  for (; j < n; ++j) gate[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
}

OPD_AVX2 float LogSumExpAvx2(const float* x, int64_t n) {
  const int64_t n8 = n / 8 * 8;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n8; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + j));
  float mx = HorizontalMax(mv);
  for (int64_t j = n8; j < n; ++j) mx = std::max(mx, x[j]);
  if (std::isinf(mx)) return mx;    // all -inf (or a +inf logit)
  constexpr int64_t kBlock = 1024;  // floats per float partial sum
  const __m256 shift = _mm256_set1_ps(mx);
  double sum = 0.0;
  for (int64_t b = 0; b < n8; b += kBlock) {
    const int64_t end = std::min(n8, b + kBlock);
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t j = b;
    for (; j + 16 <= end; j += 16) {
      s0 = _mm256_add_ps(s0, Exp(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift)));
      s1 = _mm256_add_ps(s1, Exp(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), shift)));
    }
    if (j < end) s0 = _mm256_add_ps(s0, Exp(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift)));
    sum += HorizontalSum(_mm256_add_ps(s0, s1));
  }
  for (int64_t j = n8; j < n; ++j) sum += std::exp(x[j] - mx);
  return mx + static_cast<float>(std::log(sum));
}

}  // namespace

bool HasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

void MatmulWeightT(const float* a, int64_t lda, int64_t m, const float* w, int64_t N, int64_t K,
                   float* out, int64_t ldo) {
  MatmulWeightTAvx2(a, lda, m, w, N, K, out, ldo);
}

void MatmulPackedPanels(const float* a, int64_t lda, int64_t m, const float* packed, int64_t N,
                        int64_t K, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  MatmulPackedPanelsAvx2(a, lda, m, packed, N, K, p0, p1, out, ldo);
}

float LogSumExp(const float* x, int64_t n) {
  return LogSumExpAvx2(x, n);
}
#else  // not x86: no kernels; HasAvx2Fma() keeps every caller on the library path
bool HasAvx2Fma() {
  return false;
}
void MatmulWeightT(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*,
                   int64_t) {
  std::abort();
}
void MatmulPackedPanels(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t,
                        int64_t, float*, int64_t) {
  std::abort();
}
float LogSumExp(const float*, int64_t) {
  std::abort();
}
#endif

void PackPanels(const float* w, int64_t N, int64_t K, int64_t p0, int64_t p1, float* packed) {
  for (int64_t p = p0; p < p1; ++p) {
    float* panel = packed + p * kPanel * K;
    for (int64_t c = 0; c < kPanel; ++c) {
      const int64_t n = p * kPanel + c;
      if (n < N) {
        const float* row = w + n * K;
        for (int64_t k = 0; k < K; ++k) panel[k * kPanel + c] = row[k];
      } else {
        for (int64_t k = 0; k < K; ++k) panel[k * kPanel + c] = 0.0f;
      }
    }
  }
}

void ExpertSwiGlu(const float* x, int64_t m, int64_t H, const float* gate_up, const float* down,
                  int64_t I, float* scratch, float* y) {
  MatmulWeightT(x, H, m, gate_up, 2 * I, H, scratch, 2 * I);
  SiluMulInPlace(scratch, m, I);
  MatmulWeightT(scratch, 2 * I, m, down, H, I, y, H);
}

void SiluMulInPlace(float* gu, int64_t m, int64_t I) {
  for (int64_t r = 0; r < m; ++r) {
    float* g = gu + r * 2 * I;
#ifdef OPD_X86
    if (HasAvx2Fma()) {
      SiluMulAvx2(g, g + I, I);
      continue;
    }
#endif
    const float* u = g + I;
    for (int64_t j = 0; j < I; ++j) g[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
}

}  // namespace lm::cpu
