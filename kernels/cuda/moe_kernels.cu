// CUDA kernels of the MoE layer (see moe_kernels.cuh for the pipeline and the contracts).
#include "kernels/cuda/moe_kernels.cuh"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "kernels/ needs sm_80 or newer (bf16 mma.sync, cp.async); set OPD_CUDA_ARCHITECTURES"
#endif

namespace kernels {
namespace {

using bf16 = __nv_bfloat16;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Tile configurations: the one place where GEMM tile shapes are chosen.
//
// A block computes BM rows (one expert's padded rows) x BN columns of the GEMM, where the BN
// columns are rows of the expert's weight matrix (for the SwiGLU GEMM: BN/2 gate rows and the
// matching BN/2 up rows, i.e. BN/2 columns of act). Warps tile the block WM x WN; each warp
// issues (WM/16) x (WN/8) mma.sync m16n8k16 per 16-wide k step. STAGES shared-memory stages are
// filled by cp.async ahead of the tensor cores.
// ---------------------------------------------------------------------------------------------
template <int kBM, int kBN, int kBK, int kWM, int kWN, int kStages>
struct MmaTile {
  static constexpr int BM = kBM, BN = kBN, BK = kBK, WM = kWM, WN = kWN, STAGES = kStages;
  static constexpr int WARPS_M = BM / WM, WARPS_N = BN / WN;
  static constexpr int THREADS = WARPS_M * WARPS_N * 32;
  static constexpr int MT = WM / 16, NT = WN / 8;  // m16 and n8 tiles per warp
  // Shared-memory rows are padded by 8 elements (16 bytes): the 8 row addresses of one ldmatrix
  // phase then fall into 8 distinct 16-byte bank groups (row strides 80 and 144 bytes).
  static constexpr int LDS = BK + 8;
  static constexpr int SMEM_BYTES = STAGES * (BM + BN) * LDS * static_cast<int>(sizeof(bf16));
  static_assert(BM % WM == 0 && BN % WN == 0, "warps must tile the block");
  static_assert(WM % 16 == 0, "whole m16 tiles per warp");
  static_assert(WN % 16 == 0, "pairs of n8 tiles per warp (and whole n8 tiles per SwiGLU half)");
  static_assert(BK % 16 == 0 && BK >= 16, "whole k16 steps per stage");
  static_assert(STAGES >= 2, "a pipeline needs two stages");
  static_assert((LDS * sizeof(bf16)) % 16 == 0, "cp.async and ldmatrix need 16-byte rows");
};

//                      BM   BN  BK  WM  WN  STAGES   threads  smem
using Bf16Small = MmaTile<16, 64, 64, 16, 16, 4>;    // 128      45 KB
using Bf16Medium = MmaTile<64, 128, 32, 32, 64, 4>;  // 128      60 KB
using Bf16Large = MmaTile<128, 128, 32, 64, 32, 4>;  // 256      80 KB

// float: plain FMA tiles, 256 threads as 16 x 16, each thread 2 rows x 4 columns.
struct Fp32Tile {
  static constexpr int BM = 32, BN = 64, BK = 16, THREADS = 256;
};

// Average routed rows per active expert above which the next larger tile height is used.
constexpr int64_t kSmallMaxRowsPerExpert = 24;
constexpr int64_t kMediumMaxRowsPerExpert = 96;

constexpr int kAlignWarps = 4;  // warps (= chunks of kAlignChunk pairs) per block in AlignRows
constexpr int kCombineThreads = 128;
constexpr int kTopkWarps = 4;

// ---------------------------------------------------------------------------------------------
// Small device helpers.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float ToFloat(float v) {
  return v;
}
__device__ __forceinline__ float ToFloat(bf16 v) {
  return __bfloat162float(v);
}

__device__ __forceinline__ float Silu(float g) {
  return g / (1.0f + expf(-g));
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

__device__ __forceinline__ unsigned LaneMaskLt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; zero-fills the destination when !valid (nothing is read then).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += a (16x16, row-major) * b (16x8, "col": k contiguous per column), fp32 accumulators.
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 8 consecutive elements <-> 8 floats (16-byte aligned for bf16, 32-byte for float).
__device__ __forceinline__ void Load8(const bf16* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void Load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void Store8(bf16* p, const float (&v)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void Store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// ---------------------------------------------------------------------------------------------
// 1. Router: softmax + top-k (+ renormalisation). One warp per row; lane l holds the logits of
//    experts l, l+32, ... (E <= 512: 16 per lane, in registers). Selection is by logit (the
//    softmax is monotonic), k rounds of a warp arg-max in which the larger value wins and equal
//    values go to the lower expert id; selected experts are masked by a per-lane bit set.
// ---------------------------------------------------------------------------------------------
template <typename LogitT, typename IdT>
__global__ void __launch_bounds__(kTopkWarps * 32)
    TopkSoftmaxKernel(const LogitT* __restrict__ logits, int64_t tokens, int experts, int top_k,
                      bool renormalize, float* __restrict__ weights, IdT* __restrict__ ids) {
  constexpr int kPerLane = kMaxExperts / 32;
  constexpr int kNone = INT_MAX;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kTopkWarps + (threadIdx.x >> 5);
  if (row >= tokens) return;  // uniform across the warp
  const LogitT* l = logits + row * experts;

  float v[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int col = lane + 32 * j;
    v[j] = col < experts ? ToFloat(l[col]) : -INFINITY;
  }
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) m = fmaxf(m, v[j]);
  m = WarpMax(m);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (lane + 32 * j < experts) s += expf(v[j] - m);
  }
  s = WarpSum(s);

  uint32_t taken = 0;  // bit j: expert lane + 32 j already selected
  float my_weight = 0.0f;
  int my_id = 0;
  for (int r = 0; r < top_k; ++r) {
    float bv = -INFINITY;
    int bi = kNone;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int col = lane + 32 * j;
      if (col < experts && !((taken >> j) & 1u) && (bi == kNone || v[j] > bv)) {
        bv = v[j];
        bi = col;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, bv, off);
      const int oi = __shfl_xor_sync(kFullMask, bi, off);
      if (oi != kNone && (bi == kNone || ov > bv || (ov == bv && oi < bi))) {
        bv = ov;
        bi = oi;
      }
    }
    // Every lane holds the same winner unless NaNs broke the order; lane 0's answer decides.
    bv = __shfl_sync(kFullMask, bv, 0);
    bi = __shfl_sync(kFullMask, bi, 0);
    if (bi != kNone && (bi & 31) == lane) taken |= 1u << (bi >> 5);
    if (lane == r) {
      my_weight = bi == kNone ? 0.0f : expf(bv - m) / s;
      my_id = bi == kNone ? 0 : bi;
    }
  }
  const float total = WarpSum(lane < top_k ? my_weight : 0.0f);
  if (lane < top_k) {
    weights[row * top_k + lane] = renormalize ? my_weight / total : my_weight;
    ids[row * top_k + lane] = static_cast<IdT>(my_id);
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Align: a stable counting sort of the pairs by expert, in three deterministic passes.
//    The pairs are cut into chunks of kAlignChunk; one warp owns one chunk and walks it 32 pairs
//    at a time in pair order, grouping equal experts with __match_any_sync (a lane's rank among
//    its peers is the number of lower lanes with the same expert).
//    a) count:   chunk_counts[c][e] = pairs of expert e in chunk c
//    b) scan:    chunk_counts[c][e] <- pairs of expert e in chunks < c (exclusive, in place);
//                expert_offsets = exclusive scan of counts rounded up to block_m; padding rows
//                get -1; tile_expert maps each block_m tile to its expert (-1 past the end)
//    c) scatter: pair -> expert_offsets[e] + chunk prefix + rank within the chunk
// ---------------------------------------------------------------------------------------------
template <typename IdT>
__device__ __forceinline__ int ValidExpert(const IdT* ids, int64_t pair, int64_t pairs,
                                           int experts) {
  if (pair >= pairs) return -1;
  const int64_t v = static_cast<int64_t>(ids[pair]);
  return (v >= 0 && v < experts) ? static_cast<int>(v) : -1;
}

// One warp counts the pairs of the chunk starting at `base`: cnt[e] += pairs of expert e
// (cnt zeroed by the caller; the warp's lanes are the only writers).
template <typename IdT>
__device__ __forceinline__ void CountChunk(const IdT* __restrict__ ids, int64_t pairs, int experts,
                                           int64_t base, int lane, int32_t* cnt) {
  for (int j = 0; j < kAlignChunk / 32; ++j) {
    const int id = ValidExpert(ids, base + j * 32 + lane, pairs, experts);
    const unsigned peers = __match_any_sync(kFullMask, id);
    if (id >= 0 && lane == 31 - __clz(peers)) cnt[id] += __popc(peers);
    __syncwarp();
  }
}

// One warp places the pairs of the chunk starting at `base` in pair order: next[e] is the row
// of the chunk's first pair of expert e and advances past each pair placed.
template <typename IdT>
__device__ __forceinline__ void ScatterChunk(const IdT* __restrict__ ids, int64_t pairs,
                                             int experts, int64_t base, int lane, int32_t* next,
                                             int32_t* __restrict__ sorted_rows,
                                             int32_t* __restrict__ row_of_pair) {
  for (int j = 0; j < kAlignChunk / 32; ++j) {
    const int64_t pair = base + j * 32 + lane;
    const int id = ValidExpert(ids, pair, pairs, experts);
    const unsigned peers = __match_any_sync(kFullMask, id);
    if (id >= 0) {
      const int32_t row = next[id] + __popc(peers & LaneMaskLt());
      sorted_rows[row] = static_cast<int32_t>(pair);
      row_of_pair[pair] = row;
    } else if (pair < pairs) {
      row_of_pair[pair] = -1;
    }
    __syncwarp();
    if (id >= 0 && lane == 31 - __clz(peers)) next[id] += __popc(peers);
    __syncwarp();
  }
}

// Called by all kMaxExperts threads of a block, thread e holding `count` = rows of expert e
// (0 for e >= experts): exclusive scan of the counts rounded up to block_m; writes
// expert_offsets, -1 into padding rows (and every row past the rows in use), tile_expert (-1 past
// the rows in use). Returns expert
// e's first row.
__device__ __forceinline__ int32_t PadAndMapExperts(int32_t count, int experts, int block_m,
                                                    int64_t max_tiles,
                                                    int32_t* __restrict__ expert_offsets,
                                                    int32_t* __restrict__ sorted_rows,
                                                    int32_t* __restrict__ tile_expert) {
  constexpr int kWarps = kMaxExperts / 32;
  __shared__ int32_t warp_prefix[kWarps];
  __shared__ int32_t total_rows;
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const int32_t padded = (count + block_m - 1) / block_m * block_m;
  int32_t incl = padded;  // warp scans, then a scan of the warp sums
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t y = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == 31) warp_prefix[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int32_t w = lane < kWarps ? warp_prefix[lane] : 0;
    int32_t wi = w;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int32_t y = __shfl_up_sync(kFullMask, wi, off);
      if (lane >= off) wi += y;
    }
    if (lane < kWarps) warp_prefix[lane] = wi - w;
    if (lane == kWarps - 1) total_rows = wi;
  }
  __syncthreads();
  const int32_t start = warp_prefix[warp] + incl - padded;
  const int32_t total = total_rows;
  if (e < experts) {
    expert_offsets[e] = start;
    for (int32_t r = start + count; r < start + padded; ++r) sorted_rows[r] = -1;
    for (int32_t t = start / block_m; t < (start + padded) / block_m; ++t) tile_expert[t] = e;
  }
  if (e == 0) expert_offsets[experts] = total;
  for (int64_t t = total / block_m + e; t < max_tiles; t += kMaxExperts) tile_expert[t] = -1;
  // The rows past the last expert's are padding too: every row of sorted_rows is written, so the
  // outputs are the same bytes on every call.
  for (int64_t r = total + e; r < max_tiles * block_m; r += kMaxExperts) sorted_rows[r] = -1;
  return start;
}

// a) count, chunk c by warp c.
template <typename IdT>
__global__ void __launch_bounds__(kAlignWarps * 32)
    AlignCountKernel(const IdT* __restrict__ ids, int64_t pairs, int experts, int64_t num_chunks,
                     int32_t* __restrict__ chunk_counts) {
  __shared__ int32_t counts[kAlignWarps][kMaxExperts];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kAlignWarps + warp;
  if (chunk >= num_chunks) return;  // uniform across the warp; only warp-level sync below
  int32_t* cnt = counts[warp];
  for (int e = lane; e < experts; e += 32) cnt[e] = 0;
  __syncwarp();
  CountChunk(ids, pairs, experts, chunk * kAlignChunk, lane, cnt);
  for (int e = lane; e < experts; e += 32) chunk_counts[chunk * experts + e] = cnt[e];
}

// b) scan, one block of kMaxExperts threads.
__global__ void __launch_bounds__(kMaxExperts)
    AlignScanKernel(int experts, int64_t num_chunks, int block_m, int64_t max_tiles,
                    int32_t* __restrict__ chunk_counts, int32_t* __restrict__ expert_offsets,
                    int32_t* __restrict__ sorted_rows, int32_t* __restrict__ tile_expert) {
  const int e = threadIdx.x;
  // Exclusive prefix over chunks, per expert (coalesced across experts), loads batched.
  int32_t count = 0;
  if (e < experts) {
    int32_t* p = chunk_counts + e;
    int64_t c = 0;
    for (; c + 8 <= num_chunks; c += 8) {
      int32_t v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = p[(c + u) * experts];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        p[(c + u) * experts] = count;
        count += v[u];
      }
    }
    for (; c < num_chunks; ++c) {
      const int32_t v = p[c * experts];
      p[c * experts] = count;
      count += v;
    }
  }
  PadAndMapExperts(count, experts, block_m, max_tiles, expert_offsets, sorted_rows, tile_expert);
}

