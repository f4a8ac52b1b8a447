#include "lm/model/paged_kv.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include <torch/torch.h>

#include "lm/model/fast_paths.h"
#include "lm/model/layers.h"

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

// Pool row of position j of a sequence with block table `table`.
int64_t PoolRow(const std::vector<int32_t>& table, int64_t j, int64_t block_size) {
  return int64_t{table[j / block_size]} * block_size + j % block_size;
}

torch::Tensor I32ToDevice(const std::vector<int64_t>& x, torch::Device device) {
  return ToDevice(torch::tensor(x, torch::kInt64).to(torch::kInt32), device);
}

// The varlen path's indices for a step other than decode (PagedAttention): on CUDA every
// sequence's key rows and the int32 boundaries the varlen kernels take, on the CPU the rows of
// the continued sequences' contexts. Host work and memory O(context + new tokens), no mask.
void SetVarlen(const PagedStep& step, int64_t block_size, torch::Device device,
               PagedAttentionMeta& m) {
  const int64_t B = m.batch;
  m.cu_seqlens = step.cu_seqlens;
  m.context_lens = step.context_lens;
  m.all_fresh = std::all_of(step.context_lens.begin(), step.context_lens.end(),
                            [](int64_t c) { return c == 0; });
  std::vector<int64_t> rows;
  if (device.is_cuda()) {
    std::vector<int64_t> cu_k{0};
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = step.context_lens[b] + step.cu_seqlens[b + 1] - step.cu_seqlens[b];
      for (int64_t j = 0; j < len; ++j)
        rows.push_back(PoolRow(step.block_tables[b], j, block_size));
      cu_k.push_back(cu_k.back() + len);
    }
    m.key_rows = ToDevice(torch::tensor(rows, torch::kInt64), device);
    m.cu_q = I32ToDevice(step.cu_seqlens, device);
    m.cu_k = I32ToDevice(cu_k, device);
    return;
  }
  if (m.all_fresh) return;
  m.context_offsets.assign(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    m.context_offsets[b] = static_cast<int64_t>(rows.size());
    for (int64_t j = 0; j < step.context_lens[b]; ++j)
      rows.push_back(PoolRow(step.block_tables[b], j, block_size));
  }
  m.context_rows = I64(rows, device);
}

// OPD_PAGED_DECODE=gather sends decode steps down the varlen path (each sequence's K/V gathered
// from the pools), as before the decode kernel: for A/B benchmarks (scripts/bench.sh) only.
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
      positions[start + i] = ctx + i;
      slots[start + i] = PoolRow(table, ctx + i, block_size);
    }
    last[b] = start + q - 1;
  }
  m.positions = I64(positions, device);
  m.slot_mapping = I64(slots, device);
  m.last_rows = I64(last, device);
  SetBlockTables(step, device, m);
  if (!m.decode) SetVarlen(step, block_size, device, m);
  return m;
}

void WritePagedKV(torch::Tensor& k_pool, torch::Tensor& v_pool, const torch::Tensor& k,
                  const torch::Tensor& v, const PagedAttentionMeta& meta) {
  const int64_t rows = k_pool.size(0) * k_pool.size(1);
  k_pool.view({rows, k_pool.size(2), k_pool.size(3)}).index_copy_(0, meta.slot_mapping, k);
  v_pool.view({rows, v_pool.size(2), v_pool.size(3)}).index_copy_(0, meta.slot_mapping, v);
}

