#include "trainer/common/optim.h"

#include <cmath>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace trainer {

double CosineSchedule::LrAt(int64_t step) const {
  if (step < warmup_steps) {
    return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

bool UsesWeightDecay(const std::string& name, const torch::Tensor& param) {
  const std::string bias = ".bias";
  const bool is_bias =
      name == "bias" || (name.size() >= bias.size() &&
                         name.compare(name.size() - bias.size(), bias.size(), bias) == 0);
  return param.dim() >= 2 && !is_bias;
}

AdamW::AdamW(const std::vector<std::pair<std::string, torch::Tensor>>& named_params,
             const OptimConfig& config)
    : config_(config) {
  decay_.weight_decay = config.weight_decay;
  no_decay_.weight_decay = 0.0;
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : named_params) {
    Group& g = UsesWeightDecay(name, p) ? decay_ : no_decay_;
    g.names.push_back(name);
    g.params.push_back(p);
    g.exp_avg.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    g.exp_avg_sq.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    // The fused kernel reads the step count from a float tensor on the parameter's device.
    g.steps.push_back(torch::zeros({}, p.options().dtype(torch::kFloat32)));
    all_params_.push_back(p);
  }
}

void AdamW::StepGroup(Group& g, double lr) {
  std::vector<torch::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
  for (size_t i = 0; i < g.params.size(); ++i) {
    if (!g.params[i].grad().defined()) continue;
    params.push_back(g.params[i]);
    grads.push_back(g.params[i].grad());
    exp_avg.push_back(g.exp_avg[i]);
    exp_avg_sq.push_back(g.exp_avg_sq[i]);
    steps.push_back(g.steps[i]);
  }
  if (params.empty()) return;
  // As torch.optim.AdamW(fused=True): the caller advances the step counts, then one kernel.
  at::_foreach_add_(steps, 1);
  at::_fused_adamw_(params, grads, exp_avg, exp_avg_sq, /*max_exp_avg_sqs=*/{}, steps, lr,
                    config_.beta1, config_.beta2, g.weight_decay, config_.eps, /*amsgrad=*/false,
                    /*maximize=*/false);
}

void AdamW::Step(double lr) {
  torch::NoGradGuard no_grad;
  StepGroup(decay_, lr);
  StepGroup(no_decay_, lr);
  ++steps_;
}

void AdamW::ZeroGrad() {
  for (auto& p : all_params_) p.mutable_grad() = torch::Tensor();
}

std::map<std::string, torch::Tensor> AdamW::StateTensors() const {
  std::map<std::string, torch::Tensor> out;
  for (const Group* g : {&decay_, &no_decay_}) {
    for (size_t i = 0; i < g->names.size(); ++i) {
      out["exp_avg." + g->names[i]] = g->exp_avg[i].detach().to(torch::kCPU).contiguous();
      out["exp_avg_sq." + g->names[i]] = g->exp_avg_sq[i].detach().to(torch::kCPU).contiguous();
    }
  }
  return out;
}

absl::Status AdamW::LoadState(const std::map<std::string, torch::Tensor>& tensors, int64_t steps) {
  torch::NoGradGuard no_grad;
  for (Group* g : {&decay_, &no_decay_}) {
    for (size_t i = 0; i < g->names.size(); ++i) {
      for (auto [prefix, dst] : {std::make_pair("exp_avg.", &g->exp_avg[i]),
                                 std::make_pair("exp_avg_sq.", &g->exp_avg_sq[i])}) {
        auto it = tensors.find(prefix + g->names[i]);
        if (it == tensors.end())
          return absl::NotFoundError(absl::StrCat("optimizer state has no ", prefix, g->names[i]));
        if (it->second.sizes() != dst->sizes())
          return absl::InvalidArgumentError(
              absl::StrCat("optimizer state ", prefix, g->names[i], " has the wrong shape"));
        dst->copy_(it->second);
      }
      g->steps[i].fill_(static_cast<double>(steps));
    }
  }
  steps_ = steps;
  return absl::OkStatus();
}

double ClipGradNorm(const std::vector<torch::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return 0.0;
  // The same operations, in the same order, as clip_grad_norm_: per-tensor norms, their norm,
  // and the clamped coefficient as an fp32 tensor.
  auto total = torch::stack(at::_foreach_norm(grads, 2)).norm(2);
  const double norm = total.item<double>();
  if (max_norm > 0 && std::isfinite(norm)) {
    auto coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
    at::_foreach_mul_(grads, coef);
  }
  return norm;
}

}  // namespace trainer
