// The FP8 block-scaled GEMM contract (block-wise FP8 checkpoints: lm/model/fp8_format.h, 128 x 128
// weight blocks), and its CPU twin: plain row-major arrays, no LibTorch. kernels/cuda/fp8_gemm.cuh
// implements the same three operations on the GPU; tests/fp8_test.cc holds both to this one.
//
// Activations are quantized per row ("token") in groups of kFp8Group columns:
//   amax = max |x[m, k]| over group g (the last group ragged when K % 128 != 0)
//   s[m, g] = max(amax, 1e-10) / 448                                      (fp32 division)
//   q[m, k] = e4m3(x[m, k] / s[m, g])     (fp32 division; round to nearest even, saturating at
//                                          +-448; the e4m3fn bits)
// so q[m, k] * s[m, g] is x[m, k] to within 2^-4 relative (3 mantissa bits), or 2^-10 s[m, g]
// where x / s falls among e4m3's subnormals. The floor 1e-10 keeps a zero group finite (q = 0).
//
// The GEMM multiplies quantized rows by quantized weights W [E, N, K] (E experts, one for a plain
// linear layer) with block scales Ws [E, NB, KB], KB = ceil(K / 128):
//   out[r, n] = sum_g ( sum_{k in g} dec(q[a(r), k]) dec(W[e(r), n, k]) ) * s[a(r), g] * Ws[e(r),
//   b(n), g]
// in fp32: each block's dot product is accumulated on its own (its products are exact: 4 x 4
// significant bits) and only then scaled and added to the row's fp32 sum, group by group, as
// DeepSeek-V3's kernels promote their tensor-core partials. Here:
//   a(r)  = row_index[r] when given (an expert's rows gathered from the tokens), else r; a
//           negative index marks a padding row, whose output is 0;
//   e(r)  = the expert whose rows [group_ends[e - 1], group_ends[e]) hold r (group_ends given),
//           else 0; rows at or past group_ends[E - 1] are 0 too;
//   b(n)  = n / 128 for n < split, else ceil(split / 128) + (n - split) / 128: a fused gate/up
//           weight [2I, H] keeps the gate's and the up's block grids (NB = 2 ceil(I / 128)) even
//           when I is not a multiple of 128; split = N for a plain weight (NB = ceil(N / 128)).
#pragma once

#include <cstdint>

namespace lm::cpu {

inline constexpr int64_t kFp8Group = 128;  // activation group and weight block edge
inline constexpr float kFp8Max = 448.0f;   // the largest finite e4m3fn magnitude
inline constexpr float kFp8ScaleFloor = 1e-10f;

// float8_e4m3fn bits -> value (exact); 0x7F / 0xFF are NaN.
float Fp8E4m3ToFloat(uint8_t bits);
// value -> float8_e4m3fn bits: round to nearest even, |x| >= 448 saturates to +-448, NaN -> 0x7F.
uint8_t FloatToFp8E4m3(float x);

// Rows [m0, m1) of x [M, K] (ldx floats apart) -> q [M, K] bytes and s [M, ceil(K / 128)].
void Fp8QuantizeRows(const float* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, uint8_t* q,
                     float* s);

// The SwiGLU of the fused expert output, quantized: gu [M, 2I] rows [gate | up] ->
// h = silu(gate) * up in fp32 (silu(g) = g / (1 + exp(-g))), then Fp8QuantizeRows of h [M, I].
void Fp8QuantizeSwiGluRows(const float* gu, int64_t I, int64_t m0, int64_t m1, uint8_t* q,
                           float* s);

struct Fp8GemmArgs {
  const uint8_t* a = nullptr;           // quantized activations [*, K]
  const float* a_scale = nullptr;       // [*, KB]
  const int64_t* row_index = nullptr;   // [R] source row of each output row, -1 padding; or null
  int64_t rows = 0;                     // R
  int64_t n = 0, k = 0;                 // N, K
  const uint8_t* w = nullptr;           // [E, N, K]
  const float* w_scale = nullptr;       // [E, NB, KB]
  const int32_t* group_ends = nullptr;  // [E] or null (then E == 1)
  int64_t experts = 1;
  int64_t split = 0;  // N for a plain weight
};

// Scale rows of an [N, K] weight split at `split` (see b(n) above).
int64_t Fp8ScaleRows(int64_t n, int64_t split);

// Output rows [r0, r1) of the GEMM above into out [R, N] (fp32). Single-threaded.
void Fp8BlockGemm(const Fp8GemmArgs& args, int64_t r0, int64_t r1, float* out);

}  // namespace lm::cpu
