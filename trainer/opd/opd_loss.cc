#include "trainer/opd/opd_loss.h"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

namespace trainer {

torch::Tensor TokenWeights(const std::vector<int64_t>& response_lengths, Normalization norm,
                           int64_t step_tokens, int64_t step_sequences,
                           const torch::TensorOptions& options) {
  int64_t n = 0;
  for (int64_t len : response_lengths) n += len;
  auto w = torch::empty({n}, options.dtype(torch::kFloat64).device(torch::kCPU));
  auto* p = w.data_ptr<double>();
  for (int64_t len : response_lengths) {
    const double each = norm == Normalization::kToken
                            ? 1.0 / static_cast<double>(std::max<int64_t>(step_tokens, 1))
                            : 1.0 / (static_cast<double>(len) *
                                     static_cast<double>(std::max<int64_t>(step_sequences, 1)));
    std::fill(p, p + len, each);
    p += len;
  }
  return w.to(options);
}

torch::Tensor DiscountedSums(const torch::Tensor& d, const std::vector<int64_t>& response_lengths,
                             double gamma) {
  if (gamma == 0) return d;
  // Backwards through each response on the host: N is a micro-batch's response tokens, and the
  // recurrence R_t = d_t + gamma R_{t+1} is sequential.
  auto host = d.detach().to(torch::kCPU, torch::kFloat64).contiguous();
  auto out = torch::empty_like(host);
  const double* in = host.data_ptr<double>();
  double* r = out.data_ptr<double>();
  int64_t start = 0;
  for (int64_t len : response_lengths) {
    double acc = 0;
    for (int64_t t = start + len - 1; t >= start; --t) r[t] = acc = in[t] + gamma * acc;
    start += len;
  }
  return out.to(d.options());
}

torch::Tensor SampledTokenLoss(const torch::Tensor& lp, const torch::Tensor& lp_old,
                               const torch::Tensor& lp_teacher, double token_normaliser,
                               const SampledTokenLossOptions& opts, LossStats* stats) {
  return SampledTokenLoss(lp, lp_old, lp_teacher, torch::full_like(lp, 1.0 / token_normaliser),
                          {lp.numel()}, opts, stats);
}

torch::Tensor SampledTokenLoss(const torch::Tensor& lp, const torch::Tensor& lp_old,
                               const torch::Tensor& lp_teacher, const torch::Tensor& token_weights,
                               const std::vector<int64_t>& response_lengths,
                               const SampledTokenLossOptions& opts, LossStats* stats) {
  const auto d = lp.detach() - lp_teacher;
  const auto adv = -opts.kl_coef * DiscountedSums(d, response_lengths, opts.kl_discount);
  const auto log_ratio = lp - lp_old;
  const auto ratio = log_ratio.exp();
  torch::Tensor per_token, clipped;
  switch (opts.correction) {
    case Correction::kNone:
      per_token = -adv * lp;
      clipped = torch::zeros_like(lp, torch::kBool);
      break;
    case Correction::kTruncatedIs: {
      const auto w = ratio.detach().clamp_max(opts.tis_cap);
      per_token = -w * adv * lp;
      clipped = ratio.detach() > opts.tis_cap;
      break;
    }
    case Correction::kPpoClip: {
      const auto r_clip = ratio.clamp(1.0 - opts.clip_low, 1.0 + opts.clip_high);
      per_token = torch::max(-ratio * adv, -r_clip * adv);
      clipped = ((-r_clip * adv) > (-ratio * adv)).detach();
      break;
    }
  }
  if (stats && lp.numel() > 0) {
    torch::NoGradGuard no_grad;
    const auto r = ratio.detach();
    stats->reverse_kl_sum += d.sum().item<double>();
    stats->ratio_sum += r.sum().item<double>();
    const double rmin = r.min().item<double>(), rmax = r.max().item<double>();
    stats->ratio_min = stats->tokens == 0 ? rmin : std::min(stats->ratio_min, rmin);
    stats->ratio_max = stats->tokens == 0 ? rmax : std::max(stats->ratio_max, rmax);
    stats->clipped += clipped.sum().item<double>();
    stats->mismatch_abs_sum += log_ratio.detach().abs().sum().item<double>();
    stats->tokens += static_cast<double>(lp.numel());
  }
  return (per_token * token_weights.to(per_token.scalar_type())).sum();
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per chunk of GatheredLogits: a chunk's gathered weights, [rows, k, H] in fp32, stay near
// 64 MiB whatever the micro-batch.
int64_t ChunkRows(int64_t k, int64_t hidden) {
  return std::max<int64_t>(1, (int64_t{64} << 20) / (4 * std::max<int64_t>(1, k * hidden)));
}

struct GatheredLogitsFn : torch::autograd::Function<GatheredLogitsFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& ids) {
    // fp32 arithmetic whatever the caller's autocast (bf16-mixed would run the bmm in bf16): the
    // same arithmetic as the sampled token's log-prob (lm::TokenLogprobs), whose normaliser the
    // top-k log-probs share, so the k + 1 buckets sum to 1.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    ctx->save_for_backward({hidden, weight, ids});
    const int64_t n = ids.size(0), k = ids.size(1), H = hidden.size(1);
    auto out = torch::empty({n, k}, hidden.options().dtype(torch::kFloat32));
    const int64_t rows = ChunkRows(k, H);
    for (int64_t r0 = 0; r0 < n; r0 += rows) {
      const int64_t c = std::min(rows, n - r0);
      auto w = weight.index_select(0, ids.narrow(0, r0, c).reshape({-1}))
                   .to(torch::kFloat32)
                   .view({c, k, H});
      auto h = hidden.narrow(0, r0, c).to(torch::kFloat32).unsqueeze(2);
      out.narrow(0, r0, c).copy_(torch::bmm(w, h).squeeze(2));
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &hidden = saved[0], &weight = saved[1], &ids = saved[2];
    const auto g = grads[0].to(torch::kFloat32);
    const int64_t n = ids.size(0), k = ids.size(1), H = hidden.size(1);
    const int64_t rows = ChunkRows(k, H);
    torch::Tensor grad_hidden, grad_weight;
    const bool want_h = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    if (want_h) grad_hidden = torch::empty({n, H}, g.options());
    // The weight's gradient reaches only the rows the ids name: accumulated in fp32 over those
    // rows, rounded once to the weight's dtype.
    torch::Tensor uniq, slot, acc;
    if (want_w) {
      auto u = at::_unique2(ids.reshape({-1}), /*sorted=*/true, /*return_inverse=*/true);
      uniq = std::get<0>(u);
      slot = std::get<1>(u).view({n, k});
      acc = torch::zeros({uniq.size(0), H}, g.options());
    }
    for (int64_t r0 = 0; r0 < n; r0 += rows) {
      const int64_t c = std::min(rows, n - r0);
      auto gc = g.narrow(0, r0, c);
      if (want_h) {
        auto w = weight.index_select(0, ids.narrow(0, r0, c).reshape({-1}))
                     .to(torch::kFloat32)
                     .view({c, k, H});
        grad_hidden.narrow(0, r0, c).copy_(torch::bmm(gc.unsqueeze(1), w).squeeze(1));
      }
      if (want_w) {
        auto h = hidden.narrow(0, r0, c).to(torch::kFloat32);
        auto contrib = (gc.unsqueeze(2) * h.unsqueeze(1)).reshape({c * k, H});
        acc.index_add_(0, slot.narrow(0, r0, c).reshape({-1}), contrib);
      }
    }
    if (want_h) grad_hidden = grad_hidden.to(hidden.scalar_type());
    if (want_w)
      grad_weight = torch::zeros_like(weight).index_copy_(0, uniq, acc.to(weight.scalar_type()));
    return {grad_hidden, grad_weight, torch::Tensor()};
  }
};

// log(1 - sum_i exp(log_probs_i)) over the last dim: the mass outside the k ids, floored at
// k * 2^-24, the rounding of a sum of k fp32 probabilities near 1 (a smaller tail cannot be told
// from 0, and the floor keeps its log finite).
torch::Tensor LogTail(const torch::Tensor& log_probs) {
  const double floor = static_cast<double>(log_probs.size(-1)) * std::ldexp(1.0, -24);
  return torch::log(torch::clamp_min(1.0 - log_probs.exp().sum(-1), floor));
}

}  // namespace

