// Paged decode attention on the CPU: the CPU twin of kernels/cuda/paged_decode.cuh, registered as
// the CPU lm::FastPaths::paged_decode (kernels/cpu/register.cc). The contract is
// lm::PagedDecodeAttention (lm/model/paged_kv.h).
//
// Tasks of (sequence, split of kPagedDecodeCpuSplitTokens tokens) run whole on one thread,
// longest first. A task reads its blocks in place through the block table, each block once, front
// to back ([block_size, Hkv, D] is one contiguous run, and the next block is prefetched: the
// threads go over sequences x splits rather than sequences x heads, which would stride through
// every block once per head), and for each KV head computes the scores of all the query heads of
// its group from one load of each K row and accumulates p * V the same way (AVX2 FMA, fp32, online
// softmax). A second pass merges each query head's splits. The split size is fixed, so the result
// depends neither on the thread count nor on the other sequences of the batch.
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace lm {

inline constexpr int64_t kPagedDecodeCpuSplitTokens = 1024;

// Whether PagedDecodeCpu handles these inputs: CPU tensors, no gradient, fp32 or bf16 pools (both
// the same, contiguous), fp32 or bf16 q, int32 block tables and lengths, an AVX2 + FMA CPU.
bool UseCpuPagedDecode(const torch::Tensor& q, const torch::Tensor& k_pool,
                       const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                       const torch::Tensor& seq_lens);

// q [B, Hq, D], pools [num_blocks, block_size, Hkv, D], block_tables [B, max_blocks],
// seq_lens [B] (1 <= seq_lens[b] <= max_blocks * block_size) -> [B, Hq, D] in q's dtype.
torch::Tensor PagedDecodeCpu(const torch::Tensor& q, const torch::Tensor& k_pool,
                             const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, double scale);

}  // namespace lm
