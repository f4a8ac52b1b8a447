#include "lm/model/recompute.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

namespace lm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Block = std::function<std::vector<torch::Tensor>(const torch::Tensor&)>;

// The autocast state (CPU and CUDA) of the forward. The recomputation runs in the backward, where
// autocast is off (and on CUDA on another thread): it must compute in the forward's dtypes, or its
// activations and gradients would not be those of the forward (bf16-mixed training would even
// meet fp32 activations against bf16 weights).
struct AutocastState {
  bool enabled[2] = {false, false};
  at::ScalarType dtype[2] = {at::kBFloat16, at::kBFloat16};
  static constexpr c10::DeviceType kTypes[2] = {c10::DeviceType::CPU, c10::DeviceType::CUDA};

  static AutocastState Current() {
    AutocastState s;
    for (int i = 0; i < 2; ++i) {
      s.enabled[i] = at::autocast::is_autocast_enabled(kTypes[i]);
      s.dtype[i] = at::autocast::get_autocast_dtype(kTypes[i]);
    }
    return s;
  }
  void Apply() const {
    for (int i = 0; i < 2; ++i) {
      at::autocast::set_autocast_dtype(kTypes[i], dtype[i]);
      at::autocast::set_autocast_enabled(kTypes[i], enabled[i]);
    }
  }
};

// Sets an autocast state for a scope and restores the previous one.
class ScopedAutocast {
 public:
  explicit ScopedAutocast(const AutocastState& s) : saved_(AutocastState::Current()) { s.Apply(); }
  ~ScopedAutocast() { saved_.Apply(); }

 private:
  AutocastState saved_;
};

// The block travels to the backward in the context's saved data, with the forward's autocast
// state.
struct BlockHolder : torch::CustomClassHolder {
  explicit BlockHolder(Block b) : block(std::move(b)), autocast(AutocastState::Current()) {}
  Block block;
  AutocastState autocast;
};

// The block's parameters are not inputs of this node: the backward's nested backward reaches them
// through the recomputed graph and accumulates into their .grad itself (so their post-accumulate
// hooks fire as usual); the node returns the gradient of x only.
struct RecomputeFn : torch::autograd::Function<RecomputeFn> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<BlockHolder> holder,
                               const torch::Tensor& x) {
    ctx->saved_data["block"] = c10::IValue::make_capsule(holder);
    ctx->save_for_backward({x});
    // The forward runs with autograd on, as the recomputation will: kernels are chosen by whether
    // a gradient is needed (the CPU fast paths serve only gradient-free calls), and a forward on
    // other kernels than its recomputation would round differently, so the backward would not be
    // the gradient of the values the forward passed on. The graph built here is one layer's and
    // is freed as the detached outputs leave this scope.
    torch::AutoGradMode grad(true);
    torch::Tensor input = x.detach().requires_grad_(true);  // as in the backward
    std::vector<torch::Tensor> outputs = holder->block(input);
    for (auto& t : outputs) t = t.detach();
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto holder =
        c10::static_intrusive_pointer_cast<BlockHolder>(ctx->saved_data["block"].toCapsule());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    std::vector<torch::Tensor> outputs;
    {
      torch::AutoGradMode grad(true);
      ScopedAutocast autocast(holder->autocast);
      outputs = holder->block(x);
    }
    std::vector<torch::Tensor> roots, grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (!grad_outputs[i].defined() || !outputs[i].requires_grad()) continue;
      roots.push_back(outputs[i]);
      grads.push_back(grad_outputs[i]);
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    return {torch::Tensor(), x.grad()};
  }
};

}  // namespace

std::vector<torch::Tensor> Recompute(Block block, const torch::Tensor& x) {
  return RecomputeFn::apply(c10::make_intrusive<BlockHolder>(std::move(block)), x);
}

}  // namespace lm
