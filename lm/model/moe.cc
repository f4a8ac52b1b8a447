#include "lm/model/moe.h"

#include <algorithm>
#include <array>
#include <initializer_list>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include "lm/model/batch_invariant.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/fast_paths.h"
#include "lm/model/fp8.h"
#include "lm/model/layers.h"
#include "lm/model/moe_grouped.h"

namespace lm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Per-expert SwiGLU MLP over rows already sorted by expert:
//   rows [offsets[e], offsets[e+1]) of x go through expert e.
// A custom autograd function so that the backward writes each expert's weight gradient into its
// slice of one [E, ...] tensor, instead of autograd materialising a full-size zero tensor per
// expert for every `gate_up[e]` view.
class GroupedSwiGlu : public torch::autograd::Function<GroupedSwiGlu> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               std::vector<int64_t> offsets, const torch::Tensor& gate_up,
                               const torch::Tensor& down) {
    const int64_t I = down.size(2);
    auto gu = torch::empty({x.size(0), 2 * I}, x.options());
    auto y = torch::empty({x.size(0), down.size(1)}, x.options());
    for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
      const int64_t s = offsets[e], n = offsets[e + 1] - s;
      if (n == 0) continue;
      auto gu_e = gu.narrow(0, s, n);
      MatmulWeightTOut(gu_e, x.narrow(0, s, n), gate_up[e]);
      auto h = pointwise::Silu(gu_e.narrow(1, 0, I)) * gu_e.narrow(1, I, I);
      auto y_e = y.narrow(0, s, n);
      MatmulWeightTOut(y_e, h, down[e]);
    }
    ctx->save_for_backward({x, gate_up, down, gu});
    ctx->saved_data["offsets"] = c10::IValue(offsets);
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &gate_up = saved[1], &down = saved[2], &gu = saved[3];
    const auto offsets = ctx->saved_data["offsets"].toIntVector();
    auto dy = grad_outputs[0].contiguous();
    const int64_t I = down.size(2);
    auto dx = torch::zeros_like(x);
    auto dgate_up = torch::zeros_like(gate_up);
    auto ddown = torch::zeros_like(down);
    for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
      const int64_t s = offsets[e], n = offsets[e + 1] - s;
      if (n == 0) continue;
      auto g = gu.narrow(0, s, n).narrow(1, 0, I), u = gu.narrow(0, s, n).narrow(1, I, I);
      auto sg = torch::sigmoid(g);
      auto act = g * sg;  // silu(g)
      auto dy_e = dy.narrow(0, s, n);
      auto ddown_e = ddown[e];
      torch::mm_out(ddown_e, dy_e.t(), act * u);
      auto dh = torch::mm(dy_e, down[e]);                                        // [n, I]
      auto dgu = torch::cat({dh * u * (sg * (1 + g * (1 - sg))), dh * act}, 1);  // [n, 2I]
      auto dgate_up_e = dgate_up[e];
      torch::mm_out(dgate_up_e, dgu.t(), x.narrow(0, s, n));
      auto dx_e = dx.narrow(0, s, n);
      torch::mm_out(dx_e, dgu, gate_up[e]);
    }
    return {dx, torch::Tensor(), dgate_up, ddown};
  }
};

thread_local std::vector<torch::Tensor>* routing_recorder = nullptr;
thread_local const std::vector<torch::Tensor>* routing_replay = nullptr;
thread_local size_t routing_replay_next = 0;

}  // namespace

ScopedRoutingRecorder::ScopedRoutingRecorder(std::vector<torch::Tensor>* out)
    : prev_(routing_recorder) {
  routing_recorder = out;
}
ScopedRoutingRecorder::~ScopedRoutingRecorder() {
  routing_recorder = prev_;
}

ScopedRoutingReplay::ScopedRoutingReplay(const std::vector<torch::Tensor>* layers)
    : prev_(routing_replay), prev_next_(routing_replay_next) {
  routing_replay = layers;
  routing_replay_next = 0;
}
ScopedRoutingReplay::~ScopedRoutingReplay() {
  routing_replay = prev_;
  routing_replay_next = prev_next_;
}

