// Loading one rank's part of a MoE model for expert-parallel serving (lm/model/expert_parallel.h):
// the replicated tensors and this rank's range of every MoE layer's experts, read from the
// safetensors shards. Other ranks' expert tensors are skipped by name: their bytes are never read
// (the shards are memory-mapped), so a rank's I/O and memory are the replicated part + experts/N.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "lm/model/model.h"

namespace lm {

// Rank `rank` of `world_size` (> 1) of the model in `dir`, in `opts.dtype` on `opts.device`; its
// config's expert_first/local_experts say which experts it holds. INVALID_ARGUMENT (naming
// --world-size) when the model has fewer experts than ranks, or none.
absl::StatusOr<std::shared_ptr<CausalLM>> LoadExpertShard(const std::string& dir,
                                                          const LoadOptions& opts, int rank,
                                                          int world_size);

}  // namespace lm
