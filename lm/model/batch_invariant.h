// Batch-invariant inference: while a ScopedBatchInvariant is alive on a thread, a forward and its
// log-probs compute every token with arithmetic that does not depend on what else is in the batch,
// so a sequence's scores are the same bits whether it is scored alone or packed with others.
//
// Why it is needed: the teacher packs whatever requests are queued into one batch, and which
// requests share a batch depends on when concurrent calls arrive. The library picks its kernels by
// shape, so a sequence's log-probs moved by up to ~1e-6 with its neighbours, and an OPD run that
// needs several teacher calls per step was not reproducible, nor its resume exact. What depends on
// the batch, on the CPU, and what this mode does about it:
//   - GEMMs: MKL blocks and threads a product by its row count (and the library's few-row path
//     transposes it), so a row's reduction order changes with the batch. Here every product is
//     cut into fixed [kInvariantRows, K] x [K, <= kInvariantCols] tiles (the last rows padded with
//     zeros), each one single-threaded library call of the same shape and alignment.
//   - Pointwise transcendentals (silu, sigmoid, softplus, cos, sin): the library's vector loop
//     leaves a scalar tail at the end of each thread's range, and the scalar exp rounds unlike the
//     vector one, so which elements take the tail depends on the tensor's length. Here they run
//     on zero-padded blocks of kPointwiseBlock elements, one call each, always the vector code.
//   - Attention: documents were padded into buckets of similar length, and the flash kernel's
//     tiling follows the padded length. Here each document is attended alone.
//   - The MoE experts and the LM head's log-probs (kernels/cpu): fixed-height row tiles, padded.
//   - Row reductions (RMSNorm's mean, softmax, log-sum-exp over the vocabulary): one thread
//     reduces one row in a fixed order (LibTorch for rows shorter than its grain; the kernels'
//     row-wise log-sum-exp), which tests/batch_invariance_test.cc checks.
// The cost is measured next to the default path by bench/batch_invariant_bench.cc.
//
// Inference only: with gradients required, every helper here takes the library's op (autograd
// needs it) and makes no promise. On CUDA the helpers take the library's ops too: pointwise CUDA
// kernels compute each element alone, but cuBLAS and the reduction kernels choose by shape, so CUDA
// scoring is not batch-invariant (docs/gpu.md).
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace lm {

// Rows of one GEMM tile in batch-invariant mode: a multiple of every BLAS micro-kernel's height,
// large enough that the library runs near its speed on a tile of it.
inline constexpr int64_t kInvariantRows = 64;
// Output columns of one tile: splits a product into tasks when it has few rows.
inline constexpr int64_t kInvariantCols = 512;
// Elements per pointwise call: below LibTorch's grain (32768), so one call never splits across
// threads, and a multiple of every vector width, so its vector loop leaves no scalar tail.
inline constexpr int64_t kPointwiseBlock = 16384;

namespace batch_invariant_internal {
// In the header, so that the kernels of kernels/ (linked after lm) read it without a symbol of lm.
inline thread_local bool enabled = false;
}  // namespace batch_invariant_internal

// Whether the calling thread is in batch-invariant mode.
inline bool BatchInvariant() {
  return batch_invariant_internal::enabled;
}

// Puts the calling thread in batch-invariant mode while alive (`enabled`), restoring the previous
// mode after. Nestable.
class ScopedBatchInvariant {
 public:
  explicit ScopedBatchInvariant(bool enabled = true);
  ~ScopedBatchInvariant();
  ScopedBatchInvariant(const ScopedBatchInvariant&) = delete;
  ScopedBatchInvariant& operator=(const ScopedBatchInvariant&) = delete;

 private:
  bool previous_;
};

// x [M, K] W^T for W [N, K], each row of the result independent of the other rows of x: the CPU
// fast path (fp32, kernels/cpu) or, for other dtypes, fixed [kInvariantRows, K] blocks through the
// library one at a time. Any device (other devices: the library's product).
torch::Tensor InvariantMatmulWeightT(const torch::Tensor& x, const torch::Tensor& w);

// log(sum(exp(row))) of each row of logits [rows, V] -> [rows] fp32, each row reduced alone in a
// fixed order (the CPU kernels' row-wise log-sum-exp, or a scalar loop where they do not apply).
torch::Tensor InvariantLogSumExpRows(const torch::Tensor& logits);

// Pointwise ops that are torch's own outside batch-invariant mode, and in it (on the CPU) compute
// every element with the same vector code whatever its position (kPointwiseBlock above).
namespace pointwise {
torch::Tensor Silu(const torch::Tensor& x);
torch::Tensor Sigmoid(const torch::Tensor& x);
torch::Tensor Softplus(const torch::Tensor& x);  // beta 1, threshold 20, as F.softplus
torch::Tensor Cos(const torch::Tensor& x);
torch::Tensor Sin(const torch::Tensor& x);
}  // namespace pointwise

}  // namespace lm
