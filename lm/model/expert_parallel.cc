#include "lm/model/expert_parallel.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/model/config.h"
#include "lm/model/fp8.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/model/moe_grouped.h"

namespace lm {

ExpertRange LocalExpertRange(int64_t num_experts, int rank, int world_size) {
  const int64_t base = num_experts / world_size, extra = num_experts % world_size;
  ExpertRange r;
  r.count = base + (rank < extra ? 1 : 0);
  r.first = rank * base + std::min<int64_t>(rank, extra);
  return r;
}

absl::Status ShardConfig(ModelConfig& config, int rank, int world_size) {
  if (world_size <= 1) return absl::OkStatus();
  if (config.num_experts <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--world-size=", world_size, ": a ", config.model_type,
                     " model has no experts to shard (expert parallelism needs a MoE model)"));
  if (config.num_experts < world_size)
    return absl::InvalidArgumentError(absl::StrCat("--world-size=", world_size,
                                                   " is more ranks than the model's ",
                                                   config.num_experts, " experts per layer"));
  const ExpertRange r = LocalExpertRange(config.num_experts, rank, world_size);
  config.expert_first = r.first;
  config.local_experts = r.count;
  return absl::OkStatus();
}

CollectiveError::CollectiveError(absl::Status status)
    : std::runtime_error(std::string(status.message())), status_(std::move(status)) {}

void AttachExpertParallel(CausalLM& model, std::shared_ptr<const ExpertParallel> ep) {
  for (auto& m : model.modules(/*include_self=*/false)) {
    if (auto* experts = m->as<ExpertsImpl>()) experts->ep = ep;
  }
}

std::shared_ptr<const ExpertParallel> ExpertParallelOf(CausalLM& model) {
  for (auto& m : model.modules(/*include_self=*/false)) {
    if (auto* experts = m->as<ExpertsImpl>()) return experts->ep;
  }
  return nullptr;
}

namespace {

// On a device: every token's slots go through the grouped experts with the other ranks' experts
// dropped (ids shifted to the local range fall outside it), fixed shapes, no host sync; the
// partial sum stays in fp32.
torch::Tensor LocalPartialOnDevice(const ExpertParallel& ep, const torch::Tensor& x,
                                   const Routing& r, const ExpertsImpl& experts) {
  return MoeExpertsGroupedFp32(x, r.ids - ep.local.first, r.weights, experts.gate_up_proj,
                               experts.down_proj);
}

// On the CPU (where a nonzero costs no sync): the pairs routed to a local expert are gathered
// first, so the CPU kernels' work is proportional to them.
torch::Tensor LocalPartialOnCpu(const ExpertParallel& ep, const torch::Tensor& x, const Routing& r,
                                const ExpertsImpl& experts) {
  const int64_t k = r.ids.size(1);
  // The (token, slot) pairs routed to a local expert, in token order.
  auto flat_ids = r.ids.reshape({-1});
  auto pairs = ((flat_ids >= ep.local.first) & (flat_ids < ep.local.first + ep.local.count))
                   .nonzero()
                   .squeeze(1);
  auto y = torch::zeros({x.size(0), x.size(1)}, x.options().dtype(torch::kFloat32));
  if (pairs.numel() > 0) {
    auto tokens = torch::div(pairs, k, "floor");
    auto ids = (flat_ids.index_select(0, pairs) - ep.local.first).unsqueeze(1);
    auto weights = r.weights.reshape({-1}).index_select(0, pairs).unsqueeze(1);
    // One row per pair (a token routed to two local experts appears twice), then summed back.
    auto part =
        MoeExperts(x.index_select(0, tokens), ids, weights, experts.gate_up_proj, experts.down_proj)
            .to(torch::kFloat32);
    // One slot at a time: a token has at most one pair per slot, so each pass adds one non-zero
    // term per row (the others are exact zeros) and the sum cannot depend on the order in which
    // index_add_'s atomics land on a GPU. In slot order, as one pass over the pairs would add.
    auto slot = pairs.remainder(k).unsqueeze(1);
    if (k == 1) {
      y.index_add_(0, tokens, part);
    } else {
      for (int64_t s = 0; s < k; ++s) y.index_add_(0, tokens, part * (slot == s));
    }
  }
  return y;
}

}  // namespace

torch::Tensor ExpertParallelExperts(const ExpertParallel& ep, const torch::Tensor& x,
                                    const Routing& r, const ExpertsImpl& experts) {
  // The combine and the all-reduce in fp32, rounded to the activations' dtype once at the end: a
  // bf16 sum over k experts and then over ranks would round at every addition.
  torch::Tensor y;
  if (HoldsFp8(experts)) {  // drops the other ranks' ids itself, on any device
    y = Fp8MoeExperts(x, r.ids - ep.local.first, r.weights, experts, /*fp32_sum=*/true);
  } else if (!x.device().is_cpu() && GroupedGemmsFit(x, experts.down_proj)) {
    y = LocalPartialOnDevice(ep, x, r, experts);
  } else {
    y = LocalPartialOnCpu(ep, x, r, experts);
  }
  if (absl::Status st = ep.all_reduce_sum(y); !st.ok()) throw CollectiveError(std::move(st));
  return y.to(x.scalar_type());
}

ParameterBytes CountParameterBytes(CausalLM& model) {
  ParameterBytes b;
  for (const auto& p : model.named_parameters()) {
    const int64_t n = p.value().numel() * p.value().element_size();
    b.total += n;
    if (p.key().find(".experts.") != std::string::npos) b.experts += n;
  }
  return b;
}

}  // namespace lm
