// Fused small ops (see fused_ops.cuh for the algorithms and the contracts).
#include "kernels/cuda/fused_ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kernels {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kNormThreads = 256;
constexpr int kRopeWarps = 4;

__device__ __forceinline__ float ToF(float v) {
  return v;
}
__device__ __forceinline__ float ToF(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ float ToF(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T FromF(float v);
template <>
__device__ __forceinline__ float FromF<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromF<__half>(float v) {
  return __float2half_rn(v);
}

// v rounded to T and back: what the library's op in T would have stored.
template <typename T>
__device__ __forceinline__ float Round(float v) {
  return ToF(FromF<T>(v));
}

// Sum over the block, the same order on every run: warps by shuffles, then warp 0 over the
// warps' partials.
__device__ float BlockSum(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// One row per block. Element j of the row is always handled by thread j % blockDim.x, so pass 2
// reads back only what this thread wrote in pass 1.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    AddRmsNormKernel(const T* __restrict__ x, const T* __restrict__ residual,
                     const T* __restrict__ weight, int64_t hidden, float eps, T* __restrict__ out,
                     T* sum) {
  __shared__ float scratch[kNormThreads / 32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hidden;
  const T* src = xr;
  float ss = 0.0f;
  if (residual != nullptr) {
    const T* rr = residual + row * hidden;
    T* sr = sum + row * hidden;
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      const float v = Round<T>(__fadd_rn(ToF(xr[j]), ToF(rr[j])));
      sr[j] = FromF<T>(v);
      ss = __fmaf_rn(v, v, ss);
    }
    src = sr;
  } else {
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      const float v = ToF(xr[j]);
      ss = __fmaf_rn(v, v, ss);
    }
  }
  ss = BlockSum(ss, scratch);
  const float inv =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(hidden)), eps)));
  T* orow = out + row * hidden;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
    const float n = Round<T>(__fmul_rn(ToF(src[j]), inv));
    orow[j] = FromF<T>(__fmul_rn(ToF(weight[j]), n));
  }
}

// One warp per (token, head): heads [0, q_heads) of q, then [q_heads, q_heads + kv_heads) of k.
template <typename T>
__global__ void __launch_bounds__(kRopeWarps * 32) QkNormRopeKernel(QkNormRopeArgs a) {
  extern __shared__ float rows[];  // [kRopeWarps][head_dim]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t heads = a.q_heads + a.kv_heads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kRopeWarps + warp;
  if (item >= a.tokens * heads) return;  // uniform across the warp
  const int64_t t = item / heads, h = item % heads;
  const bool is_q = h < a.q_heads;
  const int64_t D = a.head_dim, R = a.rotary_dim, half = R / 2;
  const int64_t offset = is_q ? (t * a.q_heads + h) * D : (t * a.kv_heads + (h - a.q_heads)) * D;
  const T* x = static_cast<const T*>(is_q ? a.q : a.k) + offset;
  const T* w = static_cast<const T*>(is_q ? a.q_weight : a.k_weight);
  T* out = static_cast<T*>(is_q ? a.q_out : a.k_out) + offset;
  float* n = rows + warp * D;

  float ss = 0.0f;
  for (int64_t j = lane; j < D; j += 32) {
    const float v = ToF(x[j]);
    ss = __fmaf_rn(v, v, ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(kFullMask, ss, o);
  const float inv =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(D)), a.eps)));
  for (int64_t j = lane; j < D; j += 32) n[j] = __fmul_rn(ToF(w[j]), __fmul_rn(ToF(x[j]), inv));
  __syncwarp();  // every lane's reads of x are done (out may be x) and n is complete
  const float* c = a.cos + t * R;
  const float* s = a.sin + t * R;
  for (int64_t j = lane; j < D; j += 32) {
    float v = n[j];
    if (j < half) {
      v = __fsub_rn(__fmul_rn(n[j], c[j]), __fmul_rn(n[j + half], s[j]));
    } else if (j < R) {
      v = __fadd_rn(__fmul_rn(n[j], c[j]), __fmul_rn(n[j - half], s[j]));
    }
    out[j] = FromF<T>(v);
  }
}

template <typename T>
cudaError_t LaunchAddRmsNorm(const AddRmsNormArgs& a, cudaStream_t stream) {
  AddRmsNormKernel<T><<<static_cast<unsigned>(a.rows), kNormThreads, 0, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.residual),
      static_cast<const T*>(a.weight), a.hidden, a.eps, static_cast<T*>(a.out),
      static_cast<T*>(a.sum));
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchQkNormRope(const QkNormRopeArgs& a, cudaStream_t stream) {
  const int64_t items = a.tokens * (a.q_heads + a.kv_heads);
  const int64_t blocks = (items + kRopeWarps - 1) / kRopeWarps;
  const size_t smem = sizeof(float) * kRopeWarps * a.head_dim;
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  QkNormRopeKernel<T><<<static_cast<unsigned>(blocks), kRopeWarps * 32, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t AddRmsNorm(const AddRmsNormArgs& a, cudaStream_t stream) {
  if (a.hidden < 1 || a.rows < 0 || a.rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  switch (a.dtype) {
    case FusedDtype::kFloat32:
      return LaunchAddRmsNorm<float>(a, stream);
    case FusedDtype::kBFloat16:
      return LaunchAddRmsNorm<__nv_bfloat16>(a, stream);
    case FusedDtype::kFloat16:
      return LaunchAddRmsNorm<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

bool QkNormRopeSupports(int64_t head_dim, int64_t rotary_dim) {
  return head_dim >= 1 && head_dim <= kQkNormRopeMaxDim && rotary_dim >= 0 && rotary_dim % 2 == 0 &&
         rotary_dim <= head_dim;
}

cudaError_t QkNormRope(const QkNormRopeArgs& a, cudaStream_t stream) {
  if (!QkNormRopeSupports(a.head_dim, a.rotary_dim) || a.tokens < 0 || a.q_heads < 0 ||
      a.kv_heads < 0)
    return cudaErrorInvalidValue;
  const int64_t items = a.tokens * (a.q_heads + a.kv_heads);
  if (items == 0) return cudaSuccess;
  if ((items + kRopeWarps - 1) / kRopeWarps > 0x7fffffff) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case FusedDtype::kFloat32:
      return LaunchQkNormRope<float>(a, stream);
    case FusedDtype::kBFloat16:
      return LaunchQkNormRope<__nv_bfloat16>(a, stream);
    case FusedDtype::kFloat16:
      return LaunchQkNormRope<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels
