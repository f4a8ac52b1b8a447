#include "lm/model/paged_kv.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include <torch/torch.h>

#include "lm/model/fast_paths.h"

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

namespace {

torch::Tensor I64(const std::vector<int64_t>& x, torch::Device device) {
  return torch::tensor(x, torch::kInt64).to(device);
}

// A host tensor on `device`: to a GPU through pinned memory without blocking the host (the
// caching host allocator keeps the buffer until the copy is done).
torch::Tensor ToDevice(const torch::Tensor& host, torch::Device device) {
  if (device.is_cpu()) return host;
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

// The step's block tables [B, max_blocks] int32 (the null block 0 past a table's end) and lengths
// [B] int32: what decode attention reads, sent to the device once per step.
void SetBlockTables(const PagedStep& step, torch::Device device, PagedAttentionMeta& m) {
  const int64_t B = step.num_sequences();
  int64_t width = 1;
  for (const auto& t : step.block_tables) width = std::max<int64_t>(width, t.size());
  auto tables = torch::zeros({B, width}, torch::kInt32);
  auto lens = torch::empty({B}, torch::kInt32);
  int32_t* tp = tables.data_ptr<int32_t>();
  int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    std::copy(step.block_tables[b].begin(), step.block_tables[b].end(), tp + b * width);
    lp[b] =
        static_cast<int32_t>(step.context_lens[b] + step.cu_seqlens[b + 1] - step.cu_seqlens[b]);
  }
  m.block_tables = ToDevice(tables, device);
  m.seq_lens = ToDevice(lens, device);
}

// The query padding, gather indices and mask of a step other than decode.
void SetGatherAndMask(const PagedStep& step, int64_t block_size, torch::Device device,
                      PagedAttentionMeta& m) {
  const int64_t B = m.batch, T = step.num_tokens(), Q = m.max_new, L = m.max_len;
  std::vector<int64_t> q_valid(T), q_gather(B * Q, T), kv(B * L, 0);
  std::vector<uint8_t> mask(B * Q * L, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = step.cu_seqlens[b], q = step.cu_seqlens[b + 1] - start;
    const int64_t ctx = step.context_lens[b];
    const auto& table = step.block_tables[b];
    for (int64_t j = 0; j < ctx + q; ++j)
      kv[b * L + j] = int64_t{table[j / block_size]} * block_size + j % block_size;
    for (int64_t i = 0; i < q; ++i) {
      q_valid[start + i] = b * Q + i;
      q_gather[b * Q + i] = start + i;
      // Causal: query i (position ctx + i) sees keys 0 .. ctx + i.
      std::fill_n(mask.begin() + (b * Q + i) * L, ctx + i + 1, 1);
    }
    // Padded queries see key 0 so that no softmax row is empty (their outputs are dropped).
    for (int64_t i = q; i < Q; ++i) mask[(b * Q + i) * L] = 1;
  }
  m.q_gather = I64(q_gather, device);
  m.q_valid = I64(q_valid, device);
  m.kv_gather = I64(kv, device).view({B, L});
  m.mask = torch::from_blob(mask.data(), {B, 1, Q, L}, torch::kUInt8).to(torch::kBool).to(device);
}

// OPD_PAGED_DECODE=gather sends decode steps down the general path (gather + host-built mask +
// SDPA), as before the decode kernel: for A/B benchmarks (scripts/bench.sh) only.
bool DecodeKernelDisabled() {
  static const bool off = [] {
    const char* v = std::getenv("OPD_PAGED_DECODE");
    return v != nullptr && std::string(v) == "gather";
  }();
  return off;
}

}  // namespace

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
  m.decode = m.max_new == 1 && T == B && !DecodeKernelDisabled();
  std::vector<int64_t> positions(T), slots(T), last(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = step.cu_seqlens[b], q = step.cu_seqlens[b + 1] - start;
    const int64_t ctx = step.context_lens[b];
    const auto& table = step.block_tables[b];
    for (int64_t i = 0; i < q; ++i) {
      const int64_t pos = ctx + i;
      positions[start + i] = pos;
      slots[start + i] = int64_t{table[pos / block_size]} * block_size + pos % block_size;
    }
    last[b] = start + q - 1;
  }
  m.positions = I64(positions, device);
  m.slot_mapping = I64(slots, device);
  m.last_rows = I64(last, device);
  SetBlockTables(step, device, m);
  if (!m.decode) SetGatherAndMask(step, block_size, device, m);
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
  if (meta.decode)
    return PagedDecodeAttention(q, k_pool, v_pool, meta.block_tables, meta.seq_lens, scale);
  const int64_t B = meta.batch, Q = meta.max_new, L = meta.max_len;
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_pool.size(2);
  const int64_t rows = k_pool.size(0) * k_pool.size(1);
  auto gather_kv = [&](const torch::Tensor& pool) {  // [B, Hkv, L, D]
    return pool.view({rows, Hkv, D})
        .index_select(0, meta.kv_gather.view({B * L}))
        .view({B, L, Hkv, D})
        .transpose(1, 2);
  };
  // One new token each (a decode step sent here by OPD_PAGED_DECODE=gather) needs no padding.
  const bool one_each = Q == 1 && q.size(0) == B;
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

torch::Tensor PagedDecodeAttention(const torch::Tensor& q, const torch::Tensor& k_pool,
                                   const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                                   const torch::Tensor& seq_lens, double scale) {
  if (auto* kernel = FastPathsFor(q.device().type()).paged_decode) {
    torch::Tensor o = kernel(q, k_pool, v_pool, block_tables, seq_lens, scale);
    if (o.defined()) return o;
  }
  return PagedDecodeAttentionReference(q, k_pool, v_pool, block_tables, seq_lens, scale);
}

torch::Tensor PagedDecodeAttentionReference(const torch::Tensor& q, const torch::Tensor& k_pool,
                                            const torch::Tensor& v_pool,
                                            const torch::Tensor& block_tables,
                                            const torch::Tensor& seq_lens, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_pool.size(1), Hkv = k_pool.size(2), L = block_tables.size(1) * bs;
  // Pool row of every (sequence, position) < L; positions past the length read row 0 (the null
  // block, zero) rather than rows that may hold anything.
  auto pos = torch::arange(L, block_tables.options().dtype(torch::kInt64));
  auto visible = pos.unsqueeze(0) < seq_lens.to(torch::kInt64).unsqueeze(1);  // [B, L]
  auto rows =
      block_tables.to(torch::kInt64).index_select(1, pos.div(bs, "floor")) * bs + pos.remainder(bs);
  rows = torch::where(visible, rows, torch::zeros_like(rows));
  auto gather = [&](const torch::Tensor& pool) {  // [B, Hkv, L, D]
    return pool.reshape({-1, Hkv, D})
        .index_select(0, rows.view(-1))
        .view({B, L, Hkv, D})
        .transpose(1, 2);
  };
  auto o = at::scaled_dot_product_attention(q.unsqueeze(2), gather(k_pool), gather(v_pool),
                                            visible.view({B, 1, 1, L}), 0.0, false, scale,
                                            /*enable_gqa=*/Hq != Hkv);
  return o.squeeze(2);
}

}  // namespace lm
