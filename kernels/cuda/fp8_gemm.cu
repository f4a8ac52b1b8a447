// The FP8 block-scaled GEMM contract on the GPU (kernels/cuda/fp8_gemm.cuh; the arithmetic is
// kernels/cpu/fp8_gemm.h's, the twin tests/fp8_test.cc holds these to).
#include "kernels/cuda/fp8_gemm.cuh"

#include <atomic>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace kernels {
namespace {

constexpr int kGroup = 128;        // activation group and weight block edge
constexpr float kFp8Max = 448.0f;  // the largest e4m3fn magnitude
constexpr float kScaleFloor = 1e-10f;

__host__ __device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// ---------------------------------------------------------------------------------------------
// Activation quantization: one warp per (row, 128-group), four elements per lane.

__device__ __forceinline__ float LoadElement(const void* p, Fp8Element type, int64_t i) {
  switch (type) {
    case Fp8Element::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case Fp8Element::kFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// The 1 x 128 rule for one group held four values per lane (absent ones 0): s = max(amax, 1e-10)
// / 448 and q = e4m3(v / s), both divisions correctly rounded (as the twin's), e4m3 by round to
// nearest even with saturation.
__device__ __forceinline__ void QuantizeGroup(const float (&v)[4], int n_valid, uint8_t* q,
                                              float* s) {
  const int lane = threadIdx.x & 31;
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float scale = __fdiv_rn(fmaxf(amax, kScaleFloor), kFp8Max);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (lane * 4 + j < n_valid)
      q[lane * 4 + j] = __nv_cvt_float_to_fp8(__fdiv_rn(v[j], scale), __NV_SATFINITE, __NV_E4M3);
  }
  if (lane == 0) *s = scale;
}

__global__ void QuantizeRowsKernel(const void* x, Fp8Element type, int64_t ldx, int64_t M,
                                   int64_t K, uint8_t* q, float* s) {
  const int64_t KB = (K + kGroup - 1) / kGroup;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (item >= M * KB) return;  // whole warps exit together
  const int64_t m = item / KB, g = item % KB, k0 = g * kGroup;
  const int lane = threadIdx.x & 31;
  const int n_valid = static_cast<int>(Min64(kGroup, K - k0));
  float v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = lane * 4 + j;
    v[j] = c < n_valid ? LoadElement(x, type, m * ldx + k0 + c) : 0.0f;
  }
  QuantizeGroup(v, n_valid, q + m * K + k0, s + m * KB + g);
}

__global__ void QuantizeSwiGluKernel(const void* gu, Fp8Element type, int64_t M, int64_t I,
                                     uint8_t* q, float* s) {
  const int64_t KB = (I + kGroup - 1) / kGroup;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (item >= M * KB) return;
  const int64_t m = item / KB, g = item % KB, k0 = g * kGroup;
  const int lane = threadIdx.x & 31;
  const int n_valid = static_cast<int>(Min64(kGroup, I - k0));
  float v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = lane * 4 + j;
    v[j] = 0.0f;
    if (c < n_valid) {
      const float gate = LoadElement(gu, type, m * 2 * I + k0 + c);
      const float up = LoadElement(gu, type, m * 2 * I + I + k0 + c);
      v[j] = gate / (1.0f + expf(-gate)) * up;  // the twin's expression, in its order
    }
  }
  QuantizeGroup(v, n_valid, q + m * I + k0, s + m * KB + g);
}

cudaError_t LaunchQuantize(bool swiglu, const void* x, Fp8Element type, int64_t ldx, int64_t M,
                           int64_t K, uint8_t* q, float* s, cudaStream_t stream) {
  if (M < 0 || K < 1 || (M > 0 && (x == nullptr || q == nullptr || s == nullptr)))
    return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  const int64_t warps = M * ((K + kGroup - 1) / kGroup);
  constexpr int kThreads = 256;
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  if (swiglu) {
    QuantizeSwiGluKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, type, M, K, q,
                                                                                 s);
  } else {
    QuantizeRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, type, ldx, M, K,
                                                                               q, s);
  }
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// The GEMM: 64 x 128 output tiles, 8 warps as 2 (rows) x 4 (columns), each a 32 x 32 piece of
// 2 x 4 mma.sync m16n8k32 tiles; K in blocks of 128 (4 MMA steps), two shared-memory stages.

constexpr int kBM = 64, kBN = 128, kBK = 128, kThreads = 256;
constexpr int kLds = kBK + 16;  // row pitch in bytes: 16-byte aligned, 4-byte words on distinct
                                // banks for the 8 rows a fragment load touches
constexpr int kStageBytes = (kBM + kBN) * kLds;
constexpr int kSmemBytes = 2 * kStageBytes;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;  // 0: the destination is zero-filled, nothing is read
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

