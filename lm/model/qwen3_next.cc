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

Qwen3NextAttentionImpl::Projected Qwen3NextAttentionImpl::Project(const torch::Tensor& x,
                                                                  const torch::Tensor& cos,
                                                                  const torch::Tensor& sin) {
  const int64_t N = x.size(0);
  auto q_gate = q_proj(x).view({N, heads_, 2 * head_dim_});  // per head [query | gate]
  Projected p;
  p.q = rope_.Apply(q_norm(q_gate.narrow(2, 0, head_dim_)), cos, sin);
  p.gate = q_gate.narrow(2, head_dim_, head_dim_);
  p.k = rope_.Apply(k_norm(k_proj(x).view({N, kv_heads_, head_dim_})), cos, sin);
  p.v = v_proj(x).view({N, kv_heads_, head_dim_});
  return p;
}

torch::Tensor Qwen3NextAttentionImpl::Output(const torch::Tensor& o, const torch::Tensor& gate) {
  return o_proj((o * pointwise::Sigmoid(gate)).reshape({o.size(0), heads_ * head_dim_}));
}

torch::Tensor Qwen3NextAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                              const torch::Tensor& sin,
                                              const std::vector<int64_t>& cu_seqlens,
                                              torch::Tensor* k_cache, torch::Tensor* v_cache) {
  Projected p = Project(x, cos, sin);
  if (k_cache) FillCache(*k_cache, *v_cache, p.k, p.v, cu_seqlens);
  auto o = VarlenCausalAttention(p.q, p.k, p.v, cu_seqlens,
                                 1.0 / std::sqrt(static_cast<double>(head_dim_)));
  return Output(o, p.gate);
}

torch::Tensor Qwen3NextAttentionImpl::decode(const torch::Tensor& x, const torch::Tensor& cos,
                                             const torch::Tensor& sin, torch::Tensor& k_cache,
                                             torch::Tensor& v_cache,
                                             const std::vector<int64_t>& lengths) {
  Projected p = Project(x, cos, sin);
  AppendCache(k_cache, v_cache, p.k, p.v, lengths);
  std::vector<int64_t> visible(lengths.size());
  for (size_t b = 0; b < lengths.size(); ++b) visible[b] = lengths[b] + 1;
  auto o = CachedAttention(p.q, k_cache, v_cache, visible,
                           1.0 / std::sqrt(static_cast<double>(head_dim_)));
  return Output(o, p.gate);
}

torch::Tensor Qwen3NextAttentionImpl::paged(const torch::Tensor& x, const torch::Tensor& cos,
                                            const torch::Tensor& sin, torch::Tensor& k_pool,
                                            torch::Tensor& v_pool, const PagedAttentionMeta& meta) {
  Projected p = Project(x, cos, sin);
  WritePagedKV(k_pool, v_pool, p.k, p.v, meta);
  auto o = PagedAttention(p.q, p.k, p.v, k_pool, v_pool, meta,
                          1.0 / std::sqrt(static_cast<double>(head_dim_)));
  return Output(o, p.gate);
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

torch::Tensor Qwen3NextDecoderLayerImpl::forward(const torch::Tensor& h,
                                                 const Qwen3NextStep& step) {
  auto x = input_layernorm(h);
  KVCache* cache = step.cache;
  torch::Tensor mixed;
  if (linear_attn) {
    mixed = linear_attn(x, *step.layout, cache ? &cache->conv[cache_index_] : nullptr,
                        cache ? &cache->recurrent[cache_index_] : nullptr);
  } else {
    mixed = self_attn(x, step.cos, step.sin, *step.cu_seqlens,
                      cache ? &cache->k[cache_index_] : nullptr,
                      cache ? &cache->v[cache_index_] : nullptr);
  }
  auto h1 = h + mixed;
  return h1 + Mlp(post_attention_layernorm(h1), step.router_logits);
}

torch::Tensor Qwen3NextDecoderLayerImpl::decode(const torch::Tensor& h, const torch::Tensor& cos,
                                                const torch::Tensor& sin, KVCache& cache) {
  auto x = input_layernorm(h);
  auto mixed = linear_attn
                   ? linear_attn->decode(x, cache.conv[cache_index_], cache.recurrent[cache_index_])
                   : self_attn->decode(x, cos, sin, cache.k[cache_index_], cache.v[cache_index_],
                                       cache.lengths);
  auto h1 = h + mixed;
  return h1 + Mlp(post_attention_layernorm(h1), nullptr);
}

torch::Tensor Qwen3NextDecoderLayerImpl::paged(const torch::Tensor& h, const torch::Tensor& cos,
                                               const torch::Tensor& sin, PagedKVCache& cache,
                                               const PagedAttentionMeta& meta,
                                               const Qwen3NextPagedPlan& plan) {
  auto x = input_layernorm(h);
  auto mixed = linear_attn ? linear_attn->paged(x, cache.state[2 * cache_index_],
                                                cache.state[2 * cache_index_ + 1], plan)
                           : self_attn->paged(x, cos, sin, cache.k[cache_index_],
                                              cache.v[cache_index_], meta);
  auto h1 = h + mixed;
  return h1 + Mlp(post_attention_layernorm(h1), nullptr);
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
  auto [cos, sin] = rope_.Tables(batch.position_ids);
  const auto layout = DeltaRuleLayout::Make(batch.cu_seqlens, batch.input_ids.device());
  const Qwen3NextStep step{cos, sin, &batch.cu_seqlens, &layout, opts.router_logits, cache};
  auto h = model->embed_tokens(batch.input_ids);
  for (size_t i = 0; i < model->layers->size(); ++i) {
    h = model->layers->ptr<Qwen3NextDecoderLayerImpl>(i)->forward(h, step);
  }
  if (cache) {
    for (int64_t b = 0; b < batch.num_sequences(); ++b) cache->lengths[b] = batch.length(b);
  }
  return model->norm(h);
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
  auto positions = torch::tensor(cache.lengths, torch::kInt64).to(device);
  auto [cos, sin] = rope_.Tables(positions);
  auto h = model->embed_tokens(tokens.to(device));
  for (size_t i = 0; i < model->layers->size(); ++i) {
    h = model->layers->ptr<Qwen3NextDecoderLayerImpl>(i)->decode(h, cos, sin, cache);
  }
  for (auto& len : cache.lengths) ++len;
  return model->norm(h);
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
  const PagedAttentionMeta meta = BuildPagedAttentionMeta(step, cache.block_size, device);
  const Qwen3NextPagedPlan plan =
      Qwen3NextPagedPlan::Make(step, config_.linear_conv_kernel_dim, device);
  auto [cos, sin] = rope_.Tables(meta.positions);
  auto h = model->embed_tokens(step.input_ids);
  for (size_t i = 0; i < model->layers->size(); ++i) {
    h = model->layers->ptr<Qwen3NextDecoderLayerImpl>(i)->paged(h, cos, sin, cache, meta, plan);
  }
  // Only the last new token of each sequence is sampled from: norm those rows alone.
  if (meta.max_new > 1) h = h.index_select(0, meta.last_rows);
  return model->norm(h);
}

}  // namespace lm
