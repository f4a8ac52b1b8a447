#include "trainer/common/gradient_order.h"

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <utility>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "lm/model/logprobs.h"

namespace trainer {
namespace {

class ArrivalHook : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit ArrivalHook(std::function<void()> arrived) : arrived_(std::move(arrived)) {}
  void operator()(const torch::autograd::Variable&) override { arrived_(); }

 private:
  std::function<void()> arrived_;
};

}  // namespace

absl::StatusOr<std::vector<std::string>> GradientArrivalOrder(lm::CausalLM& model,
                                                              Precision precision,
                                                              bool checkpoint_layers) {
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : model.named_parameters()) {
    if (p.value().grad().defined())
      return absl::FailedPreconditionError(
          absl::StrCat("parameter ", p.key(), " has a gradient already"));
    params.emplace_back(p.key(), p.value());
  }
  std::vector<std::string> order;
  std::mutex mu;
  // Removes the hooks and any gradient however the probe ends.
  struct Cleanup {
    std::vector<std::pair<std::string, torch::Tensor>>& params;
    ~Cleanup() {
      for (auto& [name, p] : params) {
        torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
        p.mutable_grad() = torch::Tensor();
      }
    }
  } cleanup{params};
  for (size_t i = 0; i < params.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        params[i].second, std::make_unique<ArrivalHook>([&, i] {
          std::lock_guard<std::mutex> lock(mu);
          if (std::find(order.begin(), order.end(), params[i].first) == order.end())
            order.push_back(params[i].first);
          params[i].second.mutable_grad() = torch::Tensor();
        }));
  }
  if (params.empty()) return order;
  const torch::Device device = params.front().second.device();
  const int64_t vocab = model.config().vocab_size;
  lm::PackedBatch batch = lm::PackedBatch::FromSequences(
      {{1 % vocab, 2 % vocab, 3 % vocab}});  // any ids: only the graph's shape matters
  auto [rows, targets] = lm::NextTokenRows(batch);
  batch.input_ids = batch.input_ids.to(device);
  batch.position_ids = batch.position_ids.to(device);
  try {
    torch::Tensor loss;
    {
      ForwardPrecision autocast(precision, device);
      lm::ForwardOptions fwd;
      fwd.checkpoint_layers = checkpoint_layers;
      torch::Tensor hidden = model.Forward(batch, fwd).index_select(0, rows.to(device));
      loss = lm::TokenLogprobs(hidden, model.LmHeadWeight(), targets.to(device)).sum();
    }
    loss.backward();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("the probe's backward failed: ", e.what()));
  }
  return order;
}

}  // namespace trainer