// c += a (16 x 32 e4m3, row-major) * b (32 x 8 e4m3, k contiguous per column), fp32.
__device__ __forceinline__ void MmaE4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  // No e4m3 tensor cores before sm_89: Fp8GemmRunsOnCurrentDevice() keeps this code from being
  // launched; should it be, it stops rather than return wrong numbers.
  __trap();
#endif
}

struct TileInfo {
  int64_t expert;     // -1: every row of the tile is past the last group
  int64_t group_end;  // rows at or past it are not this expert's
};

__device__ int64_t ScaleRowOf(int64_t n, int64_t split) {
  return n < split ? n / kGroup : (split + kGroup - 1) / kGroup + (n - split) / kGroup;
}

// One K block's tiles into stage `buf` (async), and their scales into rs / cs (plain loads).
template <bool kVec>
__device__ void LoadStage(const Fp8GemmCudaArgs& p, uint8_t* smem, int64_t m0, int64_t n0,
                          int64_t kb, const int64_t* src_rows, const TileInfo& tile, float* rs,
                          float* cs) {
  uint8_t* sa = smem;
  uint8_t* sb = smem + kBM * kLds;
  const int64_t KB = (p.k + kGroup - 1) / kGroup, k0 = kb * kBK;
  const int64_t NB = (p.split + kGroup - 1) / kGroup + (p.n - p.split + kGroup - 1) / kGroup;
  const uint8_t* w = p.w + tile.expert * p.n * p.k;
  if constexpr (kVec) {
    for (int c = threadIdx.x; c < kBM * (kBK / 16); c += kThreads) {
      const int r = c / (kBK / 16), part = c % (kBK / 16);
      const int64_t src = src_rows[r], k = k0 + part * 16;
      const bool valid = src >= 0 && k < p.k;
      CpAsync16(SmemAddr(sa + r * kLds + part * 16), valid ? p.a + src * p.k + k : p.a, valid);
    }
    for (int c = threadIdx.x; c < kBN * (kBK / 16); c += kThreads) {
      const int r = c / (kBK / 16), part = c % (kBK / 16);
      const int64_t n = n0 + r, k = k0 + part * 16;
      const bool valid = n < p.n && k < p.k;
      CpAsync16(SmemAddr(sb + r * kLds + part * 16), valid ? w + n * p.k + k : p.w, valid);
    }
  } else {
    for (int c = threadIdx.x; c < kBM * kBK; c += kThreads) {
      const int r = c / kBK, col = c % kBK;
      const int64_t src = src_rows[r], k = k0 + col;
      sa[r * kLds + col] = src >= 0 && k < p.k ? p.a[src * p.k + k] : 0;
    }
    for (int c = threadIdx.x; c < kBN * kBK; c += kThreads) {
      const int r = c / kBK, col = c % kBK;
      const int64_t n = n0 + r, k = k0 + col;
      sb[r * kLds + col] = n < p.n && k < p.k ? w[n * p.k + k] : 0;
    }
  }
  for (int r = threadIdx.x; r < kBM; r += kThreads) {
    const int64_t src = src_rows[r];
    rs[r] = src >= 0 ? p.a_scale[src * KB + kb] : 0.0f;
  }
  for (int c = threadIdx.x; c < kBN; c += kThreads) {
    const int64_t n = n0 + c;
    cs[c] = n < p.n ? p.w_scale[(tile.expert * NB + ScaleRowOf(n, p.split)) * KB + kb] : 0.0f;
  }
}