// c) scatter, chunk c by warp c.
template <typename IdT>
__global__ void __launch_bounds__(kAlignWarps * 32)
    AlignScatterKernel(const IdT* __restrict__ ids, int64_t pairs, int experts, int64_t num_chunks,
                       const int32_t* __restrict__ chunk_prefix,
                       const int32_t* __restrict__ expert_offsets,
                       int32_t* __restrict__ sorted_rows, int32_t* __restrict__ row_of_pair) {
  __shared__ int32_t next_row[kAlignWarps][kMaxExperts];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kAlignWarps + warp;
  if (chunk >= num_chunks) return;  // uniform across the warp
  int32_t* next = next_row[warp];
  for (int e = lane; e < experts; e += 32) {
    next[e] = expert_offsets[e] + chunk_prefix[chunk * experts + e];
  }
  __syncwarp();
  ScatterChunk(ids, pairs, experts, chunk * kAlignChunk, lane, next, sorted_rows, row_of_pair);
}

// a) + b) + c) in one block when all pairs fit in one chunk (decode): one launch instead of three.
template <typename IdT>
__global__ void __launch_bounds__(kMaxExperts)
    AlignSmallKernel(const IdT* __restrict__ ids, int64_t pairs, int experts, int block_m,
                     int64_t max_tiles, int32_t* __restrict__ expert_offsets,
                     int32_t* __restrict__ sorted_rows, int32_t* __restrict__ tile_expert,
                     int32_t* __restrict__ row_of_pair) {
  __shared__ int32_t counts[kMaxExperts];  // pairs per expert, then each expert's next row
  const int e = threadIdx.x;
  counts[e] = 0;
  __syncthreads();
  if (e < 32) CountChunk(ids, pairs, experts, 0, e, counts);
  __syncthreads();
  const int32_t count = e < experts ? counts[e] : 0;
  const int32_t start = PadAndMapExperts(count, experts, block_m, max_tiles, expert_offsets,
                                         sorted_rows, tile_expert);
  counts[e] = start;  // thread e alone read counts[e] since the barrier after counting
  __syncthreads();
  if (e < 32) ScatterChunk(ids, pairs, experts, 0, e, counts, sorted_rows, row_of_pair);
}

