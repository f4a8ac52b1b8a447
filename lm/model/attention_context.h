// Where one forward's token mixers read and write what they remember: the object each
// architecture's single layer loop (Qwen3MoeForCausalLM::Run, Qwen3NextForCausalLM::Run) hands to
// every layer, so that a layer reads like its math and never asks which cache it runs over (the
// idea of llama.cpp's one graph per model with the cache behind one attention call).
//
//   Packed(batch [, cache])  whole documents of a packed batch (cu_seqlens): training, scoring,
//                            and a sampler's prefill, which also fills a contiguous KVCache, slot
//                            b = document b from position 0;
//   Decode(cache)            one new token per slot of a contiguous KVCache, at cache.lengths;
//   Paged(step, cache)       the rollout engine's step over the paged KV pool
//   (lm/model/paged_kv.h).
//
// An attention layer gives its new q, k, v to Attend: the context writes k, v where it keeps them
// and returns the causal attention over everything the tokens may see. A Gated DeltaNet layer
// (Qwen3-Next) hands itself and its input to Recur: the context runs the form of the delta rule
// its kind needs (chunked over whole documents, one recurrent step, or a paged step's mix) from
// and into the layer's state where it keeps it (KVCache::conv/recurrent, PagedKVCache::state).
// The per-forward tables every layer shares (RoPE's cos/sin, the paged step's indices, the delta
// rule's chunk layout) are built once, here.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "lm/model/batch.h"
#include "lm/model/paged_kv.h"

namespace lm {

class Rope;
struct DeltaRuleLayout;
struct Qwen3NextPagedPlan;
class Qwen3NextGatedDeltaNetImpl;

class AttentionContext {
 public:
  enum class Kind { kPacked, kDecode, kPaged };

  // The documents of `batch`; with `fill`, a prefill into it (its slots' lengths set by Finish).
  static AttentionContext Packed(const PackedBatch& batch, const Rope& rope,
                                 KVCache* fill = nullptr);
  // One token per slot of `cache` at positions cache.lengths (tables on `device`).
  static AttentionContext Decode(KVCache& cache, const Rope& rope, torch::Device device);
  // One step of the rollout engine over `cache`; `step` must outlive the context.
  static AttentionContext Paged(const PagedStep& step, PagedKVCache& cache, const Rope& rope,
                                torch::Device device);

  Kind kind() const { return kind_; }
  // RoPE tables [T, rotary_dim] fp32 at the positions of the forward's T tokens.
  const torch::Tensor& cos() const { return cos_; }
  const torch::Tensor& sin() const { return sin_; }

  // Attention layer `kv_layer` (its index among the layers that keep keys and values): writes the
  // new tokens' k, v [T, Hkv, D] (after q/k-norm and RoPE) where this context keeps them, then
  // returns causal attention [T, Hq, D] of q [T, Hq, D] over every key each token may see.
  torch::Tensor Attend(int64_t kv_layer, const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& v, double scale);
  // Gated DeltaNet layer `state_layer` (its index among the linear-attention layers): `mixer`'s
  // output [T, H] for its input x [T, H], from and into the state this context keeps.
  torch::Tensor Recur(int64_t state_layer, Qwen3NextGatedDeltaNetImpl& mixer,
                      const torch::Tensor& x);

  // The rows of the final hidden states the caller gets: undefined for every row; a paged step
  // with more than one new token in some sequence keeps each sequence's last new token.
  torch::Tensor OutputRows() const;
  // Ends the forward: a contiguous cache's slots count what was written into them.
  void Finish();

 private:
  explicit AttentionContext(Kind kind) : kind_(kind) {}

  Kind kind_;
  torch::Tensor cos_, sin_;
  torch::Device device_ = torch::kCPU;
  // kPacked: the documents' boundaries (a copy: a recomputed layer runs again in the backward,
  // after the batch may be gone); kDecode: the positions each slot attends to.
  std::vector<int64_t> cu_seqlens_, visible_;
  KVCache* cache_ = nullptr;  // kDecode, or kPacked's prefill
  PagedKVCache* paged_ = nullptr;
  const PagedStep* step_ = nullptr;
  PagedAttentionMeta meta_;
  // Built by the first linear-attention layer that needs them (Qwen3-Next only); shared by
  // copies of the context.
  std::shared_ptr<const DeltaRuleLayout> layout_;
  std::shared_ptr<const Qwen3NextPagedPlan> plan_;
};

}  // namespace lm