__device__ __forceinline__ uint32_t Word(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <bool kVec, typename OutT>
__global__ void __launch_bounds__(kThreads, 2) Fp8GemmKernel(Fp8GemmCudaArgs p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float row_scale[2][kBM], col_scale[2][kBN];
  __shared__ int64_t src_rows[kBM];
  __shared__ TileInfo tile;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBN;
  if (threadIdx.x == 0) {
    TileInfo t{0, p.rows};
    if (p.group_ends != nullptr) {  // the first group whose end is past m0
      int64_t lo = 0, hi = p.experts;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (p.group_ends[mid] > m0) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      t.expert = lo < p.experts ? lo : -1;
      t.group_end = lo < p.experts ? Min64(p.group_ends[lo], p.rows) : 0;
    }
    tile = t;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < kBM; r += kThreads) {
    const int64_t m = m0 + r;
    int64_t src = -1;
    if (tile.expert >= 0 && m < tile.group_end) src = p.row_index ? p.row_index[m] : m;
    src_rows[r] = src;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / 4, wn = warp % 4, g = lane / 4, t = lane % 4;
  float acc[2][4][4] = {};
  if (tile.expert >= 0) {
    const int64_t KB = (p.k + kBK - 1) / kBK;
    LoadStage<kVec>(p, smem, m0, n0, 0, src_rows, tile, row_scale[0], col_scale[0]);
    CpAsyncCommit();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const int buf = static_cast<int>(kb & 1);
      if (kb + 1 < KB) {
        LoadStage<kVec>(p, smem + (buf ^ 1) * kStageBytes, m0, n0, kb + 1, src_rows, tile,
                        row_scale[buf ^ 1], col_scale[buf ^ 1]);
        CpAsyncCommit();
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();
      const uint8_t* sa = smem + buf * kStageBytes;
      const uint8_t* sb = sa + kBM * kLds;
      float part[2][4][4] = {};  // this K block's dot products, on their own
#pragma unroll
      for (int ks = 0; ks < kBK / 32; ++ks) {
        uint32_t a[2][4], b[4][2];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const uint8_t* row = sa + (wm * 32 + mi * 16 + g) * kLds + ks * 32 + t * 4;
          a[mi][0] = Word(row);
          a[mi][1] = Word(row + 8 * kLds);
          a[mi][2] = Word(row + 16);
          a[mi][3] = Word(row + 8 * kLds + 16);
        }
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const uint8_t* col = sb + (wn * 32 + ni * 8 + g) * kLds + ks * 32 + t * 4;
          b[ni][0] = Word(col);
          b[ni][1] = Word(col + 16);
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int ni = 0; ni < 4; ++ni) MmaE4m3(part[mi][ni], a[mi], b[ni][0], b[ni][1]);
      }
      // Promote: scale the block's partials and add them to the fp32 sums (the twin's
      // acc += (partial x s_row) x s_col).
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int r = wm * 32 + mi * 16 + g + (c >= 2 ? 8 : 0);
            const int col = wn * 32 + ni * 8 + t * 2 + (c & 1);
            acc[mi][ni][c] += part[mi][ni][c] * row_scale[buf][r] * col_scale[buf][col];
          }
      __syncthreads();  // the next iteration's loads overwrite this stage
    }
  }
  OutT* out = static_cast<OutT*>(p.out);
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t m = m0 + wm * 32 + mi * 16 + g + (c >= 2 ? 8 : 0);
        const int64_t n = n0 + wn * 32 + ni * 8 + t * 2 + (c & 1);
        if (m < p.rows && n < p.n) {
          if constexpr (sizeof(OutT) == 4) {
            out[m * p.n + n] = acc[mi][ni][c];
          } else {
            out[m * p.n + n] = __float2bfloat16_rn(acc[mi][ni][c]);
          }
        }
      }
}

template <bool kVec, typename OutT>
cudaError_t LaunchGemm(const Fp8GemmCudaArgs& p, cudaStream_t stream) {
  auto kernel = Fp8GemmKernel<kVec, OutT>;
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit == 0 || !(configured.load(std::memory_order_relaxed) & bit)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
    configured.fetch_or(bit, std::memory_order_relaxed);
  }
  const dim3 grid(static_cast<unsigned>((p.n + kBN - 1) / kBN),
                  static_cast<unsigned>((p.rows + kBM - 1) / kBM));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

cudaError_t Fp8QuantizeRowsCuda(const void* x, Fp8Element type, int64_t ldx, int64_t M, int64_t K,
                                uint8_t* q, float* s, cudaStream_t stream) {
  return LaunchQuantize(false, x, type, ldx, M, K, q, s, stream);
}

cudaError_t Fp8QuantizeSwiGluCuda(const void* gu, Fp8Element type, int64_t M, int64_t I, uint8_t* q,
                                  float* s, cudaStream_t stream) {
  return LaunchQuantize(true, gu, type, 2 * I, M, I, q, s, stream);
}

cudaError_t Fp8BlockGemmCuda(const Fp8GemmCudaArgs& p, cudaStream_t stream) {
  if (p.rows < 0 || p.n < 1 || p.k < 1 || p.split < 1 || p.split > p.n || p.experts < 1 ||
      (p.group_ends == nullptr && p.experts != 1) || p.w == nullptr || p.w_scale == nullptr ||
      p.out == nullptr || (p.rows > 0 && (p.a == nullptr || p.a_scale == nullptr)))
    return cudaErrorInvalidValue;
  if ((p.n + kBN - 1) / kBN > INT32_MAX || (p.rows + kBM - 1) / kBM > 65535)
    return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  const bool vec = p.k % 16 == 0 && Aligned16(p.a) && Aligned16(p.w);
  const bool bf16 = p.out_type == Fp8Element::kBFloat16;
  if (!bf16 && p.out_type != Fp8Element::kFloat32) return cudaErrorInvalidValue;
  if (vec)
    return bf16 ? LaunchGemm<true, __nv_bfloat16>(p, stream) : LaunchGemm<true, float>(p, stream);
  return bf16 ? LaunchGemm<false, __nv_bfloat16>(p, stream) : LaunchGemm<false, float>(p, stream);
}

bool Fp8GemmRunsOnCurrentDevice() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return false;
  if (major * 10 + minor < 89) return false;
  // The virtual architecture the kernel's machine code was compiled from: sm_80 code (run on a
  // newer device) holds only the trap above.
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, Fp8GemmKernel<true, float>) != cudaSuccess) return false;
  return attr.ptxVersion >= 89;
}

}  // namespace kernels