namespace {

// [L, H, D] -> [1, H, L, D], the layout of the CPU flash kernel.
torch::Tensor Heads(const torch::Tensor& x) {
  return x.transpose(0, 1).unsqueeze(0);
}

// The CPU: fresh sequences in one bucketed flash call, each continued one by its two parts.
torch::Tensor VarlenAttentionCpu(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& k_pool,
                                 const torch::Tensor& v_pool, const PagedAttentionMeta& m,
                                 double scale) {
  if (m.all_fresh) return VarlenCausalAttention(q, k, v, m.cu_seqlens, scale);
  auto out = torch::empty_like(q);
  std::vector<int64_t> fresh_rows, fresh_cu{0};
  for (int64_t b = 0; b < m.batch; ++b) {
    if (m.context_lens[b] > 0) continue;
    for (int64_t t = m.cu_seqlens[b]; t < m.cu_seqlens[b + 1]; ++t) fresh_rows.push_back(t);
    fresh_cu.push_back(static_cast<int64_t>(fresh_rows.size()));
  }
  if (!fresh_rows.empty()) {
    const auto idx = torch::tensor(fresh_rows, torch::kInt64).to(q.device());
    out.index_copy_(0, idx,
                    VarlenCausalAttention(q.index_select(0, idx), k.index_select(0, idx),
                                          v.index_select(0, idx), fresh_cu, scale));
  }
  // Every continued sequence's context, gathered from the pools once for the layer.
  const int64_t rows = k_pool.size(0) * k_pool.size(1), Hkv = k_pool.size(2), D = k_pool.size(3);
  const auto k_ctx = k_pool.view({rows, Hkv, D}).index_select(0, m.context_rows);
  const auto v_ctx = v_pool.view({rows, Hkv, D}).index_select(0, m.context_rows);
  for (int64_t b = 0; b < m.batch; ++b) {
    const int64_t c = m.context_lens[b];
    if (c == 0) continue;
    const int64_t s = m.cu_seqlens[b], n = m.cu_seqlens[b + 1] - s;
    const int64_t off = m.context_offsets[b];
    out.narrow(0, s, n).copy_(PagedContinuedAttention(q.narrow(0, s, n), k_ctx.narrow(0, off, c),
                                                      v_ctx.narrow(0, off, c), k.narrow(0, s, n),
                                                      v.narrow(0, s, n), scale));
  }
  return out;
}

// CUDA: one varlen launch over the step, the keys of each sequence (context then new) gathered
// from the pools; causal from the bottom right, so query i of a sequence with context c sees its
// first c + i + 1 keys.
torch::Tensor VarlenAttentionCuda(const torch::Tensor& q, const torch::Tensor& k_pool,
                                  const torch::Tensor& v_pool, const PagedAttentionMeta& m,
                                  double scale) {
  const int64_t rows = k_pool.size(0) * k_pool.size(1), Hkv = k_pool.size(2), D = k_pool.size(3);
  const int64_t Hq = q.size(1);
  auto keys = k_pool.view({rows, Hkv, D}).index_select(0, m.key_rows);
  auto values = v_pool.view({rows, Hkv, D}).index_select(0, m.key_rows);
  const auto dtype = q.scalar_type();
  if ((dtype == torch::kBFloat16 || dtype == torch::kHalf) && D % 8 == 0 && D <= 256) {
    // FlashAttention-2 reads GQA heads natively.
    return std::get<0>(at::_flash_attention_forward(q.contiguous(), keys, values, m.cu_q, m.cu_k,
                                                    m.max_new, m.max_len, /*dropout_p=*/0.0,
                                                    /*is_causal=*/true,
                                                    /*return_debug_mask=*/false, scale));
  }
  // The memory-efficient kernel (fp32 too) wants as many KV heads as query heads.
  if (Hq != Hkv) {
    keys = keys.repeat_interleave(Hq / Hkv, 1);
    values = values.repeat_interleave(Hq / Hkv, 1);
  }
  constexpr int64_t kCausalFromBottomRight = 2;  // the kernel's custom_mask_type
  auto o = std::get<0>(at::_efficient_attention_forward(
      q.contiguous().unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), /*bias=*/std::nullopt,
      m.cu_q, m.cu_k, m.max_new, m.max_len, /*dropout_p=*/0.0, kCausalFromBottomRight,
      /*compute_log_sumexp=*/false, scale));
  return o.squeeze(0);
}

}  // namespace

torch::Tensor PagedContinuedAttention(const torch::Tensor& q, const torch::Tensor& k_ctx,
                                      const torch::Tensor& v_ctx, const torch::Tensor& k_new,
                                      const torch::Tensor& v_new, double scale) {
  // o_j and lse_j per query and head over each part; the whole softmax is their mix weighted by
  // exp(lse_j), taken relative to the larger lse so nothing overflows.
  auto [o_ctx, lse_ctx] = at::_scaled_dot_product_flash_attention_for_cpu(
      Heads(q), Heads(k_ctx), Heads(v_ctx), /*dropout_p=*/0.0, /*is_causal=*/false,
      /*attn_mask=*/std::nullopt, scale);
  auto [o_new, lse_new] = at::_scaled_dot_product_flash_attention_for_cpu(
      Heads(q), Heads(k_new), Heads(v_new), /*dropout_p=*/0.0, /*is_causal=*/true,
      /*attn_mask=*/std::nullopt, scale);
  const auto top = torch::maximum(lse_ctx, lse_new);
  const auto w_ctx = (lse_ctx - top).exp().unsqueeze(-1),
             w_new = (lse_new - top).exp().unsqueeze(-1);
  const auto o =
      (o_ctx.to(torch::kFloat32) * w_ctx + o_new.to(torch::kFloat32) * w_new) / (w_ctx + w_new);
  return o.squeeze(0).transpose(0, 1).to(q.scalar_type());  // [n, Hq, D]
}

torch::Tensor PagedAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                             const PagedAttentionMeta& meta, double scale) {
  if (meta.decode)
    return PagedDecodeAttention(q, k_pool, v_pool, meta.block_tables, meta.seq_lens, scale);
  if (q.is_cuda()) return VarlenAttentionCuda(q, k_pool, v_pool, meta, scale);
  return VarlenAttentionCpu(q, k, v, k_pool, v_pool, meta, scale);
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
