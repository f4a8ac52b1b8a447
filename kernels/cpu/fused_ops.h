// The small ops of a decoder layer fused into one pass each on the CPU: the CPU twins of
// kernels/cuda/fused_ops.cuh (RMSNorm with the residual add, q/k-norm + RoPE) and of the CUDA
// router top-k (kernels/cuda/moe_kernels.cuh TopkSoftmax), registered as the CPU
// lm::FastPaths::add_rms_norm, qk_norm_rope and route_topk (kernels/cpu/register.cc). Each
// replaces a chain of 4-10 library ops (a pass over memory and an allocation each) with one pass
// per row; rows are independent, so a row's result depends neither on the batch nor on the
// thread count. The contracts are lm/model/fast_paths.h's; the references they are tested
// against are lm's op chains (RMSNormImpl, Rope::Apply, lm::Route: tests/fused_ops_test.cc).
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace lm {

// Whether AddRmsNormCpu applies: CPU, no gradient needed, x/residual [rows, H] contiguous (the
// residual may be undefined), weight [H], all fp32 or all bf16, an AVX2 + FMA CPU.
bool UseCpuAddRmsNorm(const torch::Tensor& x, const torch::Tensor& residual,
                      const torch::Tensor& weight);

// FastPaths::add_rms_norm: *sum = x + residual (rounded to the dtype; not written without a
// residual), *out = weight * cast(sum * rsqrt(mean(sum^2) + eps)) with fp32 statistics.
void AddRmsNormCpu(const torch::Tensor& x, const torch::Tensor& residual,
                   const torch::Tensor& weight, double eps, torch::Tensor* out, torch::Tensor* sum);

// Whether QkNormRopeCpu applies: CPU, no gradient needed, q [T, Hq, D] and k [T, Hkv, D]
// contiguous of one dtype (fp32 or bf16) with weights [D] of that dtype, cos/sin [T, R] fp32
// contiguous with R even and <= D, outputs of the inputs' shapes and dtype (contiguous), an
// AVX2 + FMA CPU.
bool UseCpuQkNormRope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                      const torch::Tensor& k_weight, const torch::Tensor& cos,
                      const torch::Tensor& sin, const torch::Tensor& q_out,
                      const torch::Tensor& k_out);

// FastPaths::qk_norm_rope: per head h of q and k, n = x * rsqrt(mean(x^2) + eps) * w in fp32,
// out[d] = n[d] cos[d] - n[d + R/2] sin[d] and out[d + R/2] = n[d + R/2] cos[d + R/2] +
// n[d] sin[d + R/2] for d < R/2, out[d] = n[d] for d >= R, rounded once to the dtype. For fp32 the
// arithmetic is the reference's op for op (products, then their sum), all but the sum of squares'
// order.
void QkNormRopeCpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                   const torch::Tensor& k_weight, const torch::Tensor& cos,
                   const torch::Tensor& sin, double eps, const torch::Tensor& q_out,
                   const torch::Tensor& k_out);

// FastPaths::route_topk on CPU fp32 logits [T, E] (contiguous, no gradient needed; false
// otherwise): p = exp(l - max) / sum, the top_k largest logits (the lower expert id first among
// equal ones; NaN counts as the largest, as in torch.topk), renormalised over the k when asked.
bool RouteTopkCpu(const torch::Tensor& logits, int64_t top_k, bool renormalize,
                  torch::Tensor* weights, torch::Tensor* ids);

// FastPaths::route_weights on CPU fp32 logits [T, E] and int64 ids [T, k] in [0, E): the same
// softmax and renormalisation as RouteTopkCpu at the given ids (false when not handled).
bool RouteWeightsCpu(const torch::Tensor& logits, const torch::Tensor& ids, bool renormalize,
                     torch::Tensor* weights);

}  // namespace lm
