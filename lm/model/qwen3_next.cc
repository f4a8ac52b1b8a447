#include "lm/model/qwen3_next.h"

#include <cmath>

#include <torch/torch.h>

#include "lm/model/batch_invariant.h"

namespace lm {

Qwen3NextAttentionImpl::Qwen3NextAttentionImpl(const ModelConfig& c)
    : heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      rope_(c.RotaryDim(), c.rope_theta) {
  q_proj = register_module("q_proj", Linear(c.hidden_size, heads_ * head_dim_ * 2));
  k_proj = register_module("k_proj", Linear(c.hidden_size, kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", Linear(c.hidden_size, kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", Linear(heads_ * head_dim_, c.hidden_size));
  q_norm = register_module("q_norm", RMSNorm(head_dim_, c.rms_norm_eps, /*zero_centered=*/true));
  k_norm = register_module("k_norm", RMSNorm(head_dim_, c.rms_norm_eps, /*zero_centered=*/true));
}

torch::Tensor Qwen3NextAttentionImpl::forward(const torch::Tensor& x, AttentionContext& ctx,
                                              int64_t kv_layer) {
  const int64_t n = x.size(0);
  auto q_gate = q_proj(x).view({n, heads_, 2 * head_dim_});  // per head [query | gate]
  auto q = rope_.Apply(q_norm(q_gate.narrow(2, 0, head_dim_)), ctx.cos(), ctx.sin());
  auto gate = q_gate.narrow(2, head_dim_, head_dim_);
  auto k = rope_.Apply(k_norm(k_proj(x).view({n, kv_heads_, head_dim_})), ctx.cos(), ctx.sin());
  auto v = v_proj(x).view({n, kv_heads_, head_dim_});
  auto o = ctx.Attend(kv_layer, q, k, v, 1.0 / std::sqrt(static_cast<double>(head_dim_)));
  return o_proj((o * pointwise::Sigmoid(gate)).reshape({n, heads_ * head_dim_}));
}

Qwen3NextSparseMoeBlockImpl::Qwen3NextSparseMoeBlockImpl(const ModelConfig& c)
    : top_k_(c.num_experts_per_tok), norm_topk_prob_(c.norm_topk_prob) {
  gate = register_module("gate", Router(c.num_experts, c.hidden_size));
  experts =
      register_module("experts", Experts(c.LocalExperts(), c.hidden_size, c.moe_intermediate_size));
  shared_expert =
      register_module("shared_expert", DenseMlp(c.hidden_size, c.shared_expert_intermediate_size));
  shared_expert_gate = register_module("shared_expert_gate", Linear(c.hidden_size, 1));
}

torch::Tensor Qwen3NextSparseMoeBlockImpl::forward(const torch::Tensor& x,
                                                   torch::Tensor* router_logits) {
  Routing r = Route(x, gate->weight, top_k_, norm_topk_prob_);
  if (router_logits) *router_logits = r.logits;
  // Under expert parallelism only the routed part is summed over the group; the replicated shared
  // expert is added once, on every rank.
  auto routed = RunExperts(x, r, *experts);
  return routed + pointwise::Sigmoid(shared_expert_gate(x)) * shared_expert(x);
}

Qwen3NextDecoderLayerImpl::Qwen3NextDecoderLayerImpl(const ModelConfig& c, int64_t layer) {
  input_layernorm =
      register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, true));
  const bool full = c.IsFullAttentionLayer(layer);
  if (full) {
    self_attn = register_module("self_attn", Qwen3NextAttention(c));
  } else {
    linear_attn = register_module("linear_attn", Qwen3NextGatedDeltaNet(c));
  }
  for (int64_t j = 0; j < layer; ++j) cache_index_ += c.IsFullAttentionLayer(j) == full;
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, true));
  if (c.IsMoeLayer(layer)) {
    moe = register_module("mlp", Qwen3NextSparseMoeBlock(c));
  } else {
    dense = register_module("mlp", DenseMlp(c.hidden_size, c.intermediate_size));
  }
}

torch::Tensor Qwen3NextDecoderLayerImpl::Mlp(const torch::Tensor& x,
                                             std::vector<torch::Tensor>* router_logits) {
  if (!moe) return dense(x);
  torch::Tensor logits;
  auto y = moe(x, router_logits ? &logits : nullptr);
  if (router_logits) router_logits->push_back(logits);
  return y;
}

void Qwen3NextDecoderLayerImpl::forward(ResidualStream& h, AttentionContext& ctx,
                                        std::vector<torch::Tensor>* router_logits) {
  auto x = h.Norm(*input_layernorm);
  h.Add(linear_attn ? ctx.Recur(cache_index_, *linear_attn, x) : self_attn(x, ctx, cache_index_));
  h.Add(Mlp(h.Norm(*post_attention_layernorm), router_logits));
}

Qwen3NextModelImpl::Qwen3NextModelImpl(const ModelConfig& c) {
  embed_tokens = register_module("embed_tokens", Embedding(c.vocab_size, c.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(Qwen3NextDecoderLayer(c, i));
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps, /*zero_centered=*/true));
}

Qwen3NextForCausalLM::Qwen3NextForCausalLM(ModelConfig c)
    : CausalLM(std::move(c)), rope_(config_.RotaryDim(), config_.rope_theta) {
  model = register_module("model", Qwen3NextModel(config_));
  AddLmHead(model->embed_tokens);
}