// ---------------------------------------------------------------------------------------------
// 3./4. Grouped GEMM on tensor cores (bf16 in, fp32 accumulation).
//
// Block (tile, n-block): tile = blockIdx.x is a block of BM padded rows of one expert e
// (tile_expert[tile], -1: unused, exit), n-block = blockIdx.y a block of BN weight rows.
//   kSwiGlu (GEMM 1): A row r = x[token(sorted_rows[r])], K = H; weight rows: BN/2 gate rows
//     n0 .. n0+BN/2 of gate_up[e] and the matching up rows I+n0 ..; out act[r, n0 ..] =
//     silu(gate) * up, with N = I.
//   !kSwiGlu (GEMM 2): A row r = act[r], K = I; weight rows n0 .. n0+BN of down[e]; N = H.
// Padding rows (sorted_rows = -1) and k / n beyond the matrix are zero-filled by cp.async, so
// they produce zeros and read nothing. K and N are multiples of 8 (whole 16-byte chunks).
// ---------------------------------------------------------------------------------------------
template <class Cfg, bool kSwiGlu>
__device__ __forceinline__ int WarpBRow(int wn, int nt) {
  if constexpr (kSwiGlu) {
    constexpr int kHalf = Cfg::NT / 2;
    return nt < kHalf ? wn * (Cfg::WN / 2) + nt * 8
                      : Cfg::BN / 2 + wn * (Cfg::WN / 2) + (nt - kHalf) * 8;
  } else {
    return wn * Cfg::WN + nt * 8;
  }
}

