// Fused small ops on the CPU (see fused_ops.h). Compiled with -fopenmp (at::parallel_for's region
// is compiled inline here) and -ffp-contract=off: a product and a sum stay two roundings, as in
// the library ops these replace, instead of becoming one FMA where the compiler sees fit.
#include "kernels/cpu/fused_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "kernels/cpu/cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OPD_X86 1
#endif

namespace lm {
namespace {

using BF16 = c10::BFloat16;

inline float ToF(float x) {
  return x;
}
inline float ToF(BF16 x) {
  return static_cast<float>(x);
}
template <typename T>
inline T FromF(float x) {
  if constexpr (std::is_same_v<T, BF16>) {
    return BF16(x);  // round to nearest even, NaN stays NaN (c10's rounding, the library's)
  } else {
    return x;
  }
}

// One row's worth of elements per parallel task at least: a few thousand per task.
int64_t GrainRows(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1));
}

bool NoGrad(const torch::Tensor& t) {
  return !t.defined() || !(torch::GradMode::is_enabled() && t.requires_grad());
}

#ifdef OPD_X86
// Only these functions use AVX2/FMA instructions (per-function target, as in cpu_kernels.cc);
// callers reach them only where cpu::HasAvx2Fma().
#define OPD_AVX2 __attribute__((target("avx2,fma")))

OPD_AVX2 inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
// bf16 is the high half of an fp32: widen to 32 bits and shift up.
OPD_AVX2 inline __m256 Load8(const BF16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The bf16 bits of 8 floats (low 16 bits of each lane), rounded as c10::BFloat16 rounds: to
// nearest even, NaN to 0x7FC0.
OPD_AVX2 inline __m256i Bf16Bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}

// v rounded to bf16, kept as fp32.
OPD_AVX2 inline __m256 RoundBf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(Bf16Bits(v), 16));
}

template <typename T>
OPD_AVX2 inline __m256 RoundTo(__m256 v) {
  if constexpr (std::is_same_v<T, BF16>) {
    return RoundBf16(v);
  } else {
    return v;
  }
}

OPD_AVX2 inline void Store8(float* p, __m256 v) {
  _mm256_storeu_ps(p, v);
}
OPD_AVX2 inline void Store8(BF16* p, __m256 v) {
  const __m256i b = Bf16Bits(v);  // lanes hold values <= 0xFFFF: unsigned packing keeps them
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

OPD_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum of squares of n values, fp32 with FMA (8 lanes, then the tail in order).
template <typename T>
OPD_AVX2 float SumSquares(const T* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = Load8(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = HorizontalSum(acc);
  for (; j < n; ++j) ss += ToF(x[j]) * ToF(x[j]);
  return ss;
}

// One row of AddRmsNormCpu (see fused_ops.h); `sum` is written only when `r` is given.
template <typename T>
OPD_AVX2 void AddRmsNormRow(const T* x, const T* r, const T* w, int64_t H, float eps, T* out,
                            T* sum) {
  const T* src = x;
  if (r != nullptr) {
    int64_t j = 0;
    for (; j + 8 <= H; j += 8)
      Store8(sum + j, RoundTo<T>(_mm256_add_ps(Load8(x + j), Load8(r + j))));
    for (; j < H; ++j) sum[j] = FromF<T>(ToF(x[j]) + ToF(r[j]));
    src = sum;
  }
  // The library's: sum * rsqrt(mean + eps), its rsqrt being 1 / sqrt (both correctly rounded).
  const float inv = 1.0f / std::sqrt(SumSquares(src, H) / static_cast<float>(H) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t j = 0;
  for (; j + 8 <= H; j += 8) {
    const __m256 n = RoundTo<T>(_mm256_mul_ps(Load8(src + j), vinv));
    Store8(out + j, _mm256_mul_ps(Load8(w + j), n));
  }
  for (; j < H; ++j) out[j] = FromF<T>(ToF(w[j]) * ToF(FromF<T>(ToF(src[j]) * inv)));
}

// One head of QkNormRopeCpu: x [D] -> out [D] (out may be x); `n` holds D floats.
template <typename T>
OPD_AVX2 void NormRopeHead(const T* x, const T* w, const float* c, const float* s, int64_t D,
                           int64_t R, float eps, float* n, T* out) {
  const float inv = 1.0f / std::sqrt(SumSquares(x, D) / static_cast<float>(D) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t j = 0;
  for (; j + 8 <= D; j += 8)
    _mm256_storeu_ps(n + j, _mm256_mul_ps(Load8(w + j), _mm256_mul_ps(Load8(x + j), vinv)));
  for (; j < D; ++j) n[j] = ToF(w[j]) * (ToF(x[j]) * inv);
  const int64_t half = R / 2;
  int64_t d = 0;
  if (half % 8 == 0) {
    for (; d < half; d += 8) {
      const __m256 a = _mm256_loadu_ps(n + d), b = _mm256_loadu_ps(n + d + half);
      const __m256 first = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + d)),
                                         _mm256_mul_ps(b, _mm256_loadu_ps(s + d)));
      const __m256 second = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + d + half)),
                                          _mm256_mul_ps(a, _mm256_loadu_ps(s + d + half)));
      Store8(out + d, first);
      Store8(out + d + half, second);
    }
  }
  for (; d < half; ++d) {
    const float a = n[d], b = n[d + half];
    out[d] = FromF<T>(a * c[d] - b * s[d]);
    out[d + half] = FromF<T>(b * c[d + half] + a * s[d + half]);
  }
  for (d = R; d < D; ++d) out[d] = FromF<T>(n[d]);
}
#endif  // OPD_X86