namespace {

// Router logits [T, E] in fp32, in every process: an fp32 GEMM of x and the gate weight, each
// taken to fp32 (exact from bf16), outside autocast. The learner keeps the gate in fp32
// (lm/model/precision.h) and so always computed this; the rollout and teacher serve the bf16
// rounding of the same gate and used to compute it in bf16, whose rounded logits flip near-ties
// in the top-k. With the gate's values the same (the served bf16 gate, or a learner gate holding
// bf16-representable values, as loaded from a bf16 checkpoint) and x the same, both sides now
// run one fp32 GEMM on equal operands: the same logits and the same experts. An fp32 model is
// unchanged (both casts are no-ops). The gate is E x H, so its fp32 copy is cheap.
torch::Tensor RouterLogits(const torch::Tensor& x, const torch::Tensor& gate_weight) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // Batch-invariant: a token's logits, hence its experts, whatever else is in the batch.
  if (BatchInvariant() && x.is_cpu())
    return InvariantMatmulWeightT(x.to(torch::kFloat32), gate_weight.to(torch::kFloat32));
  return torch::linear(x.to(torch::kFloat32), gate_weight.to(torch::kFloat32));
}

}  // namespace

namespace {

bool RouterNeedsGrad(const torch::Tensor& logits) {
  return torch::GradMode::is_enabled() && logits.requires_grad();
}

// The experts the router picks on its own from fp32 logits [T, E], exactly as Route picks them:
// without autograd the device's fused top-k where it has one, else softmax + topk. (Where logits
// tie, or round to equal probabilities, the two can differ: a recorded or replayed "own" pick
// must be the one Route makes.)
torch::Tensor OwnTopK(const torch::Tensor& logits, int64_t top_k) {
  const auto route_topk = FastPathsFor(logits.device().type()).route_topk;
  torch::Tensor w, ids;
  if (route_topk && !RouterNeedsGrad(logits) && route_topk(logits, top_k, false, &w, &ids))
    return ids;
  return std::get<1>(torch::softmax(logits.detach(), -1, torch::kFloat32).topk(top_k, -1));
}

}  // namespace

Routing RouteForced(const torch::Tensor& x, const torch::Tensor& gate_weight,
                    const torch::Tensor& ids, bool norm_topk_prob) {
  Routing r;
  r.logits = RouterLogits(x, gate_weight);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0),
              "routing replay: forced expert ids must be [tokens=", x.size(0), ", top_k], got ",
              ids.sizes());
  r.ids = ids.to(r.logits.device(), torch::kInt64);
  const int64_t E = r.logits.size(-1);
  TORCH_CHECK(
      ids.numel() == 0 || (r.ids.min().item<int64_t>() >= -1 && r.ids.max().item<int64_t>() < E),
      "routing replay: forced expert ids outside [-1, ", E, ")");
  // A row with a negative id takes the router's own top-k (a position not replayed).
  const auto own_row = (r.ids < 0).any(-1, /*keepdim=*/true);
  const bool own = own_row.any().item<bool>();
  // Without autograd, the device's fused router where it has one: its top-k for the rows not
  // replayed and its softmax at the given ids, so that replaying a row's own routing gives
  // Route's weights bit for bit.
  if (own) r.ids = torch::where(own_row, OwnTopK(r.logits, ids.size(1)), r.ids);
  const auto route_weights = FastPathsFor(r.logits.device().type()).route_weights;
  torch::Tensor w;
  if (route_weights && !RouterNeedsGrad(r.logits) &&
      route_weights(r.logits, r.ids, norm_topk_prob, &w)) {
    r.weights = w.to(x.scalar_type());
    return r;
  }
  auto p = torch::softmax(r.logits, -1, torch::kFloat32).gather(1, r.ids);
  if (norm_topk_prob) p = p / p.sum(-1, /*keepdim=*/true);
  r.weights = p.to(x.scalar_type());
  return r;
}