// The weight row that row r of a B tile (BN rows) loads, and the output column it feeds. A SwiGLU
// tile holds the gate rows of BN/2 columns followed by the up rows of the same columns (rows N..2N
// of the expert's gate_up), so that one tile computes both halves of its columns.
template <bool kSwiGlu, int BN>
__device__ __forceinline__ int64_t TileWeightRow(int r, int64_t n0, int64_t N, int64_t* col) {
  if constexpr (kSwiGlu) {
    const int up = r >= BN / 2;
    *col = n0 + r - up * (BN / 2);
    return up * N + *col;
  }
  *col = n0 + r;
  return *col;
}

template <class Cfg, bool kSwiGlu>
__global__ void __launch_bounds__(Cfg::THREADS)
    GroupedGemmBf16Kernel(const bf16* __restrict__ A, int64_t K, int top_k,
                          const bf16* __restrict__ W, int64_t N,
                          const int32_t* __restrict__ sorted_rows,
                          const int32_t* __restrict__ tile_expert, bf16* __restrict__ C) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, LDS = Cfg::LDS, STAGES = Cfg::STAGES;
  constexpr int kChunksPerRow = BK / 8;
  const int64_t tile = blockIdx.x;
  const int expert = tile_expert[tile];
  if (expert < 0) return;  // uniform across the block

  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sA = reinterpret_cast<bf16*>(smem_raw);  // [STAGES][BM][LDS]
  bf16* sB = sA + STAGES * BM * LDS;             // [STAGES][BN][LDS]
  __shared__ int64_t a_src[BM];                  // element offset of each A row in A, -1: zero

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / Cfg::WARPS_N, wn = warp % Cfg::WARPS_N;
  for (int i = tid; i < BM; i += Cfg::THREADS) {
    const int64_t row = tile * BM + i;
    const int32_t pair = sorted_rows[row];
    a_src[i] = pair < 0 ? -1 : (kSwiGlu ? static_cast<int64_t>(pair / top_k) : row) * K;
  }
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * (kSwiGlu ? BN / 2 : BN);
  const bf16* We = W + static_cast<int64_t>(expert) * (kSwiGlu ? 2 * N : N) * K;
  __syncthreads();

  auto load_stage = [&](int stage, int kt) {
    const int64_t k0 = static_cast<int64_t>(kt) * BK;
    bf16* a = sA + stage * BM * LDS;
    for (int c = tid; c < BM * kChunksPerRow; c += Cfg::THREADS) {
      const int r = c / kChunksPerRow, kc = (c % kChunksPerRow) * 8;
      const int64_t src = a_src[r];
      const bool ok = src >= 0 && k0 + kc < K;
      CpAsync16(SmemAddr(a + r * LDS + kc), ok ? A + src + k0 + kc : A, ok);
    }
    bf16* b = sB + stage * BN * LDS;
    for (int c = tid; c < BN * kChunksPerRow; c += Cfg::THREADS) {
      const int r = c / kChunksPerRow, kc = (c % kChunksPerRow) * 8;
      int64_t col;
      const int64_t wrow = TileWeightRow<kSwiGlu, BN>(r, n0, N, &col);
      const bool ok = col < N && k0 + kc < K;
      CpAsync16(SmemAddr(b + r * LDS + kc), ok ? We + wrow * K + k0 + kc : W, ok);
    }
  };

  float acc[Cfg::MT][Cfg::NT][4];
