// The keyed token draw on the CPU: the CPU twin of kernels/cuda/sampler.cuh, registered as the
// CPU lm::FastPaths::sample_rows (kernels/cpu/register.cc). The contract is lm::SampleRows
// (lm/generate/sampler.h); the arithmetic is kernels/cpu/draw_math.h's, shared with the device,
// so that both draw the same token with the same log-prob bit for bit.
//
// Per row (rows in parallel, each whole on one thread): one pass for the max (and the greedy
// argmax), the integer weights of the row once into a scratch buffer, the top-k and top-p cuts as
// four 8-bit radix passes each over the logits' order keys (counts for top-k, weight sums for
// top-p, the GPU's algorithm run serially), then the inverse-CDF walk in token order.
#pragma once

#include <torch/types.h>

namespace lm {

// lm::FastPaths::sample_rows on CPU tensors (logits [B, V] fp32; keys, positions, top_k [B]
// int64; temperature, top_p [B] float64; stop_ids [B, S] int64). False when any of them is not a
// CPU tensor of that shape and dtype.
bool SampleRowsCpu(const torch::Tensor& logits, const torch::Tensor& keys,
                   const torch::Tensor& positions, const torch::Tensor& temperature,
                   const torch::Tensor& top_k, const torch::Tensor& top_p,
                   const torch::Tensor& stop_ids, torch::Tensor* tokens, torch::Tensor* logprobs,
                   torch::Tensor* stopped);

}  // namespace lm
