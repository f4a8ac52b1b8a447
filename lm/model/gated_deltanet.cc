#include "lm/model/gated_deltanet.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <torch/torch.h>

#include "lm/model/batch_invariant.h"
#include "lm/model/fast_paths.h"

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
  layout.order = std::move(order);
  layout.doc_pos = HostIndex(doc_pos, device);
  layout.gather = HostIndex(gather, device);
  layout.scatter = HostIndex(scatter, device);
  return layout;
}

Qwen3NextPagedPlan Qwen3NextPagedPlan::Make(const PagedStep& step, int64_t conv_kernel,
                                            torch::Device device) {
  Qwen3NextPagedPlan plan;
  std::vector<int64_t> prefill_rows, prefill_slots, decode_rows, decode_slots, cu{0};
  std::vector<int64_t> continue_rows, continue_slots, continue_cu{0};
  for (int64_t b = 0; b < step.num_sequences(); ++b) {
    const int64_t start = step.cu_seqlens[b], n = step.cu_seqlens[b + 1] - start;
    TORCH_CHECK(b < static_cast<int64_t>(step.state_slots.size()),
                "Qwen3-Next paged step: sequence ", b, " has no state slot");
    if (step.context_lens[b] == 0) {
      for (int64_t t = start; t < start + n; ++t) prefill_rows.push_back(t);
      prefill_slots.push_back(step.state_slots[b]);
      cu.push_back(cu.back() + n);
    } else if (n == 1) {
      decode_rows.push_back(start);
      decode_slots.push_back(step.state_slots[b]);
    } else {
      for (int64_t t = start; t < start + n; ++t) continue_rows.push_back(t);
      continue_slots.push_back(step.state_slots[b]);
      continue_cu.push_back(continue_cu.back() + n);
    }
  }
  plan.prefills = static_cast<int64_t>(prefill_slots.size());
  plan.decodes = static_cast<int64_t>(decode_slots.size());
  plan.continues = static_cast<int64_t>(continue_slots.size());
  plan.all_prefill = plan.decodes == 0 && plan.continues == 0;
  plan.prefill_rows = HostIndex(prefill_rows, device);
  plan.prefill_slots = HostIndex(prefill_slots, device);
  plan.decode_rows = HostIndex(decode_rows, device);
  plan.decode_slots = HostIndex(decode_slots, device);
  if (plan.prefills > 0) plan.prefill_layout = DeltaRuleLayout::Make(cu, device);
  if (plan.continues == 0) return plan;
  plan.continue_rows = HostIndex(continue_rows, device);
  plan.continue_slots = HostIndex(continue_slots, device);
  plan.continue_layout = DeltaRuleLayout::Make(continue_cu, device);
  // Sequence i's conv input: its window (rows i (K-1) .. of the windows) then its chunk (rows
  // after all windows).
  const int64_t w = conv_kernel - 1, windows = plan.continues * w;
  std::vector<int64_t> gather, pos, keep;
  plan.window_cu.push_back(0);
  for (int64_t i = 0; i < plan.continues; ++i) {
    for (int64_t j = 0; j < w; ++j) gather.push_back(i * w + j);
    for (int64_t t = continue_cu[i]; t < continue_cu[i + 1]; ++t) {
      keep.push_back(static_cast<int64_t>(gather.size()));
      gather.push_back(windows + t);
    }
    const int64_t len = static_cast<int64_t>(gather.size()) - plan.window_cu.back();
    for (int64_t p = 0; p < len; ++p) pos.push_back(p);
    plan.window_cu.push_back(static_cast<int64_t>(gather.size()));
  }
  plan.window_gather = HostIndex(gather, device);
  plan.window_pos = HostIndex(pos, device);
  plan.window_keep = HostIndex(keep, device);
  return plan;
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
                                    const torch::Tensor& beta, const DeltaRuleLayout& layout,
                                    torch::Tensor* final_state,
                                    const torch::Tensor* initial_state) {
  const int64_t B = static_cast<int64_t>(layout.order.size());
  const int64_t H = v.size(1), dk = k.size(2), dv = v.size(2);
  if (initial_state)
    TORCH_CHECK(initial_state->sizes() == c10::IntArrayRef({B, H, dk, dv}),
                "delta rule: initial state ", initial_state->sizes(), " for ", B, " documents of [",
                H, ", ", dk, ", ", dv, "]");
  // A document's state is final after the step of its last chunk; documents without tokens keep
  // their initial state (zero unless given).
  std::vector<torch::Tensor> finals(final_state ? B : 0);
  auto finish = [&](const torch::Tensor& S, size_t s) {
    if (!final_state) return;
    const int64_t n = S.size(0);
    const int64_t n_next = s + 2 < layout.step_offsets.size()
                               ? layout.step_offsets[s + 2] - layout.step_offsets[s + 1]
                               : 0;
    for (int64_t i = n_next; i < n; ++i) finals[layout.order[i]] = S[i];
  };
  auto collect = [&] {
    if (!final_state) return;
    auto zero = torch::zeros({H, dk, dv}, v.options());
    for (int64_t b = 0; b < B; ++b)
      if (!finals[b].defined()) finals[b] = initial_state ? (*initial_state)[b] : zero;
    *final_state = B > 0 ? torch::stack(finals, 0) : torch::zeros({0, H, dk, dv}, v.options());
  };
  if (layout.num_chunks() == 0) {
    collect();
    return torch::zeros({0, v.size(1), v.size(2)}, v.options());
  }
  auto qc = ToChunks(q, layout);
  ChunkTerms c = IntraChunk(qc, ToChunks(k, layout), ToChunks(v, layout), ToChunks(g, layout),
                            ToChunks(beta, layout));
  // The scan: step s advances every document that has an s-th chunk; those are the first n of the
  // previous step's documents, so the state batch S [n, H, dk, dv] only shrinks.
  const int64_t C = layout.chunk;
  std::vector<torch::Tensor> outs;
  torch::Tensor S;  // in the layout's document order
  if (initial_state)
    S = initial_state->to(torch::kFloat32).index_select(0, HostIndex(layout.order, v.device()));
  for (size_t s = 0; s + 1 < layout.step_offsets.size(); ++s) {
    const int64_t off = layout.step_offsets[s], n = layout.step_offsets[s + 1] - off;
    auto u = c.u.narrow(0, off, n), attn = c.attn.narrow(0, off, n);
    auto k_decayed_t = c.k_decayed_t.narrow(0, off, n);
    if (s == 0 && !S.defined()) {  // zero state: V' = U and the old state contributes nothing
      outs.push_back(torch::matmul(attn, u));
      S = torch::matmul(k_decayed_t, u);
      finish(S, s);
      continue;
    }
    S = S.narrow(0, 0, n);
    auto reads = torch::matmul(c.wq.narrow(0, off, n), S);  // [W S | exp(G) Q S]
    auto v_new = u - reads.narrow(2, 0, C);
    outs.push_back(reads.narrow(2, C, C) + torch::matmul(attn, v_new));
    S = S * c.chunk_decay.narrow(0, off, n) + torch::matmul(k_decayed_t, v_new);
    finish(S, s);
  }
  collect();
  return FromChunks(torch::cat(outs, 0), layout);
}

