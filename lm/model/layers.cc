#include "lm/model/layers.h"

#include <torch/torch.h>

#include <algorithm>
#include <numeric>

#include "lm/model/batch_invariant.h"
#include "lm/model/fast_paths.h"
#include "lm/model/fp8.h"

namespace lm {

namespace F = torch::nn::functional;
using torch::indexing::Slice;

namespace {
constexpr int64_t kFewRows = 32;  // measured crossover on AVX2 + MKL (2 threads)
bool FewRows(const torch::Tensor& x) {
  return x.dim() == 2 && x.size(0) <= kFewRows && x.is_cpu();
}
}  // namespace

torch::Tensor MatmulWeightT(const torch::Tensor& x, const torch::Tensor& w) {
  if (BatchInvariant() && x.is_cpu()) {  // rows computed alone: no choice by row count
    auto rows = x.reshape({-1, x.size(-1)});
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return InvariantMatmulWeightT(rows, w).view(sizes);
  }
  return FewRows(x) ? torch::mm(w, x.t()).t().contiguous() : torch::linear(x, w);
}

void MatmulWeightTOut(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w) {
  if (BatchInvariant() && x.is_cpu()) {
    out.copy_(InvariantMatmulWeightT(x, w));
  } else if (FewRows(x)) {
    out.copy_(torch::mm(w, x.t()).t());
  } else {
    torch::mm_out(out, x, w.t());
  }
}

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features) {
  weight = register_parameter("weight", torch::empty({out_features, in_features}));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (weight_scale_inv.defined()) return Fp8Linear(x, weight, weight_scale_inv);
  return MatmulWeightT(x, weight);
}

EmbeddingImpl::EmbeddingImpl(int64_t vocab, int64_t hidden) {
  weight = register_parameter("weight", torch::empty({vocab, hidden}));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  return torch::embedding(weight, ids);
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, bool zero_centered)
    : eps(eps), zero_centered(zero_centered) {
  weight = register_parameter("weight", zero_centered ? torch::zeros({dim}) : torch::ones({dim}));
}

namespace {

bool NeedsGrad(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad());
}

}  // namespace

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  const auto fused = FastPathsFor(x.device().type()).add_rms_norm;
  torch::Tensor out, unused;
  if (fused && !zero_centered && !NeedsGrad(x, weight) &&
      fused(x, torch::Tensor(), weight, eps, &out, &unused))
    return out;
  return Reference(x);
}

torch::Tensor RMSNormImpl::AddForward(const torch::Tensor& delta, torch::Tensor& residual) {
  const auto fused = FastPathsFor(delta.device().type()).add_rms_norm;
  torch::Tensor out, sum;
  if (fused && !zero_centered && !NeedsGrad(delta, weight) && !NeedsGrad(residual, residual) &&
      fused(delta, residual, weight, eps, &out, &sum)) {
    residual = sum;
    return out;
  }
  residual = residual + delta;
  return forward(residual);
}

torch::Tensor RMSNormImpl::Reference(const torch::Tensor& x) {
  const auto in_dtype = x.scalar_type();
  auto h = x.to(torch::kFloat32);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  if (zero_centered) return (h * (1.0 + weight.to(torch::kFloat32))).to(in_dtype);
  return weight * h.to(in_dtype);
}

DenseMlpImpl::DenseMlpImpl(int64_t hidden, int64_t intermediate) {
  gate_proj = register_module("gate_proj", Linear(hidden, intermediate));
  up_proj = register_module("up_proj", Linear(hidden, intermediate));
  down_proj = register_module("down_proj", Linear(intermediate, hidden));
}

torch::Tensor DenseMlpImpl::forward(const torch::Tensor& x) {
  return down_proj(pointwise::Silu(gate_proj(x)) * up_proj(x));
}

Rope::Rope(int64_t rotary_dim, double theta) : rotary_dim_(rotary_dim) {
  // Same expression as transformers, so that the fp32 tables agree bit for bit.
  auto exponent = torch::arange(0, rotary_dim, 2, torch::kInt64).to(torch::kFloat32) / rotary_dim;
  inv_freq_ = 1.0 / torch::pow(torch::scalar_tensor(theta, torch::kFloat32), exponent);
}

