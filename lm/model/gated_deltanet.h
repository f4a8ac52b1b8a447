// Gated DeltaNet, Qwen3-Next's linear-attention mixer (the checkpoint's linear_attn.*, used by
// lm/model/qwen3_next.h in three of every four layers): the gated delta rule (the per-token
// reference, the chunked prefill and the one-token decode step), the packed batch's chunk layout,
// the causal conv, the gated RMSNorm, and the layer with its decode state.
//
// Gated DeltaNet, x [T, H]; Hk key heads of dim dk, Hv = r * Hk value heads of dim dv (value
// head j of key head i is head i * r + j):
//   in_proj_qkvz(x), per key head:  [q (dk) | k (dk) | v (r dv) | z (r dv)]
//   in_proj_ba(x), per key head:    [b (r) | a (r)]
//   [q | k | v] = silu(conv1d(q | k | v))      causal depthwise conv over time, kernel K, per
//                                              document
//   q = l2norm(q) / sqrt(dk), k = l2norm(k)    each key head serves its r value heads
//   beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)    [T, Hv], g <= 0
//   per value head a state S [dk, dv], zero at every document start (fp32), the delta rule:
//     S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
//   out = out_proj(norm(o) * silu(z))          norm: plain RMSNorm over dv, weight w (not 1 + w)
//
// The delta rule runs chunked for prefill (see GatedDeltaRuleChunked); the per-token recurrence is
// kept as the reference. On CPU without gradients (scoring) the layer takes the same algebra as
// one task per document and head (GatedDeltaRuleInferenceCpu, kernels/cpu/cpu_inference.h).
//
// Decode state (KVCache::conv, recurrent; PagedKVCache::state): the conv's last K-1 inputs and the
// delta rule's S [Hv, dk, dv] in fp32, per linear-attention layer (see lm/model/qwen3_next.h).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "lm/model/layers.h"
#include "lm/model/model.h"

namespace lm {

// ---- the gated delta rule ----

// Where each token of a packed batch sits for the linear-attention layers, computed once per
// forward. Documents are cut into chunks of `chunk` tokens (the last one zero-padded). Chunks are
// stored step-major, documents in decreasing chunk count: scan step s (every document's s-th
// chunk) is then the contiguous block [step_offsets[s], step_offsets[s+1]) and its documents are
// the first n_s of the previous step's, so the state batch only ever shrinks from the end.
struct DeltaRuleLayout {
  int64_t chunk = 64;
  torch::Tensor doc_pos;              // [T] int64: index of each token within its document
  torch::Tensor gather;               // [N * chunk] int64: token of each chunk slot (T = padding)
  torch::Tensor scatter;              // [T] int64: chunk slot of each token
  std::vector<int64_t> step_offsets;  // [steps + 1] first chunk of each scan step
  std::vector<int64_t> cu_seqlens;    // [B + 1] the documents it was made for
  std::vector<int64_t> order;         // [B] the documents by decreasing chunk count (scan rows)