torch::Tensor GatedDeltaRuleStep(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& g,
                                 const torch::Tensor& beta, torch::Tensor& state) {
  const int64_t B = v.size(0), H = v.size(1), dk = k.size(2), dv = v.size(2);
  const int64_t r = H / k.size(1);
  TORCH_CHECK(state.is_contiguous() && state.sizes() == c10::IntArrayRef({B, H, dk, dv}),
              "delta rule step: expected a contiguous state [", B, ", ", H, ", ", dk, ", ", dv,
              "], got ", state.sizes());
  // Batched matrix-vector products and an in-place rank-1 update: the broadcast form
  // ((S * k).sum(-2), S + k * delta) makes a state-sized temporary per product.
  auto qh = (r > 1 ? q.repeat_interleave(r, 1) : q).reshape({B * H, 1, dk});
  auto kh = (r > 1 ? k.repeat_interleave(r, 1) : k).reshape({B * H, 1, dk});
  auto S = state.view({B * H, dk, dv});
  S.mul_(g.exp().reshape({B * H, 1, 1}));
  auto kv_mem = torch::bmm(kh, S);  // S^T k  [BH, 1, dv]
  auto delta = (v.reshape({B * H, 1, dv}) - kv_mem) * beta.reshape({B * H, 1, 1});
  S.baddbmm_(kh.transpose(1, 2), delta);      // S += k delta^T
  return torch::bmm(qh, S).view({B, H, dv});  // S^T q
}

