// The learner's side of weight pushes to the rollout workers:
//   - WeightPublisher: what a job calls, on every learner rank, once per step. With
//     rollout.weight_sync collective or auto it is the parallel push: every learner rank and every
//     worker form one c10d group, and each rank broadcasts its own share of the new weights (a
//     1/N slice of their concatenated bytes in the workers' dtype, in buckets), so no rank casts,
//     hashes or sends the whole model and the bytes cross each link once. Workers outside the
//     group (expert-parallel ones, another dtype, a CPU worker of a CUDA learner) get gRPC
//     pushes from rank 0; with weight_sync grpc every worker does (the star).
//   - WeightPusher: rank 0's push to one worker, in the worker's dtype, only the tensors that
//     changed, over gRPC streaming or over a two-rank c10d group (the star's collective form).
//
// One WeightPusher:
//
// Wire dtype: the worker's parameter dtype (its ServiceInfo), so an fp32 learner sends bf16 to a
// bf16 worker. Parameters are cast a bucket at a time into one reused buffer (rpc/weight_wire.h),
// never into a wire-dtype copy of the model.
//
// Only changed tensors: the sender keeps the checksum of every tensor the worker acknowledged and
// sends those whose wire bytes differ now, with a manifest (names, shapes, dtypes, checksums, and
// the version the others come from) so the worker's completeness and checksum checks stay exact.
// After any failed push it forgets them (the next push sends everything), so a worker's weights
// never mix versions; a worker that restarted refuses the partial update and gets a full one.
//
// Collective sync (mode collective or auto): at connect, the learner serves a TCPStore on
// `store_host` and the worker joins it (JoinWeightGroup), forming a two-rank group (Gloo, or NCCL
// when both are on CUDA); one group per worker. A push is then a SyncWeights call (the control
// plane: version and manifest) followed by broadcasts of the changed tensors' wire bytes in
// buckets, and the worker's verdict broadcast back. In mode auto a group that cannot form, or a
// push that fails on it, falls back to gRPC streaming with a logged warning; in mode collective
// it is an error. A worker that takes full updates only (expert-parallel) refuses a manifest;
// it then gets every tensor of every push over gRPC, without one.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json_fwd.hpp"
#include "rpc/client.h"
#include "rpc/weight_wire.h"
#include "trainer/opd/opd_config.h"  // WeightSyncMode

namespace lm::dist {
class ProcessGroup;
}
namespace torch::nn {
class Module;
}

namespace trainer {

class RolloutPool;

struct WeightPushOptions {
  WeightSyncMode mode = WeightSyncMode::kGrpc;
  // Where this learner's TCPStore listens for the worker: "" = 127.0.0.1 for a worker on
  // loopback, else this host's name.
  std::string store_host;
  absl::Duration group_timeout = absl::Seconds(120);  // rendezvous and each collective
  int64_t bucket_bytes = int64_t{64} << 20;           // one cast buffer of this size per worker
  size_t grpc_chunk_bytes = 4 << 20;                  // gRPC messages carry at most this
  // Called after each bucket went out (progress; tests use it to stop a learner mid-push).
  std::function<void(int64_t bucket)> on_bucket;
};

struct PushReport {
  bool collective = false;  // over the group (else gRPC streaming)
  int64_t tensors = 0;      // sent (the worker applied this many)
  int64_t bytes = 0;        // wire bytes sent
};

class WeightPusher {
 public:
  // `options` name the worker (its address); `info` is its ServiceInfo.
  static absl::StatusOr<std::unique_ptr<WeightPusher>> Connect(
      const opd::rpc::ClientOptions& options, const opd::v1::ServiceInfo& info,
      const WeightPushOptions& push, torch::Device learner_device);
  ~WeightPusher();

  opd::rpc::WireDtype wire_dtype() const { return wire_dtype_; }
  bool has_group() const { return group_ != nullptr; }

