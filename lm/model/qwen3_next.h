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
// one task per document and head (GatedDeltaRuleInferenceCpu, lm/model/cpu_inference.h). This
// teacher only scores: there is no KV-cache decode.
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

  int64_t num_chunks() const { return step_offsets.empty() ? 0 : step_offsets.back(); }
  static DeltaRuleLayout Make(const std::vector<int64_t>& cu_seqlens, torch::Device device,
                              int64_t chunk = 64);
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
// steps runs every document at once.
torch::Tensor GatedDeltaRuleChunked(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& g,
                                    const torch::Tensor& beta, const DeltaRuleLayout& layout);

// ---- modules ----

// Causal depthwise conv over time, `weight` [C, 1, K] (checkpoint `conv1d.weight`, no bias):
// y_t = sum_i w[:, i] x_{t-K+1+i}, where x of an earlier document counts as zero.
class CausalConv1dImpl : public torch::nn::Module {
 public:
  CausalConv1dImpl(int64_t channels, int64_t kernel);
  // x [T, C], doc_pos [T] -> [T, C]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& doc_pos);
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
  // x [T, H] -> [T, H]
  torch::Tensor forward(const torch::Tensor& x, const DeltaRuleLayout& layout);

  Linear in_proj_qkvz{nullptr}, in_proj_ba{nullptr}, out_proj{nullptr};
  CausalConv1d conv1d{nullptr};
  RMSNormGated norm{nullptr};
  torch::Tensor A_log, dt_bias;  // [Hv]

 private:
  int64_t num_k_heads_, num_v_heads_, head_k_dim_, head_v_dim_;
};
TORCH_MODULE(Qwen3NextGatedDeltaNet);

class Qwen3NextAttentionImpl : public torch::nn::Module {
 public:
  explicit Qwen3NextAttentionImpl(const ModelConfig& c);
  // x [T, H]; rope tables [T, rotary_dim] -> [T, H]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<int64_t>& cu_seqlens);

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};

 private:
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
};

class Qwen3NextDecoderLayerImpl : public torch::nn::Module {
 public:
  Qwen3NextDecoderLayerImpl(const ModelConfig& c, int64_t layer);
  torch::Tensor forward(const torch::Tensor& h, const Qwen3NextStep& step);

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Qwen3NextGatedDeltaNet linear_attn{nullptr};  // linear_attention layers
  Qwen3NextAttention self_attn{nullptr};        // full_attention layers
  Qwen3NextSparseMoeBlock moe{nullptr};         // registered as "mlp" when a MoE layer
  DenseMlp dense{nullptr};                      // registered as "mlp" otherwise
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

  // Scoring prefill over a packed batch; `opts.cache` must be null (no decode for this teacher).
  torch::Tensor Forward(const PackedBatch& batch, const ForwardOptions& opts = {}) override;
  bool SupportsKVCache() const override { return false; }
  torch::Tensor Decode(const torch::Tensor& tokens, KVCache& cache) override;  // throws
  KVCache NewKVCache(int64_t batch, int64_t capacity) const override;          // throws
  torch::Tensor LmHeadWeight() override;
  std::vector<std::string> TiedAliases() const override;

  Qwen3NextModel model{nullptr};
  Linear lm_head{nullptr};  // null when tie_word_embeddings

 private:
  Rope rope_;
};

}  // namespace lm
