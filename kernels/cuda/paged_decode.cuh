// Paged decode attention (split-KV flash-decoding) as a pure CUDA C++ API: raw device pointers,
// one cudaStream_t per call, no LibTorch; declarations only, so host compilers include it too.
// The LibTorch adapter is kernels/cuda/paged_decode_cuda.h; the contract is
// lm::PagedDecodeAttention (lm/model/paged_kv.h): one new query token per sequence attends to its
// sequence's first seq_lens[b] tokens, read in place from the pools through the block table.
//
// Two launches, both on `stream`, no host synchronisation:
//   1. Split: one thread block per (split of kPagedDecodeSplitTokens tokens, KV head, sequence)
//      computes, for the (up to kPagedDecodeGroup) query heads of that KV head, the split's
//      scores, their max m and sum l of exp2(s - m) and the unnormalised sum of p * V, in fp32.
//      Each K and V row of the split is read from memory once for all those query heads (more
//      than kPagedDecodeGroup query heads per KV head take one pass per group of them). Splits
//      that start past a sequence's length exit at once, so the grid is sized by host-known
//      shapes (the block table's width) and never by the lengths, which stay on the device.
//   2. Reduce: one thread block per (query head, sequence) merges the splits' partials.
//
// Supported: head_dim 64, 128 or 256; K/V pools bf16, fp16 or fp32 (same for both), contiguous
// [num_blocks, block_size, kv_heads, head_dim] and 16-byte aligned; q_heads a multiple of
// kv_heads. Pool offsets are 64-bit (a pool may hold more than 2^31 elements).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace kernels {

enum class KvDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline constexpr int kPagedDecodeSplitTokens = 256;  // tokens per split (a partial each)
inline constexpr int kPagedDecodeGroup = 8;          // query heads per pass over a KV head

struct PagedDecodeArgs {
  const float* q = nullptr;  // [batch, q_heads, head_dim] fp32 (unscaled)
  const void* k_pool = nullptr;
  const void* v_pool = nullptr;           // [num_blocks, block_size, kv_heads, head_dim]
  const int32_t* block_tables = nullptr;  // [batch, max_blocks]
  const int32_t* seq_lens = nullptr;      // [batch], 1 <= seq_lens[b] <= max_blocks * block_size
  float* out = nullptr;                   // [batch, q_heads, head_dim] fp32
  float* part_acc = nullptr;              // [batch, q_heads, num_splits, head_dim]
  float* part_ml = nullptr;               // [batch, q_heads, num_splits, 2]: max (log2 units), sum
  int64_t batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0, block_size = 0, max_blocks = 0;
  int64_t num_splits = 0;  // PagedDecodeNumSplits(max_blocks, block_size)
  float scale = 1.0f;
  KvDtype dtype = KvDtype::kBFloat16;
};

// Splits covering a block table of max_blocks blocks.
int64_t PagedDecodeNumSplits(int64_t max_blocks, int64_t block_size);

// Whether PagedDecode handles these shapes (see above).
bool PagedDecodeSupports(int64_t head_dim, int64_t q_heads, int64_t kv_heads);

// Launches both kernels; cudaErrorInvalidValue for unsupported shapes.
cudaError_t PagedDecode(const PagedDecodeArgs& args, cudaStream_t stream);

}  // namespace kernels
