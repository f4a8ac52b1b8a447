// The learner's side of weight pushes to one rollout worker: in the worker's dtype, only the
// tensors that changed, over gRPC streaming or over a c10d group (collective weight sync).
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
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/client.h"
#include "rpc/weight_wire.h"
#include "trainer/opd/opd_config.h"  // WeightSyncMode

namespace lm::dist {
class ProcessGroup;
}

namespace trainer {

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

  torch::Dtype wire_dtype() const { return wire_dtype_; }
  bool has_group() const { return group_ != nullptr; }

  // Pushes `tensors` (in wire_dtype(), checksums computed: opd::rpc::ComputeChecksums) as version
  // `version`, sending those that changed since the last acknowledged push.
  absl::StatusOr<PushReport> Push(const std::vector<opd::rpc::WireTensor>& tensors,
                                  int64_t version);

 private:
  WeightPusher() = default;
  absl::Status JoinGroup();
  absl::StatusOr<PushReport> PushOnce(const std::vector<opd::rpc::WireTensor>& tensors,
                                      int64_t version);
  absl::StatusOr<PushReport> PushGrpc(const std::vector<opd::rpc::WireTensor>& tensors,
                                      const std::vector<size_t>& which,
                                      const opd::v1::WeightManifest* manifest, int64_t version);
  absl::StatusOr<PushReport> PushCollective(const std::vector<opd::rpc::WireTensor>& tensors,
                                            const std::vector<size_t>& which,
                                            const opd::v1::WeightManifest& manifest,
                                            int64_t version);
  absl::Status Fail(const std::string& what, const absl::Status& st) const;

  opd::rpc::ClientOptions options_;
  std::unique_ptr<opd::v1::Rollout::Stub> stub_;
  WeightPushOptions push_;
  torch::Device device_{torch::kCPU};  // the learner's
  torch::Dtype wire_dtype_ = torch::kFloat32;
  std::unique_ptr<lm::dist::ProcessGroup> group_;
  std::string group_id_;
  std::string backend_;
  bool collective_off_ = false;  // auto mode gave up on the group
  bool manifest_off_ = false;    // the worker takes full updates only (no manifest, no diffing)
  torch::Tensor bucket_;         // the cast buffer (on the group's device for collective pushes)
  // What the worker holds: checksum per tensor, and its version; empty = unknown.
  std::map<std::string, uint64_t> acked_;
  int64_t acked_version_ = -1;
};

}  // namespace trainer
