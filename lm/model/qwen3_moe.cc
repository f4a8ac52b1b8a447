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

// q/k/v for rows x [N, H]: per-head RMSNorm on q and k BEFORE RoPE, as Qwen3 does.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> Qwen3MoeAttentionImpl::Project(
    const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t n = x.size(0);
  // The projections are fresh tensors: the fused norm + RoPE may overwrite them.
  auto [q, k] =
      QkNormRope(q_proj(x).view({n, heads_, head_dim_}), k_proj(x).view({n, kv_heads_, head_dim_}),
                 *q_norm, *k_norm, rope_, cos, sin, /*in_place=*/true);
  auto v = v_proj(x).view({n, kv_heads_, head_dim_});
  return {q, k, v};
}

torch::Tensor Qwen3MoeAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                             const torch::Tensor& sin,
                                             const std::vector<int64_t>& cu_seqlens,
                                             torch::Tensor* k_cache, torch::Tensor* v_cache) {
  auto [q, k, v] = Project(x, cos, sin);
  if (k_cache) FillCache(*k_cache, *v_cache, k, v, cu_seqlens);
  auto o = VarlenCausalAttention(q, k, v, cu_seqlens, 1.0 / std::sqrt(double(head_dim_)));
  return o_proj(o.reshape({x.size(0), heads_ * head_dim_}));
}

torch::Tensor Qwen3MoeAttentionImpl::decode(const torch::Tensor& x, const torch::Tensor& cos,
                                            const torch::Tensor& sin, torch::Tensor& k_cache,
                                            torch::Tensor& v_cache,
                                            const std::vector<int64_t>& lengths) {
  auto [q, k, v] = Project(x, cos, sin);
  AppendCache(k_cache, v_cache, k, v, lengths);
  std::vector<int64_t> visible(lengths.size());
  for (size_t b = 0; b < lengths.size(); ++b) visible[b] = lengths[b] + 1;
  auto o = CachedAttention(q, k_cache, v_cache, visible, 1.0 / std::sqrt(double(head_dim_)));
  return o_proj(o.reshape({x.size(0), heads_ * head_dim_}));
}

torch::Tensor Qwen3MoeAttentionImpl::paged(const torch::Tensor& x, const torch::Tensor& cos,
                                           const torch::Tensor& sin, torch::Tensor& k_pool,
                                           torch::Tensor& v_pool, const PagedAttentionMeta& meta) {
  auto [q, k, v] = Project(x, cos, sin);
  WritePagedKV(k_pool, v_pool, k, v, meta);
  auto o = PagedAttention(q, k, v, k_pool, v_pool, meta, 1.0 / std::sqrt(double(head_dim_)));
  return o_proj(o.reshape({x.size(0), heads_ * head_dim_}));
}

