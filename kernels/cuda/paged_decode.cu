// Paged decode attention kernels (see paged_decode.cuh for the algorithm and the contract).
#include "kernels/cuda/paged_decode.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

namespace kernels {
namespace {

constexpr int kThreads = 128;  // 4 warps per split block
constexpr int kWarps = kThreads / 32;
constexpr int kLanesPerToken = 4;  // lanes sharing one K row in the score pass
constexpr int kSplit = kPagedDecodeSplitTokens;
constexpr int kGroup = kPagedDecodeGroup;
constexpr float kLog2e = 1.4426950408889634f;

// 16-byte vectors of T, converted to fp32.
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void Load(const float* p, float* f) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
  }
};
template <>
struct Vec<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ static void Load(const __nv_bfloat16* p, float* f) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __bfloat1622float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
};
template <>
struct Vec<__half> {
  static constexpr int kN = 8;
  __device__ static void Load(const __half* p, float* f) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
};

__device__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The pool blocks of one split, staged in shared memory at the split's start, so that a row's
// address needs no dependent load from the block table in the loops (a split of kSplit tokens
// spans at most kSplit + 1 table entries, for any block size).
struct SplitBlocks {
  const int32_t* ids;  // shared: table entries first_entry, first_entry + 1, ...
  int first_entry;
};

// Row `pos` (from the sequence's start) of the keys or values for KV head h: 64-bit offsets.
template <typename T>
__device__ const T* Row(const T* pool, const PagedDecodeArgs& a, const SplitBlocks& blocks, int pos,
                        int h) {
  const int entry = pos / static_cast<int>(a.block_size);
  const int64_t block = blocks.ids[entry - blocks.first_entry];
  const int64_t row = block * a.block_size + (pos - entry * static_cast<int>(a.block_size));
  return pool + (row * a.kv_heads + h) * a.head_dim;
}

// Shared memory of one split block, in floats.
template <typename T, int D>
struct SplitSmem {
  static constexpr int kSlices = D / Vec<T>::kN;  // 16-byte slices of a row
  static constexpr int kTokenLanes = kThreads / kSlices;
  // Partial sums of p * V left after the in-warp reduction, one row each.
  static constexpr int kRows = kSlices < 32 ? kWarps : kTokenLanes;
  static constexpr int kQ = kGroup * D, kScores = kGroup * kSplit, kRed = kRows * kGroup * D;
  static constexpr size_t kBytes = sizeof(float) * (kQ + kScores + kRed);
};

// Scores of the split's tokens for query heads [0, gc) of the group: kLanesPerToken lanes per
// K row, 8 rows per warp per group and kScoreUnroll groups per iteration (their loads issued
// before any use; one group for D = 256, whose rows would not fit the registers twice), so that
// each row is loaded once for every query head.
template <typename T, int D>
__device__ void Scores(const PagedDecodeArgs& a, const SplitBlocks& blocks, int kvh, int start,
                       int n, int gc, const float* q_s, float* s_s) {
  using V = Vec<T>;
  constexpr int kVecsPerLane = D / V::kN / kLanesPerToken;
  constexpr int kTokensPerWarp = 32 / kLanesPerToken;
  constexpr int kStride = kWarps * kTokensPerWarp;  // tokens between a warp's groups
  constexpr int kScoreUnroll = D / kLanesPerToken <= 32 ? 2 : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int li = lane % kLanesPerToken, token_in_warp = lane / kLanesPerToken;
  for (int j0 = warp * kTokensPerWarp; j0 < n; j0 += kScoreUnroll * kStride) {
    float kf[kScoreUnroll][kVecsPerLane][V::kN];
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const int j = j0 + u * kStride + token_in_warp;
      if (j < n) {
        const T* k = Row(static_cast<const T*>(a.k_pool), a, blocks, start + j, kvh);
#pragma unroll
        for (int i = 0; i < kVecsPerLane; ++i)
          V::Load(k + (li + kLanesPerToken * i) * V::kN, kf[u][i]);
      }
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const int j = j0 + u * kStride + token_in_warp;
      float dot[kGroup] = {};
      if (j < n) {
#pragma unroll
        for (int i = 0; i < kVecsPerLane; ++i) {
          const int d0 = (li + kLanesPerToken * i) * V::kN;
#pragma unroll
          for (int g = 0; g < kGroup; ++g) {
            if (g >= gc) break;
#pragma unroll
            for (int e = 0; e < V::kN; ++e) dot[g] = fmaf(q_s[g * D + d0 + e], kf[u][i][e], dot[g]);
          }
        }
      }
      // Every lane of the warp takes part in the shuffles (j0 is uniform across the warp).
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (g >= gc) break;
        dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], 1);
        dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], 2);
        if (j < n && li == 0) s_s[g * kSplit + j] = dot[g];
      }
    }
  }
}

