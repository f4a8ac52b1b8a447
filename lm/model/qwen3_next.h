// Qwen3-Next: the stage-2 teacher (Qwen3-Next-80B-A3B). Three of every four layers mix tokens with
// a Gated DeltaNet (linear attention with a matrix-valued state), the fourth with gated full
// attention; every layer's MLP is a sparse MoE plus a gated shared expert.
//
//   h = embed(ids)
//   per layer (layer_types):
//     h += Mixer(input_layernorm(h))          GatedDeltaNet or gated attention
//     h += Mlp(post_attention_layernorm(h))   MoE + shared expert, or a dense SwiGLU MLP
//   logits = lm_head(norm(h))
//
// Zero-centred RMSNorm (all norms but the gated one), in fp32:
//   y = x * rsqrt(mean(x^2) + eps) * (1 + w)
//
// Gated attention, x [T, H]:
//   [q | gate] = q_proj(x) split per head     q, gate [T, Hq, D]
//   k = k_proj(x), v = v_proj(x)              [T, Hkv, D]
//   q, k = RoPE(q_norm(q)), RoPE(k_norm(k))   RoPE on the first D * partial_rotary_factor dims
//   out  = o_proj(CausalAttention(q, k, v) * sigmoid(gate))
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
// MoE:  y = sum_k p_k Expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)
//       (router as Qwen3-MoE: softmax in fp32, top-k, renormalised when norm_topk_prob)
//
// The delta rule runs chunked for prefill (see GatedDeltaRuleChunked); the per-token recurrence is
// kept as the reference. On CPU without gradients (scoring) the layer takes the same algebra as
// one task per document and head (GatedDeltaRuleInferenceCpu, kernels/cpu/cpu_inference.h).
//
// Incremental decoding (a rollout student): the KVCache holds per slot the full-attention layers'
// keys/values (KVCache::k, v, one entry per full-attention layer in layer order) and each Gated
// DeltaNet layer's fixed-size state (KVCache::conv, recurrent, one entry per linear-attention
// layer): the conv's last K-1 inputs and the delta rule's S [Hv, dk, dv] in fp32. A prefill
// (Forward with opts.cache) computes them chunked, as the forward does; Decode advances them one
// token, as transformers' causal_conv1d_update and torch_recurrent_gated_delta_rule do.
//
// The paged cache of the rollout engine (lm/model/paged_kv.h): the full-attention layers' keys and
// values live in the block pools (PagedKVCache::k, v per full-attention layer), each Gated DeltaNet
// layer's state in the engine's state slots (PagedKVCache::state[2j] the conv window
// [slots, K-1, C], state[2j + 1] the delta-rule state [slots, Hv, dk, dv] fp32, for the j-th
// linear-attention layer). A sequence with no context is a prefill (chunked, its slot overwritten);
// one new token after a context is a decode step from its slot.
//
// Member names are the checkpoint's names (model.layers.N.linear_attn.in_proj_qkvz.weight, ...);
// `mtp.*` tensors of published checkpoints are skipped by LoadModel.
#pragma once

#include <torch/nn/modules/container/modulelist.h>

#include "lm/model/layers.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"

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
// chunked over their own packed rows, the decodes one token each from their state slots.
struct Qwen3NextPagedPlan {
  torch::Tensor prefill_rows, prefill_slots;  // [Tp] rows of the step, [Bp] state slots
  DeltaRuleLayout prefill_layout;             // over the prefill rows alone
  torch::Tensor decode_rows, decode_slots;    // [Bd] each
  bool all_prefill = false;                   // the prefill rows are the whole step, in order
  int64_t prefills = 0, decodes = 0;
  static Qwen3NextPagedPlan Make(const PagedStep& step, torch::Device device);
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
// after its last token, [B, H, dk, dv] (a decode cache's prefill).
torch::Tensor GatedDeltaRuleChunked(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& g,
                                    const torch::Tensor& beta, const DeltaRuleLayout& layout,
                                    torch::Tensor* final_state = nullptr);

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
  // norm(o) * silu(z), out_proj: o [N, Hv, dv] fp32 -> [N, H]
  torch::Tensor Output(const torch::Tensor& o, const Mixed& m, torch::ScalarType dtype);

  int64_t num_k_heads_, num_v_heads_, head_k_dim_, head_v_dim_;
};
TORCH_MODULE(Qwen3NextGatedDeltaNet);

