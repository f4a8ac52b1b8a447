#include "lm/model/qwen3_moe.h"

#include <cmath>

#include <torch/torch.h>

#include "lm/model/recompute.h"

namespace lm {

Qwen3MoeAttentionImpl::Qwen3MoeAttentionImpl(const ModelConfig& c)
    : heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      rope_(c.RotaryDim(), c.rope_theta) {
  q_proj = register_module("q_proj", Linear(c.hidden_size, heads_ * head_dim_));
  k_proj = register_module("k_proj", Linear(c.hidden_size, kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", Linear(c.hidden_size, kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", Linear(heads_ * head_dim_, c.hidden_size));
  q_norm = register_module("q_norm", RMSNorm(head_dim_, c.rms_norm_eps));
  k_norm = register_module("k_norm", RMSNorm(head_dim_, c.rms_norm_eps));
}

torch::Tensor Qwen3MoeAttentionImpl::forward(const torch::Tensor& x, AttentionContext& ctx,
                                             int64_t kv_layer) {
  const int64_t n = x.size(0);
  // Per-head RMSNorm on q and k BEFORE RoPE, as Qwen3 does. The projections are fresh tensors:
  // the fused norm + RoPE may overwrite them.
  auto [q, k] =
      QkNormRope(q_proj(x).view({n, heads_, head_dim_}), k_proj(x).view({n, kv_heads_, head_dim_}),
                 *q_norm, *k_norm, rope_, ctx.cos(), ctx.sin(), /*in_place=*/true);
  auto v = v_proj(x).view({n, kv_heads_, head_dim_});
  auto o = ctx.Attend(kv_layer, q, k, v, 1.0 / std::sqrt(double(head_dim_)));
  return o_proj(o.reshape({n, heads_ * head_dim_}));
}

Qwen3MoeDecoderLayerImpl::Qwen3MoeDecoderLayerImpl(const ModelConfig& c, int64_t layer)
    : index_(layer) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  self_attn = register_module("self_attn", Qwen3MoeAttention(c));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (c.IsMoeLayer(layer)) {
    moe = register_module(
        "mlp", SparseMoeBlock(c.hidden_size, c.num_experts, c.moe_intermediate_size,
                              c.num_experts_per_tok, c.norm_topk_prob, c.LocalExperts()));
  } else {
    dense = register_module("mlp", DenseMlp(c.hidden_size, c.intermediate_size));
  }
}

void Qwen3MoeDecoderLayerImpl::forward(ResidualStream& h, AttentionContext& ctx,
                                       std::vector<torch::Tensor>* router_logits,
                                       const torch::Tensor& forced_ids) {
  h.Add(self_attn(h.Norm(*input_layernorm), ctx, index_));
  h.Add(Mlp(h.Norm(*post_attention_layernorm), router_logits, forced_ids));
}

torch::Tensor Qwen3MoeDecoderLayerImpl::Mlp(const torch::Tensor& x,
                                            std::vector<torch::Tensor>* router_logits,
                                            const torch::Tensor& forced_ids) {
  if (!moe) return dense(x);
  torch::Tensor logits;
  auto y = moe(x, router_logits ? &logits : nullptr, forced_ids);
  if (router_logits) router_logits->push_back(logits);
  return y;
}

Qwen3MoeModelImpl::Qwen3MoeModelImpl(const ModelConfig& c) {
  embed_tokens = register_module("embed_tokens", Embedding(c.vocab_size, c.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(Qwen3MoeDecoderLayer(c, i));
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

Qwen3MoeForCausalLM::Qwen3MoeForCausalLM(ModelConfig c)
    : CausalLM(std::move(c)), rope_(config_.RotaryDim(), config_.rope_theta), routing_(config_) {
  model = register_module("model", Qwen3MoeModel(config_));
  AddLmHead(model->embed_tokens);
}

torch::Tensor Qwen3MoeForCausalLM::Run(const torch::Tensor& input_ids, AttentionContext& ctx,
                                       const ForwardOptions& opts) {
  // Activation checkpointing: each layer a block of its input alone, run again in the backward
  // (the block keeps its own copy of the context: it outlives this call).
  const bool recompute = opts.checkpoint_layers && ctx.kind() == AttentionContext::Kind::kPacked &&
                         !opts.cache && torch::GradMode::is_enabled();
  ResidualStream h(model->embed_tokens(input_ids));
  for (size_t i = 0; i < model->layers->size(); ++i) {
    auto layer = model->layers->ptr<Qwen3MoeDecoderLayerImpl>(i);
    const torch::Tensor forced = routing_.LayerIds(opts.replay_experts, static_cast<int64_t>(i));
    if (!recompute) {
      layer->forward(h, ctx, opts.router_logits, forced);
      continue;
    }
    // The block returns the layer's output and, when asked for, its router logits (the aux loss
    // backpropagates through them into the router).
    const bool logits = opts.router_logits != nullptr;
    auto block = [layer, ctx, logits, forced](const torch::Tensor& x) mutable {
      std::vector<torch::Tensor> router;
      ResidualStream y(x);
      layer->forward(y, ctx, logits ? &router : nullptr, forced);
      router.insert(router.begin(), y.Sum());
      return router;
    };
    std::vector<torch::Tensor> out = Recompute(block, h.Sum());
    h = ResidualStream(out[0]);
    if (logits) opts.router_logits->insert(opts.router_logits->end(), out.begin() + 1, out.end());
  }
  ctx.Finish();
  return h.Final(*model->norm, ctx.OutputRows());
}

torch::Tensor Qwen3MoeForCausalLM::Forward(const PackedBatch& batch, const ForwardOptions& opts) {
  if (opts.replay_experts.defined()) {
    const absl::Status st = routing_.CheckReplay(opts.replay_experts, batch.num_tokens());
    TORCH_CHECK(st.ok(), st.message());
  }
  auto ctx = AttentionContext::Packed(batch, rope_, opts.cache);
  return Run(batch.input_ids, ctx, opts);
}

torch::Tensor Qwen3MoeForCausalLM::Decode(const torch::Tensor& tokens, KVCache& cache) {
  auto ctx = AttentionContext::Decode(cache, rope_, tokens.device());
  return Run(tokens, ctx, {});
}

KVCache Qwen3MoeForCausalLM::NewKVCache(int64_t batch, int64_t capacity) const {
  KVCache cache;
  auto opts = model->embed_tokens->weight.options().requires_grad(false);
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    cache.k.push_back(
        torch::zeros({batch, capacity, config_.num_key_value_heads, config_.head_dim}, opts));
    cache.v.push_back(torch::zeros_like(cache.k.back()));
  }
  cache.lengths.assign(batch, 0);
  return cache;
}

PagedCacheSpec Qwen3MoeForCausalLM::PagedSpec() const {
  PagedCacheSpec spec;
  spec.kv_layers = config_.num_hidden_layers;
  spec.kv_bytes_per_token = 2 * config_.num_hidden_layers * config_.num_key_value_heads *
                            config_.head_dim * model->embed_tokens->weight.element_size();
  return spec;
}

PagedKVCache Qwen3MoeForCausalLM::NewPagedKVCache(int64_t num_blocks, int64_t block_size,
                                                  int64_t /*num_state_slots: no state*/) const {
  PagedKVCache cache;
  cache.block_size = block_size;
  cache.num_blocks = num_blocks;
  auto opts = model->embed_tokens->weight.options().requires_grad(false);
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    // Uninitialised: a row is always written before it is read, and padding reads the null
    // block, which is zero (untouched pages cost no memory until the pool fills).
    for (auto* pools : {&cache.k, &cache.v}) {
      pools->push_back(torch::empty(
          {num_blocks, block_size, config_.num_key_value_heads, config_.head_dim}, opts));
      pools->back()[0].zero_();
    }
  }
  return cache;
}

torch::Tensor Qwen3MoeForCausalLM::PagedForward(const PagedStep& step, PagedKVCache& cache) {
  auto ctx = AttentionContext::Paged(step, cache, rope_, model->embed_tokens->weight.device());
  return Run(step.input_ids, ctx, {});
}

}  // namespace lm