torch::Tensor Qwen3NextForCausalLM::Run(const torch::Tensor& input_ids, AttentionContext& ctx,
                                        std::vector<torch::Tensor>* router_logits) {
  ResidualStream h(model->embed_tokens(input_ids));
  for (size_t i = 0; i < model->layers->size(); ++i)
    model->layers->ptr<Qwen3NextDecoderLayerImpl>(i)->forward(h, ctx, router_logits);
  ctx.Finish();
  return h.Final(*model->norm, ctx.OutputRows());
}

torch::Tensor Qwen3NextForCausalLM::Forward(const PackedBatch& batch, const ForwardOptions& opts) {
  KVCache* cache = opts.cache;
  if (cache) {
    TORCH_CHECK(cache->batch() == batch.num_sequences(),
                "Qwen3-Next prefill: ", batch.num_sequences(), " documents for a cache of ",
                cache->batch(), " slots");
    TORCH_CHECK(cache->k.size() + cache->conv.size() == model->layers->size() &&
                    cache->recurrent.size() == cache->conv.size(),
                "Qwen3-Next prefill: the cache was not made by this model's NewKVCache");
  }
  auto ctx = AttentionContext::Packed(batch, rope_, cache);
  return Run(batch.input_ids, ctx, opts.router_logits);
}

torch::Tensor Qwen3NextForCausalLM::Decode(const torch::Tensor& tokens, KVCache& cache) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == cache.batch(),
              "Qwen3-Next decode: ", tokens.sizes(), " tokens for a cache of ", cache.batch(),
              " slots");
  for (int64_t len : cache.lengths) {
    TORCH_CHECK(cache.k.empty() || len < cache.capacity(), "Qwen3-Next decode: a slot holds ", len,
                " tokens, the cache's capacity");
  }
  // The sampler hands host tokens; the cache and the weights may live on a GPU.
  const auto device = model->embed_tokens->weight.device();
  auto ctx = AttentionContext::Decode(cache, rope_, device);
  return Run(tokens.to(device), ctx, nullptr);
}

KVCache Qwen3NextForCausalLM::NewKVCache(int64_t batch, int64_t capacity) const {
  const ModelConfig& c = config_;
  KVCache cache;
  auto opts = model->embed_tokens->weight.options().requires_grad(false);
  const int64_t conv_channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                                c.linear_num_value_heads * c.linear_value_head_dim;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.IsFullAttentionLayer(i)) {
      cache.k.push_back(torch::zeros({batch, capacity, c.num_key_value_heads, c.head_dim}, opts));
      cache.v.push_back(torch::zeros_like(cache.k.back()));
    } else {
      cache.conv.push_back(
          torch::zeros({batch, c.linear_conv_kernel_dim - 1, conv_channels}, opts));
      cache.recurrent.push_back(torch::zeros(
          {batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim},
          opts.dtype(torch::kFloat32)));
    }
  }
  cache.lengths.assign(batch, 0);
  return cache;
}

PagedCacheSpec Qwen3NextForCausalLM::PagedSpec() const {
  const ModelConfig& c = config_;
  const int64_t elt = model->embed_tokens->weight.element_size();
  PagedCacheSpec spec;
  int64_t linear = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.IsFullAttentionLayer(i)) {
      ++spec.kv_layers;
    } else {
      ++linear;
    }
  }
  spec.kv_bytes_per_token = 2 * spec.kv_layers * c.num_key_value_heads * c.head_dim * elt;
  const int64_t conv_channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                                c.linear_num_value_heads * c.linear_value_head_dim;
  spec.state_bytes_per_slot =
      linear * ((c.linear_conv_kernel_dim - 1) * conv_channels * elt +
                c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4);
  return spec;
}

PagedKVCache Qwen3NextForCausalLM::NewPagedKVCache(int64_t num_blocks, int64_t block_size,
                                                   int64_t num_state_slots) const {
  const ModelConfig& c = config_;
  PagedKVCache cache;
  cache.block_size = block_size;
  cache.num_blocks = num_blocks;
  cache.num_state_slots = num_state_slots;
  auto opts = model->embed_tokens->weight.options().requires_grad(false);
  const int64_t conv_channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                                c.linear_num_value_heads * c.linear_value_head_dim;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.IsFullAttentionLayer(i)) {
      // Uninitialised but the null block: a row is written before it is read (as Qwen3-MoE).
      for (auto* pools : {&cache.k, &cache.v}) {
        pools->push_back(
            torch::empty({num_blocks, block_size, c.num_key_value_heads, c.head_dim}, opts));
        pools->back()[0].zero_();
      }
    } else {
      // A slot's state is written whole by its sequence's prefill before any decode reads it.
      cache.state.push_back(
          torch::zeros({num_state_slots, c.linear_conv_kernel_dim - 1, conv_channels}, opts));
      cache.state.push_back(torch::zeros({num_state_slots, c.linear_num_value_heads,
                                          c.linear_key_head_dim, c.linear_value_head_dim},
                                         opts.dtype(torch::kFloat32)));
    }
  }
  return cache;
}

torch::Tensor Qwen3NextForCausalLM::PagedForward(const PagedStep& step, PagedKVCache& cache) {
  const auto device = model->embed_tokens->weight.device();
  TORCH_CHECK(cache.k.size() + cache.state.size() / 2 == model->layers->size(),
              "Qwen3-Next paged step: the cache was not made by this model's NewPagedKVCache");
  auto ctx = AttentionContext::Paged(step, cache, rope_, device);
  return Run(step.input_ids, ctx, nullptr);
}

}  // namespace lm
