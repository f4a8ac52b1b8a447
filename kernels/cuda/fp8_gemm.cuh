// CUDA kernels of the FP8 block-scaled GEMM contract (kernels/cpu/fp8_gemm.h states it and holds
// its CPU twin): per-token 1 x 128 activation quantization to e4m3, the SwiGLU of the experts'
// gate/up output quantized the same way, and the block-scaled GEMM over 128 x 128 weight blocks,
// grouped by expert. A pure CUDA C++ API (raw device pointers, one cudaStream_t per call, no
// LibTorch); declarations only, so host compilers include it too.
//
// The GEMM runs on the e4m3 tensor cores (mma.sync m16n8k32, fp32 accumulators: compute
// capability 8.9 and up). A CTA computes a 64 x 128 tile of the output; for each 128-wide block
// of K it loads the activation and weight tiles into shared memory (cp.async, two stages), runs
// the block's dot products into fresh accumulators, and only then scales them by the rows' and
// the weight block's scales and adds them to the fp32 sums: the promotion DeepSeek-V3's kernels
// make, which keeps the tensor cores' reduced-precision accumulation to one block of 128.
//
// Requirements (cudaErrorInvalidValue otherwise): 1 <= K; N >= 1; 0 < split <= N; when
// group_ends is given, every group starts at a multiple of kFp8GroupRows (so that no 64-row tile
// holds two experts: lm/model/fp8.cc pads each expert's rows to it), and row_index entries are
// below the rows of `a`. 16-byte loads where K is a multiple of 16 and the pointers 16-byte
// aligned, byte loads otherwise.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace kernels {

inline constexpr int kFp8GroupRows = 64;  // the GEMM's tile height: expert groups align to it

enum class Fp8Element : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// x [M, K] (elements `type`, rows ldx elements apart) -> q [M, K] e4m3 bytes, s [M, ceil(K/128)].
cudaError_t Fp8QuantizeRowsCuda(const void* x, Fp8Element type, int64_t ldx, int64_t M, int64_t K,
                                uint8_t* q, float* s, cudaStream_t stream);

// gu [M, 2I] (rows [gate | up]) -> q [M, I], s [M, ceil(I/128)] of silu(gate) * up in fp32.
cudaError_t Fp8QuantizeSwiGluCuda(const void* gu, Fp8Element type, int64_t M, int64_t I, uint8_t* q,
                                  float* s, cudaStream_t stream);

struct Fp8GemmCudaArgs {
  const uint8_t* a = nullptr;          // [*, K]
  const float* a_scale = nullptr;      // [*, KB]
  const int64_t* row_index = nullptr;  // [rows] or null
  int64_t rows = 0, n = 0, k = 0;
  const uint8_t* w = nullptr;           // [E, N, K]
  const float* w_scale = nullptr;       // [E, NB, KB]
  const int32_t* group_ends = nullptr;  // [E] or null (E == 1)
  int64_t experts = 1;
  int64_t split = 0;
  void* out = nullptr;                         // [rows, N]
  Fp8Element out_type = Fp8Element::kFloat32;  // kFloat32 or kBFloat16
};
cudaError_t Fp8BlockGemmCuda(const Fp8GemmCudaArgs& args, cudaStream_t stream);

// Whether the current device runs the GEMM: its compute capability is 8.9 or more and the build
// holds machine code for it that has the e4m3 tensor-core path (not only an sm_80 fallback).
bool Fp8GemmRunsOnCurrentDevice();

}  // namespace kernels
