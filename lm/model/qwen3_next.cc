#include "lm/model/qwen3_next.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <torch/torch.h>

#include "lm/model/cpu_inference.h"

namespace lm {
namespace {

constexpr double kL2NormEps = 1e-6;  // as the FLA kernels and transformers' fallback

torch::Tensor HostIndex(const std::vector<int64_t>& v, torch::Device device) {
  return torch::tensor(v, torch::kInt64).to(device);
}

// [T, H, ...] token rows -> [N, H, C, ...] chunks in the layout's order; padding slots read zeros.
torch::Tensor ToChunks(const torch::Tensor& x, const DeltaRuleLayout& layout) {
  auto zero_row = torch::zeros_like(x.narrow(0, 0, 1));
  auto slots = torch::cat({x, zero_row}, 0).index_select(0, layout.gather);
  auto shape = slots.sizes().vec();
  shape[0] = layout.chunk;
  shape.insert(shape.begin(), layout.num_chunks());
  return slots.view(shape).transpose(1, 2).contiguous();
}

// Inverse of ToChunks for o [N, H, C, d] -> [T, H, d].
torch::Tensor FromChunks(const torch::Tensor& o, const DeltaRuleLayout& layout) {
  auto slots = o.transpose(1, 2).reshape({-1, o.size(1), o.size(3)});
  return slots.index_select(0, layout.scatter);
}

torch::Tensor L2Normalize(const torch::Tensor& x) {
  return x * torch::rsqrt((x * x).sum(-1, /*keepdim=*/true) + kL2NormEps);
}

// The per-chunk terms of the chunked form that need no state: everything but the scan.
struct ChunkTerms {
  torch::Tensor u;            // UT-transformed values beta V                [N, H, C, dv]
  torch::Tensor wq;           // [W | exp(G) Q]: the two reads of the state  [N, H, 2C, dk]
  torch::Tensor attn;         // (Q K^T) * D, causal within the chunk        [N, H, C, C]
  torch::Tensor k_decayed_t;  // (exp(G_C - G) K)^T                          [N, H, dk, C]
  torch::Tensor chunk_decay;  // exp(G_C)                                    [N, H, 1, 1]
};

ChunkTerms IntraChunk(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& g, const torch::Tensor& beta) {
  const int64_t C = q.size(2);
  auto G = g.cumsum(-1);  // [N, H, C]: log of the decay from the chunk start to each position
  auto G_exp = G.exp().unsqueeze(-1);
  // D_ij = exp(G_i - G_j) for j <= i; the upper triangle is masked before exp (it would overflow).
  auto upper = torch::ones({C, C}, q.options().dtype(torch::kBool)).triu(1);
  auto D = (G.unsqueeze(-1) - G.unsqueeze(-2))
               .masked_fill(upper, -std::numeric_limits<float>::infinity())
               .exp();
  auto b = beta.unsqueeze(-1);
  auto kb = k * b;
  // (I + strict_lower(kkt))^-1 once per chunk, then two batched matmuls: cheaper than solving
  // against the 2 * d right-hand sides (small triangular solves run far below matmul speed).
  auto kkt = torch::matmul(kb, k.transpose(-1, -2)) * D;  // only its strict lower triangle is used
  auto eye = torch::eye(C, q.options()).expand_as(kkt);
  auto inv = torch::linalg_solve_triangular(kkt, eye, /*upper=*/false, /*left=*/true,
                                            /*unitriangular=*/true);
  ChunkTerms t;
  t.u = torch::matmul(inv, v * b);
  t.wq = torch::cat({torch::matmul(inv, kb * G_exp), q * G_exp}, 2);
  t.attn = torch::matmul(q, k.transpose(-1, -2)) * D;
  auto G_last = G.narrow(-1, C - 1, 1);  // [N, H, 1]
  t.k_decayed_t = (k * (G_last - G).exp().unsqueeze(-1)).transpose(-1, -2);
  t.chunk_decay = G_last.exp().unsqueeze(-1);
  return t;
}

}  // namespace

// ---- the gated delta rule ----

DeltaRuleLayout DeltaRuleLayout::Make(const std::vector<int64_t>& cu_seqlens, torch::Device device,
                                      int64_t chunk) {
  const int64_t B = static_cast<int64_t>(cu_seqlens.size()) - 1, T = cu_seqlens.back();
  std::vector<int64_t> doc_pos(T), chunks(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = cu_seqlens[b + 1] - cu_seqlens[b];
    chunks[b] = (len + chunk - 1) / chunk;
    std::iota(doc_pos.begin() + cu_seqlens[b], doc_pos.begin() + cu_seqlens[b + 1], 0);
  }
  std::vector<int64_t> order(B);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return chunks[a] > chunks[b]; });

  DeltaRuleLayout layout;
  layout.chunk = chunk;
  layout.cu_seqlens = cu_seqlens;
  std::vector<int64_t> gather, scatter(T);
  layout.step_offsets.push_back(0);
  const int64_t steps = B > 0 ? chunks[order[0]] : 0;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t b : order) {
      if (chunks[b] <= s) break;  // sorted: no later document has an s-th chunk either
      for (int64_t p = 0; p < chunk; ++p) {
        const int64_t t = cu_seqlens[b] + s * chunk + p;
        if (t < cu_seqlens[b + 1]) scatter[t] = static_cast<int64_t>(gather.size());
        gather.push_back(t < cu_seqlens[b + 1] ? t : T);
      }
    }
    layout.step_offsets.push_back(static_cast<int64_t>(gather.size()) / chunk);
  }
  layout.doc_pos = HostIndex(doc_pos, device);
  layout.gather = HostIndex(gather, device);
  layout.scatter = HostIndex(scatter, device);
  return layout;
}

