#include "lm/model/recompute.h"

#include <torch/torch.h>

namespace lm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Block = std::function<std::vector<torch::Tensor>(const torch::Tensor&)>;

// The block travels to the backward in the context's saved data.
struct BlockHolder : torch::CustomClassHolder {
  explicit BlockHolder(Block b) : block(std::move(b)) {}
  Block block;
};

// The block's parameters are not inputs of this node: the backward's nested backward reaches them
// through the recomputed graph and accumulates into their .grad itself (so their post-accumulate
// hooks fire as usual); the node returns the gradient of x only.
struct RecomputeFn : torch::autograd::Function<RecomputeFn> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<BlockHolder> holder,
                               const torch::Tensor& x) {
    ctx->saved_data["block"] = c10::IValue::make_capsule(holder);
    ctx->save_for_backward({x});
    torch::NoGradGuard no_grad;
    return holder->block(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto holder =
        c10::static_intrusive_pointer_cast<BlockHolder>(ctx->saved_data["block"].toCapsule());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    std::vector<torch::Tensor> outputs;
    {
      torch::AutoGradMode grad(true);
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