  int64_t num_chunks() const { return step_offsets.empty() ? 0 : step_offsets.back(); }
  static DeltaRuleLayout Make(const std::vector<int64_t>& cu_seqlens, torch::Device device,
                              int64_t chunk = 64);
};

// A paged step's sequences as the linear-attention layers take them: the prefills (no context)
// chunked over their own packed rows, the decodes one token each from their state slots, and the
// continued chunks (several new tokens after a context: a long prompt's or a recompute's later
// chunks) from their state slots: the conv over each one's window (the slot's last K-1 inputs)
// followed by its chunk, the chunked rule from the slot's state.
struct Qwen3NextPagedPlan {
  torch::Tensor prefill_rows, prefill_slots;    // [Tp] rows of the step, [Bp] state slots
  DeltaRuleLayout prefill_layout;               // over the prefill rows alone
  torch::Tensor decode_rows, decode_slots;      // [Bd] each
  torch::Tensor continue_rows, continue_slots;  // [Tc] rows of the step, [Bc] state slots
  DeltaRuleLayout continue_layout;              // over the continued rows alone
  // The conv's input of the continued sequences, [window | chunk] each: rows of
  // cat(windows [Bc * (K-1)], continued rows [Tc]) (window_gather), their boundaries
  // (window_cu, [Bc + 1]) and positions (window_pos), and where the chunk rows sit among them
  // (window_keep, [Tc]).
  torch::Tensor window_gather, window_pos, window_keep;
  std::vector<int64_t> window_cu;
  bool all_prefill = false;  // the prefill rows are the whole step, in order
  int64_t prefills = 0, decodes = 0, continues = 0;
  static Qwen3NextPagedPlan Make(const PagedStep& step, int64_t conv_kernel, torch::Device device);
};

// Both forms take fp32 q, k [T, H, dk] (already L2-normalised, q scaled by dk^-1/2, one key head
// per value head), v [T, H, dv], g and beta [T, H], and return o [T, H, dv]; the state starts at
// zero at every document start. Both are differentiable.
//
// Per-token recurrence, the reference (one step per token).
torch::Tensor GatedDeltaRuleRecurrent(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& g,
                                      const torch::Tensor& beta,
                                      const std::vector<int64_t>& cu_seqlens);

// Chunked (WY / UT-transform) form, one step per chunk of C tokens. Within a chunk, with
// G_i = g_1 + ... + g_i, D_ij = exp(G_i - G_j) for j <= i (else 0) and S the state at the chunk's
// start:
//   (I + strict_lower((beta K) K^T * D)) [U | W] = [beta V | beta exp(G) K]   (UT transform)
//   V' = U - W S                       (what each token writes, less what S already predicts)
//   O  = (exp(G) Q) S + ((Q K^T) * D) V'
//   S  = exp(G_C) S + (exp(G_C - G) K)^T V'
// All chunks of all documents solve their triangular systems in one batch; the scan over chunk
// steps runs every document at once. `final_state`, when given, receives each document's state
// after its last token, [B, H, dk, dv] (a decode cache's prefill). `initial_state`, when given,
// [B, H, dk, dv] fp32, is each document's state before its first token instead of zero (a chunk
// continuing a sequence whose earlier tokens ran before).
torch::Tensor GatedDeltaRuleChunked(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& g,
                                    const torch::Tensor& beta, const DeltaRuleLayout& layout,
                                    torch::Tensor* final_state = nullptr,
                                    const torch::Tensor* initial_state = nullptr);

// One decode step of B sequences, transformers' torch_recurrent_gated_delta_rule for one token:
// q, k [B, Hk, dk] (normalised as above; value head h reads key head h / (Hv / Hk)), v [B, Hv, dv],
// g, beta [B, Hv], fp32; `state` [B, Hv, dk, dv] fp32 is advanced in place. Returns o [B, Hv, dv].
torch::Tensor GatedDeltaRuleStep(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& g,
                                 const torch::Tensor& beta, torch::Tensor& state);

// ---- modules ----

// Causal depthwise conv over time, `weight` [C, 1, K] (checkpoint `conv1d.weight`, no bias):
// y_t = sum_i w[:, i] x_{t-K+1+i}, where x of an earlier document counts as zero.
class CausalConv1dImpl : public torch::nn::Module {
 public:
  CausalConv1dImpl(int64_t channels, int64_t kernel);
  // x [T, C], doc_pos [T] -> [T, C]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& doc_pos);
  // One decode step: x [B, C] after the K-1 inputs in `state` [B, K-1, C], which moves on by x.
  torch::Tensor step(const torch::Tensor& x, torch::Tensor& state);
  // The decode state after a prefill: each document's last K-1 inputs [B, K-1, C], zeros before a
  // document's start (as the forward reads them).
  torch::Tensor LastInputs(const torch::Tensor& x, const std::vector<int64_t>& cu_seqlens) const;
  torch::Tensor weight;
};
TORCH_MODULE(CausalConv1d);

// Gated RMSNorm: (w * rmsnorm(x)) * silu(gate), normalised in fp32; `weight` [dim] (starts at 1).
class RMSNormGatedImpl : public torch::nn::Module {
 public:
  RMSNormGatedImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& gate);
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNormGated);

class Qwen3NextGatedDeltaNetImpl : public torch::nn::Module {
 public:
  explicit Qwen3NextGatedDeltaNetImpl(const ModelConfig& c);
  // x [T, H] -> [T, H]. With `conv_state` and `recurrent_state` (a prefill into a cache, every
  // document from its start), each document's final states go to row b of them.
  torch::Tensor forward(const torch::Tensor& x, const DeltaRuleLayout& layout,
                        torch::Tensor* conv_state = nullptr,
                        torch::Tensor* recurrent_state = nullptr);
  // One decode step: x [B, H] -> [B, H], advancing conv_state [B, K-1, C] and recurrent_state
  // [B, Hv, dk, dv] in place.
  torch::Tensor decode(const torch::Tensor& x, torch::Tensor& conv_state,
                       torch::Tensor& recurrent_state);
  // A paged step: x [T, H]; conv_slots [slots, K-1, C] and recurrent_slots [slots, Hv, dk, dv]
  // hold every sequence's state (see Qwen3NextPagedPlan), read and written in place.
  torch::Tensor paged(const torch::Tensor& x, torch::Tensor& conv_slots,
                      torch::Tensor& recurrent_slots, const Qwen3NextPagedPlan& plan);

  Linear in_proj_qkvz{nullptr}, in_proj_ba{nullptr}, out_proj{nullptr};
  CausalConv1d conv1d{nullptr};
  RMSNormGated norm{nullptr};
  torch::Tensor A_log, dt_bias;  // [Hv]

 private:
  struct Mixed {
    torch::Tensor qkv, z, b, a;  // conv input [N, C], z [N, Hv, dv], b and a [N, Hv]
  };
  Mixed Project(const torch::Tensor& x);
  // The rule's inputs from the conv output qkv [N, C]: fp32 q, k (normalised) [N, Hk, dk], v
  // [N, Hv, dv], g and beta [N, Hv].
  struct RuleInputs {
    torch::Tensor q, k, v, g, beta;
  };
  RuleInputs Prepare(const torch::Tensor& qkv, const Mixed& m);
  // The continued chunks of a paged step (x [Tc, H], the plan's continue_rows), advancing their
  // slots' conv windows and states in place.
  torch::Tensor Continue(const torch::Tensor& x, torch::Tensor& conv_slots,
                         torch::Tensor& recurrent_slots, const Qwen3NextPagedPlan& plan);
  // norm(o) * silu(z), out_proj: o [N, Hv, dv] fp32 -> [N, H]
  torch::Tensor Output(const torch::Tensor& o, const Mixed& m, torch::ScalarType dtype);

  int64_t num_k_heads_, num_v_heads_, head_k_dim_, head_v_dim_;
};
TORCH_MODULE(Qwen3NextGatedDeltaNet);

}  // namespace lm
