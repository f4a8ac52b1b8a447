// The on-policy distillation losses.
//
// Sampled-token form (default; what the Marco-MoE paper used via slime). For each sampled
// response token t, with the learner's log-prob lp_t (differentiable), the sampler's lp_old_t and
// the teacher's lp_T_t:
//   d_t = sg(lp_t) - lp_T_t                 per-token reverse-KL estimate
//   A_t = -kl_coef * sum_{j >= t} gamma^(j - t) d_j     advantage (stop-gradient) over the rest of
//                                           the same response; gamma = kl_discount, default 0 (the
//                                           paper's per-token form; 1 is the sequence-level KL's
//                                           gradient, as tinker-cookbook's kl_discount_factor)
//   r_t = exp(lp_t - lp_old_t)              importance ratio learner / sampler
//   correction "none":  L_t = -A_t * lp_t
//   correction "tis":   L_t = -min(sg(r_t), C) * A_t * lp_t         (truncated importance sampling)
//   correction "ppo":   L_t = max(-r_t A_t, -clip(r_t, 1-eps_lo, 1+eps_hi) A_t)
// Top-k form (option): the teacher's top-k ids S_t and log-probs at each position; p = teacher,
// q = student, both at their full-vocabulary probabilities over k + 1 buckets, S_t's ids and the
// tail V \ S_t as one (p_tail = 1 - sum_S p, q_tail = 1 - sum_S q; as NeMo-RL's top-k KD), so a
// student that moves its mass off the teacher's support is not free:
//   forward KL(p||q), reverse KL(q||p), or mixed alpha * forward + (1 - alpha) * reverse.
//
// Normalisation (`loss.normalization`): "token" (default) divides the sum of L_t over every
// response token of every sample in the step by the step's total response-token count (a token
// mean over the whole global batch: `token_normaliser` is that total); "sequence" takes each
// response's token mean, then the mean over the step's responses (TokenWeights gives each token
// its weight either way).
#pragma once

#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "trainer/opd/opd_config.h"  // Correction, TopKDivergence, Normalization: the loss's words

namespace trainer {

struct SampledTokenLossOptions {
  Correction correction = Correction::kTruncatedIs;
  double kl_coef = 1.0;
  double tis_cap = 2.0;     // C
  double clip_low = 0.2;    // eps_lo
  double clip_high = 0.28;  // eps_hi
  double kl_discount = 0;   // gamma
};

struct LossStats {
  double reverse_kl_sum = 0;  // sum of d_t
  double ratio_sum = 0, ratio_min = 0, ratio_max = 0;
  double clipped = 0;           // tokens whose ratio was truncated / clipped
  double mismatch_abs_sum = 0;  // sum |lp_t - lp_old_t| (sampler vs learner)
  double tokens = 0;
};

// lp, lp_old, lp_teacher: [N] fp32 over this micro-batch's response tokens, the responses one
// after another with `response_lengths` (summing to N; the discount stays within a response).
// Returns sum_t w_t L_t (differentiable w.r.t. lp) and fills `stats` (sums, not means).
torch::Tensor SampledTokenLoss(const torch::Tensor& lp, const torch::Tensor& lp_old,
                               const torch::Tensor& lp_teacher, const torch::Tensor& token_weights,
                               const std::vector<int64_t>& response_lengths,
                               const SampledTokenLossOptions& opts, LossStats* stats);
// The same with every w_t = 1 / token_normaliser, the N tokens one response (no discount across
// responses matters then only where opts.kl_discount is 0).
torch::Tensor SampledTokenLoss(const torch::Tensor& lp, const torch::Tensor& lp_old,
                               const torch::Tensor& lp_teacher, double token_normaliser,
                               const SampledTokenLossOptions& opts, LossStats* stats);

// The weight of each of a micro-batch's response tokens in the step's loss: 1 / step_tokens
// ("token"), or 1 / (|y_s| * step_sequences) for the tokens of response s ("sequence"), where
// step_tokens and step_sequences count the whole step (every rank, every micro-batch; responses
// with no token do not count).
torch::Tensor TokenWeights(const std::vector<int64_t>& response_lengths, Normalization norm,
                           int64_t step_tokens, int64_t step_sequences,
                           const torch::TensorOptions& options);

// R_t = sum_{j >= t} gamma^(j - t) d_j within each response (d [N], responses one after another).
torch::Tensor DiscountedSums(const torch::Tensor& d, const std::vector<int64_t>& response_lengths,
                             double gamma);

// student_logprobs_k, teacher_logprobs_k: [N, k] full-vocabulary log-probs at the teacher's top-k
// ids. Returns sum_t w_t KL_t over the k + 1 buckets (token_weights [N], from TokenWeights).
torch::Tensor TopKLoss(const torch::Tensor& student_logprobs_k,
                       const torch::Tensor& teacher_logprobs_k, const torch::Tensor& token_weights,
                       TopKDivergence divergence, double alpha);
// The same with every w_t = 1 / token_normaliser.
torch::Tensor TopKLoss(const torch::Tensor& student_logprobs_k,
                       const torch::Tensor& teacher_logprobs_k, double token_normaliser,
                       TopKDivergence divergence, double alpha);

// logits[n, j] = hidden[n] . weight[ids[n, j]] in fp32, differentiable in hidden and weight,
// computed in row chunks: the [n, k, H] gather of the rows never exists whole, and the weight's
// gradient is accumulated in fp32 over the rows the ids name, then rounded once to its dtype.
// hidden [n, H], weight [V, H], ids [n, k] int64.
torch::Tensor GatheredLogits(const torch::Tensor& hidden, const torch::Tensor& weight,
                             const torch::Tensor& ids);

// The student's full-vocabulary log-probs at ids [n, k]: (z_ids - z_target) / T + lp_target,
// where lp_target [n] are the learner's log-probs of the sampled targets [n] (which carry the
// normaliser log sum exp(z / T)); differentiable through all three.
torch::Tensor StudentTopKLogprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                                  const torch::Tensor& ids, const torch::Tensor& targets,
                                  const torch::Tensor& target_logprobs, double temperature);

}  // namespace trainer
