// The training loss through the LM head: sum over rows of -log softmax(hidden W^T)[target],
// never holding more than a chunk of rows x vocabulary logits.
//
// lm::TokenLogprobs (the general, per-row differentiable op) recomputes every chunk's logits in
// its backward: four [N, H] x [H, V] matmuls per step, the largest matmuls of a small-hidden,
// large-vocabulary student (151,936 x 1,024 for Marco). A loss that is a plain sum of the rows
// (then scaled) has the same gradient factor for every row, so the gradients can be formed in the
// forward while each chunk's logits are at hand and the backward only scales them: three matmuls,
// as an unfused implementation with full logits, and still chunk x V memory.
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace trainer {

// hidden [N, H], weight [V, H], targets [N] int64 -> 0-dim fp32 sum of -log p(target). Gradients
// flow to hidden and weight (computed during the forward when either requires grad).
torch::Tensor FusedNllSum(const torch::Tensor& hidden, const torch::Tensor& weight,
                          const torch::Tensor& targets, int64_t chunk_rows = 512);

}  // namespace trainer
