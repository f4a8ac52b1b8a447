// Qwen3-MoE (and dense Qwen3): the students (Marco-Nano/Mini) and the stage-1 teacher.
//
//   h = embed(ids)
//   per layer:  h += o_proj(Attn(RoPE(q_norm(q)), RoPE(k_norm(k)), v))   on input_layernorm(h)
//               h += MLP(post_attention_layernorm(h))    MLP = SparseMoeBlock or DenseMlp
//   logits = lm_head(norm(h))
//
// Member names are the checkpoint's names (model.layers.N.self_attn.q_proj.weight, ...).
#pragma once

#include <torch/nn/modules/container/modulelist.h>

#include "lm/model/layers.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"

namespace lm {

class Qwen3MoeAttentionImpl : public torch::nn::Module {
 public:
  Qwen3MoeAttentionImpl(const ModelConfig& c);
  // Prefill over a packed batch: x [T, H]; rope tables [T, D]. Fills `cache_layer` if given.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<int64_t>& cu_seqlens, torch::Tensor* k_cache,
                        torch::Tensor* v_cache);
  // Decode: x [B, H] at per-slot positions, appending to the caches.
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
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> Project(const torch::Tensor& x,
                                                                  const torch::Tensor& cos,
                                                                  const torch::Tensor& sin);
  int64_t heads_, kv_heads_, head_dim_;
  Rope rope_;
};
TORCH_MODULE(Qwen3MoeAttention);

class Qwen3MoeDecoderLayerImpl : public torch::nn::Module {
 public:
  Qwen3MoeDecoderLayerImpl(const ModelConfig& c, int64_t layer);
  // `forced_ids` [T, k] when defined: routing replay for this (MoE) layer.
  torch::Tensor Mlp(const torch::Tensor& x, std::vector<torch::Tensor>* router_logits,
                    const torch::Tensor& forced_ids = {});

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Qwen3MoeAttention self_attn{nullptr};
  SparseMoeBlock moe{nullptr};  // registered as "mlp" when this is a MoE layer
  DenseMlp dense{nullptr};      // registered as "mlp" otherwise
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
  Rope rope_;
};

}  // namespace lm
