// The packed (variable-length) batch every model forward consumes.
//
// B sequences are concatenated into T tokens with no padding; `cu_seqlens` holds the document
// boundaries [0, len0, len0+len1, ..., T] and `position_ids` restart at 0 per document (or
// continue from a KV cache). Attention never crosses a boundary.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "absl/types/span.h"

namespace lm {

struct PackedBatch {
  torch::Tensor input_ids;          // [T] int64
  torch::Tensor position_ids;       // [T] int64
  std::vector<int64_t> cu_seqlens;  // [B+1], host side: loops over documents need the boundaries

  int64_t num_tokens() const { return cu_seqlens.empty() ? 0 : cu_seqlens.back(); }
  int64_t num_sequences() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  int64_t length(int64_t b) const { return cu_seqlens[b + 1] - cu_seqlens[b]; }

  // Packs whole sequences (positions 0..len-1 each).
  static PackedBatch FromSequences(const std::vector<std::vector<int64_t>>& seqs);
  // The same from token ids as the host keeps them (int32, read in place, e.g. samples' tokens):
  // they are widened to int64 only as they are written into input_ids, with no copy between.
  static PackedBatch FromSpans(absl::Span<const absl::Span<const int32_t>> seqs);
};

// Per-layer key/value cache for incremental decoding. Slot b holds sequence b; keys are stored
// after q/k-norm and RoPE, exactly as attention consumes them. Models with linear-attention
// (recurrent) layers (Qwen3-Next's Gated DeltaNet) keep those layers' fixed-size state per slot
// instead: the causal conv's last K-1 inputs and the delta rule's matrix state.
struct KVCache {
  std::vector<torch::Tensor> k, v;       // per attention layer: [B, capacity, n_kv, head_dim]
  std::vector<torch::Tensor> conv;       // per linear-attention layer: [B, K-1, conv channels]
  std::vector<torch::Tensor> recurrent;  // per linear-attention layer: [B, Hv, dk, dv] fp32
  std::vector<int64_t> lengths;          // [B] tokens already cached per slot

  int64_t batch() const { return static_cast<int64_t>(lengths.size()); }
  int64_t capacity() const { return k.empty() ? 0 : k[0].size(1); }
  // Repeats every slot `n` times (slot b -> slots b*n .. b*n+n-1): samples of one prompt share
  // the prompt's prefill.
  KVCache RepeatInterleave(int64_t n) const;
  // Keeps only the listed slots (finished sequences leave the batch).
  KVCache Select(const std::vector<int64_t>& slots) const;
};

}  // namespace lm