torch::Tensor GatedDeltaRuleRecurrent(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& g,
                                      const torch::Tensor& beta,
                                      const std::vector<int64_t>& cu_seqlens) {
  const int64_t H = q.size(1), dk = k.size(2), dv = v.size(2);
  auto decay = g.exp().view({-1, H, 1, 1});
  std::vector<torch::Tensor> outs;
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    auto S = torch::zeros({H, dk, dv}, v.options());
    for (int64_t t = cu_seqlens[b]; t < cu_seqlens[b + 1]; ++t) {
      S = S * decay[t];
      auto kt = k[t].unsqueeze(-1);                                   // [H, dk, 1]
      auto delta = (v[t] - (S * kt).sum(1)) * beta[t].unsqueeze(-1);  // beta (v - S^T k)  [H, dv]
      S = S + kt * delta.unsqueeze(1);
      outs.push_back((S * q[t].unsqueeze(-1)).sum(1));  // S^T q  [H, dv]
    }
  }
  if (outs.empty()) return torch::zeros({0, H, dv}, v.options());
  return torch::stack(outs, 0);
}

torch::Tensor GatedDeltaRuleChunked(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& g,
                                    const torch::Tensor& beta, const DeltaRuleLayout& layout) {
  if (layout.num_chunks() == 0) return torch::zeros({0, v.size(1), v.size(2)}, v.options());
  auto qc = ToChunks(q, layout);
  ChunkTerms c = IntraChunk(qc, ToChunks(k, layout), ToChunks(v, layout), ToChunks(g, layout),
                            ToChunks(beta, layout));
  // The scan: step s advances every document that has an s-th chunk; those are the first n of the
  // previous step's documents, so the state batch S [n, H, dk, dv] only shrinks.
  const int64_t C = layout.chunk;
  std::vector<torch::Tensor> outs;
  torch::Tensor S;
  for (size_t s = 0; s + 1 < layout.step_offsets.size(); ++s) {
    const int64_t off = layout.step_offsets[s], n = layout.step_offsets[s + 1] - off;
    auto u = c.u.narrow(0, off, n), attn = c.attn.narrow(0, off, n);
    auto k_decayed_t = c.k_decayed_t.narrow(0, off, n);
    if (s == 0) {  // zero state: V' = U and the old state contributes nothing
      outs.push_back(torch::matmul(attn, u));
      S = torch::matmul(k_decayed_t, u);
      continue;
    }
    S = S.narrow(0, 0, n);
    auto reads = torch::matmul(c.wq.narrow(0, off, n), S);  // [W S | exp(G) Q S]
    auto v_new = u - reads.narrow(2, 0, C);
    outs.push_back(reads.narrow(2, C, C) + torch::matmul(attn, v_new));
    S = S * c.chunk_decay.narrow(0, off, n) + torch::matmul(k_decayed_t, v_new);
  }
  return FromChunks(torch::cat(outs, 0), layout);
}

// ---- modules ----

CausalConv1dImpl::CausalConv1dImpl(int64_t channels, int64_t kernel) {
  weight = register_parameter("weight", torch::empty({channels, 1, kernel}));
}