Routing Route(const torch::Tensor& x, const torch::Tensor& gate_weight, int64_t top_k,
              bool norm_topk_prob) {
  Routing r;
  r.logits = RouterLogits(x, gate_weight);  // fp32: the top-k never sees bf16-rounded logits
  // Without autograd (sampling, scoring) a device's fused softmax + top-k where it has one.
  const auto route_topk = FastPathsFor(r.logits.device().type()).route_topk;
  if (route_topk && !RouterNeedsGrad(r.logits) &&
      route_topk(r.logits, top_k, norm_topk_prob, &r.weights, &r.ids)) {
    r.weights = r.weights.to(x.scalar_type());
    return r;
  }
  auto probs = torch::softmax(r.logits, -1, torch::kFloat32);
  auto [top_p, top_i] = probs.topk(top_k, -1);
  if (norm_topk_prob) top_p = top_p / top_p.sum(-1, /*keepdim=*/true);
  r.weights = top_p.to(x.scalar_type());
  r.ids = top_i;
  return r;
}

torch::Tensor MoeExpertsCpu(const torch::Tensor& x, const torch::Tensor& ids,
                            const torch::Tensor& weights, const torch::Tensor& gate_up,
                            const torch::Tensor& down) {
  const int64_t T = x.size(0), k = ids.size(1), E = gate_up.size(0);
  auto flat_ids = ids.reshape({-1});
  // Stable sort of the T*k (token, slot) pairs by expert: deterministic row order per expert.
  auto order = std::get<1>(flat_ids.sort(/*stable=*/true, 0, false));
  auto counts = torch::bincount(flat_ids, /*weights=*/{}, E).cpu();
  std::vector<int64_t> offsets(E + 1, 0);
  auto* c = counts.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + c[e];

  auto token_of = torch::div(order, k, "floor");
  // bf16 weights with fp32 activations (bf16-mixed training): the expert MLPs run in the weights'
  // dtype (the matmuls accumulate in fp32), the weighted sum over the k experts in x's dtype.
  const auto compute = gate_up.scalar_type();
  auto y = GroupedSwiGlu::apply(x.index_select(0, token_of).to(compute), offsets, gate_up,
                                down.to(compute));
  y = y.to(x.scalar_type()) *
      weights.reshape({-1}).index_select(0, order).unsqueeze(1).to(x.scalar_type());
  return torch::zeros({T, x.size(1)}, x.options()).index_add(0, token_of, y);
}

namespace {

bool NeedsGrad(std::initializer_list<const torch::Tensor*> ts) {
  if (!torch::GradMode::is_enabled()) return false;
  return std::any_of(ts.begin(), ts.end(),
                     [](const torch::Tensor* t) { return t->requires_grad(); });
}

}  // namespace

torch::Tensor MoeExperts(const torch::Tensor& x, const torch::Tensor& ids,
                         const torch::Tensor& weights, const torch::Tensor& gate_up,
                         const torch::Tensor& down) {
  const auto fast = FastPathsFor(x.device().type()).moe_experts;
  if (fast) {
    torch::Tensor y = fast(x, ids, weights, gate_up, down);
    if (y.defined()) return y;  // undefined: inputs it does not handle (gradients among them)
  }
  // Training on a device: the device's forward kernel (or grouped GEMMs) and the grouped-GEMM
  // backward, with no host sync. The CPU keeps the per-expert path, which saves its activations
  // instead of recomputing them.
  if (!x.device().is_cpu() && GroupedGemmsFit(x, down) &&
      NeedsGrad({&x, &weights, &gate_up, &down})) {
    return MoeExpertsGrouped(x, ids, weights, gate_up, down, fast);
  }
  return MoeExpertsCpu(x, ids, weights, gate_up, down);
}

RouterImpl::RouterImpl(int64_t num_experts, int64_t hidden) {
  weight = register_parameter("weight", torch::empty({num_experts, hidden}));
}

