#include "kernels/cpu/fp8_gemm.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace lm::cpu {
namespace {

// Every e4m3fn value, decoded once.
const std::array<float, 256>& DecodeTable() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, exponent = (b >> 3) & 0xF, mantissa = b & 0x7;
      float v;
      if (exponent == 0xF && mantissa == 0x7) {
        v = std::nanf("");
      } else if (exponent == 0) {
        v = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m x 2^-9
      } else {
        v = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // 1.m x 2^(e - 7)
      }
      t[b] = sign ? -v : v;
    }
    return t;
  }();
  return table;
}

int64_t CeilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The expert of row r, or -1 past the last group.
int64_t ExpertOf(const Fp8GemmArgs& g, int64_t r) {
  if (g.group_ends == nullptr) return r < g.rows ? 0 : -1;
  const int32_t* end = g.group_ends + g.experts;
  const int32_t* it = std::upper_bound(g.group_ends, end, static_cast<int32_t>(r));
  return it == end ? -1 : it - g.group_ends;
}

int64_t ScaleRow(int64_t n, int64_t split) {
  return n < split ? n / kFp8Group : CeilDiv(split, kFp8Group) + (n - split) / kFp8Group;
}

// Rows [r0, r1), all of expert e: decoded activations, then one weight row at a time.
void ExpertRun(const Fp8GemmArgs& g, int64_t e, int64_t r0, int64_t r1, float* out) {
  const auto& dec = DecodeTable();
  const int64_t K = g.k, KB = CeilDiv(K, kFp8Group), NB = Fp8ScaleRows(g.n, g.split);
  const int64_t rows = r1 - r0;
  std::vector<float> a(static_cast<size_t>(rows * K)), sa(static_cast<size_t>(rows * KB));
  std::vector<char> valid(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t src = g.row_index ? g.row_index[r0 + i] : r0 + i;
    valid[i] = src >= 0;
    if (!valid[i]) continue;
    for (int64_t k = 0; k < K; ++k) a[i * K + k] = dec[g.a[src * K + k]];
    for (int64_t b = 0; b < KB; ++b) sa[i * KB + b] = g.a_scale[src * KB + b];
  }
  std::vector<float> w(static_cast<size_t>(K));
  for (int64_t n = 0; n < g.n; ++n) {
    const uint8_t* wrow = g.w + (e * g.n + n) * K;
    for (int64_t k = 0; k < K; ++k) w[k] = dec[wrow[k]];
    const float* ws = g.w_scale + (e * NB + ScaleRow(n, g.split)) * KB;
    for (int64_t i = 0; i < rows; ++i) {
      float acc = 0.0f;
      if (valid[i]) {
        const float* ai = a.data() + i * K;
        for (int64_t b = 0; b < KB; ++b) {
          float partial = 0.0f;  // one block's dot product, on its own
          for (int64_t k = b * kFp8Group; k < std::min(K, (b + 1) * kFp8Group); ++k)
            partial += ai[k] * w[k];
          acc += partial * sa[i * KB + b] * ws[b];
        }
      }
      out[(r0 + i) * g.n + n] = acc;
    }
  }
}

// One row of K values -> its K e4m3 bytes and ceil(K / 128) scales.
void QuantizeRow(const float* row, int64_t K, uint8_t* q, float* s) {
  for (int64_t b = 0; b * kFp8Group < K; ++b) {
    const int64_t k0 = b * kFp8Group, k1 = std::min(K, k0 + kFp8Group);
    float amax = 0.0f;
    for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float scale = std::max(amax, kFp8ScaleFloor) / kFp8Max;
    s[b] = scale;
    for (int64_t k = k0; k < k1; ++k) q[k] = FloatToFp8E4m3(row[k] / scale);
  }
}

// Rows per ExpertRun: bounds its decoded activations to 64 x K floats.
constexpr int64_t kRunRows = 64;

}  // namespace

float Fp8E4m3ToFloat(uint8_t bits) {
  return DecodeTable()[bits];
}

uint8_t FloatToFp8E4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= kFp8Max) return sign | 0x7E;
  // Below 2^-6 the spacing is 2^-9 (subnormals); above, 2^(e - 3) in [2^e, 2^(e+1)). Scaling by a
  // power of two is exact, and nearbyint rounds half to even (the default rounding mode).
  if (a < std::ldexp(1.0f, -6)) {
    const int m = static_cast<int>(std::nearbyint(std::ldexp(a, 9)));  // 0..8; 8 is 2^-6
    return sign | static_cast<uint8_t>(m);
  }
  int e2 = 0;
  (void)std::frexp(a, &e2);  // a = f x 2^e2, f in [0.5, 1)
  const int e = e2 - 1;      // a in [2^e, 2^(e+1)), e in [-6, 8]
  int m = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - e)));  // 8..16
  int biased = e + 7;
  if (m == 16) {
    m = 8;
    ++biased;
  }
  if (biased > 15 || (biased == 15 && m - 8 == 7)) return sign | 0x7E;  // rounds past 448
  return sign | static_cast<uint8_t>((biased << 3) | (m - 8));
}

void Fp8QuantizeRows(const float* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, uint8_t* q,
                     float* s) {
  const int64_t KB = CeilDiv(K, kFp8Group);
  for (int64_t m = m0; m < m1; ++m) QuantizeRow(x + m * ldx, K, q + m * K, s + m * KB);
}

void Fp8QuantizeSwiGluRows(const float* gu, int64_t I, int64_t m0, int64_t m1, uint8_t* q,
                           float* s) {
  const int64_t KB = CeilDiv(I, kFp8Group);
  std::vector<float> h(static_cast<size_t>(I));
  for (int64_t m = m0; m < m1; ++m) {
    const float* g = gu + m * 2 * I;
    for (int64_t i = 0; i < I; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * g[I + i];
    QuantizeRow(h.data(), I, q + m * I, s + m * KB);
  }
}

int64_t Fp8ScaleRows(int64_t n, int64_t split) {
  return CeilDiv(split, kFp8Group) + CeilDiv(n - split, kFp8Group);
}

void Fp8BlockGemm(const Fp8GemmArgs& g, int64_t r0, int64_t r1, float* out) {
  int64_t r = r0;
  while (r < r1) {
    const int64_t e = ExpertOf(g, r);
    int64_t end = std::min(r1, r + kRunRows);
    if (e < 0) {  // past the last group: zeros
      std::fill(out + r * g.n, out + end * g.n, 0.0f);
      r = end;
      continue;
    }
    if (g.group_ends != nullptr) end = std::min<int64_t>(end, g.group_ends[e]);
    ExpertRun(g, e, r, end, out);
    r = end;
  }
}

}  // namespace lm::cpu
