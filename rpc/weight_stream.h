// The one gRPC weight streamer: every UpdateWeights call of the project goes through StreamWeights
// (the learner's pushes, trainer/opd/weight_push.h; opd-ctl push-weights; the tests). The parallel
// collective push (SyncWeights, trainer/opd/weight_publish.cc) is another transport.
//
// Parameters are cast into their wire dtype a bucket at a time (rpc/weight_wire.h PackBuckets),
// never into a wire-dtype copy of the model, and each bucket goes out as WeightChunk messages of at
// most `chunk_bytes`. A tensor's chunks are consecutive and in byte order; a zero-byte tensor
// sends one empty chunk, so that the worker sees it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "opd/v1/rollout.grpc.pb.h"
#include "rpc/client.h"
#include "rpc/weight_wire.h"

namespace opd::rpc {

struct StreamOptions {
  size_t chunk_bytes = 4 << 20;  // gRPC messages carry at most this (>= 1)
  // Called after each bucket went out (progress; tests use it to stop a sender mid-push).
  std::function<void(int64_t bucket)> on_bucket;
};

struct StreamReport {
  opd::v1::UpdateWeightsResponse applied;  // what the worker serves now
  int64_t bytes = 0;                       // wire bytes sent
};

// Streams tensors[which[0]], tensors[which[1]], ... as weight version `version` over one
// UpdateWeights call of `stub` (deadline, secret and canceller from `options`), with `manifest`
// (optional) in the first chunk; a manifest with nothing to send goes alone, which moves the
// worker's version on. `bucket` is the cast buffer (a CPU uint8 tensor whose size is a multiple
// of 8; reused across calls). The worker's error comes back with its gRPC code, the message
// starting with the worker's address.
absl::StatusOr<StreamReport> StreamWeights(opd::v1::Rollout::StubInterface& stub,
                                           const ClientOptions& options, int64_t version,
                                           const std::vector<OutgoingTensor>& tensors,
                                           const std::vector<size_t>& which,
                                           const opd::v1::WeightManifest* manifest,
                                           torch::Tensor& bucket, const StreamOptions& stream = {});

// A full update of every tensor, without a manifest, over a channel of its own: the one-off push
// of opd-ctl and the tests. The cast buffer holds 64 MiB (or the whole update, if smaller).
absl::StatusOr<StreamReport> StreamWeights(const ClientOptions& options, int64_t version,
                                           const std::vector<OutgoingTensor>& tensors,
                                           const StreamOptions& stream = {});

}  // namespace opd::rpc
