#include "lm/model/attention_context.h"

#include <torch/torch.h>

#include "lm/model/gated_deltanet.h"
#include "lm/model/layers.h"

namespace lm {

AttentionContext AttentionContext::Packed(const PackedBatch& batch, const Rope& rope,
                                          KVCache* fill) {
  AttentionContext ctx(Kind::kPacked);
  std::tie(ctx.cos_, ctx.sin_) = rope.Tables(batch.position_ids);
  ctx.device_ = batch.input_ids.device();
  ctx.cu_seqlens_ = batch.cu_seqlens;
  ctx.cache_ = fill;
  return ctx;
}

AttentionContext AttentionContext::Decode(KVCache& cache, const Rope& rope, torch::Device device) {
  AttentionContext ctx(Kind::kDecode);
  std::tie(ctx.cos_, ctx.sin_) =
      rope.Tables(torch::tensor(cache.lengths, torch::kInt64).to(device));
  ctx.device_ = device;
  ctx.cache_ = &cache;
  // Each slot's new token sees what the slot holds and itself.
  ctx.visible_ = cache.lengths;
  for (int64_t& n : ctx.visible_) ++n;
  return ctx;
}

AttentionContext AttentionContext::Paged(const PagedStep& step, PagedKVCache& cache,
                                         const Rope& rope, torch::Device device) {
  AttentionContext ctx(Kind::kPaged);
  ctx.meta_ = BuildPagedAttentionMeta(step, cache.block_size, device);
  std::tie(ctx.cos_, ctx.sin_) = rope.Tables(ctx.meta_.positions);
  ctx.device_ = device;
  ctx.paged_ = &cache;
  ctx.step_ = &step;
  return ctx;
}

torch::Tensor AttentionContext::Attend(int64_t l, const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, double scale) {
  switch (kind_) {
    case Kind::kPacked:
      if (cache_) FillCache(cache_->k[l], cache_->v[l], k, v, cu_seqlens_);
      return VarlenCausalAttention(q, k, v, cu_seqlens_, scale);
    case Kind::kDecode:
      AppendCache(cache_->k[l], cache_->v[l], k, v, cache_->lengths);
      return CachedAttention(q, cache_->k[l], cache_->v[l], visible_, scale);
    case Kind::kPaged:
      WritePagedKV(paged_->k[l], paged_->v[l], k, v, meta_);
      return PagedAttention(q, k, v, paged_->k[l], paged_->v[l], meta_, scale);
  }
  TORCH_CHECK(false, "AttentionContext: unknown kind");
}

torch::Tensor AttentionContext::Recur(int64_t j, Qwen3NextGatedDeltaNetImpl& mixer,
                                      const torch::Tensor& x) {
  switch (kind_) {
    case Kind::kPacked:
      if (!layout_)
        layout_ =
            std::make_shared<const DeltaRuleLayout>(DeltaRuleLayout::Make(cu_seqlens_, device_));
      return mixer.forward(x, *layout_, cache_ ? &cache_->conv[j] : nullptr,
                           cache_ ? &cache_->recurrent[j] : nullptr);
    case Kind::kDecode:
      return mixer.decode(x, cache_->conv[j], cache_->recurrent[j]);
    case Kind::kPaged: {
      if (!plan_) {
        const int64_t conv_kernel = mixer.conv1d->weight.size(2);
        plan_ = std::make_shared<const Qwen3NextPagedPlan>(
            Qwen3NextPagedPlan::Make(*step_, conv_kernel, device_));
      }
      // PagedKVCache::state holds per linear-attention layer its conv window, then its state.
      return mixer.paged(x, paged_->state[2 * j], paged_->state[2 * j + 1], *plan_);
    }
  }
  TORCH_CHECK(false, "AttentionContext: unknown kind");
}

torch::Tensor AttentionContext::OutputRows() const {
  // Only the last new token of each sequence is sampled from (a decode step's rows are those).
  if (kind_ == Kind::kPaged && meta_.max_new > 1) return meta_.last_rows;
  return {};
}

void AttentionContext::Finish() {
  if (!cache_) return;
  if (kind_ == Kind::kDecode) {
    for (int64_t& len : cache_->lengths) ++len;
  } else {
    for (size_t b = 0; b + 1 < cu_seqlens_.size(); ++b)
      cache_->lengths[b] = cu_seqlens_[b + 1] - cu_seqlens_[b];
  }
}

}  // namespace lm
