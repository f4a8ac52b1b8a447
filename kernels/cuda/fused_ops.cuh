// The small ops of a decoder layer fused into one launch each, as a pure CUDA C++ API: raw
// device pointers, one cudaStream_t per call, no LibTorch; declarations only, so host compilers
// include it too. The LibTorch adapter is kernels/cuda/fused_ops_cuda.h; the contracts are
// lm::FastPaths::add_rms_norm and qk_norm_rope (lm/model/fast_paths.h), whose CPU twins are
// kernels/cpu/fused_ops.h. A decode step of Marco-Nano ran RMSNorm as 8 library launches and
// q/k-norm + RoPE as ~30; these are one each, and rows are independent (a row's bits depend
// neither on the batch nor on the launch's shape).
//
//   AddRmsNorm: one block per row; pass 1 writes sum = x + residual rounded to the dtype (as the
//     library's add rounds) and sums its squares in fp32; pass 2 re-reads the row (its own
//     writes, in L1/L2) and writes weight * cast(sum * (1 / sqrt(mean + eps))).
//   QkNormRope: one warp per (token, head) of q and k; the head's normalised row in fp32 goes
//     through shared memory so that each lane reads its rotation partner; one rounding at the
//     end. Products and sums are separate roundings (no FMA), the reference's op for op in fp32.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace kernels {

enum class FusedDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct AddRmsNormArgs {
  const void* x = nullptr;         // [rows, hidden]
  const void* residual = nullptr;  // [rows, hidden] or null (no add; `sum` unused)
  const void* weight = nullptr;    // [hidden]
  void* out = nullptr;             // [rows, hidden]
  void* sum = nullptr;             // [rows, hidden], written when residual is given
  int64_t rows = 0, hidden = 0;
  float eps = 1e-6f;
  FusedDtype dtype = FusedDtype::kBFloat16;
};

// cudaErrorInvalidValue for a bad shape (hidden < 1).
cudaError_t AddRmsNorm(const AddRmsNormArgs& args, cudaStream_t stream);

struct QkNormRopeArgs {
  const void* q = nullptr;  // [tokens, q_heads, head_dim]
  const void* k = nullptr;  // [tokens, kv_heads, head_dim]
  const void* q_weight = nullptr;
  const void* k_weight = nullptr;  // [head_dim]
  const float* cos = nullptr;
  const float* sin = nullptr;  // [tokens, rotary_dim] fp32
  void* q_out = nullptr;       // like q; may be q
  void* k_out = nullptr;       // like k; may be k
  int64_t tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  float eps = 1e-6f;
  FusedDtype dtype = FusedDtype::kBFloat16;
};

// Whether QkNormRope handles these sizes: head_dim <= kQkNormRopeMaxDim, rotary_dim even and
// <= head_dim.
inline constexpr int64_t kQkNormRopeMaxDim = 1024;
bool QkNormRopeSupports(int64_t head_dim, int64_t rotary_dim);

// cudaErrorInvalidValue for unsupported sizes.
cudaError_t QkNormRope(const QkNormRopeArgs& args, cudaStream_t stream);

}  // namespace kernels