// Per query head g < gc of the group: the split's max and sum of exp2(s - max) into ml (pairs,
// query head g's at ml[g * ml_stride]), the scores replaced by exp2(s - max).
__device__ void Softmax(float* s_s, int n, int gc, float* ml, int64_t ml_stride) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int g = warp; g < gc; g += kWarps) {
    float* s = s_s + g * kSplit;
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, s[j]);
    m = WarpMax(m);
    float l = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float p = exp2f(s[j] - m);
      s[j] = p;
      l += p;
    }
    l = WarpSum(l);
    if (lane == 0) ml[g * ml_stride] = m, ml[g * ml_stride + 1] = l;
  }
}

// acc = sum_j p_j V_j for each query head of the group: thread (token lane r, slice s) sums the
// tokens r, r + kTokenLanes, ... of slice s; the token lanes are then added in a fixed order
// (shuffles within a warp, then shared memory), so the result is deterministic.
constexpr int kValueUnroll = 4;
template <typename T, int D>
__device__ void WeightedValues(const PagedDecodeArgs& a, const SplitBlocks& blocks, int kvh,
                               int start, int n, int gc, const float* s_s, float* red, float* out) {
  using V = Vec<T>;
  using S = SplitSmem<T, D>;
  const int slice = threadIdx.x % S::kSlices, r = threadIdx.x / S::kSlices;
  float acc[kGroup][V::kN] = {};
  // kValueUnroll rows per iteration, loaded before any is used; tokens in increasing order per
  // thread, as one row at a time would add them.
  for (int j0 = r; j0 < n; j0 += kValueUnroll * S::kTokenLanes) {
    float vf[kValueUnroll][V::kN];
#pragma unroll
    for (int u = 0; u < kValueUnroll; ++u) {
      const int j = j0 + u * S::kTokenLanes;
      if (j < n)
        V::Load(Row(static_cast<const T*>(a.v_pool), a, blocks, start + j, kvh) + slice * V::kN,
                vf[u]);
    }
#pragma unroll
    for (int u = 0; u < kValueUnroll; ++u) {
      const int j = j0 + u * S::kTokenLanes;
      if (j >= n) break;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (g >= gc) break;
        const float p = s_s[g * kSplit + j];
#pragma unroll
        for (int e = 0; e < V::kN; ++e) acc[g][e] = fmaf(p, vf[u][e], acc[g][e]);
      }
    }
  }
  int row = r;
  bool writes = true;
  if constexpr (S::kSlices < 32) {  // token lanes of one warp: lanes kSlices apart
#pragma unroll
    for (int o = S::kSlices; o < 32; o *= 2)
#pragma unroll
      for (int g = 0; g < kGroup; ++g)
#pragma unroll
        for (int e = 0; e < V::kN; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
    row = threadIdx.x / 32;
    writes = threadIdx.x % 32 < S::kSlices;
  }
  if (writes) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {  // compile-time indices keep acc in registers
      if (g >= gc) break;
#pragma unroll
      for (int e = 0; e < V::kN; ++e) red[(row * kGroup + g) * D + slice * V::kN + e] = acc[g][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < gc * D; i += kThreads) {
    float sum = 0.0f;
    for (int k = 0; k < S::kRows; ++k) sum += red[k * kGroup * D + i];
    out[(i / D) * a.num_splits * D + i % D] = sum;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) PagedDecodeSplit(PagedDecodeArgs a) {
  using S = SplitSmem<T, D>;
  const int split = blockIdx.x;
  const int64_t b = blockIdx.z;
  const int groups = static_cast<int>((a.q_heads / a.kv_heads + kGroup - 1) / kGroup);
  const int kvh = blockIdx.y / groups, g0 = blockIdx.y % groups * kGroup;
  // Lengths past the table are clamped rather than read out of bounds.
  const int len = min(static_cast<int64_t>(a.seq_lens[b]), a.max_blocks * a.block_size);
  const int start = split * kSplit;
  if (start >= len) return;  // past this sequence: the reduce reads only its own splits
  const int n = min(kSplit, len - start);
  const int gc = min(kGroup, static_cast<int>(a.q_heads / a.kv_heads) - g0);
  const int64_t hq0 = kvh * (a.q_heads / a.kv_heads) + g0;  // the group's first query head

  extern __shared__ float smem[];
  float* q_s = smem;
  float* s_s = q_s + S::kQ;
  float* red = s_s + S::kScores;
  __shared__ int32_t ids_s[kSplit + 1];
  const int bs = static_cast<int>(a.block_size);
  const SplitBlocks blocks{ids_s, start / bs};
  for (int e = blocks.first_entry + threadIdx.x; e <= (start + n - 1) / bs; e += kThreads)
    ids_s[e - blocks.first_entry] = a.block_tables[b * a.max_blocks + e];
  const float qscale = a.scale * kLog2e;  // scores in log2 units: exp2 in the softmax
  for (int i = threadIdx.x; i < gc * D; i += kThreads)
    q_s[i] = a.q[(b * a.q_heads + hq0) * D + i] * qscale;
  __syncthreads();
  Scores<T, D>(a, blocks, kvh, start, n, gc, q_s, s_s);
  __syncthreads();
  const int64_t part = (b * a.q_heads + hq0) * a.num_splits + split;  // query head g: + g * splits
  Softmax(s_s, n, gc, a.part_ml + part * 2, a.num_splits * 2);
  __syncthreads();
  WeightedValues<T, D>(a, blocks, kvh, start, n, gc, s_s, red, a.part_acc + part * D);
}

// out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the sequence's splits.
__global__ void __launch_bounds__(kThreads) PagedDecodeReduce(PagedDecodeArgs a) {
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int64_t D = a.head_dim, base = (b * a.q_heads + h) * a.num_splits;
  const int ns = min((static_cast<int64_t>(a.seq_lens[b]) + kSplit - 1) / kSplit, a.num_splits);
  extern __shared__ float w_s[];  // [num_splits]: the splits' weights
  for (int s = threadIdx.x; s < ns; s += kThreads) w_s[s] = a.part_ml[(base + s) * 2];
  __syncthreads();
  float m = -INFINITY;
  for (int s = 0; s < ns; ++s) m = fmaxf(m, w_s[s]);
  __syncthreads();
  for (int s = threadIdx.x; s < ns; s += kThreads) w_s[s] = exp2f(w_s[s] - m);
  __syncthreads();
  float l = 0.0f;
  for (int s = 0; s < ns; ++s) l += w_s[s] * a.part_ml[(base + s) * 2 + 1];
  const float inv = ns > 0 ? 1.0f / l : 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float o = 0.0f;
    for (int s = 0; s < ns; ++s) o = fmaf(w_s[s], a.part_acc[(base + s) * D + d], o);
    a.out[(b * a.q_heads + h) * D + d] = o * inv;
  }
}

template <typename T, int D>
cudaError_t LaunchSplit(const PagedDecodeArgs& a, cudaStream_t stream) {
  constexpr size_t kBytes = SplitSmem<T, D>::kBytes;
  auto* kernel = &PagedDecodeSplit<T, D>;
  // Above 48 KiB of shared memory in all (the dynamic part and the block ids) needs the opt-in.
  if (kBytes + sizeof(int32_t) * (kSplit + 1) > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (e != cudaSuccess) return e;
  }
  const int64_t groups = (a.q_heads / a.kv_heads + kGroup - 1) / kGroup;
  const dim3 grid(static_cast<unsigned>(a.num_splits), static_cast<unsigned>(a.kv_heads * groups),
                  static_cast<unsigned>(a.batch));
  kernel<<<grid, kThreads, kBytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchSplitFor(const PagedDecodeArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64:
      return LaunchSplit<T, 64>(a, stream);
    case 128:
      return LaunchSplit<T, 128>(a, stream);
    case 256:
      return LaunchSplit<T, 256>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

int64_t PagedDecodeNumSplits(int64_t max_blocks, int64_t block_size) {
  return (max_blocks * block_size + kSplit - 1) / kSplit;
}

bool PagedDecodeSupports(int64_t head_dim, int64_t q_heads, int64_t kv_heads) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && kv_heads > 0 &&
         q_heads % kv_heads == 0 && q_heads > 0;
}

cudaError_t PagedDecode(const PagedDecodeArgs& a, cudaStream_t stream) {
  if (!PagedDecodeSupports(a.head_dim, a.q_heads, a.kv_heads) || a.block_size <= 0 ||
      a.num_splits != PagedDecodeNumSplits(a.max_blocks, a.block_size) || a.batch > 65535 ||
      a.num_splits > 12 * 1024)
    return cudaErrorInvalidValue;
  if (a.batch == 0 || a.num_splits == 0) return cudaSuccess;
  cudaError_t e = cudaErrorInvalidValue;
  switch (a.dtype) {
    case KvDtype::kFloat32:
      e = LaunchSplitFor<float>(a, stream);
      break;
    case KvDtype::kBFloat16:
      e = LaunchSplitFor<__nv_bfloat16>(a, stream);
      break;
    case KvDtype::kFloat16:
      e = LaunchSplitFor<__half>(a, stream);
      break;
  }
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(a.q_heads), static_cast<unsigned>(a.batch));
  PagedDecodeReduce<<<grid, kThreads, sizeof(float) * a.num_splits, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kernels
