// Qwen3-MoE (and dense Qwen3): the students (Marco-Nano/Mini) and the stage-1 teacher.
//
//   h = embed(ids)
//   per layer:  h += o_proj(Attn(RoPE(q_norm(q)), RoPE(k_norm(k)), v))   on input_layernorm(h)
//               h += MLP(post_attention_layernorm(h))    MLP = SparseMoeBlock or DenseMlp
//   logits = lm_head(norm(h))
//
// One forward (Run) computes this for every caller: Forward (packed documents, optionally
// prefilling a KVCache), Decode and PagedForward only build the AttentionContext that says where
// attention's keys and values live (lm/model/attention_context.h).
//
// Member names are the checkpoint's names (model.layers.N.self_attn.q_proj.weight, ...).
#pragma once

#include <torch/nn/modules/container/modulelist.h>

#include "lm/model/attention_context.h"
#include "lm/model/layers.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/model/residual_stream.h"
#include "lm/model/routing_trace.h"

namespace lm {

class Qwen3MoeAttentionImpl : public torch::nn::Module {
 public:
  Qwen3MoeAttentionImpl(const ModelConfig& c);
  // x [T, H] -> [T, H]: the new tokens' q, k, v, attending through `ctx` as attention layer
  // `kv_layer` (every layer of this architecture is one: kv_layer = the layer's index).
  torch::Tensor forward(const torch::Tensor& x, AttentionContext& ctx, int64_t kv_layer);

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};

 private:
  int64_t heads_, kv_heads_, head_dim_;
  Rope rope_;
};
TORCH_MODULE(Qwen3MoeAttention);

class Qwen3MoeDecoderLayerImpl : public torch::nn::Module {
 public:
  Qwen3MoeDecoderLayerImpl(const ModelConfig& c, int64_t layer);
  // h += Attn(input_layernorm(h)); h += Mlp(post_attention_layernorm(h)). The router logits go to
  // `router_logits` when given; `forced_ids` [T, k] when defined: routing replay for this (MoE)
  // layer.
  void forward(ResidualStream& h, AttentionContext& ctx, std::vector<torch::Tensor>* router_logits,
               const torch::Tensor& forced_ids);
  torch::Tensor Mlp(const torch::Tensor& x, std::vector<torch::Tensor>* router_logits,
                    const torch::Tensor& forced_ids = {});

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Qwen3MoeAttention self_attn{nullptr};
  SparseMoeBlock moe{nullptr};  // registered as "mlp" when this is a MoE layer
  DenseMlp dense{nullptr};      // registered as "mlp" otherwise

 private:
  int64_t index_;  // the layer's index: its attention's KV layer
};
TORCH_MODULE(Qwen3MoeDecoderLayer);

class Qwen3MoeModelImpl : public torch::nn::Module {
 public:
  explicit Qwen3MoeModelImpl(const ModelConfig& c);
  Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(Qwen3MoeModel);

class Qwen3MoeForCausalLM : public CausalLM {
 public:
  explicit Qwen3MoeForCausalLM(ModelConfig c);

  torch::Tensor Forward(const PackedBatch& batch, const ForwardOptions& opts = {}) override;
  torch::Tensor Decode(const torch::Tensor& tokens, KVCache& cache) override;
  KVCache NewKVCache(int64_t batch, int64_t capacity) const override;
  bool SupportsPagedKV() const override { return true; }
  bool SupportsRoutingReplay() const override { return true; }
  PagedCacheSpec PagedSpec() const override;
  PagedKVCache NewPagedKVCache(int64_t num_blocks, int64_t block_size,
                               int64_t num_state_slots) const override;
  torch::Tensor PagedForward(const PagedStep& step, PagedKVCache& cache) override;

  Qwen3MoeModel model{nullptr};

 private:
  // The one forward, what the entry points above wrap: embed -> layers -> norm over `ctx`.
  // Returns the final hidden states at ctx.OutputRows().
  torch::Tensor Run(const torch::Tensor& input_ids, AttentionContext& ctx,
                    const ForwardOptions& opts);

  Rope rope_;
  RoutingTrace routing_;  // the layout of routing replay's record (no positions)
};

}  // namespace lm