Qwen3MoeDecoderLayerImpl::Qwen3MoeDecoderLayerImpl(const ModelConfig& c, int64_t layer) {
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

namespace {

// The decoder layers over the residual stream h, each residual add fused into the norm after it
// (RMSNormImpl::AddForward: h += delta and the next norm in one pass where a device has the
// kernel; the same ops as `h = h + delta; norm(h)` under autograd). attend(i, normed) is layer
// i's attention output on its normed input, mlp(i, normed) its MLP's. Returns the final norm.
template <class Attend, class Mlp>
torch::Tensor RunLayers(Qwen3MoeModelImpl& model, torch::Tensor h, const Attend& attend,
                        const Mlp& mlp) {
  const size_t n = model.layers->size();
  auto layer = [&](size_t i) { return model.layers->ptr<Qwen3MoeDecoderLayerImpl>(i); };
  torch::Tensor normed = n > 0 ? layer(0)->input_layernorm(h) : model.norm(h);
  for (size_t i = 0; i < n; ++i) {
    normed = layer(i)->post_attention_layernorm->AddForward(attend(i, normed), h);
    RMSNormImpl& next = i + 1 < n ? *layer(i + 1)->input_layernorm : *model.norm;
    normed = next.AddForward(mlp(i, normed), h);
  }
  return normed;
}

}  // namespace

Qwen3MoeForCausalLM::Qwen3MoeForCausalLM(ModelConfig c)
    : CausalLM(std::move(c)), rope_(config_.RotaryDim(), config_.rope_theta) {
  model = register_module("model", Qwen3MoeModel(config_));
  AddLmHead(model->embed_tokens);
}

torch::Tensor Qwen3MoeForCausalLM::Forward(const PackedBatch& batch, const ForwardOptions& opts) {
  auto [cos, sin] = rope_.Tables(batch.position_ids);
  auto h = model->embed_tokens(batch.input_ids);
  const bool replay = opts.replay_experts.defined();
  if (replay) {
    int64_t moe_layers = 0;
    for (int64_t i = 0; i < config_.num_hidden_layers; ++i) moe_layers += config_.IsMoeLayer(i);
    TORCH_CHECK(opts.replay_experts.dim() == 3 &&
                    opts.replay_experts.size(0) == batch.num_tokens() &&
                    opts.replay_experts.size(1) == moe_layers &&
                    opts.replay_experts.size(2) == config_.num_experts_per_tok,
                "replay_experts must be [tokens=", batch.num_tokens(), ", moe_layers=", moe_layers,
                ", top_k=", config_.num_experts_per_tok, "], got ", opts.replay_experts.sizes());
  }
  // The expert ids layer i replays (undefined for a dense layer or without replay).
  std::vector<torch::Tensor> forced(model->layers->size());
  if (replay) {
    int64_t moe_index = 0;
    for (size_t i = 0; i < model->layers->size(); ++i) {
      if (model->layers->ptr<Qwen3MoeDecoderLayerImpl>(i)->moe)
        forced[i] = opts.replay_experts.select(1, moe_index++);
    }
  }
  if (opts.checkpoint_layers && !opts.cache && torch::GradMode::is_enabled()) {
    for (size_t i = 0; i < model->layers->size(); ++i) {
      auto layer = model->layers->ptr<Qwen3MoeDecoderLayerImpl>(i);
      // The block returns the layer's output and, when asked for, its router logits (the aux
      // loss backpropagates through them into the router).
      const bool logits = opts.router_logits != nullptr;
      auto block = [layer, cos = cos, sin = sin, cu = batch.cu_seqlens, logits,
                    forced = forced[i]](const torch::Tensor& x) {
        std::vector<torch::Tensor> router;
        torch::Tensor y =
            x + layer->self_attn(layer->input_layernorm(x), cos, sin, cu, nullptr, nullptr);
        y = y + layer->Mlp(layer->post_attention_layernorm(y), logits ? &router : nullptr, forced);
        router.insert(router.begin(), y);
        return router;
      };
      std::vector<torch::Tensor> out = Recompute(block, h);
      h = out[0];
      if (logits) opts.router_logits->insert(opts.router_logits->end(), out.begin() + 1, out.end());
    }
    return model->norm(h);
  }
  auto out = RunLayers(
      *model, h,
      [&](size_t i, const torch::Tensor& x) {
        torch::Tensor* kc = opts.cache ? &opts.cache->k[i] : nullptr;
        torch::Tensor* vc = opts.cache ? &opts.cache->v[i] : nullptr;
        return model->layers->ptr<Qwen3MoeDecoderLayerImpl>(i)->self_attn(x, cos, sin,
                                                                          batch.cu_seqlens, kc, vc);
      },
      [&](size_t i, const torch::Tensor& x) {
        return model->layers->ptr<Qwen3MoeDecoderLayerImpl>(i)->Mlp(x, opts.router_logits,
                                                                    forced[i]);
      });
  if (opts.cache) {
    for (int64_t b = 0; b < batch.num_sequences(); ++b) opts.cache->lengths[b] = batch.length(b);
  }
  return out;
}

torch::Tensor Qwen3MoeForCausalLM::Decode(const torch::Tensor& tokens, KVCache& cache) {
  auto positions = torch::tensor(cache.lengths, torch::kInt64).to(tokens.device());
  auto [cos, sin] = rope_.Tables(positions);
  auto out = RunLayers(
      *model, model->embed_tokens(tokens),
      [&](size_t i, const torch::Tensor& x) {
        return model->layers->ptr<Qwen3MoeDecoderLayerImpl>(i)->self_attn->decode(
            x, cos, sin, cache.k[i], cache.v[i], cache.lengths);
      },
      [&](size_t i, const torch::Tensor& x) {
        return model->layers->ptr<Qwen3MoeDecoderLayerImpl>(i)->Mlp(x, nullptr);
      });
  for (auto& len : cache.lengths) ++len;
  return out;
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
  const auto device = model->embed_tokens->weight.device();
  const PagedAttentionMeta meta = BuildPagedAttentionMeta(step, cache.block_size, device);
  auto [cos, sin] = rope_.Tables(meta.positions);
  auto h = model->embed_tokens(step.input_ids);
  for (size_t i = 0; i < model->layers->size(); ++i) {
    auto layer = model->layers->ptr<Qwen3MoeDecoderLayerImpl>(i);
    h = h +
        layer->self_attn->paged(layer->input_layernorm(h), cos, sin, cache.k[i], cache.v[i], meta);
    h = h + layer->Mlp(layer->post_attention_layernorm(h), nullptr);
  }
  // Only the last new token of each sequence is sampled from: norm those rows alone.
  if (meta.max_new > 1) h = h.index_select(0, meta.last_rows);
  return model->norm(h);
}

}  // namespace lm
