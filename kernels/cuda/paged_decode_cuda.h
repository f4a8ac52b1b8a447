// LibTorch adapter of the paged decode attention kernels (paged_decode.cuh), registered as the
// CUDA lm::FastPaths::paged_decode (kernels/cuda/register.cc).
#pragma once

#include <torch/types.h>

namespace kernels {

// lm::PagedDecodeAttention (lm/model/paged_kv.h) on CUDA tensors: q [B, Hq, D], pools
// [num_blocks, block_size, Hkv, D], block_tables [B, max_blocks] int32, seq_lens [B] int32, all
// on one device -> [B, Hq, D] in q's dtype. Launched on the current stream of q's device, no host
// synchronisation. Undefined for inputs it does not handle (see paged_decode.cuh; also a q that
// needs a gradient), and the caller runs the reference. OPD_PAGED_DECODE_CUDA=cores|tensor in
// the environment forces a form of the split kernel (benchmarks and tests compare them); a
// forced form that does not apply to the inputs leaves them to the reference.
torch::Tensor PagedDecodeCuda(const torch::Tensor& q, const torch::Tensor& k_pool,
                              const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_lens, double scale);

}  // namespace kernels