  // Pushes `tensors` (in wire_dtype(), checksums computed: opd::rpc::ComputeChecksums) as version
  // `version`, sending those that changed since the last acknowledged push.
  absl::StatusOr<PushReport> Push(const std::vector<opd::rpc::OutgoingTensor>& tensors,
                                  int64_t version);

 private:
  WeightPusher() = default;
  absl::Status JoinGroup();
  absl::StatusOr<PushReport> PushOnce(const std::vector<opd::rpc::OutgoingTensor>& tensors,
                                      int64_t version);
  absl::StatusOr<PushReport> PushGrpc(const std::vector<opd::rpc::OutgoingTensor>& tensors,
                                      const std::vector<size_t>& which,
                                      const opd::v1::WeightManifest* manifest, int64_t version);
  absl::StatusOr<PushReport> PushCollective(const std::vector<opd::rpc::OutgoingTensor>& tensors,
                                            const std::vector<size_t>& which,
                                            const opd::v1::WeightManifest& manifest,
                                            int64_t version);
  absl::Status Fail(const std::string& what, const absl::Status& st) const;

  opd::rpc::ClientOptions options_;
  std::unique_ptr<opd::v1::Rollout::Stub> stub_;
  WeightPushOptions push_;
  torch::Device device_{torch::kCPU};  // the learner's
  opd::rpc::WireDtype wire_dtype_ = opd::rpc::WireDtype::kFloat32;
  std::unique_ptr<lm::dist::ProcessGroup> group_;
  std::string group_id_;
  std::string backend_;
  bool collective_off_ = false;  // auto mode gave up on the group
  bool manifest_off_ = false;    // the worker takes full updates only (no manifest, no diffing)
  torch::Tensor bucket_;         // the cast buffer (on the group's device for collective pushes)
  // What the worker holds: checksum per tensor, and its version; empty = unknown.
  std::map<std::string, std::optional<uint64_t>> acked_;  // a tensor without one is always sent
  int64_t acked_version_ = -1;
};

// A weight group's rendezvous: where this learner's TCPStore listens (`store_host` when set,
// 127.0.0.1 for a worker on loopback, else this host's name) and a port free there now (the store
// binds it a moment later; a clash is an error the push reports, not a hang); and a fresh id.
absl::StatusOr<std::pair<std::string, int>> WeightGroupAddress(const std::string& store_host,
                                                               const std::string& worker);
std::string NewWeightGroupId();

// What one Publish did for one worker.
struct WorkerPush {
  std::string address;
  // OK: the worker serves the version, or accepted it and serves it once the requests on its
  // previous version end (rollout/weights.h); else why not, naming the worker.
  absl::Status status;
  bool collective = false;  // over the weight group (else gRPC from rank 0)
  int64_t tensors = 0;      // the worker applied this many
  int64_t bytes = 0;        // wire bytes it received
};

// The outcome of one Publish: the same on every learner rank.
struct PublishReport {
  int64_t version = 0;
  absl::Status status;              // OK, or the first worker's failure (naming it)
  std::vector<WorkerPush> workers;  // in endpoint order
  bool group_formed = false;        // the weight group was (re)formed for this push
  int64_t senders = 0;              // learner ranks that broadcast a share (0: no collective)
  double seconds = 0;               // the push on rank 0, wall time
};

// The parallel push (weight_sync collective or auto) and its gRPC fallback, on every learner rank.
//
// Per Publish: rank 0 probes the workers that were down or outside the group (Info), and when the
// group's members would change (a worker came back, one left) forms it anew: it asks each worker
// to join (JoinWeightGroup: rank L + i of L + W, the backend: NCCL when the learner is on CUDA,
// else Gloo) and every learner rank joins as its own rank. Rank 0 then announces the version to
// every member (SyncWeights: the manifest of every parameter without checksums, the bucket size,
// and each rank's share); if every member accepted, each learner rank broadcasts its share in
// buckets, in rank order, and every member takes part in a closing all-gather of the workers'
// verdicts (rollout.proto). A member that dies or stalls breaks the group for everyone: every
// learner rank sees it (the collectives fail, bounded by rollout.weight_sync_timeout_s), the ranks
// agree over the learner group, the group is dropped, the dead worker is reported (it does not
// answer), and at a later push, once it answers again, the group is formed with it and it gets
// the weights. In mode auto the members left without the version get it over gRPC in the same
// push. Every tensor goes at every push (after an optimizer step every tensor has changed).
//
// Versions: the caller's, growing; a worker refuses a version not above its own, and says so in
// its verdict. A worker holds one weight group at a time: a job whose publisher pushes connects
// its RolloutPool (sampling) with push mode grpc, so that the pool forms no two-rank groups.
class WeightPublisher {
 public:
  // Every learner rank, together (a collective over `learners`, not owned). Rank 0 connects to
  // every worker of `endpoints` (its ServiceInfo gives the dtype the weights travel in); the group
  // forms at the first Publish. `pool` (rank 0, optional, not owned) is told every push's version
  // for the checks of the samples it gets (RolloutPool::RecordPush).
  static absl::StatusOr<std::unique_ptr<WeightPublisher>> Create(
      lm::dist::ProcessGroup* learners, const std::vector<std::string>& endpoints,
      const opd::rpc::ClientOptions& base, const WeightPushOptions& push, torch::Device device,
      RolloutPool* pool = nullptr);
  ~WeightPublisher();

