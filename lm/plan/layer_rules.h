// The plan's small shared rules (lm_base, no torch): ModelConfig::IsMoeLayer and
// IsFullAttentionLayer live in lm/model/config.cc, in the torch library (it resolves the
// architecture table), so the plan's files share the same two rules from here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "lm/model/config.h"

namespace lm::plan::internal {

inline bool IsMoe(const ModelConfig& c, int64_t i) {
  if (c.num_experts <= 0) return false;
  if (std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), i) != c.mlp_only_layers.end())
    return false;
  return (i + 1) % c.decoder_sparse_step == 0;
}

inline bool IsFull(const ModelConfig& c, int64_t i) {
  return c.layer_types.empty() || c.layer_types[i] == "full_attention";
}

// a / b rounded up; 0 for b <= 0 (nothing to divide among).
inline int64_t CeilDiv(int64_t a, int64_t b) {
  return b > 0 ? (a + b - 1) / b : 0;
}

}  // namespace lm::plan::internal
