// Activation checkpointing: run a block without keeping its activations, and run it again in the
// backward to get its gradients. Memory per decoder layer falls from everything its backward
// needs to its input; the price is a second forward of the layer.
#pragma once

#include <functional>
#include <vector>

#include <torch/types.h>

namespace lm {

// outputs = block(x). The forward runs without autograd; the outputs carry a graph node whose
// backward runs block(x) again with autograd and backpropagates through it, so the gradients of x
// and of every parameter the block reads equal those of calling block(x) directly (the
// parameters' gradients are accumulated by that inner backward). `block` must be deterministic
// (no dropout here), must not modify its inputs, and is kept until the backward. x must require
// grad (a decoder layer's input does: it comes from the embedding).
std::vector<torch::Tensor> Recompute(
    std::function<std::vector<torch::Tensor>(const torch::Tensor&)> block, const torch::Tensor& x);

}  // namespace lm