torch::Tensor CausalConv1dImpl::forward(const torch::Tensor& x, const torch::Tensor& doc_pos) {
  const int64_t T = x.size(0), K = weight.size(2);
  auto w = weight.squeeze(1);  // [C, K]; tap K-1 sees x_t, tap K-1-j sees x_{t-j}
  auto y = x * w.select(1, K - 1);
  for (int64_t j = 1; j < std::min(K, T); ++j) {
    y.narrow(0, j, T - j).addcmul_(x.narrow(0, 0, T - j), w.select(1, K - 1 - j));
  }
  // Rows less than K-1 tokens into a document other than the first took taps from the previous
  // document: recompute them the same way with those taps' inputs zeroed (exactly as if alone).
  auto t = torch::arange(T, doc_pos.options());
  auto rows = torch::nonzero((doc_pos < K - 1) & (t > doc_pos)).squeeze(1);
  if (rows.numel() == 0) return y;
  auto pos = doc_pos.index_select(0, rows).unsqueeze(1);
  auto fixed = x.index_select(0, rows) * w.select(1, K - 1);
  for (int64_t j = 1; j < K; ++j) {
    auto earlier = x.index_select(0, (rows - j).clamp_min(0)) * (pos >= j).to(x.scalar_type());
    fixed.addcmul_(earlier, w.select(1, K - 1 - j));
  }
  return y.index_copy(0, rows, fixed);
}

RMSNormGatedImpl::RMSNormGatedImpl(int64_t dim, double eps) : eps(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormGatedImpl::forward(const torch::Tensor& x, const torch::Tensor& gate) {
  const auto in_dtype = x.scalar_type();
  auto h = x.to(torch::kFloat32);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (weight * h.to(in_dtype) * torch::silu(gate.to(torch::kFloat32))).to(in_dtype);
}

Qwen3NextGatedDeltaNetImpl::Qwen3NextGatedDeltaNetImpl(const ModelConfig& c)
    : num_k_heads_(c.linear_num_key_heads),
      num_v_heads_(c.linear_num_value_heads),
      head_k_dim_(c.linear_key_head_dim),
      head_v_dim_(c.linear_value_head_dim) {
  const int64_t key_dim = num_k_heads_ * head_k_dim_, value_dim = num_v_heads_ * head_v_dim_;
  in_proj_qkvz =
      register_module("in_proj_qkvz", Linear(c.hidden_size, 2 * key_dim + 2 * value_dim));
  in_proj_ba = register_module("in_proj_ba", Linear(c.hidden_size, 2 * num_v_heads_));
  conv1d =
      register_module("conv1d", CausalConv1d(2 * key_dim + value_dim, c.linear_conv_kernel_dim));
  dt_bias = register_parameter("dt_bias", torch::ones({num_v_heads_}));
  A_log = register_parameter("A_log", torch::zeros({num_v_heads_}));
  norm = register_module("norm", RMSNormGated(head_v_dim_, c.rms_norm_eps));
  out_proj = register_module("out_proj", Linear(value_dim, c.hidden_size));
}

torch::Tensor Qwen3NextGatedDeltaNetImpl::forward(const torch::Tensor& x,
                                                  const DeltaRuleLayout& layout) {
  const int64_t T = x.size(0), r = num_v_heads_ / num_k_heads_;
  const int64_t dk = head_k_dim_, dv = head_v_dim_;
  const int64_t key_dim = num_k_heads_ * dk;
  // Grouped per key head: [q | k | v of its r value heads | z of its r value heads], [b | a].
  auto qkvz = in_proj_qkvz(x).view({T, num_k_heads_, 2 * dk + 2 * r * dv});
  auto ba = in_proj_ba(x).view({T, num_k_heads_, 2 * r});
  auto z = qkvz.narrow(2, 2 * dk + r * dv, r * dv).reshape({T, num_v_heads_, dv});
  auto qkv = torch::cat(
      {qkvz.narrow(2, 0, dk).reshape({T, key_dim}), qkvz.narrow(2, dk, dk).reshape({T, key_dim}),
       qkvz.narrow(2, 2 * dk, r * dv).reshape({T, num_v_heads_ * dv})},
      1);
  qkv = torch::silu(conv1d(qkv, layout.doc_pos));
  auto q = qkv.narrow(1, 0, key_dim).view({T, num_k_heads_, dk});
  auto k = qkv.narrow(1, key_dim, key_dim).view({T, num_k_heads_, dk});
  auto v = qkv.narrow(1, 2 * key_dim, num_v_heads_ * dv).view({T, num_v_heads_, dv});

  auto beta = torch::sigmoid(ba.narrow(2, 0, r).reshape({T, num_v_heads_}));
  auto a = ba.narrow(2, r, r).reshape({T, num_v_heads_});
  auto g = -A_log.to(torch::kFloat32).exp() *
           torch::nn::functional::softplus(a.to(torch::kFloat32) + dt_bias);

  // The rule runs in fp32 with L2-normalised q/k; each key head serves r consecutive value heads.
  auto qf = L2Normalize(q.to(torch::kFloat32)) * (1.0 / std::sqrt(static_cast<double>(dk)));
  auto kf = L2Normalize(k.to(torch::kFloat32));
  auto vf = v.to(torch::kFloat32), bf = beta.to(torch::kFloat32);
  torch::Tensor o;
  if (UseCpuInferenceDeltaRule(qf, kf, vf, g, bf)) {  // reads key head h / r itself
    o = GatedDeltaRuleInferenceCpu(qf, kf, vf, g, bf, layout.cu_seqlens, layout.chunk);
  } else {
    if (r > 1) {
      qf = qf.repeat_interleave(r, 1);
      kf = kf.repeat_interleave(r, 1);
    }
    o = GatedDeltaRuleChunked(qf, kf, vf, g, bf, layout);
  }
  o = o.to(x.scalar_type());
  return out_proj(norm(o, z).reshape({T, num_v_heads_ * dv}));
}

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

torch::Tensor Qwen3NextAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                              const torch::Tensor& sin,
                                              const std::vector<int64_t>& cu_seqlens) {
  const int64_t T = x.size(0);
  auto q_gate = q_proj(x).view({T, heads_, 2 * head_dim_});  // per head [query | gate]
  auto q = rope_.Apply(q_norm(q_gate.narrow(2, 0, head_dim_)), cos, sin);
  auto gate = q_gate.narrow(2, head_dim_, head_dim_);
  auto k = rope_.Apply(k_norm(k_proj(x).view({T, kv_heads_, head_dim_})), cos, sin);
  auto v = v_proj(x).view({T, kv_heads_, head_dim_});
  auto o =
      VarlenCausalAttention(q, k, v, cu_seqlens, 1.0 / std::sqrt(static_cast<double>(head_dim_)));
  return o_proj((o * torch::sigmoid(gate)).reshape({T, heads_ * head_dim_}));
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
  return routed + torch::sigmoid(shared_expert_gate(x)) * shared_expert(x);
}

