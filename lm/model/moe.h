// The sparse mixture-of-experts block and the one interface its experts computation goes through.
//
//   router:  p = softmax(x Wg^T) in fp32, top-k of p, renormalised when norm_topk_prob
//   experts: y = sum_k w_k * down_k(silu(gate_k(x)) * up_k(x))
//
// The reference path (MoeExpertsCpu) sorts the (token, slot) pairs by expert and runs one matmul
// pair per expert that received tokens; experts that received none cost nothing. Device fast paths
// (kernels/cpu for CPU inference, kernels/cuda for CUDA tensors) register themselves
// (lm/model/fast_paths.h) and are taken where they apply.
#pragma once

#include <memory>
#include <mutex>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace lm {

struct ExpertParallel;

struct Routing {
  torch::Tensor logits;   // [T, E] router logits (fp32 on CPU; the aux loss reads them)
  torch::Tensor weights;  // [T, k] routing weights, in x's dtype
  torch::Tensor ids;      // [T, k] int64 expert ids
};

// Router: softmax over E experts in fp32, top-k, optional renormalisation.
Routing Route(const torch::Tensor& x, const torch::Tensor& gate_weight, int64_t top_k,
              bool norm_topk_prob);

// Routing replay (R3): the experts are given (`ids` [T, k], any integer dtype), the weights are
// the router's own fp32 softmax at those ids, renormalised over them when norm_topk_prob. A row
// holding a negative id (-1) is not replayed: it takes the router's own top-k.
Routing RouteForced(const torch::Tensor& x, const torch::Tensor& gate_weight,
                    const torch::Tensor& ids, bool norm_topk_prob);

// Records routing on this thread while alive: every SparseMoeBlock forward appends the top-k ids
// [T, k] (int64) its router picked on its own (under replay: what it would have picked, not the
// replayed ids), in call order (one entry per MoE layer per forward). Not nestable.
class ScopedRoutingRecorder {
 public:
  explicit ScopedRoutingRecorder(std::vector<torch::Tensor>* out);
  ~ScopedRoutingRecorder();
  ScopedRoutingRecorder(const ScopedRoutingRecorder&) = delete;
  ScopedRoutingRecorder& operator=(const ScopedRoutingRecorder&) = delete;

 private:
  std::vector<torch::Tensor>* prev_;
};

// Routing replay for forwards that take no ForwardOptions (the rollout engine's recompute of a
// preempted sequence through PagedForward): while alive, the n-th SparseMoeBlock forward on this
// thread routes through (*layers)[n] ([T, k]; rows holding -1 take their own top-k), as
// RouteForced. Inference only (a recomputed backward would not see it). Not nestable.
class ScopedRoutingReplay {
 public:
  explicit ScopedRoutingReplay(const std::vector<torch::Tensor>* layers);
  ~ScopedRoutingReplay();
  ScopedRoutingReplay(const ScopedRoutingReplay&) = delete;
  ScopedRoutingReplay& operator=(const ScopedRoutingReplay&) = delete;

 private:
  const std::vector<torch::Tensor>* prev_;
  size_t prev_next_;
};

// Experts computation: x [T, H], ids/weights [T, k], gate_up [E, 2I, H] (gate rows first),
// down [E, H, I] -> [T, H]. Differentiable w.r.t. x, weights, gate_up and down.
torch::Tensor MoeExperts(const torch::Tensor& x, const torch::Tensor& ids,
                         const torch::Tensor& weights, const torch::Tensor& gate_up,
                         const torch::Tensor& down);

// The reference path on any device (also what tests compare the fast paths against).
torch::Tensor MoeExpertsCpu(const torch::Tensor& x, const torch::Tensor& ids,
                            const torch::Tensor& weights, const torch::Tensor& gate_up,
                            const torch::Tensor& down);

// Router parameters: `weight` [E, H] (checkpoint name `mlp.gate.weight`).
class RouterImpl : public torch::nn::Module {
 public:
  RouterImpl(int64_t num_experts, int64_t hidden);
  // The gate in fp32, what Route and RouteForced multiply with: `weight` itself when it is fp32
  // or needs a gradient here (the cast then stays under autograd); otherwise (a bf16 gate served
  // for inference) an fp32 copy converted once and again only when `weight` changes (its
  // version counter, storage or device: a load, a weight update's in-place copy, a move). A
  // changed weight of the same shape is converted into the same copy, in place, so that a
  // captured CUDA graph reads the new values once this has run after the update.
  torch::Tensor Fp32Weight() const;

  torch::Tensor weight;

 private:
  mutable std::mutex fp32_mu_;  // forwards on several threads may share one model
  mutable torch::Tensor fp32_;
  mutable int64_t fp32_version_ = -1;
  mutable const void* fp32_source_ = nullptr;
};
TORCH_MODULE(Router);

// Expert parameters in the fused layout (`mlp.experts.gate_up_proj` [E, 2I, H],
// `mlp.experts.down_proj` [E, H, I]); checkpoints with per-expert tensors are fused at load.
class ExpertsImpl : public torch::nn::Module {
 public:
  ExpertsImpl(int64_t num_experts, int64_t hidden, int64_t intermediate);
  torch::Tensor gate_up_proj, down_proj;
  // FP8 weights only (lm/model/fp8.h): the buffers of their block scales.
  torch::Tensor gate_up_proj_scale_inv, down_proj_scale_inv;
  // Set under expert parallelism (lm/model/expert_parallel.h): the tensors hold only this
  // process's range of experts, and the layer's output is summed over the group.
  std::shared_ptr<const ExpertParallel> ep;
};
TORCH_MODULE(Experts);

// The experts' output for routing `r`: MoeExperts over `experts`' tensors, or under expert
// parallelism the local experts' share summed over the group.
torch::Tensor RunExperts(const torch::Tensor& x, const Routing& r, const ExpertsImpl& experts);

class SparseMoeBlockImpl : public torch::nn::Module {
 public:
  // `local_experts` > 0: the experts tensors hold only that many (expert parallelism).
  SparseMoeBlockImpl(int64_t hidden, int64_t num_experts, int64_t intermediate, int64_t top_k,
                     bool norm_topk_prob, int64_t local_experts = 0);
  // x [T, H] -> [T, H]; the router logits go to `router_logits` when given (aux loss).
  // `forced_ids` [T, top_k] when defined: routing replay (RouteForced) instead of the top-k.
  torch::Tensor forward(const torch::Tensor& x, torch::Tensor* router_logits = nullptr,
                        const torch::Tensor& forced_ids = {});

  Router gate{nullptr};
  Experts experts{nullptr};
  int64_t top_k;
  bool norm_topk_prob;
};
TORCH_MODULE(SparseMoeBlock);

// Switch-Transformer load-balancing loss over all MoE layers, as transformers computes it: with
// R = rows over all layers, f_e = (#top-k picks of e) / R and P_e = (sum of p_e) / R,
// L = E * sum_e f_e * P_e. Gradient flows through P only.
torch::Tensor LoadBalancingLoss(const std::vector<torch::Tensor>& router_logits,
                                int64_t num_experts, int64_t top_k);

}  // namespace lm