#pragma unroll
  for (int mt = 0; mt < Cfg::MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Cfg::NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
    }
  }

  const int ktiles = static_cast<int>((K + BK - 1) / BK);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    CpAsyncCommit();  // always commit, so that group counts stay uniform
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    // Group kt (this stage) has landed for this thread; the barrier makes every thread's copies
    // visible and guarantees that all warps finished reading the stage refilled below (kt - 1).
    CpAsyncWait<STAGES - 2>();
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < ktiles) load_stage(next % STAGES, next);
    CpAsyncCommit();

    const bf16* a = sA + (kt % STAGES) * BM * LDS;
    const bf16* b = sB + (kt % STAGES) * BN * LDS;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t af[Cfg::MT][4];
#pragma unroll
      for (int mt = 0; mt < Cfg::MT; ++mt) {
        const int row = wm * Cfg::WM + mt * 16 + (lane & 15);
        LdMatrixX4(af[mt], SmemAddr(a + row * LDS + kk + (lane >> 4) * 8));
      }
      uint32_t bfrag[Cfg::NT][2];
#pragma unroll
      for (int p = 0; p < Cfg::NT / 2; ++p) {
        // Lanes 0-15 address n-tile 2p (k 0-7, then k 8-15), lanes 16-31 n-tile 2p+1.
        const int row = WarpBRow<Cfg, kSwiGlu>(wn, 2 * p + (lane >> 4)) + (lane & 7);
        uint32_t r[4];
        LdMatrixX4(r, SmemAddr(b + row * LDS + kk + ((lane >> 3) & 1) * 8));
        bfrag[2 * p][0] = r[0];
        bfrag[2 * p][1] = r[1];
        bfrag[2 * p + 1][0] = r[2];
        bfrag[2 * p + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < Cfg::MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; ++nt)
          MmaBf16(acc[mt][nt], af[mt], bfrag[nt][0], bfrag[nt][1]);
      }
    }
  }
  CpAsyncWait<0>();

  // Epilogue: accumulator (row g / g+8, columns 2c, 2c+1) of each m16n8 tile -> bf16 pairs.
  const int g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < Cfg::MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = tile * BM + wm * Cfg::WM + mt * 16 + g + h * 8;
      if constexpr (kSwiGlu) {
#pragma unroll
        for (int j = 0; j < Cfg::NT / 2; ++j) {
          const int64_t col = n0 + wn * (Cfg::WN / 2) + j * 8 + c2;
          if (col < N) {
            const float* gt = acc[mt][j];
            const float* up = acc[mt][j + Cfg::NT / 2];
            *reinterpret_cast<__nv_bfloat162*>(C + row * N + col) = __floats2bfloat162_rn(
                Silu(gt[2 * h]) * up[2 * h], Silu(gt[2 * h + 1]) * up[2 * h + 1]);
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; ++nt) {
          const int64_t col = n0 + wn * Cfg::WN + nt * 8 + c2;
          if (col < N) {
            *reinterpret_cast<__nv_bfloat162*>(C + row * N + col) =
                __floats2bfloat162_rn(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
          }
        }
      }
    }
  }
}

// The same grouped GEMMs in float with FMA tiles (the exact path). Thread (tx, ty) of 16 x 16
// computes rows 2ty, 2ty+1 and weight rows BCol(j), j < 4 (for SwiGLU j < 2 gate, j >= 2 the
// matching up rows).
template <bool kSwiGlu>
__device__ __forceinline__ int Fp32BCol(int tx, int j) {
  constexpr int BN = Fp32Tile::BN;
  if constexpr (kSwiGlu) {
    return j < 2 ? tx + 16 * j : BN / 2 + tx + 16 * (j - 2);
  } else {
    return tx + 16 * j;
  }
}

