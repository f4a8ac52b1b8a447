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
// Gated DeltaNet: lm/model/gated_deltanet.h (its math, kernels and state).
//
// MoE:  y = sum_k p_k Expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)
//       (router as Qwen3-MoE: softmax in fp32, top-k, renormalised when norm_topk_prob)
//
// One forward (Run) computes this for every caller: Forward, Decode and PagedForward only build the
// AttentionContext (lm/model/attention_context.h) that holds the layers' keys/values and state:
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
// one new token after a context is a decode step from its slot; several after a context (a long
// prompt's or a recompute's later chunk) continue from its slot: the conv over its window and the
// chunk, the chunked rule from its state.
//
// Member names are the checkpoint's names (model.layers.N.linear_attn.in_proj_qkvz.weight, ...);
// `mtp.*` tensors of published checkpoints are skipped by LoadModel.
#pragma once

#include <torch/nn/modules/container/modulelist.h>

#include "lm/model/attention_context.h"
#include "lm/model/gated_deltanet.h"
#include "lm/model/layers.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/model/residual_stream.h"

namespace lm {

class Qwen3NextAttentionImpl : public torch::nn::Module {
 public:
  explicit Qwen3NextAttentionImpl(const ModelConfig& c);
  // x [T, H] -> [T, H]: the new tokens' gated attention through `ctx` as its attention layer
  // `kv_layer` (the layer's index among the full-attention layers).
  torch::Tensor forward(const torch::Tensor& x, AttentionContext& ctx, int64_t kv_layer);

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

class Qwen3NextDecoderLayerImpl : public torch::nn::Module {
 public:
  Qwen3NextDecoderLayerImpl(const ModelConfig& c, int64_t layer);
  // h += Mixer(input_layernorm(h)); h += Mlp(post_attention_layernorm(h)), the mixer's memory
  // in `ctx`. The router logits go to `router_logits` when given.
  void forward(ResidualStream& h, AttentionContext& ctx, std::vector<torch::Tensor>* router_logits);

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Qwen3NextGatedDeltaNet linear_attn{nullptr};  // linear_attention layers
  Qwen3NextAttention self_attn{nullptr};        // full_attention layers
  Qwen3NextSparseMoeBlock moe{nullptr};         // registered as "mlp" when a MoE layer
  DenseMlp dense{nullptr};                      // registered as "mlp" otherwise

 private:
  torch::Tensor Mlp(const torch::Tensor& x, std::vector<torch::Tensor>* router_logits);
  // This layer's index among the layers of its kind (full or linear attention): its entry in the
  // context's keys and values or recurrent state.
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
  // The one forward, what the entry points above wrap: embed -> layers -> norm over `ctx`.
  // Returns the final hidden states at ctx.OutputRows().
  torch::Tensor Run(const torch::Tensor& input_ids, AttentionContext& ctx,
                    std::vector<torch::Tensor>* router_logits);

  Rope rope_;
};

}  // namespace lm