torch::Tensor Rope::InvFreqOn(const torch::Device& device) const {
  if (device == inv_freq_.device()) return inv_freq_;
  std::lock_guard<std::mutex> lock(on_devices_->mu);
  for (const torch::Tensor& t : on_devices_->copies)
    if (t.device() == device) return t;
  on_devices_->copies.push_back(inv_freq_.to(device));
  return on_devices_->copies.back();
}

std::pair<torch::Tensor, torch::Tensor> Rope::Tables(const torch::Tensor& positions) const {
  auto freqs =
      positions.to(torch::kFloat32).unsqueeze(1) * InvFreqOn(positions.device()).unsqueeze(0);
  auto emb = torch::cat({freqs, freqs}, -1);  // [T, rotary_dim]
  return {pointwise::Cos(emb), pointwise::Sin(emb)};
}

torch::Tensor Rope::Apply(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin) const {
  const int64_t half = rotary_dim_ / 2;
  const bool partial = rotary_dim_ < x.size(-1);
  auto xr = partial ? x.narrow(-1, 0, rotary_dim_) : x;
  auto c = cos.unsqueeze(1).to(x.scalar_type());  // [T, 1, rotary_dim]: broadcast over heads
  auto s = sin.unsqueeze(1).to(x.scalar_type());
  auto rotated = torch::cat({-xr.narrow(-1, half, half), xr.narrow(-1, 0, half)}, -1);
  auto out = xr * c + rotated * s;
  if (!partial) return out;
  return torch::cat({out, x.narrow(-1, rotary_dim_, x.size(-1) - rotary_dim_)}, -1);
}

std::pair<torch::Tensor, torch::Tensor> QkNormRope(const torch::Tensor& q, const torch::Tensor& k,
                                                   RMSNormImpl& q_norm, RMSNormImpl& k_norm,
                                                   const Rope& rope, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, bool in_place) {
  const auto fused = FastPathsFor(q.device().type()).qk_norm_rope;
  if (fused && !q_norm.zero_centered && !k_norm.zero_centered && q_norm.eps == k_norm.eps &&
      !NeedsGrad(q, q_norm.weight) && !NeedsGrad(k, k_norm.weight) &&
      !(torch::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad()))) {
    const torch::Tensor q_out = in_place ? q : torch::empty_like(q);
    const torch::Tensor k_out = in_place ? k : torch::empty_like(k);
    if (fused(q, k, q_norm.weight, k_norm.weight, cos, sin, q_norm.eps, q_out, k_out))
      return {q_out, k_out};
  }
  return {rope.Apply(q_norm.forward(q), cos, sin), rope.Apply(k_norm.forward(k), cos, sin)};
}

namespace {

// Causal attention of one document: q/k/v [L, H, D] -> [L, Hq, D]. No mask: the kernel applies
// causality itself (on the CPU the flash kernel, which tiles the scores and reads GQA heads
// natively), so nothing [L, L] is ever materialised.
torch::Tensor DocumentAttention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, double scale) {
  auto o = at::scaled_dot_product_attention(
      q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
      v.transpose(0, 1).unsqueeze(0), /*attn_mask=*/{}, 0.0,
      /*is_causal=*/true, scale, /*enable_gqa=*/q.size(1) != k.size(1));
  return o.squeeze(0).transpose(0, 1);
}

// FlashAttention-2's varlen kernel (LibTorch's own build) takes half-precision CUDA tensors with
// head_dim a multiple of 8 up to 256; its backward is registered with autograd.
bool UseFlashVarlen(const torch::Tensor& q) {
  const auto dtype = q.scalar_type();
  const int64_t d = q.size(-1);
  return q.is_cuda() && (dtype == torch::kBFloat16 || dtype == torch::kHalf) && d % 8 == 0 &&
         d <= 256;
}

