// opd-rollout under expert parallelism (rpc/ep_group.h), on the static sampler (the paged engine
// is single-process).
//
// Generate: rank 0 sends each request (prompts, sampling parameters, seed and seed indices, the
// weight version its snapshot holds and rank 0's batch budget) to the followers as one command,
// and every rank runs SampleResponses on it with its own shard of the weights, in the same
// batches. The computation is the same on every
// rank (the MoE all-reduces give every rank the same bytes, the sampling is seeded per sample),
// so every rank draws the same tokens, takes the same number of decode steps and pairs its
// collectives with the others'; only rank 0 streams samples back. Cancellation (the client left)
// is agreed on at every decode step (one tiny all-reduce). A request whose snapshot is no longer
// the serving version when its turn on the group comes (an update committed while it waited) is
// ABORTED, to be retried: the followers hold only the serving weights.
//
// Weight pushes (full UpdateWeights streams): rank 0 receives the chunks over gRPC and sends each
// one to the group; every rank stages the version (its own shard's shapes) and keeps the bytes
// of its experts' rows of each fused expert tensor, all of every replicated tensor. At the end
// every rank checks its copy and they commit together (all or none), with the same versioned
// atomic swap as one process. Announced (changed-only) updates and the collective weight sync
// are refused with FAILED_PRECONDITION: send every tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/generate/generator.h"
#include "lm/generate/sampler.h"
#include "rollout/weights.h"
#include "rpc/ep_group.h"

namespace rollout {

class EpRollout final : public lm::Generator {
 public:
  // Neither is owned; both outlive this. `max_batch_kv_bytes` bounds the cache of one batch of
  // the static sampler every rank runs (lm::SampleResponses; 0: one batch a request): a request
  // of any number of prompts runs as consecutive batches, the same on every rank.
  EpRollout(opd::rpc::EpGroup* group, WeightStore* store, int64_t max_batch_kv_bytes = 0);
  ~EpRollout() override;

  // lm::Generator on rank 0: each call runs the static sampler on the whole group. Routing is
  // not recorded (UNIMPLEMENTED).
  absl::Status Generate(const Snapshot& snapshot, const std::vector<std::vector<int32_t>>& prompts,
                        const lm::SamplingParams& params,
                        const std::function<void(lm::Sample)>& on_sample,
                        const std::function<bool()>& cancelled) override;
  bool RecordsRouting() const override { return false; }
  const char* name() const override { return "expert-parallel"; }
  // A follower's work: every command rank 0 sends.
  opd::rpc::EpGroup::Work FollowerWork();

  // One weight push on rank 0; dropping it unfinished drops every rank's staged copy.
  class Update {
   public:
    ~Update();
    // INVALID_ARGUMENT as StagedWeights::Add (a chunk out of order, of a wrong shape, ...).
    absl::Status Add(const WireTensor& chunk);
    // Every rank's copy complete: all swap in; else none does (the error names why).
    absl::Status Commit();
    int64_t version() const { return version_; }
    int64_t tensors() const { return tensors_; }  // received over gRPC
    int64_t bytes() const { return bytes_; }

   private:
    friend class EpRollout;
    Update(EpRollout* ep, uint64_t id, int64_t version) : ep_(ep), id_(id), version_(version) {}
    EpRollout* ep_;
    uint64_t id_;
    int64_t version_;
    bool open_ = true;
    std::string last_name_;
    int64_t tensors_ = 0, bytes_ = 0;
  };
  // Stages `version` on every rank (FAILED_PRECONDITION when not above the serving version).
  absl::StatusOr<std::unique_ptr<Update>> BeginUpdate(int64_t version);

 private:
  // Runs a weight command on this rank (every rank runs each one).
  absl::Status Apply(const std::string& command);
  absl::Status AddLocal(uint64_t id, const WireTensor& chunk);
  absl::Status CommitLocal(uint64_t id);
  absl::Status SampleLocal(const std::string& command, const Snapshot* leader_snapshot,
                           const std::function<void(lm::Sample)>& on_sample,
                           const std::function<bool()>& cancelled);

  struct Staging {
    std::unique_ptr<StagedWeights> staged;
    std::string name;      // tensor whose chunks are arriving
    int64_t expected = 0;  // its next byte (of the whole tensor)
    absl::Status error;    // the first chunk this rank could not take
  };

  opd::rpc::EpGroup* group_;
  WeightStore* store_;
  int64_t max_batch_kv_bytes_;  // rank 0's, sent with each request
  uint64_t next_id_ = 1;        // rank 0
  // Touched only inside group commands: serialised by the group on rank 0, one thread elsewhere.
  std::map<uint64_t, Staging> staging_;
};

}  // namespace rollout