bool CpuFloatOrBf16(const torch::Tensor& t) {
  return t.defined() && t.is_cpu() && t.is_contiguous() &&
         (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16);
}

template <typename T>
void AddRmsNormTyped(const torch::Tensor& x, const torch::Tensor& residual,
                     const torch::Tensor& weight, double eps, torch::Tensor* out,
                     torch::Tensor* sum) {
#ifdef OPD_X86
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  *out = torch::empty_like(x);
  const bool add = residual.defined();
  if (add) *sum = torch::empty_like(x);
  const T* xp = x.data_ptr<T>();
  const T* rp = add ? residual.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out->data_ptr<T>();
  T* sp = add ? sum->data_ptr<T>() : nullptr;
  const float e = static_cast<float>(eps);  // the library adds eps as a float to fp32 values
  at::parallel_for(0, rows, GrainRows(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      AddRmsNormRow<T>(xp + r * H, add ? rp + r * H : nullptr, wp, H, e, op + r * H,
                       add ? sp + r * H : nullptr);
  });
#endif
}

template <typename T>
void QkNormRopeTyped(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                     const torch::Tensor& k_weight, const torch::Tensor& cos,
                     const torch::Tensor& sin, double eps, const torch::Tensor& q_out,
                     const torch::Tensor& k_out) {
#ifdef OPD_X86
  const int64_t T_ = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2), R = cos.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* qw = q_weight.data_ptr<T>();
  const T* kw = k_weight.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* qo = q_out.data_ptr<T>();
  T* ko = k_out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T_, GrainRows((Hq + Hk) * D), [&](int64_t t0, int64_t t1) {
    std::vector<float> n(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * R;
      const float* s = sp + t * R;
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t at = (t * Hq + h) * D;
        NormRopeHead<T>(qp + at, qw, c, s, D, R, e, n.data(), qo + at);
      }
      for (int64_t h = 0; h < Hk; ++h) {
        const int64_t at = (t * Hk + h) * D;
        NormRopeHead<T>(kp + at, kw, c, s, D, R, e, n.data(), ko + at);
      }
    }
  });
#endif
}

// The top-k of one row of E logits: `order` receives the k winners, most probable first.
// Larger logit first, then lower id; NaN above everything (torch.topk's place for it).
void TopkRow(const float* l, int64_t E, int64_t k, int64_t* order) {
  std::vector<int64_t> idx(E);
  std::iota(idx.begin(), idx.end(), 0);
  auto before = [l](int64_t a, int64_t b) {
    const bool na = std::isnan(l[a]), nb = std::isnan(l[b]);
    if (na != nb) return na;
    if (!na && l[a] != l[b]) return l[a] > l[b];
    return a < b;
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), before);
  std::copy(idx.begin(), idx.begin() + k, order);
}

// The softmax weights of one row of E logits at ids[0..k) (the order they are summed in when
// renormalising): exp(l - max) / sum over every expert, as the library's softmax computes it.
void RouteWeightsRow(const float* row, int64_t E, const int64_t* ids, int64_t k, bool renormalize,
                     float* out) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t e = 0; e < E; ++e) {
    m = std::max(m, row[e]);
    nan = nan || std::isnan(row[e]);
  }
  if (nan) m = std::numeric_limits<float>::quiet_NaN();  // NaN logits: NaN weights
  float s = 0.0f;
  for (int64_t e = 0; e < E; ++e) s += std::exp(row[e] - m);
  float kept = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    out[j] = std::exp(row[ids[j]] - m) / s;
    kept += out[j];
  }
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) out[j] /= kept;
}

bool RouterLogitsOk(const torch::Tensor& logits) {
  return logits.defined() && logits.is_cpu() && logits.dim() == 2 &&
         logits.scalar_type() == torch::kFloat32 && NoGrad(logits);
}

}  // namespace

