// Log-probabilities through the LM head without materialising [tokens, vocab] at once.
//
// The teacher's and the learner's hot path needs log p(target) (and sometimes the top-k or the
// entropy) per position, not the logits. Rows are processed in chunks: peak extra memory is
// chunk x vocab. The training path recomputes each chunk's logits in the backward instead of
// keeping them, so a 151,936-word vocabulary costs no more than one chunk's worth of activations.
#pragma once

#include <torch/types.h>

namespace lm {

struct LogprobOptions {
  double temperature = 1.0;  // logits / temperature before the softmax
  int64_t chunk_rows = 1024;
};

// hidden [N, H], weight [V, H], targets [N] -> log p(targets) [N] in fp32. Differentiable w.r.t.
// hidden and weight. `entropy` (optional, not differentiated) receives the entropy per row [N].
torch::Tensor TokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                            const torch::Tensor& targets, const LogprobOptions& opts = {},
                            torch::Tensor* entropy = nullptr);

struct TopKLogprobs {
  torch::Tensor ids;       // [N, k] int64, most likely first
  torch::Tensor logprobs;  // [N, k] fp32
};

// The k most likely next tokens per row and their log-probs (no gradient).
TopKLogprobs TopK(const torch::Tensor& hidden, const torch::Tensor& weight, int64_t k,
                  const LogprobOptions& opts = {});

}  // namespace lm