class Qwen3NextAttentionImpl : public torch::nn::Module {
 public:
  explicit Qwen3NextAttentionImpl(const ModelConfig& c);
  // x [T, H]; rope tables [T, rotary_dim] -> [T, H]. Fills the caches (slot b = document b, from
  // position 0) when given.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<int64_t>& cu_seqlens, torch::Tensor* k_cache = nullptr,
                        torch::Tensor* v_cache = nullptr);
  // One decode step: x [B, H] at positions lengths[b] (rope tables of those), appended to the
  // caches [B, capacity, Hkv, D]; attends to the slot's lengths[b] + 1 positions.
  torch::Tensor decode(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                       torch::Tensor& k_cache, torch::Tensor& v_cache,
                       const std::vector<int64_t>& lengths);
  // A paged step (lm/model/paged_kv.h): x [T, H] the new tokens, written into the pools, then
  // attending through the block tables.
  torch::Tensor paged(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                      torch::Tensor& k_pool, torch::Tensor& v_pool, const PagedAttentionMeta& meta);

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};

 private:
  struct Projected {
    torch::Tensor q, gate, k, v;  // [N, Hq, D] x 2, [N, Hkv, D] x 2
  };
  Projected Project(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  torch::Tensor Output(const torch::Tensor& o, const torch::Tensor& gate);

  int64_t heads_, kv_heads_, head_dim_;
  Rope rope_;
};
TORCH_MODULE(Qwen3NextAttention);

class Qwen3NextSparseMoeBlockImpl : public torch::nn::Module {
 public:
  explicit Qwen3NextSparseMoeBlockImpl(const ModelConfig& c);
  // x [T, H] -> [T, H]; the router logits go to `router_logits` when given.
  torch::Tensor forward(const torch::Tensor& x, torch::Tensor* router_logits = nullptr);

  Router gate{nullptr};
  Experts experts{nullptr};
  DenseMlp shared_expert{nullptr};
  Linear shared_expert_gate{nullptr};  // [1, H]

 private:
  int64_t top_k_;
  bool norm_topk_prob_;
};
TORCH_MODULE(Qwen3NextSparseMoeBlock);

// What every layer of one forward shares.
struct Qwen3NextStep {
  torch::Tensor cos, sin;  // RoPE tables [T, rotary_dim]
  const std::vector<int64_t>* cu_seqlens;
  const DeltaRuleLayout* layout;
  std::vector<torch::Tensor>* router_logits;  // may be null
  KVCache* cache = nullptr;                   // a prefill's cache, or null
};

class Qwen3NextDecoderLayerImpl : public torch::nn::Module {
 public:
  Qwen3NextDecoderLayerImpl(const ModelConfig& c, int64_t layer);
  torch::Tensor forward(const torch::Tensor& h, const Qwen3NextStep& step);
  // One decode step: h [B, H] at positions cache.lengths (rope tables of those).
  torch::Tensor decode(const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin,
                       KVCache& cache);
  // A paged step: h [T, H] the step's new tokens (rope tables of their positions).
  torch::Tensor paged(const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin,
                      PagedKVCache& cache, const PagedAttentionMeta& meta,
                      const Qwen3NextPagedPlan& plan);

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Qwen3NextGatedDeltaNet linear_attn{nullptr};  // linear_attention layers
  Qwen3NextAttention self_attn{nullptr};        // full_attention layers
  Qwen3NextSparseMoeBlock moe{nullptr};         // registered as "mlp" when a MoE layer
  DenseMlp dense{nullptr};                      // registered as "mlp" otherwise

 private:
  torch::Tensor Mlp(const torch::Tensor& x, std::vector<torch::Tensor>* router_logits);
  // This layer's entry in KVCache::k/v (full attention) or KVCache::conv/recurrent (linear).
  int64_t cache_index_ = 0;
};
TORCH_MODULE(Qwen3NextDecoderLayer);

class Qwen3NextModelImpl : public torch::nn::Module {
 public:
  explicit Qwen3NextModelImpl(const ModelConfig& c);
  Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(Qwen3NextModel);

class Qwen3NextForCausalLM : public CausalLM {
 public:
  explicit Qwen3NextForCausalLM(ModelConfig c);

  // Forward over a packed batch; with `opts.cache` (a prefill) document b's keys/values and
  // recurrent state go to slot b, every document starting at position 0.
  torch::Tensor Forward(const PackedBatch& batch, const ForwardOptions& opts = {}) override;
  torch::Tensor Decode(const torch::Tensor& tokens, KVCache& cache) override;
  KVCache NewKVCache(int64_t batch, int64_t capacity) const override;
  bool SupportsPagedKV() const override { return true; }
  PagedCacheSpec PagedSpec() const override;
  PagedKVCache NewPagedKVCache(int64_t num_blocks, int64_t block_size,
                               int64_t num_state_slots) const override;
  torch::Tensor PagedForward(const PagedStep& step, PagedKVCache& cache) override;

  Qwen3NextModel model{nullptr};

 private:
  Rope rope_;
};

}  // namespace lm
