// Paged decode attention (split-KV flash-decoding) as a pure CUDA C++ API: raw device pointers,
// one cudaStream_t per call, no LibTorch; declarations only, so host compilers include it too.
// The LibTorch adapter is kernels/cuda/paged_decode_cuda.h; the contract is
// lm::PagedDecodeAttention (lm/model/paged_kv.h): one new query token per sequence attends to its
// sequence's first seq_lens[b] tokens, read in place from the pools through the block table.
//
// Two launches, both on `stream`, no host synchronisation:
//   1. Split: one thread block of 4 warps per (split of kPagedDecodeSplitTokens tokens, KV head
//      or group of its query heads, sequence) computes, for the query heads of that KV head, the
//      split's max m and sum l of exp2(s - m) of the scores s (log2 units) and the unnormalised
//      sum of exp2(s - m) V, in fp32. Each K and V row of the split is read from memory once for
//      all those query heads. Splits that start past a sequence's length exit at once, so the
//      grid is sized by host-known shapes (the block table's width), never by the lengths.
//   2. Reduce: one thread block per (query head, sequence) merges the splits' partials.
//
// The split kernel has two forms (PagedDecodePath):
//   - CUDA cores (any dtype, head_dim 64/128/256, any group): the query heads of the group live
//     in registers (G of them per pass, G the group rounded up to a power of two, at most 8, or 4
//     where a lane holds 8 dims or more); a row of K or V is split over the lanes of a warp in
//     16-byte vectors (16 lanes for bf16 x 128), each row group of lanes streams its own tokens
//     with four rows of K and of V loaded before any is used, and keeps its own online softmax;
//     the row groups' states merge once per split through shared memory sized for G heads.
//   - Tensor cores (bf16/fp16 pools and q of that dtype, head_dim 64/128): the group's query
//     heads padded to 16 are the M side of mma.sync m16n8k16; each warp streams its own 16-token
//     tiles of K and V into shared memory with cp.async (two stages: the next tile's loads are in
//     flight while this one is computed), S = Q K^T and O += P V on the tensor cores with fp32
//     accumulators, P split into a bf16/fp16 high and low part (two MMAs) so that it carries
//     ~16 bits; the four warps' states merge once per split.
// kAuto takes the tensor cores for groups of 4 or more query heads where they apply (Qwen3-30B's
// 8), the CUDA cores otherwise (Marco-Nano's 2).
//
// Supported: head_dim 64, 128 or 256; K/V pools bf16, fp16 or fp32 (same for both), contiguous
// [num_blocks, block_size, kv_heads, head_dim] and 16-byte aligned; q_heads a multiple of
// kv_heads. Pool offsets are 64-bit (a pool may hold more than 2^31 elements).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace kernels {

enum class KvDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class PagedDecodePath : int { kAuto = 0, kCudaCores = 1, kTensorCores = 2 };

inline constexpr int kPagedDecodeSplitTokens = 256;  // tokens per split (a partial each)
inline constexpr int kPagedDecodeMmaHeads = 16;      // query heads per tensor-core pass

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
  // q's values are exact in the pools' dtype (q came in that dtype): the tensor cores may take
  // it in that dtype. Without it only the CUDA-core form runs.
  bool q_in_kv_dtype = false;
  PagedDecodePath path = PagedDecodePath::kAuto;
};

// Splits covering a block table of max_blocks blocks.
int64_t PagedDecodeNumSplits(int64_t max_blocks, int64_t block_size);

// Whether PagedDecode handles these shapes (see above).
bool PagedDecodeSupports(int64_t head_dim, int64_t q_heads, int64_t kv_heads);

// The form of the split kernel a call with these arguments runs (kCudaCores or kTensorCores);
// kAuto when `args.path` asks for tensor cores where they do not apply.
PagedDecodePath PagedDecodeChosenPath(const PagedDecodeArgs& args);

// Launches both kernels; cudaErrorInvalidValue for unsupported shapes or a path that does not
// apply.
cudaError_t PagedDecode(const PagedDecodeArgs& args, cudaStream_t stream);

}  // namespace kernels