  // Every learner rank, once per step, with the same weights (`model`'s parameters: a ZeRO-1
  // learner all-gathers them) and `version`. Returns the report, the same on every rank; an
  // error only when the learner group itself failed (the job cannot go on).
  absl::StatusOr<PublishReport> Publish(torch::nn::Module& model, int64_t version);

  bool has_group() const { return group_ != nullptr; }

 private:
  struct Worker;
  struct Plan;
  WeightPublisher();
  absl::Status ConnectWorkers(const std::vector<std::string>& endpoints,
                              const opd::rpc::ClientOptions& base);
  Plan PlanPush(int64_t version, std::vector<absl::Status>* failed);
  absl::Status JoinAll(Plan& plan);
  absl::Status Announce(const Plan& plan, const std::vector<opd::rpc::OutgoingTensor>& wire,
                        int64_t version, std::vector<absl::Status>* failed);
  // The data phase and the workers' verdicts (an error: a collective of the group failed).
  absl::Status SendShares(const Plan& plan, const std::vector<opd::rpc::OutgoingTensor>& wire,
                          std::vector<opd::rpc::SyncVerdict>* verdicts);
  WorkerPush PushGrpc(size_t worker,
                      const std::vector<std::pair<std::string, torch::Tensor>>& params,
                      int64_t version);
  bool Probe(size_t worker);  // rank 0: whether it answers now (marks it down when not)
  // Publish's steps over one round's state (weight_publish.cc).
  struct Round;
  void DropGroup();
  absl::Status FormGroup(Round& round);  // every rank; an error: the learner group failed
  std::vector<size_t> GrpcWorkers(const Round& round) const;  // rank 0
  // Rank 0: worker i's outcome (a member of a broken group may be pushed over gRPC here).
  void Settle(size_t i, const Round& round,
              const std::vector<std::pair<std::string, torch::Tensor>>& params, WorkerPush& r);
  nlohmann::json RootReport(const Round& round, const std::vector<WorkerPush>& results,
                            double seconds);
  static PublishReport ReportFromJson(const nlohmann::json& agreed);

  lm::dist::ProcessGroup* learners_ = nullptr;
  WeightPushOptions push_;
  torch::Device device_{torch::kCPU};
  RolloutPool* pool_ = nullptr;
  std::vector<std::unique_ptr<Worker>> workers_;  // rank 0
  // The weight group (every rank): its members (worker indices at ranks L, L+1, ...).
  std::unique_ptr<lm::dist::ProcessGroup> group_;
  std::vector<int> members_;
  std::string backend_, group_id_;
  torch::Tensor bucket_;
};

}  // namespace trainer