template <bool kSwiGlu>
__global__ void __launch_bounds__(Fp32Tile::THREADS)
    GroupedGemmFp32Kernel(const float* __restrict__ A, int64_t K, int top_k,
                          const float* __restrict__ W, int64_t N,
                          const int32_t* __restrict__ sorted_rows,
                          const int32_t* __restrict__ tile_expert, float* __restrict__ C) {
  constexpr int BM = Fp32Tile::BM, BN = Fp32Tile::BN, BK = Fp32Tile::BK;
  constexpr int THREADS = Fp32Tile::THREADS;
  static_assert(THREADS == 256 && BM == 32 && BN == 64, "thread layout assumes 16 x 16");
  const int64_t tile = blockIdx.x;
  const int expert = tile_expert[tile];
  if (expert < 0) return;

  __shared__ float sA[BK][BM + 1];
  __shared__ float sB[BK][BN + 1];
  __shared__ int64_t a_src[BM];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  for (int i = tid; i < BM; i += THREADS) {
    const int64_t row = tile * BM + i;
    const int32_t pair = sorted_rows[row];
    a_src[i] = pair < 0 ? -1 : (kSwiGlu ? static_cast<int64_t>(pair / top_k) : row) * K;
  }
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * (kSwiGlu ? BN / 2 : BN);
  const float* We = W + static_cast<int64_t>(expert) * (kSwiGlu ? 2 * N : N) * K;
  __syncthreads();

  float acc[2][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += BK) {
    for (int i = tid; i < BM * BK; i += THREADS) {
      const int r = i / BK, kk = i % BK;
      const int64_t src = a_src[r];
      sA[kk][r] = (src >= 0 && k0 + kk < K) ? A[src + k0 + kk] : 0.0f;
    }
    for (int i = tid; i < BN * BK; i += THREADS) {
      const int r = i / BK, kk = i % BK;
      int64_t col;
      const int64_t wrow = TileWeightRow<kSwiGlu, BN>(r, n0, N, &col);
      sB[kk][r] = (col < N && k0 + kk < K) ? We[wrow * K + k0 + kk] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      const float a0 = sA[kk][2 * ty], a1 = sA[kk][2 * ty + 1];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float b = sB[kk][Fp32BCol<kSwiGlu>(tx, j)];
        acc[0][j] = fmaf(a0, b, acc[0][j]);
        acc[1][j] = fmaf(a1, b, acc[1][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row = tile * BM + 2 * ty + i;
    if constexpr (kSwiGlu) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t col = n0 + tx + 16 * j;
        if (col < N) C[row * N + col] = Silu(acc[i][j]) * acc[i][j + 2];
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t col = n0 + tx + 16 * j;
        if (col < N) C[row * N + col] = acc[i][j];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 5. Combine: one block per token; 8 columns per thread; the k slots in order, fp32.
// ---------------------------------------------------------------------------------------------
template <typename T, typename WT>
__global__ void __launch_bounds__(kCombineThreads)
    CombineKernel(const T* __restrict__ expert_out, const int32_t* __restrict__ row_of_pair,
                  const WT* __restrict__ weights, int top_k, int64_t hidden, T* __restrict__ y) {
  __shared__ int32_t rows[kMaxTopK];
  __shared__ float ws[kMaxTopK];
  const int64_t t = blockIdx.x;
  if (threadIdx.x < top_k) {
    rows[threadIdx.x] = row_of_pair[t * top_k + threadIdx.x];
    ws[threadIdx.x] = ToFloat(weights[t * top_k + threadIdx.x]);
  }
  __syncthreads();
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * 8; c < hidden; c += kCombineThreads * 8) {
    float acc[8] = {};
    for (int s = 0; s < top_k; ++s) {
      if (rows[s] < 0) continue;
      float v[8];
      Load8(expert_out + static_cast<int64_t>(rows[s]) * hidden + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(ws[s], v[i], acc[i]);
    }
    Store8(y + t * hidden + c, acc);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------
bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

bool ValidPlan(const MoePlan& p) {
  return p.tokens >= 0 && p.top_k >= 1 && p.top_k <= kMaxTopK && p.experts >= 1 &&
         p.experts <= kMaxExperts && p.top_k <= p.experts && p.hidden > 0 && p.hidden % 8 == 0 &&
         p.inter > 0 && p.inter % 8 == 0 && p.block_m == BlockRows(p.config) &&
         p.max_rows <= INT32_MAX && p.pairs <= INT32_MAX;
}

// Raises a kernel's dynamic shared-memory limit once per device (`done`: one bit per device, one
// variable per kernel), so that calls inside a CUDA-graph capture, which follow an eager call,
// make no such API call.
template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, int bytes, std::atomic<uint64_t>& done) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

template <class Cfg, bool kSwiGlu>
cudaError_t LaunchBf16Gemm(const MoePlan& plan, const bf16* A, int64_t K, const bf16* W, int64_t N,
                           const MoeBuffers& b, bf16* C, cudaStream_t stream) {
  auto kernel = GroupedGemmBf16Kernel<Cfg, kSwiGlu>;
  static std::atomic<uint64_t> configured{0};
  cudaError_t err = AllowSharedMemory(kernel, Cfg::SMEM_BYTES, configured);
  if (err != cudaSuccess) return err;
  const int64_t cols_per_block = kSwiGlu ? Cfg::BN / 2 : Cfg::BN;
  const dim3 grid(static_cast<unsigned>(plan.max_tiles),
                  static_cast<unsigned>((N + cols_per_block - 1) / cols_per_block));
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(A, K, static_cast<int>(plan.top_k), W, N,
                                                          b.sorted_rows, b.tile_expert, C);
  return cudaGetLastError();
}

template <bool kSwiGlu>
cudaError_t LaunchFp32Gemm(const MoePlan& plan, const float* A, int64_t K, const float* W,
                           int64_t N, const MoeBuffers& b, float* C, cudaStream_t stream) {
  const int64_t cols_per_block = kSwiGlu ? Fp32Tile::BN / 2 : Fp32Tile::BN;
  const dim3 grid(static_cast<unsigned>(plan.max_tiles),
                  static_cast<unsigned>((N + cols_per_block - 1) / cols_per_block));
  GroupedGemmFp32Kernel<kSwiGlu><<<grid, Fp32Tile::THREADS, 0, stream>>>(
      A, K, static_cast<int>(plan.top_k), W, N, b.sorted_rows, b.tile_expert, C);
  return cudaGetLastError();
}

template <typename T, bool kSwiGlu>
cudaError_t LaunchGemm(const MoePlan& plan, const T* A, int64_t K, const T* W, int64_t N,
                       const MoeBuffers& b, T* C, cudaStream_t stream) {
  if (!ValidPlan(plan) || !Aligned16(A) || !Aligned16(W) || !Aligned16(C) ||
      b.sorted_rows == nullptr || b.tile_expert == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (plan.max_tiles == 0) return cudaSuccess;
  if constexpr (std::is_same_v<T, float>) {
    if (plan.config != TileConfig::kFp32) return cudaErrorInvalidValue;
    return LaunchFp32Gemm<kSwiGlu>(plan, A, K, W, N, b, C, stream);
  } else {
    switch (plan.config) {
      case TileConfig::kBf16Small:
        return LaunchBf16Gemm<Bf16Small, kSwiGlu>(plan, A, K, W, N, b, C, stream);
      case TileConfig::kBf16Medium:
        return LaunchBf16Gemm<Bf16Medium, kSwiGlu>(plan, A, K, W, N, b, C, stream);
      case TileConfig::kBf16Large:
        return LaunchBf16Gemm<Bf16Large, kSwiGlu>(plan, A, K, W, N, b, C, stream);
      default:
        return cudaErrorInvalidValue;
    }
  }
}

}  // namespace

int BlockRows(TileConfig config) {
  switch (config) {
    case TileConfig::kBf16Small:
      return Bf16Small::BM;
    case TileConfig::kBf16Medium:
      return Bf16Medium::BM;
    case TileConfig::kBf16Large:
      return Bf16Large::BM;
    case TileConfig::kFp32:
      return Fp32Tile::BM;
  }
  return 0;
}

TileConfig ChooseTileConfig(bool bf16, int64_t pairs, int64_t experts) {
  if (!bf16) return TileConfig::kFp32;
  const int64_t active = std::max<int64_t>(1, std::min(pairs, experts));
  const int64_t rows_per_expert = pairs / active;
  if (rows_per_expert <= kSmallMaxRowsPerExpert) return TileConfig::kBf16Small;
  if (rows_per_expert <= kMediumMaxRowsPerExpert) return TileConfig::kBf16Medium;
  return TileConfig::kBf16Large;
}

MoePlan MakeMoePlan(int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t inter,
                    TileConfig config) {
  MoePlan p;
  p.tokens = tokens;
  p.top_k = top_k;
  p.experts = experts;
  p.hidden = hidden;
  p.inter = inter;
  p.config = config;
  p.block_m = BlockRows(config);
  p.pairs = tokens * top_k;
  // Each expert that receives c > 0 rows occupies ceil(c / block_m) tiles <= c / block_m + 1
  // - 1/block_m; at most min(pairs, E) experts receive rows.
  const int64_t active = std::min(p.pairs, experts);
  const int64_t bound = p.pairs + active * (p.block_m - 1);
  p.max_tiles = p.block_m > 0 ? (bound + p.block_m - 1) / p.block_m : 0;
  p.max_rows = p.max_tiles * p.block_m;
  p.num_chunks = (p.pairs + kAlignChunk - 1) / kAlignChunk;
  return p;
}

template <typename LogitT, typename IdT>
cudaError_t TopkSoftmax(const LogitT* logits, int64_t tokens, int experts, int top_k,
                        bool renormalize, float* weights, IdT* ids, cudaStream_t stream) {
  if (experts < 1 || experts > kMaxExperts || top_k < 1 || top_k > kMaxTopK || top_k > experts ||
      tokens < 0) {
    return cudaErrorInvalidValue;
  }
  if (tokens == 0) return cudaSuccess;
  const int64_t blocks = (tokens + kTopkWarps - 1) / kTopkWarps;
  TopkSoftmaxKernel<LogitT, IdT><<<static_cast<unsigned>(blocks), kTopkWarps * 32, 0, stream>>>(
      logits, tokens, experts, top_k, renormalize, weights, ids);
  return cudaGetLastError();
}

template <typename IdT>
cudaError_t AlignRows(const MoePlan& plan, const IdT* ids, const MoeBuffers& b,
                      cudaStream_t stream) {
  if (!ValidPlan(plan) || b.chunk_counts == nullptr || b.expert_offsets == nullptr ||
      b.sorted_rows == nullptr || b.tile_expert == nullptr || b.row_of_pair == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (plan.pairs == 0) return cudaSuccess;
  const int E = static_cast<int>(plan.experts);
  if (plan.num_chunks == 1) {
    AlignSmallKernel<IdT><<<1, kMaxExperts, 0, stream>>>(
        ids, plan.pairs, E, plan.block_m, plan.max_tiles, b.expert_offsets, b.sorted_rows,
        b.tile_expert, b.row_of_pair);
    return cudaGetLastError();
  }
  const unsigned blocks = static_cast<unsigned>((plan.num_chunks + kAlignWarps - 1) / kAlignWarps);
  AlignCountKernel<IdT><<<blocks, kAlignWarps * 32, 0, stream>>>(ids, plan.pairs, E,
                                                                 plan.num_chunks, b.chunk_counts);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  AlignScanKernel<<<1, kMaxExperts, 0, stream>>>(E, plan.num_chunks, plan.block_m, plan.max_tiles,
                                                 b.chunk_counts, b.expert_offsets, b.sorted_rows,
                                                 b.tile_expert);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  AlignScatterKernel<IdT>
      <<<blocks, kAlignWarps * 32, 0, stream>>>(ids, plan.pairs, E, plan.num_chunks, b.chunk_counts,
                                                b.expert_offsets, b.sorted_rows, b.row_of_pair);
  return cudaGetLastError();
}

template <typename T>
cudaError_t GroupedSwiGlu(const MoePlan& plan, const T* x, const T* gate_up, const MoeBuffers& b,
                          cudaStream_t stream) {
  return LaunchGemm<T, true>(plan, x, plan.hidden, gate_up, plan.inter, b, static_cast<T*>(b.act),
                             stream);
}

template <typename T>
cudaError_t GroupedDown(const MoePlan& plan, const T* down, const MoeBuffers& b,
                        cudaStream_t stream) {
  return LaunchGemm<T, false>(plan, static_cast<const T*>(b.act), plan.inter, down, plan.hidden, b,
                              static_cast<T*>(b.expert_out), stream);
}

template <typename T, typename WT>
cudaError_t Combine(const MoePlan& plan, const WT* weights, const MoeBuffers& b, T* y,
                    cudaStream_t stream) {
  if (!ValidPlan(plan) || !Aligned16(b.expert_out) || !Aligned16(y) || b.row_of_pair == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (plan.tokens == 0) return cudaSuccess;
  CombineKernel<T, WT><<<static_cast<unsigned>(plan.tokens), kCombineThreads, 0, stream>>>(
      static_cast<const T*>(b.expert_out), b.row_of_pair, weights, static_cast<int>(plan.top_k),
      plan.hidden, y);
  return cudaGetLastError();
}

template <typename T, typename IdT, typename WT>
cudaError_t MoeExpertsForward(const MoePlan& plan, const T* x, const IdT* ids, const WT* weights,
                              const T* gate_up, const T* down, const MoeBuffers& b, T* y,
                              cudaStream_t stream) {
  cudaError_t err = AlignRows(plan, ids, b, stream);
  if (err == cudaSuccess) err = GroupedSwiGlu(plan, x, gate_up, b, stream);
  if (err == cudaSuccess) err = GroupedDown(plan, down, b, stream);
  if (err == cudaSuccess) err = Combine(plan, weights, b, y, stream);
  return err;
}

#define OPD_KERNELS_STR2(...) #__VA_ARGS__
#define OPD_KERNELS_STR(...) OPD_KERNELS_STR2(__VA_ARGS__)
const char* CompiledArchitectures() {
#ifdef __CUDA_ARCH_LIST__
  return OPD_KERNELS_STR(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

// Explicit instantiations: bf16 and float elements, int32 and int64 ids, weights in fp32 or in
// the element type.
#define OPD_KERNELS_INSTANTIATE_ID(IdT)                                                           \
  template cudaError_t TopkSoftmax<float, IdT>(const float*, int64_t, int, int, bool, float*,     \
                                               IdT*, cudaStream_t);                               \
  template cudaError_t TopkSoftmax<bf16, IdT>(const bf16*, int64_t, int, int, bool, float*, IdT*, \
                                              cudaStream_t);                                      \
  template cudaError_t AlignRows<IdT>(const MoePlan&, const IdT*, const MoeBuffers&, cudaStream_t);
OPD_KERNELS_INSTANTIATE_ID(int32_t)
OPD_KERNELS_INSTANTIATE_ID(int64_t)

#define OPD_KERNELS_INSTANTIATE_T(T)                                                           \
  template cudaError_t GroupedSwiGlu<T>(const MoePlan&, const T*, const T*, const MoeBuffers&, \
                                        cudaStream_t);                                         \
  template cudaError_t GroupedDown<T>(const MoePlan&, const T*, const MoeBuffers&, cudaStream_t);
OPD_KERNELS_INSTANTIATE_T(float)
OPD_KERNELS_INSTANTIATE_T(bf16)

#define OPD_KERNELS_INSTANTIATE_LAYER(T, IdT, WT)                                          \
  template cudaError_t MoeExpertsForward<T, IdT, WT>(const MoePlan&, const T*, const IdT*, \
                                                     const WT*, const T*, const T*,        \
                                                     const MoeBuffers&, T*, cudaStream_t);
OPD_KERNELS_INSTANTIATE_LAYER(float, int32_t, float)
OPD_KERNELS_INSTANTIATE_LAYER(float, int64_t, float)
OPD_KERNELS_INSTANTIATE_LAYER(bf16, int32_t, float)
OPD_KERNELS_INSTANTIATE_LAYER(bf16, int64_t, float)
OPD_KERNELS_INSTANTIATE_LAYER(bf16, int32_t, bf16)
OPD_KERNELS_INSTANTIATE_LAYER(bf16, int64_t, bf16)
template cudaError_t Combine<float, float>(const MoePlan&, const float*, const MoeBuffers&, float*,
                                           cudaStream_t);
template cudaError_t Combine<bf16, float>(const MoePlan&, const float*, const MoeBuffers&, bf16*,
                                          cudaStream_t);
template cudaError_t Combine<bf16, bf16>(const MoePlan&, const bf16*, const MoeBuffers&, bf16*,
                                         cudaStream_t);

}  // namespace kernels
