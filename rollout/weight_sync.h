// The rollout worker's side of collective weight sync (gRPC stays the control plane; see
// JoinWeightGroup and SyncWeights in proto/opd/v1/rollout.proto for the protocol).
//
// The worker holds at most one c10d group, of one of two kinds:
//   - two ranks: the learner's rank 0 (it serves the TCPStore and broadcasts) and this worker,
//     rank 1 (the star: the learner forms one such group per worker, trainer/opd/weight_push.h
//     WeightPusher);
//   - every learner rank (0..L-1) and every worker (L..): the parallel push, in which each
//     learner rank broadcasts its share of the update (WeightPublisher). The buckets go straight
//     into the parameters on the device when nothing samples with them (rollout/weights.h
//     StageInPlace; the copies are queued on this thread's stream behind each broadcast, no
//     synchronisation per tensor), else into page-locked host memory; the closing all-gather
//     carries every worker's verdict.
// Gloo on host tensors; NCCL when every member is on CUDA. Joins and syncs run on a thread of
// their own, one at a time, so the gRPC handlers only check requests and start them.
//
// A sync stages an announced update, feeds the broadcast buckets into it in manifest order, and
// commits through the same versioned store as UpdateWeights. A host-staged update that goes wrong
// leaves the serving weights as they were: a checksum mismatch or a missing tensor drops it and
// is reported back to the learner. An in-place one that goes wrong half-way leaves the store
// damaged (requests refused, naming the version) until an update of every tensor arrives, which
// the learner's next push is. A collective that fails (a peer died, or stalled past the group's
// timeout) is UNAVAILABLE and also drops the group, which the learner forms again.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <torch/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "opd/v1/rollout.pb.h"
#include "rollout/weights.h"
#include "rpc/weight_manifest.h"
#include "rpc/weight_wire.h"

namespace lm::dist {
class ProcessGroup;
}

namespace rollout {

class WeightSyncReceiver {
 public:
  // `store` is not owned and must outlive this; `device` is where the model lives.
  WeightSyncReceiver(WeightStore* store, torch::Device device);
  ~WeightSyncReceiver();  // waits for a join or sync in progress (bounded by its timeout)
  WeightSyncReceiver(const WeightSyncReceiver&) = delete;
  WeightSyncReceiver& operator=(const WeightSyncReceiver&) = delete;

  // Checks the request and starts joining the learner's group (replacing any previous one).
  // INVALID_ARGUMENT for a bad field, UNAVAILABLE while a join or sync runs.
  absl::StatusOr<opd::v1::JoinWeightGroupResponse> Join(const opd::v1::JoinWeightGroupRequest& req);
  // Checks the request against the group and the model, stages the update and starts receiving
  // it. The errors of SyncWeights in rollout.proto.
  absl::StatusOr<opd::v1::SyncWeightsResponse> Start(const opd::v1::SyncWeightsRequest& req);

  // What ended so far (for logs and tests, which wait on these instead of sleeping).
  struct Stats {
    int64_t joins = 0, syncs = 0;  // ended, successfully or not
    absl::Status last_join, last_sync;
  };
  Stats stats() const;
  // Whether `syncs` (and `joins`) reached at least these counts within `timeout`.
  bool Await(int64_t joins, int64_t syncs, absl::Duration timeout) const;

 private:
  enum class State { kNone, kJoining, kReady, kSyncing };
  struct Membership {
    int rank = 1, world = 2;
    std::string backend = "gloo";
  };
  void RunJoin(opd::v1::JoinWeightGroupRequest req, Membership m);
  // `tensors`: the request's manifest, checked by Start.
  void RunSync(const opd::v1::SyncWeightsRequest& req, const std::vector<WireTensor>& tensors);
  absl::StatusOr<std::unique_ptr<StagedWeights>> StageParallel(
      const opd::v1::SyncWeightsRequest& req, const std::string& backend);
  static absl::Status TellLearners(lm::dist::ProcessGroup& group, torch::Device on,
                                   const Membership& m, bool parallel, const absl::Status& outcome,
                                   const opd::v1::UpdateWeightsResponse& applied);
  static absl::Status ShareVerdict(lm::dist::ProcessGroup& group, torch::Device on,
                                   const Membership& m, const opd::rpc::SyncVerdict& verdict);
  // Starts `fn` on the worker thread (the previous one has ended: the state said so).
  void Launch(std::function<void()> fn);

  WeightStore* const store_;
  const torch::Device device_;
  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kNone;
  std::string group_id_ ABSL_GUARDED_BY(mu_);
  Membership member_ ABSL_GUARDED_BY(mu_);
  bool parallel_ ABSL_GUARDED_BY(mu_) = false;  // a group of every learner rank
  absl::Duration timeout_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<lm::dist::ProcessGroup> group_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<StagedWeights> pending_ ABSL_GUARDED_BY(mu_);  // staged, not yet receiving
  absl::Status pending_error_ ABSL_GUARDED_BY(mu_);  // why nothing is staged (parallel pushes)
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;  // started and joined under launch_mu_
  absl::Mutex launch_mu_;
};

}  // namespace rollout
