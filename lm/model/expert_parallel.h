// Expert parallelism for serving: N processes each hold the replicated part of a MoE model
// (embeddings, attention, norms, routers, shared experts, LM head) and a contiguous range of
// every MoE layer's experts. A MoE layer routes with the replicated router, runs only the local
// experts on the rows routed to them (all tokens), and sums the partial outputs over the group:
//
//   y = all_reduce_sum( sum_{k : id_k local} w_k * Expert_{id_k}(x) )
//
// which is the single-process sum, computed in another order (equal up to rounding). Every rank
// must run the same forwards on the same tokens: each MoE layer is one collective.
//
// The group is not a dependency of the model library: the server passes the all-reduce in
// (lm::dist::ProcessGroup::AllReduce). With one process there is no ExpertParallel at all and the
// MoE layers take their usual path, unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>

#include <torch/types.h>

#include "absl/status/status.h"

namespace lm {

class CausalLM;
class ExpertsImpl;
struct ModelConfig;
struct Routing;

// Experts [first, first + count) of a layer's num_experts: rank r of n gets an even share, the
// first (num_experts % n) ranks one more.
struct ExpertRange {
  int64_t first = 0, count = 0;
};
ExpertRange LocalExpertRange(int64_t num_experts, int rank, int world_size);

// Sets `config` up for rank `rank` of `world_size`: the model it creates holds only that rank's
// experts. INVALID_ARGUMENT when the model has no experts or fewer experts than ranks.
absl::Status ShardConfig(ModelConfig& config, int rank, int world_size);

// A collective that failed inside a forward (the group broke: a rank died, a link failed, the
// timeout passed). Thrown through the model's forward, which returns tensors, and turned back into
// its status (UNAVAILABLE) by whoever drives the forward.
class CollectiveError : public std::runtime_error {
 public:
  explicit CollectiveError(absl::Status status);
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

struct ExpertParallel {
  ExpertRange local;
  // Sums a tensor over the group in place (every rank gets the same bytes).
  std::function<absl::Status(torch::Tensor&)> all_reduce_sum;
};

// Attaches `ep` to every MoE layer of `model` (whose config went through ShardConfig).
void AttachExpertParallel(CausalLM& model, std::shared_ptr<const ExpertParallel> ep);
// What `model`'s MoE layers run under; null when none (one process, or no MoE layer).
std::shared_ptr<const ExpertParallel> ExpertParallelOf(CausalLM& model);

// The experts' output [T, H] for routing `r` of rows x [T, H], summed over the group; `experts`
// holds the local range only. Throws CollectiveError when the all-reduce fails.
torch::Tensor ExpertParallelExperts(const ExpertParallel& ep, const torch::Tensor& x,
                                    const Routing& r, const ExpertsImpl& experts);

// Bytes of the parameters `model` holds, and of those its experts' share.
struct ParameterBytes {
  int64_t total = 0, experts = 0;
};
ParameterBytes CountParameterBytes(CausalLM& model);

}  // namespace lm