bool UseCpuAddRmsNorm(const torch::Tensor& x, const torch::Tensor& residual,
                      const torch::Tensor& weight) {
  if (!cpu::HasAvx2Fma() || !CpuFloatOrBf16(x) || !CpuFloatOrBf16(weight) || x.dim() < 1)
    return false;
  if (weight.scalar_type() != x.scalar_type() || weight.dim() != 1 || weight.size(0) != x.size(-1))
    return false;
  if (residual.defined() &&
      (!CpuFloatOrBf16(residual) || residual.scalar_type() != x.scalar_type() ||
       residual.sizes() != x.sizes()))
    return false;
  return NoGrad(x) && NoGrad(residual) && NoGrad(weight);
}

void AddRmsNormCpu(const torch::Tensor& x, const torch::Tensor& residual,
                   const torch::Tensor& weight, double eps, torch::Tensor* out,
                   torch::Tensor* sum) {
  if (x.scalar_type() == torch::kBFloat16) {
    AddRmsNormTyped<BF16>(x, residual, weight, eps, out, sum);
  } else {
    AddRmsNormTyped<float>(x, residual, weight, eps, out, sum);
  }
}

bool UseCpuQkNormRope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                      const torch::Tensor& k_weight, const torch::Tensor& cos,
                      const torch::Tensor& sin, const torch::Tensor& q_out,
                      const torch::Tensor& k_out) {
  if (!cpu::HasAvx2Fma()) return false;
  for (const torch::Tensor* t : {&q, &k, &q_weight, &k_weight, &q_out, &k_out})
    if (!CpuFloatOrBf16(*t) || t->scalar_type() != q.scalar_type() || !NoGrad(*t)) return false;
  if (q.dim() != 3 || k.dim() != 3 || k.size(0) != q.size(0) || k.size(2) != q.size(2))
    return false;
  if (q_out.sizes() != q.sizes() || k_out.sizes() != k.sizes()) return false;
  const int64_t D = q.size(2);
  if (q_weight.dim() != 1 || q_weight.size(0) != D || k_weight.dim() != 1 || k_weight.size(0) != D)
    return false;
  for (const torch::Tensor* t : {&cos, &sin})
    if (!t->defined() || !t->is_cpu() || !t->is_contiguous() ||
        t->scalar_type() != torch::kFloat32 || t->dim() != 2 || t->size(0) != q.size(0) ||
        !NoGrad(*t))
      return false;
  const int64_t R = cos.size(1);
  return sin.size(1) == R && R % 2 == 0 && R <= D;
}

void QkNormRopeCpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                   const torch::Tensor& k_weight, const torch::Tensor& cos,
                   const torch::Tensor& sin, double eps, const torch::Tensor& q_out,
                   const torch::Tensor& k_out) {
  if (q.scalar_type() == torch::kBFloat16) {
    QkNormRopeTyped<BF16>(q, k, q_weight, k_weight, cos, sin, eps, q_out, k_out);
  } else {
    QkNormRopeTyped<float>(q, k, q_weight, k_weight, cos, sin, eps, q_out, k_out);
  }
}

bool RouteTopkCpu(const torch::Tensor& logits, int64_t top_k, bool renormalize,
                  torch::Tensor* weights, torch::Tensor* ids) {
  if (!RouterLogitsOk(logits)) return false;
  const int64_t T = logits.size(0), E = logits.size(1);
  if (E < 1 || top_k < 1 || top_k > E) return false;
  const auto l = logits.contiguous();
  auto w = torch::empty({T, top_k}, torch::kFloat32);
  auto i = torch::empty({T, top_k}, torch::kInt64);
  const float* lp = l.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  int64_t* ip = i.data_ptr<int64_t>();
  at::parallel_for(0, T, GrainRows(E * 8), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      TopkRow(lp + t * E, E, top_k, ip + t * top_k);
      RouteWeightsRow(lp + t * E, E, ip + t * top_k, top_k, renormalize, wp + t * top_k);
    }
  });
  *weights = w;
  *ids = i;
  return true;
}

bool RouteWeightsCpu(const torch::Tensor& logits, const torch::Tensor& ids, bool renormalize,
                     torch::Tensor* weights) {
  if (!RouterLogitsOk(logits) || !ids.defined() || !ids.is_cpu() || ids.dim() != 2 ||
      ids.scalar_type() != torch::kInt64 || ids.size(0) != logits.size(0))
    return false;
  const int64_t T = logits.size(0), E = logits.size(1), k = ids.size(1);
  const auto l = logits.contiguous();
  const auto id = ids.contiguous();
  auto w = torch::empty({T, k}, torch::kFloat32);
  const float* lp = l.data_ptr<float>();
  const int64_t* ip = id.data_ptr<int64_t>();
  TORCH_CHECK(k == 0 || T == 0 || (id.min().item<int64_t>() >= 0 && id.max().item<int64_t>() < E),
              "RouteWeightsCpu: expert ids outside [0, ", E, ")");
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, T, GrainRows(E * 8), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      RouteWeightsRow(lp + t * E, E, ip + t * k, k, renormalize, wp + t * k);
  });
  *weights = w;
  return true;
}

}  // namespace lm
