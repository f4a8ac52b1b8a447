#include "lm/model/paged_kv.h"

#include <algorithm>

#include <torch/torch.h>

namespace lm {

void PagedKVCache::CopyBlock(int64_t src, int64_t dst) {
  for (size_t l = 0; l < k.size(); ++l) {
    k[l][dst].copy_(k[l][src]);
    v[l][dst].copy_(v[l][src]);
  }
}

void PagedKVCache::CopyStateSlot(int64_t src, int64_t dst) {
  for (auto& s : state) s[dst].copy_(s[src]);
}

int64_t PagedKVCache::bytes() const {
  int64_t n = 0;
  for (const auto* list : {&k, &v, &state})
    for (const auto& t : *list) n += t.numel() * t.element_size();
  return n;
}

PagedAttentionMeta BuildPagedAttentionMeta(const PagedStep& step, int64_t block_size,
                                           torch::Device device) {
  const int64_t B = step.num_sequences(), T = step.num_tokens();
  PagedAttentionMeta m;
  m.batch = B;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q = step.cu_seqlens[b + 1] - step.cu_seqlens[b];
    m.max_new = std::max(m.max_new, q);
    m.max_len = std::max(m.max_len, step.context_lens[b] + q);
  }
  const int64_t Q = m.max_new, L = m.max_len;
  std::vector<int64_t> positions(T), slots(T), q_valid(T), q_gather(B * Q, T), kv(B * L, 0),
      last(B);
  std::vector<uint8_t> mask(B * Q * L, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = step.cu_seqlens[b], q = step.cu_seqlens[b + 1] - start;
    const int64_t ctx = step.context_lens[b];
    const auto& table = step.block_tables[b];
    auto row = [&](int64_t pos) {
      return int64_t{table[pos / block_size]} * block_size + pos % block_size;
    };
    for (int64_t j = 0; j < ctx + q; ++j) kv[b * L + j] = row(j);
    for (int64_t i = 0; i < q; ++i) {
      positions[start + i] = ctx + i;
      slots[start + i] = row(ctx + i);
      q_valid[start + i] = b * Q + i;
      q_gather[b * Q + i] = start + i;
      // Causal: query i (position ctx + i) sees keys 0 .. ctx + i.
      std::fill_n(mask.begin() + (b * Q + i) * L, ctx + i + 1, 1);
    }
    // Padded queries see key 0 so that no softmax row is empty (their outputs are dropped).
    for (int64_t i = q; i < Q; ++i) mask[(b * Q + i) * L] = 1;
    last[b] = start + q - 1;
  }
  auto i64 = [&](const std::vector<int64_t>& x) {
    return torch::tensor(x, torch::kInt64).to(device);
  };
  m.positions = i64(positions);
  m.slot_mapping = i64(slots);
  m.q_gather = i64(q_gather);
  m.q_valid = i64(q_valid);
  m.kv_gather = i64(kv).view({B, L});
  m.mask = torch::from_blob(mask.data(), {B, 1, Q, L}, torch::kUInt8).to(torch::kBool).to(device);
  m.last_rows = i64(last);
  return m;
}

void WritePagedKV(torch::Tensor& k_pool, torch::Tensor& v_pool, const torch::Tensor& k,
                  const torch::Tensor& v, const PagedAttentionMeta& meta) {
  const int64_t rows = k_pool.size(0) * k_pool.size(1);
  k_pool.view({rows, k_pool.size(2), k_pool.size(3)}).index_copy_(0, meta.slot_mapping, k);
  v_pool.view({rows, v_pool.size(2), v_pool.size(3)}).index_copy_(0, meta.slot_mapping, v);
}

torch::Tensor PagedAttention(const torch::Tensor& q, const torch::Tensor& k_pool,
                             const torch::Tensor& v_pool, const PagedAttentionMeta& meta,
                             double scale) {
  const int64_t B = meta.batch, Q = meta.max_new, L = meta.max_len;
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_pool.size(2);
  const int64_t rows = k_pool.size(0) * k_pool.size(1);
  auto gather_kv = [&](const torch::Tensor& pool) {  // [B, Hkv, L, D]
    return pool.view({rows, Hkv, D})
        .index_select(0, meta.kv_gather.view({B * L}))
        .view({B, L, Hkv, D})
        .transpose(1, 2);
  };
  // A decode step (one new token per sequence) needs no query padding.
  const bool one_each = Q == 1 && T == B;
  auto qb = one_each ? q.unsqueeze(2)
                     : torch::cat({q, torch::zeros({1, Hq, D}, q.options())}, 0)
                           .index_select(0, meta.q_gather)
                           .view({B, Q, Hq, D})
                           .transpose(1, 2);  // [B, Hq, Q, D]
  auto o = at::scaled_dot_product_attention(qb, gather_kv(k_pool), gather_kv(v_pool), meta.mask,
                                            0.0, false, scale, /*enable_gqa=*/Hq != Hkv);
  if (one_each) return o.squeeze(2);
  return o.transpose(1, 2).reshape({B * Q, Hq, D}).index_select(0, meta.q_valid);
}

}  // namespace lm