// ---- modules ----

CausalConv1dImpl::CausalConv1dImpl(int64_t channels, int64_t kernel) {
  weight = register_parameter("weight", torch::empty({channels, 1, kernel}));
}

torch::Tensor CausalConv1dImpl::forward(const torch::Tensor& x, const torch::Tensor& doc_pos) {
  // bf16: the taps accumulate in fp32 and the sum is rounded once, as F.conv1d (transformers)
  // does; rounding after every tap in bf16 moved Qwen3-Next's log-probs by 0.05 nats.
  if (x.scalar_type() != torch::kFloat32)
    return forward(x.to(torch::kFloat32), doc_pos).to(x.scalar_type());
  const int64_t T = x.size(0), K = weight.size(2);
  auto w = weight.squeeze(1).to(torch::kFloat32);  // [C, K]; tap K-1 sees x_t, K-1-j x_{t-j}
  // Batch-invariant: a product and a sum per tap (each rounded once on every path); addcmul's
  // scalar tail may fuse them into one FMA where its vector loop does not.
  const bool invariant = BatchInvariant();
  auto tap = [invariant](torch::Tensor acc, const torch::Tensor& in, const torch::Tensor& w) {
    if (invariant) return acc.add_(in * w);
    return acc.addcmul_(in, w);
  };
  auto y = x * w.select(1, K - 1);
  for (int64_t j = 1; j < std::min(K, T); ++j)
    tap(y.narrow(0, j, T - j), x.narrow(0, 0, T - j), w.select(1, K - 1 - j));
  // Rows less than K-1 tokens into a document other than the first took taps from the previous
  // document: recompute them the same way with those taps' inputs zeroed (exactly as if alone).
  auto t = torch::arange(T, doc_pos.options());
  auto rows = torch::nonzero((doc_pos < K - 1) & (t > doc_pos)).squeeze(1);
  if (rows.numel() == 0) return y;
  auto pos = doc_pos.index_select(0, rows).unsqueeze(1);
  auto fixed = x.index_select(0, rows) * w.select(1, K - 1);
  for (int64_t j = 1; j < K; ++j) {
    auto earlier = x.index_select(0, (rows - j).clamp_min(0)) * (pos >= j).to(x.scalar_type());
    tap(fixed, earlier, w.select(1, K - 1 - j));
  }
  return y.index_copy(0, rows, fixed);
}

torch::Tensor CausalConv1dImpl::step(const torch::Tensor& x, torch::Tensor& state) {
  // window [B, K, C]: x_{t-K+1} .. x_t, tap i multiplies x_{t-K+1+i}
  auto window = torch::cat({state, x.unsqueeze(1)}, 1);
  auto y = (window * weight.squeeze(1).t().unsqueeze(0)).sum(1);
  state = window.narrow(1, 1, window.size(1) - 1).contiguous();
  return y;
}

torch::Tensor CausalConv1dImpl::LastInputs(const torch::Tensor& x,
                                           const std::vector<int64_t>& cu_seqlens) const {
  const int64_t K = weight.size(2), T = x.size(0);
  std::vector<int64_t> rows;  // row T of the padded input is zero
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    for (int64_t j = K - 1; j >= 1; --j) {
      const int64_t t = cu_seqlens[b + 1] - j;
      rows.push_back(t >= cu_seqlens[b] ? t : T);
    }
  }
  auto padded = torch::cat({x, torch::zeros_like(x.narrow(0, 0, 1))}, 0);
  const int64_t B = static_cast<int64_t>(cu_seqlens.size()) - 1;
  return padded.index_select(0, HostIndex(rows, x.device())).view({B, K - 1, x.size(1)});
}

