// LibTorch adapter of the fused small ops (fused_ops.cuh), registered as the CUDA
// lm::FastPaths::add_rms_norm and qk_norm_rope (kernels/cuda/register.cc). Launched on the
// current stream of the inputs' device, no host synchronisation. Each returns false, touching
// nothing, for inputs it does not handle (not CUDA, other dtypes, non-contiguous, gradients
// needed), and lm runs its reference ops.
#pragma once

#include <torch/types.h>

namespace kernels {

// lm::FastPaths::add_rms_norm on CUDA tensors (fp32, bf16 or fp16, all one dtype).
bool AddRmsNormCuda(const torch::Tensor& x, const torch::Tensor& residual,
                    const torch::Tensor& weight, double eps, torch::Tensor* out,
                    torch::Tensor* sum);

// lm::FastPaths::qk_norm_rope on CUDA tensors (q/k/weights/outputs fp32, bf16 or fp16, all one
// dtype; cos/sin fp32).
bool QkNormRopeCuda(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                    const torch::Tensor& k_weight, const torch::Tensor& cos,
                    const torch::Tensor& sin, double eps, const torch::Tensor& q_out,
                    const torch::Tensor& k_out);

}  // namespace kernels