// The whole packed batch in one launch: documents are told apart by cumulative lengths (int32 on
// the device, copied from pinned memory without waiting on the stream), GQA read natively.
torch::Tensor FlashVarlenAttention(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens,
                                   double scale) {
  const int64_t n = static_cast<int64_t>(cu_seqlens.size());
  auto cu_host = torch::empty({n}, torch::TensorOptions().dtype(torch::kInt32).pinned_memory(true));
  int64_t max_len = 0;
  for (int64_t i = 0; i < n; ++i) {
    cu_host.data_ptr<int32_t>()[i] = static_cast<int32_t>(cu_seqlens[i]);
    if (i > 0) max_len = std::max(max_len, cu_seqlens[i] - cu_seqlens[i - 1]);
  }
  auto cu = cu_host.to(q.device(), /*non_blocking=*/true);
  auto out = at::_flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu,
                                          max_len, max_len, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, /*return_debug_mask=*/false, scale);
  return std::get<0>(out);
}

// Documents of similar length, padded on the right into one [n, Lmax] batch: one attention call
// instead of n (a call per document costs ~20x more than the arithmetic for short documents).
struct Bucket {
  std::vector<int64_t> docs;
  int64_t max_len = 0, tokens = 0;
};

// Groups documents (sorted by length) so that padding wastes at most ~25% of a bucket's slots.
std::vector<Bucket> MakeBuckets(const std::vector<int64_t>& cu_seqlens) {
  std::vector<int64_t> order(cu_seqlens.size() - 1);
  std::iota(order.begin(), order.end(), 0);
  auto len = [&](int64_t b) { return cu_seqlens[b + 1] - cu_seqlens[b]; };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return len(a) < len(b); });
  std::vector<Bucket> buckets;
  for (int64_t b : order) {
    const int64_t l = len(b);
    if (l == 0) continue;
    if (buckets.empty() || 4 * static_cast<int64_t>(buckets.back().docs.size() + 1) * l >
                               5 * (buckets.back().tokens + l)) {
      buckets.emplace_back();
    }
    Bucket& k = buckets.back();
    k.docs.push_back(b);
    k.max_len = std::max(k.max_len, l);
    k.tokens += l;
  }
  return buckets;
}

// A bucket's attention with no mask: each document is padded on the right, and causality alone
// keeps a real query (position i < its length) off the padding (positions >= its length > i).
// The padded queries' rows are dropped; since nothing reads them, their gradient is zero.
// Appends the packed row of each returned row to `rows`.
torch::Tensor BucketAttention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens,
                              const Bucket& bucket, double scale, std::vector<int64_t>* rows) {
  const int64_t n = static_cast<int64_t>(bucket.docs.size()), L = bucket.max_len, T = q.size(0);
  std::vector<int64_t> gather(n * L, T);  // T: the zero row appended below
  std::vector<int64_t> valid;             // positions in the [n * L] layout that are real tokens
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = cu_seqlens[bucket.docs[i]], l = cu_seqlens[bucket.docs[i] + 1] - s;
    for (int64_t t = 0; t < l; ++t) {
      gather[i * L + t] = s + t;
      valid.push_back(i * L + t);
      rows->push_back(s + t);
    }
  }
  auto idx = torch::tensor(gather, torch::kInt64).to(q.device());
  auto pad = [&](const torch::Tensor& x) {  // [T, H, D] -> [n, H, L, D]
    auto padded = torch::cat({x, torch::zeros({1, x.size(1), x.size(2)}, x.options())}, 0);
    return padded.index_select(0, idx).view({n, L, x.size(1), x.size(2)}).transpose(1, 2);
  };
  auto o = at::scaled_dot_product_attention(pad(q), pad(k), pad(v), /*attn_mask=*/{}, 0.0,
                                            /*is_causal=*/true, scale,
                                            /*enable_gqa=*/q.size(1) != k.size(1));
  o = o.transpose(1, 2).reshape({n * L, q.size(1), v.size(2)});
  return o.index_select(0, torch::tensor(valid, torch::kInt64).to(q.device()));
}

// Each document attended alone, in packed order, from copies of its rows: the same shapes,
// strides and alignment wherever it sits in the batch.
torch::Tensor PerDocumentAttention(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens,
                                   double scale) {
  std::vector<torch::Tensor> outs;
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const int64_t s = cu_seqlens[b], l = cu_seqlens[b + 1] - s;
    if (l > 0)
      outs.push_back(DocumentAttention(q.narrow(0, s, l).clone(), k.narrow(0, s, l).clone(),
                                       v.narrow(0, s, l).clone(), scale));
  }
  if (outs.empty()) return torch::empty({0, q.size(1), v.size(2)}, q.options());
  return torch::cat(outs, 0);
}

}  // namespace

