// opd-teacher under expert parallelism (rpc/ep_group.h). The leader's Scorer batches requests as
// always; each forward it runs is first sent to the followers as one command (the packed batch's
// tokens and positions), and every rank runs that forward, so the MoE layers' all-reduces pair up.
// Only the leader computes log-probs from the hidden states (the LM head is replicated and needs
// no collective); followers drop theirs. Forwards are serialised on the group.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "lm/model/model.h"
#include "rpc/ep_group.h"

namespace teacher {

// The leader's view of the model: Forward sends the batch to the group first. A failure of the
// group throws lm::CollectiveError with an UNAVAILABLE status (the Scorer answers with it).
class EpLeaderModel final : public lm::CausalLM {
 public:
  EpLeaderModel(std::shared_ptr<lm::CausalLM> model, opd::rpc::EpGroup* group);

  torch::Tensor Forward(const lm::PackedBatch& batch, const lm::ForwardOptions& opts) override;
  torch::Tensor Decode(const torch::Tensor& tokens, lm::KVCache& cache) override;  // throws
  bool SupportsKVCache() const override { return false; }
  lm::KVCache NewKVCache(int64_t batch, int64_t capacity) const override;  // throws
  torch::Tensor LmHeadWeight() override { return model_->LmHeadWeight(); }

 private:
  std::shared_ptr<lm::CausalLM> model_;
  opd::rpc::EpGroup* group_;
};

// A follower's work: runs the forward of each batch the leader sends, in the leader's mode.
opd::rpc::EpGroup::Work FollowerForwards(std::shared_ptr<lm::CausalLM> model);

// The wire form of a forward: the packed batch (its tokens, positions and document boundaries)
// and whether the leader runs it batch-invariant (lm/model/batch_invariant.h), which every rank
// must match: the mode changes the MoE layers' collective (rpc/ep_group.cc).
struct EpForward {
  lm::PackedBatch batch;
  bool batch_invariant = false;
};
std::string EncodeBatch(const EpForward& forward);
absl::StatusOr<EpForward> DecodeBatch(const std::string& bytes);

}  // namespace teacher
