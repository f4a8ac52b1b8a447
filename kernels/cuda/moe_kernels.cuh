// CUDA kernels for the sparse mixture-of-experts layer: a pure CUDA C++ API (raw device pointers,
// one cudaStream_t per call, no LibTorch), compiled by nvcc for sm_80 and sm_90a. This header has
// declarations only, so host C++ compilers include it too.
//
// The layer, for T tokens of width H, E experts of width I, top-k routing:
//
//   1. TopkSoftmax   router logits [T, E] -> fp32 weights [T, k] and ids [T, k]: softmax in fp32,
//                    top-k (ties go to the lower expert id), renormalised when asked.
//   2. AlignRows     the T*k (token, slot) pairs ("pairs", pair = token * k + slot) sorted by
//                    expert, stable (pairs of one expert keep increasing pair order) and
//                    deterministic (no atomics); each expert's block of rows is padded to the
//                    GEMM tile height (block_m), so that every tile of block_m rows belongs to one
//                    expert. Everything stays on the device: the grids of the following kernels
//                    are sized by the host-known upper bound (max_tiles) and surplus tiles exit,
//                    which is what makes the layer CUDA-graph safe.
//   3. GroupedSwiGlu act[r] = silu(x[token(r)] Wg_e^T) * (x[token(r)] Wu_e^T) for every padded row
//                    r of expert e, gate and up columns of one tile in one pass, A rows gathered
//                    from x by the permutation -> act [max_rows, I] (padding rows are zero).
//   4. GroupedDown   out[r] = act[r] Wd_e^T -> [max_rows, H].
//   5. Combine       y[t] = sum_s w[t, s] * out[row_of_pair[t * k + s]], slots in order, fp32
//                    accumulation, no atomics.
//
// Weights are the checkpoint's fused layout, row-major: gate_up [E, 2I, H] (the I gate rows
// first, then the I up rows), down [E, H, I]; i.e. y = x W^T.
//
// Element types: __nv_bfloat16 (tensor cores: mma.sync m16n8k16 with fp32 accumulation, cp.async
// multi-stage shared-memory pipelines, ldmatrix) and float (plain FMA tiles; the exact reference
// the tests use). Requirements, checked by every entry point (cudaErrorInvalidValue otherwise):
// 1 <= E <= kMaxExperts, 1 <= k <= kMaxTopK, H and I multiples of 8, every pointer 16-byte
// aligned. Expert ids outside [0, E) are dropped (they contribute nothing) rather than written
// out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace kernels {

inline constexpr int kMaxExperts = 512;  // one warp per router row holds E/32 <= 16 logits per lane
inline constexpr int kMaxTopK = 16;
inline constexpr int kAlignChunk = 1024;  // pairs per warp in AlignRows' count and scatter passes

// The grouped-GEMM tile configurations (their shapes are defined in moe_kernels.cu, in one place).
// A configuration fixes block_m, the tile height AlignRows pads each expert's rows to.
enum class TileConfig : int {
  kBf16Small = 0,   // block_m 16: decode and few rows per expert (weights-bandwidth bound)
  kBf16Medium = 1,  // block_m 64
  kBf16Large = 2,   // block_m 128: prefill and training batches (tensor-core bound)
  kFp32 = 3,        // block_m 32: FMA tiles for float
};
int BlockRows(TileConfig config);
// The configuration the layer uses for `pairs` = T*k routed rows over `experts` experts.
TileConfig ChooseTileConfig(bool bf16, int64_t pairs, int64_t experts);

// Sizes of the device buffers one layer call needs (in elements), from host-known shapes only.
struct MoePlan {
  int64_t tokens = 0, top_k = 0, experts = 0, hidden = 0, inter = 0;
  TileConfig config = TileConfig::kFp32;
  int block_m = 0;
  int64_t pairs = 0;       // tokens * top_k
  int64_t max_tiles = 0;   // upper bound of sum_e ceil(count_e / block_m)
  int64_t max_rows = 0;    // max_tiles * block_m: rows of act and of the expert outputs
  int64_t num_chunks = 0;  // ceil(pairs / kAlignChunk)
};
MoePlan MakeMoePlan(int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t inter,
                    TileConfig config);

// Device buffers of one layer call (sizes from MoePlan).
struct MoeBuffers {
  int32_t* chunk_counts;    // [num_chunks * E] scratch of AlignRows
  int32_t* expert_offsets;  // [E + 1] padded first row of each expert; [E] = rows in use
  int32_t* sorted_rows;     // [max_rows] pair of each padded row, -1 for padding
  int32_t* tile_expert;     // [max_tiles] expert of each tile, -1 for unused tiles
  int32_t* row_of_pair;     // [pairs] padded row of each pair, -1 when its id was out of range
  void* act;                // [max_rows, I] element type
  void* expert_out;         // [max_rows, H] element type
};

// 1. logits [T, E] (LogitT: float or __nv_bfloat16) -> weights [T, k] fp32, ids [T, k]
//    (IdT: int32_t or int64_t).
template <typename LogitT, typename IdT>
cudaError_t TopkSoftmax(const LogitT* logits, int64_t tokens, int experts, int top_k,
                        bool renormalize, float* weights, IdT* ids, cudaStream_t stream);

// 2. ids [pairs] (IdT: int32_t or int64_t) -> chunk_counts, expert_offsets, sorted_rows,
//    tile_expert, row_of_pair of `buffers` (sizes from `plan`).
template <typename IdT>
cudaError_t AlignRows(const MoePlan& plan, const IdT* ids, const MoeBuffers& buffers,
                      cudaStream_t stream);

// 3. x [T, H], gate_up [E, 2I, H] -> buffers.act [max_rows, I] (T: float or __nv_bfloat16).
template <typename T>
cudaError_t GroupedSwiGlu(const MoePlan& plan, const T* x, const T* gate_up,
                          const MoeBuffers& buffers, cudaStream_t stream);

// 4. buffers.act, down [E, H, I] -> buffers.expert_out [max_rows, H].
template <typename T>
cudaError_t GroupedDown(const MoePlan& plan, const T* down, const MoeBuffers& buffers,
                        cudaStream_t stream);

// 5. buffers.expert_out, weights [T, k] (WT: float, or T itself) -> y [T, H].
template <typename T, typename WT>
cudaError_t Combine(const MoePlan& plan, const WT* weights, const MoeBuffers& buffers, T* y,
                    cudaStream_t stream);

// 2-5 in order: the experts computation of the layer.
template <typename T, typename IdT, typename WT>
cudaError_t MoeExpertsForward(const MoePlan& plan, const T* x, const IdT* ids, const WT* weights,
                              const T* gate_up, const T* down, const MoeBuffers& buffers, T* y,
                              cudaStream_t stream);

// The SM architectures this library was compiled for, e.g. "800,900" (nvcc's __CUDA_ARCH_LIST__).
const char* CompiledArchitectures();

}  // namespace kernels