torch::Tensor GatheredLogits(const torch::Tensor& hidden, const torch::Tensor& weight,
                             const torch::Tensor& ids) {
  return GatheredLogitsFn::apply(hidden, weight, ids);
}

torch::Tensor StudentTopKLogprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                                  const torch::Tensor& ids, const torch::Tensor& targets,
                                  const torch::Tensor& target_logprobs, double temperature) {
  // lse_t = z_target / T - lp_t: the sampled token's log-prob already holds the full-vocabulary
  // normaliser, so the [n, V] logits are never formed here. One pass: the target is column 0.
  const auto z = GatheredLogits(hidden, weight, torch::cat({targets.reshape({-1, 1}), ids}, 1));
  const auto z_target = z.narrow(1, 0, 1), z_k = z.narrow(1, 1, ids.size(1));
  return (z_k - z_target) / temperature + target_logprobs.to(torch::kFloat32).unsqueeze(1);
}

torch::Tensor TopKLoss(const torch::Tensor& student_logprobs_k,
                       const torch::Tensor& teacher_logprobs_k, double token_normaliser,
                       TopKDivergence divergence, double alpha) {
  return TopKLoss(student_logprobs_k, teacher_logprobs_k,
                  torch::full({student_logprobs_k.size(0)}, 1.0 / token_normaliser,
                              student_logprobs_k.options().dtype(torch::kFloat32)),
                  divergence, alpha);
}

torch::Tensor TopKLoss(const torch::Tensor& student_logprobs_k,
                       const torch::Tensor& teacher_logprobs_k, const torch::Tensor& token_weights,
                       TopKDivergence divergence, double alpha) {
  // k + 1 buckets: the teacher's top-k ids and the rest of the vocabulary as one, both sides at
  // their full-vocabulary probabilities (a student that moves mass off the teacher's support pays
  // for it in the tail bucket).
  const auto log_q = student_logprobs_k.to(torch::kFloat32);
  const auto log_p = teacher_logprobs_k.to(torch::kFloat32);
  const auto log_q_tail = LogTail(log_q), log_p_tail = LogTail(log_p);
  const auto forward =
      (log_p.exp() * (log_p - log_q)).sum(-1) + log_p_tail.exp() * (log_p_tail - log_q_tail);
  const auto reverse =
      (log_q.exp() * (log_q - log_p)).sum(-1) + log_q_tail.exp() * (log_q_tail - log_p_tail);
  torch::Tensor kl;
  switch (divergence) {
    case TopKDivergence::kForward:
      kl = forward;
      break;
    case TopKDivergence::kReverse:
      kl = reverse;
      break;
    case TopKDivergence::kMixed:
      kl = alpha * forward + (1.0 - alpha) * reverse;
      break;
  }
  return (kl * token_weights.to(torch::kFloat32)).sum();
}

}  // namespace trainer
