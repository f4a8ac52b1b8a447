// LibTorch adapter of the keyed token draw (sampler.cuh), registered as the CUDA
// lm::FastPaths::sample_rows (kernels/cuda/register.cc).
#pragma once

#include <torch/types.h>

namespace kernels {

// lm::FastPaths::sample_rows on CUDA tensors, all on one device (see lm/model/fast_paths.h);
// one launch on that device's current stream, no host synchronisation. False (outputs
// untouched) when a tensor is not of the expected shape, dtype or device.
bool SampleRowsCuda(const torch::Tensor& logits, const torch::Tensor& keys,
                    const torch::Tensor& positions, const torch::Tensor& temperature,
                    const torch::Tensor& top_k, const torch::Tensor& top_p,
                    const torch::Tensor& stop_ids, torch::Tensor* tokens, torch::Tensor* logprobs,
                    torch::Tensor* stopped);

}  // namespace kernels
