// The optimizer side of a training step: AdamW with two parameter groups, the learning-rate
// schedule, and global-norm gradient clipping. Each matches its PyTorch counterpart
// (torch.optim.AdamW(fused=True), torch.nn.utils.clip_grad_norm_) so that a Python reference loop
// reproduces our updates.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "trainer/common/sections.h"

namespace trainer {

// Warm-up then cosine decay, a pure function of the step:
//   s < W:  lr(s) = peak * (s + 1) / W
//   s >= W: lr(s) = min + (peak - min) * (1 + cos(pi * min(1, (s - W) / max(1, T - W)))) / 2
// where s is the 0-based index of the update (the first update uses lr(0)), W = warmup_steps and
// T = total_steps. Unlike transformers' schedule the first warm-up update is not wasted at lr 0.
struct CosineSchedule {
  double peak_lr = 1e-5;
  double min_lr = 1e-6;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double LrAt(int64_t step) const;
};

// Weight decay applies to matrices only: never to 1-D parameters (norm weights) or biases.
bool UsesWeightDecay(const std::string& name, const torch::Tensor& param);

// AdamW as torch.optim.AdamW with fused=True: per parameter
//   p *= 1 - lr * wd;  m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g^2
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// in one fused kernel per group (aten::_fused_adamw_). State is kept per parameter name, so it
// is saved and restored by name, independent of parameter order.
class AdamW {
 public:
  AdamW(const std::vector<std::pair<std::string, torch::Tensor>>& named_params,
        const OptimConfig& config);

  // One update of every parameter that has a gradient, at learning rate `lr`.
  void Step(double lr);
  void ZeroGrad();  // gradients to undefined (as set_to_none)
  int64_t steps() const { return steps_; }

  // exp_avg.<name> and exp_avg_sq.<name>, fp32 on the CPU.
  std::map<std::string, torch::Tensor> StateTensors() const;
  // Restores what StateTensors() returned after `steps` updates; every tensor must be present.
  absl::Status LoadState(const std::map<std::string, torch::Tensor>& tensors, int64_t steps);

  const std::vector<torch::Tensor>& params() const { return all_params_; }
  size_t num_decay() const { return decay_.params.size(); }
  size_t num_no_decay() const { return no_decay_.params.size(); }

 private:
  struct Group {
    double weight_decay = 0;
    std::vector<std::string> names;
    std::vector<torch::Tensor> params, exp_avg, exp_avg_sq, steps;
  };
  void StepGroup(Group& g, double lr);

  OptimConfig config_;
  Group decay_, no_decay_;
  std::vector<torch::Tensor> all_params_;
  int64_t steps_ = 0;
};

// Global L2 norm of the gradients, as torch.nn.utils.clip_grad_norm_ computes it (norm of the
// per-tensor norms, fp32). When it is finite and `max_norm` > 0, gradients are multiplied by
// min(1, max_norm / (norm + 1e-6)). Non-finite norms leave the gradients alone (the caller skips
// the step). Returns the norm before clipping.
double ClipGradNorm(const std::vector<torch::Tensor>& params, double max_norm);

}  // namespace trainer