torch::Tensor RouterImpl::Fp32Weight() const {
  // Inference tensors carry no version counter: nothing would tell a stale copy, so they are
  // converted per call as before.
  if (weight.scalar_type() == torch::kFloat32 || weight.is_inference() ||
      (torch::GradMode::is_enabled() && weight.requires_grad()))
    return weight;
  std::lock_guard<std::mutex> lock(fp32_mu_);
  const int64_t version = weight._version();
  const void* source = weight.data_ptr();
  if (fp32_.defined() && fp32_version_ == version && fp32_source_ == source &&
      fp32_.device() == weight.device() && fp32_.sizes() == weight.sizes())
    return fp32_;
  torch::NoGradGuard no_grad;
  if (fp32_.defined() && fp32_.device() == weight.device() && fp32_.sizes() == weight.sizes()) {
    fp32_.copy_(weight);
  } else {
    fp32_ = weight.detach().to(torch::kFloat32).contiguous();
  }
  fp32_version_ = version;
  fp32_source_ = source;
  return fp32_;
}

ExpertsImpl::ExpertsImpl(int64_t num_experts, int64_t hidden, int64_t intermediate) {
  gate_up_proj =
      register_parameter("gate_up_proj", torch::empty({num_experts, 2 * intermediate, hidden}));
  down_proj = register_parameter("down_proj", torch::empty({num_experts, hidden, intermediate}));
}

torch::Tensor RunExperts(const torch::Tensor& x, const Routing& r, const ExpertsImpl& experts) {
  if (experts.ep) return ExpertParallelExperts(*experts.ep, x, r, experts);
  if (HoldsFp8(experts)) return Fp8MoeExperts(x, r.ids, r.weights, experts);
  return MoeExperts(x, r.ids, r.weights, experts.gate_up_proj, experts.down_proj);
}

SparseMoeBlockImpl::SparseMoeBlockImpl(int64_t hidden, int64_t num_experts, int64_t intermediate,
                                       int64_t top_k, bool norm_topk_prob, int64_t local_experts)
    : top_k(top_k), norm_topk_prob(norm_topk_prob) {
  gate = register_module("gate", Router(num_experts, hidden));
  experts = register_module(
      "experts", Experts(local_experts > 0 ? local_experts : num_experts, hidden, intermediate));
}

torch::Tensor SparseMoeBlockImpl::forward(const torch::Tensor& x, torch::Tensor* router_logits,
                                          const torch::Tensor& forced) {
  torch::Tensor forced_ids = forced;
  if (!forced_ids.defined() && routing_replay) {
    TORCH_CHECK(routing_replay_next < routing_replay->size(),
                "routing replay: ", routing_replay->size(),
                " MoE layers given, a forward ran more");
    forced_ids = (*routing_replay)[routing_replay_next++];
  }
  const torch::Tensor gate_weight = gate->Fp32Weight();
  Routing r = forced_ids.defined() ? RouteForced(x, gate_weight, forced_ids, norm_topk_prob)
                                   : Route(x, gate_weight, top_k, norm_topk_prob);
  if (routing_recorder) {
    if (forced_ids.defined()) {  // what the router would have picked on its own
      routing_recorder->push_back(OwnTopK(r.logits, top_k));
    } else {
      routing_recorder->push_back(r.ids.detach().to(torch::kInt64));
    }
  }
  if (router_logits) *router_logits = r.logits;
  return RunExperts(x, r, *experts);
}

torch::Tensor LoadBalancingLoss(const std::vector<torch::Tensor>& router_logits,
                                int64_t num_experts, int64_t top_k) {
  if (router_logits.empty()) return torch::zeros({});
  auto opts = router_logits[0].options().dtype(torch::kFloat32);
  auto picks = torch::zeros({num_experts}, opts);
  auto prob_sum = torch::zeros({num_experts}, opts);
  int64_t rows = 0;
  for (const auto& logits : router_logits) {
    auto p = torch::softmax(logits.to(torch::kFloat32), -1);
    auto ids = std::get<1>(p.topk(top_k, -1));
    picks = picks + torch::bincount(ids.reshape({-1}), {}, num_experts).to(torch::kFloat32);
    prob_sum = prob_sum + p.sum(0);
    rows += logits.size(0);
  }
  return (picks / rows * (prob_sum / rows)).sum() * num_experts;
}

}  // namespace lm