torch::Tensor VarlenCausalAttention(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens,
                                    double scale) {
  TORCH_CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == q.size(0),
              "VarlenCausalAttention: cu_seqlens must run from 0 to the ", q.size(0),
              " packed rows");
  const int64_t B = static_cast<int64_t>(cu_seqlens.size()) - 1;
  // FlashAttention's varlen kernel tiles each document on its own (its tiles follow the head
  // dimension, not the batch): batch-invariant as it is.
  if (UseFlashVarlen(q)) return FlashVarlenAttention(q, k, v, cu_seqlens, scale);
  // A bucket's padded length sets the flash kernel's tiles: alone, a document's tiles are its own.
  if (BatchInvariant()) return PerDocumentAttention(q, k, v, cu_seqlens, scale);
  if (B == 1) return DocumentAttention(q, k, v, scale);
  std::vector<torch::Tensor> outs;
  std::vector<int64_t> rows;  // the packed row of each output row, in output order
  for (const Bucket& bucket : MakeBuckets(cu_seqlens)) {
    if (bucket.docs.size() == 1) {
      const int64_t s = cu_seqlens[bucket.docs[0]], l = bucket.max_len;
      outs.push_back(
          DocumentAttention(q.narrow(0, s, l), k.narrow(0, s, l), v.narrow(0, s, l), scale));
      for (int64_t t = 0; t < l; ++t) rows.push_back(s + t);
    } else {
      outs.push_back(BucketAttention(q, k, v, cu_seqlens, bucket, scale, &rows));
    }
  }
  if (outs.empty()) return torch::empty({0, q.size(1), v.size(2)}, q.options());
  // Back to packed order: output row i holds packed row rows[i].
  std::vector<int64_t> inverse(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) inverse[rows[i]] = static_cast<int64_t>(i);
  return torch::cat(outs, 0).index_select(0, torch::tensor(inverse, torch::kInt64).to(q.device()));
}

torch::Tensor CachedAttention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const std::vector<int64_t>& visible,
                              double scale) {
  const int64_t B = q.size(0);
  const int64_t L = *std::max_element(visible.begin(), visible.end());
  auto vis = torch::tensor(visible, torch::kInt64).to(q.device());
  auto mask = torch::arange(L, vis.options()).unsqueeze(0) < vis.unsqueeze(1);  // [B, L]
  auto kb = k_cache.narrow(1, 0, L).transpose(1, 2);                            // [B, Hkv, L, D]
  auto vb = v_cache.narrow(1, 0, L).transpose(1, 2);
  auto qb = q.unsqueeze(2);  // [B, Hq, 1, D]
  auto out =
      at::scaled_dot_product_attention(qb, kb, vb, mask.view({B, 1, 1, L}), 0.0, false, scale,
                                       /*enable_gqa=*/q.size(1) != k_cache.size(2));
  return out.squeeze(2);
}

void FillCache(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k,
               const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens) {
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const int64_t s = cu_seqlens[b], len = cu_seqlens[b + 1] - s;
    k_cache[b].narrow(0, 0, len).copy_(k.narrow(0, s, len));
    v_cache[b].narrow(0, 0, len).copy_(v.narrow(0, s, len));
  }
}

void AppendCache(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k,
                 const torch::Tensor& v, const std::vector<int64_t>& lengths) {
  // View the cache as rows [B * capacity, Hkv, D] and scatter one row per slot.
  const int64_t B = k_cache.size(0), cap = k_cache.size(1);
  std::vector<int64_t> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = b * cap + lengths[b];
  auto idx = torch::tensor(rows, torch::kInt64).to(k.device());
  k_cache.view({B * cap, k_cache.size(2), k_cache.size(3)}).index_copy_(0, idx, k);
  v_cache.view({B * cap, v_cache.size(2), v_cache.size(3)}).index_copy_(0, idx, v);
}

}  // namespace lm