RMSNormGatedImpl::RMSNormGatedImpl(int64_t dim, double eps) : eps(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormGatedImpl::forward(const torch::Tensor& x, const torch::Tensor& gate) {
  const auto in_dtype = x.scalar_type();
  auto h = x.to(torch::kFloat32);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (weight * h.to(in_dtype) * pointwise::Silu(gate.to(torch::kFloat32))).to(in_dtype);
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

Qwen3NextGatedDeltaNetImpl::Mixed Qwen3NextGatedDeltaNetImpl::Project(const torch::Tensor& x) {
  const int64_t N = x.size(0), r = num_v_heads_ / num_k_heads_;
  const int64_t dk = head_k_dim_, dv = head_v_dim_, key_dim = num_k_heads_ * dk;
  // Grouped per key head: [q | k | v of its r value heads | z of its r value heads], [b | a].
  auto qkvz = in_proj_qkvz(x).view({N, num_k_heads_, 2 * dk + 2 * r * dv});
  auto ba = in_proj_ba(x).view({N, num_k_heads_, 2 * r});
  Mixed m;
  m.z = qkvz.narrow(2, 2 * dk + r * dv, r * dv).reshape({N, num_v_heads_, dv});
  m.qkv = torch::cat(
      {qkvz.narrow(2, 0, dk).reshape({N, key_dim}), qkvz.narrow(2, dk, dk).reshape({N, key_dim}),
       qkvz.narrow(2, 2 * dk, r * dv).reshape({N, num_v_heads_ * dv})},
      1);
  m.b = ba.narrow(2, 0, r).reshape({N, num_v_heads_});
  m.a = ba.narrow(2, r, r).reshape({N, num_v_heads_});
  return m;
}

Qwen3NextGatedDeltaNetImpl::RuleInputs Qwen3NextGatedDeltaNetImpl::Prepare(const torch::Tensor& qkv,
                                                                           const Mixed& m) {
  const int64_t N = qkv.size(0), dk = head_k_dim_, dv = head_v_dim_;
  const int64_t key_dim = num_k_heads_ * dk;
  auto q = qkv.narrow(1, 0, key_dim).view({N, num_k_heads_, dk});
  auto k = qkv.narrow(1, key_dim, key_dim).view({N, num_k_heads_, dk});
  auto v = qkv.narrow(1, 2 * key_dim, num_v_heads_ * dv).view({N, num_v_heads_, dv});
  RuleInputs in;
  // The rule runs in fp32 with L2-normalised q/k; each key head serves r consecutive value heads.
  in.q = L2Normalize(q.to(torch::kFloat32)) * (1.0 / std::sqrt(static_cast<double>(dk)));
  in.k = L2Normalize(k.to(torch::kFloat32));
  in.v = v.to(torch::kFloat32);
  in.beta = pointwise::Sigmoid(m.b).to(torch::kFloat32);
  in.g = -A_log.to(torch::kFloat32).exp() * pointwise::Softplus(m.a.to(torch::kFloat32) + dt_bias);
  return in;
}

torch::Tensor Qwen3NextGatedDeltaNetImpl::Output(const torch::Tensor& o, const Mixed& m,
                                                 torch::ScalarType dtype) {
  return out_proj(norm(o.to(dtype), m.z).reshape({o.size(0), num_v_heads_ * head_v_dim_}));
}

torch::Tensor Qwen3NextGatedDeltaNetImpl::forward(const torch::Tensor& x,
                                                  const DeltaRuleLayout& layout,
                                                  torch::Tensor* conv_state,
                                                  torch::Tensor* recurrent_state) {
  const int64_t r = num_v_heads_ / num_k_heads_;
  Mixed m = Project(x);
  if (conv_state) *conv_state = conv1d->LastInputs(m.qkv, layout.cu_seqlens);
  RuleInputs in = Prepare(pointwise::Silu(conv1d(m.qkv, layout.doc_pos)), m);
  torch::Tensor o;
  if (const auto fast = FastPathsFor(in.q.device().type()).gated_delta_rule)  // groups heads itself
    o = fast(in.q, in.k, in.v, in.g, in.beta, layout.cu_seqlens, layout.chunk, recurrent_state);
  if (!o.defined()) {
    auto qf = r > 1 ? in.q.repeat_interleave(r, 1) : in.q;
    auto kf = r > 1 ? in.k.repeat_interleave(r, 1) : in.k;
    o = GatedDeltaRuleChunked(qf, kf, in.v, in.g, in.beta, layout, recurrent_state);
  }
  return Output(o, m, x.scalar_type());
}

torch::Tensor Qwen3NextGatedDeltaNetImpl::decode(const torch::Tensor& x, torch::Tensor& conv_state,
                                                 torch::Tensor& recurrent_state) {
  Mixed m = Project(x);
  RuleInputs in = Prepare(torch::silu(conv1d->step(m.qkv, conv_state)), m);
  auto o = GatedDeltaRuleStep(in.q, in.k, in.v, in.g, in.beta, recurrent_state);
  return Output(o, m, x.scalar_type());
}

torch::Tensor Qwen3NextGatedDeltaNetImpl::paged(const torch::Tensor& x, torch::Tensor& conv_slots,
                                                torch::Tensor& recurrent_slots,
                                                const Qwen3NextPagedPlan& plan) {
  if (plan.all_prefill) {
    torch::Tensor conv, rec;
    auto y = forward(x, plan.prefill_layout, &conv, &rec);
    conv_slots.index_copy_(0, plan.prefill_slots, conv);
    recurrent_slots.index_copy_(0, plan.prefill_slots, rec.to(recurrent_slots.scalar_type()));
    return y;
  }
  auto out = torch::empty_like(x);
  if (plan.prefills > 0) {
    torch::Tensor conv, rec;
    auto y = forward(x.index_select(0, plan.prefill_rows), plan.prefill_layout, &conv, &rec);
    conv_slots.index_copy_(0, plan.prefill_slots, conv);
    recurrent_slots.index_copy_(0, plan.prefill_slots, rec.to(recurrent_slots.scalar_type()));
    out.index_copy_(0, plan.prefill_rows, y);
  }
  if (plan.continues > 0) {
    out.index_copy_(
        0, plan.continue_rows,
        Continue(x.index_select(0, plan.continue_rows), conv_slots, recurrent_slots, plan));
  }
  if (plan.decodes > 0) {
    auto conv = conv_slots.index_select(0, plan.decode_slots);
    auto rec = recurrent_slots.index_select(0, plan.decode_slots);
    auto y = decode(x.index_select(0, plan.decode_rows), conv, rec);
    conv_slots.index_copy_(0, plan.decode_slots, conv);
    recurrent_slots.index_copy_(0, plan.decode_slots, rec);
    out.index_copy_(0, plan.decode_rows, y);
  }
  return out;
}

torch::Tensor Qwen3NextGatedDeltaNetImpl::Continue(const torch::Tensor& x,
                                                   torch::Tensor& conv_slots,
                                                   torch::Tensor& recurrent_slots,
                                                   const Qwen3NextPagedPlan& plan) {
  const int64_t r = num_v_heads_ / num_k_heads_;
  Mixed m = Project(x);
  // The conv reads each chunk after its window, as if the sequence had run whole: its first K-1
  // outputs are the window's and dropped; its last K-1 inputs are the next window.
  const auto windows = conv_slots.index_select(0, plan.continue_slots);  // [Bc, K-1, C]
  const auto input = torch::cat({windows.reshape({-1, windows.size(2)}), m.qkv}, 0)
                         .index_select(0, plan.window_gather);
  const auto conv = conv1d(input, plan.window_pos).index_select(0, plan.window_keep);
  conv_slots.index_copy_(0, plan.continue_slots, conv1d->LastInputs(input, plan.window_cu));
  RuleInputs in = Prepare(torch::silu(conv), m);
  // The reference chunked form: the CPU kernel (FastPaths::gated_delta_rule) starts from zero.
  const auto initial = recurrent_slots.index_select(0, plan.continue_slots);
  torch::Tensor final_state;
  auto qf = r > 1 ? in.q.repeat_interleave(r, 1) : in.q;
  auto kf = r > 1 ? in.k.repeat_interleave(r, 1) : in.k;
  auto o = GatedDeltaRuleChunked(qf, kf, in.v, in.g, in.beta, plan.continue_layout, &final_state,
                                 &initial);
  recurrent_slots.index_copy_(0, plan.continue_slots,
                              final_state.to(recurrent_slots.scalar_type()));
  return Output(o, m, x.scalar_type());
}

}  // namespace lm