Qwen3NextDecoderLayerImpl::Qwen3NextDecoderLayerImpl(const ModelConfig& c, int64_t layer) {
  input_layernorm =
      register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, true));
  if (c.IsFullAttentionLayer(layer)) {
    self_attn = register_module("self_attn", Qwen3NextAttention(c));
  } else {
    linear_attn = register_module("linear_attn", Qwen3NextGatedDeltaNet(c));
  }
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, true));
  if (c.IsMoeLayer(layer)) {
    moe = register_module("mlp", Qwen3NextSparseMoeBlock(c));
  } else {
    dense = register_module("mlp", DenseMlp(c.hidden_size, c.intermediate_size));
  }
}

torch::Tensor Qwen3NextDecoderLayerImpl::forward(const torch::Tensor& h,
                                                 const Qwen3NextStep& step) {
  auto x = input_layernorm(h);
  auto mixed = linear_attn ? linear_attn(x, *step.layout)
                           : self_attn(x, step.cos, step.sin, *step.cu_seqlens);
  auto h1 = h + mixed;
  x = post_attention_layernorm(h1);
  if (!moe) return h1 + dense(x);
  torch::Tensor logits;
  auto y = moe(x, step.router_logits ? &logits : nullptr);
  if (step.router_logits) step.router_logits->push_back(logits);
  return h1 + y;
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
  if (!config_.tie_word_embeddings) {
    lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size));
  }
}

torch::Tensor Qwen3NextForCausalLM::Forward(const PackedBatch& batch, const ForwardOptions& opts) {
  TORCH_CHECK(opts.cache == nullptr,
              "Qwen3-Next is served for scoring only: prefill into a KV cache is not implemented");
  auto [cos, sin] = rope_.Tables(batch.position_ids);
  const auto layout = DeltaRuleLayout::Make(batch.cu_seqlens, batch.input_ids.device());
  const Qwen3NextStep step{cos, sin, &batch.cu_seqlens, &layout, opts.router_logits};
  auto h = model->embed_tokens(batch.input_ids);
  for (size_t i = 0; i < model->layers->size(); ++i) {
    h = model->layers->ptr<Qwen3NextDecoderLayerImpl>(i)->forward(h, step);
  }
  return model->norm(h);
}

torch::Tensor Qwen3NextForCausalLM::Decode(const torch::Tensor&, KVCache&) {
  TORCH_CHECK(false,
              "Qwen3-Next is served for scoring only: incremental decode is not implemented");
  return {};
}

KVCache Qwen3NextForCausalLM::NewKVCache(int64_t, int64_t) const {
  TORCH_CHECK(false, "Qwen3-Next is served for scoring only: it has no KV cache");
  return {};
}

torch::Tensor Qwen3NextForCausalLM::LmHeadWeight() {
  return lm_head ? lm_head->weight : model->embed_tokens->weight;
}

std::vector<std::string> Qwen3NextForCausalLM::TiedAliases() const {
  if (config_.tie_word_embeddings) return {"lm_head.weight"};
  return {};
}

}  // namespace lm
