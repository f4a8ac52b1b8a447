// fp32 CPU kernels, for decode-sized products (a handful of activation rows against a large
// weight) and for the log-sum-exp of scoring.
//
// At decode a MoE layer gives each expert ~T*k/E rows (4 for 32 sequences, top-8 of 64). A library
// GEMM call per expert then costs more in packing the weight and in its thread fork/join than in
// arithmetic, and the step is bound by streaming the weights from memory. These kernels compute
// out = a W^T as dot products of each weight row with every activation row, so each weight byte is
// read once, and leave threading to the caller, which runs all experts in one parallel region.
//
// AVX2 + FMA only (checked at run time); callers fall back to the library path elsewhere. No
// LibTorch here: plain row-major float arrays.
#pragma once

#include <cstdint>

namespace lm::cpu {

// Whether this CPU runs the kernels below. Calling them when it is false is undefined.
bool HasAvx2Fma();

// out[r, n] = sum_k a[r, k] * w[n, k] for r < m, n < N (w row-major [N, K]); rows of `a` are `lda`
// floats apart, rows of `out` `ldo`. K must be a multiple of 8. Single-threaded.
void MatmulWeightT(const float* a, int64_t lda, int64_t m, const float* w, int64_t N, int64_t K,
                   float* out, int64_t ldo);

// gu [m, 2I], each row [gate | up]: the gate half becomes silu(gate) * up (the SwiGLU activation).
void SiluMulInPlace(float* gu, int64_t m, int64_t I);

// One SwiGLU expert for m rows of x [m, H]: y [m, H] = down (silu(gate x) * (up x)), with
// gate_up [2I, H] (gate rows first, as in the checkpoint's fused layout) and down [H, I].
// `scratch` holds m * 2I floats. H and I must be multiples of 8.
void ExpertSwiGlu(const float* x, int64_t m, int64_t H, const float* gate_up, const float* down,
                  int64_t I, float* scratch, float* y);

// The same product against a weight repacked once into panels of kPanel rows, each stored
// transposed ([K][kPanel], zero past N): the layout a register-blocked kernel reads contiguously
// (6 activation rows x 16 outputs per step, no horizontal sums). For a weight used by every
// decode step (the LM head), packing once per generation pays for itself in the first step.
constexpr int64_t kPanel = 16;
inline int64_t PackedPanelsFloats(int64_t N, int64_t K) {
  return (N + kPanel - 1) / kPanel * kPanel * K;
}
// Panels [p0, p1) of w [N, K] into `packed` (PackedPanelsFloats(N, K) floats in all).
void PackPanels(const float* w, int64_t N, int64_t K, int64_t p0, int64_t p1, float* packed);
// out[r, n] for r < m and n in panels [p0, p1) (n < N). Single-threaded; any K.
void MatmulPackedPanels(const float* a, int64_t lda, int64_t m, const float* packed, int64_t N,
                        int64_t K, int64_t p0, int64_t p1, float* out, int64_t ldo);

// log(sum_j exp(x[j])) over n floats: one pass for the max, one for the sum of exp(x - max) (a
// polynomial exp, relative error < 2e-7; partial sums of 1024 terms added in double). This is
// what scoring does to every row of [rows, vocab] logits, so it reads each row twice and writes
// nothing. -inf when every x is -inf.
float LogSumExp(const float* x, int64_t n);

}  // namespace lm::cpu
