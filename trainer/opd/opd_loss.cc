#include "trainer/opd/opd_loss.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace trainer {

absl::StatusOr<Correction> ParseCorrection(const std::string& s) {
  if (s == "none") return Correction::kNone;
  if (s == "tis") return Correction::kTruncatedIs;
  if (s == "ppo") return Correction::kPpoClip;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown importance correction '", s, "' (none | tis | ppo)"));
}

absl::StatusOr<TopKDivergence> ParseTopKDivergence(const std::string& s) {
  if (s == "forward") return TopKDivergence::kForward;
  if (s == "reverse") return TopKDivergence::kReverse;
  if (s == "mixed") return TopKDivergence::kMixed;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown top-k divergence '", s, "' (forward | reverse | mixed)"));
}

torch::Tensor SampledTokenLoss(const torch::Tensor& lp, const torch::Tensor& lp_old,
                               const torch::Tensor& lp_teacher, double token_normaliser,
                               const SampledTokenLossOptions& opts, LossStats* stats) {
  const auto d = lp.detach() - lp_teacher;
  const auto adv = -opts.kl_coef * d;
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
  return per_token.sum() / token_normaliser;
}

torch::Tensor TopKLoss(const torch::Tensor& student_logits_k,
                       const torch::Tensor& teacher_logprobs_k, double token_normaliser,
                       TopKDivergence divergence, double alpha) {
  // Both renormalised over the teacher's support S_t.
  const auto log_q = torch::log_softmax(student_logits_k.to(torch::kFloat32), -1);
  const auto log_p = torch::log_softmax(teacher_logprobs_k.to(torch::kFloat32), -1);
  const auto forward = (log_p.exp() * (log_p - log_q)).sum(-1);
  const auto reverse = (log_q.exp() * (log_q - log_p)).sum(-1);
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
  return kl.sum() / token_normaliser;
}

}  // namespace trainer
