// The manifest of an announced weight update (WeightChunk.manifest, SyncWeightsRequest.manifest)
// read and checked against the model's parameters, before anything is staged or copied.
//
// Torch-free on purpose: the check runs on untrusted input from the network, so the fuzz build
// (fuzz/, no LibTorch) exercises it exactly as the rollout worker runs it. The worker describes
// its model as names and shapes (ParamShapes); rollout/weights.cc does the staging.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "rpc/wire_tensor.h"

namespace opd::v1 {
class WeightManifest;
}

namespace opd::rpc {

// What a manifest is checked against: every parameter of the model, name -> shape.
using ParamShapes = std::map<std::string, std::vector<int64_t>, std::less<>>;

// An update as its manifest announced it.
struct Announcement {
  std::vector<WireTensor> tensors;  // in manifest order, without data
  // The version the unsent tensors are taken from; unset: whatever serves.
  std::optional<int64_t> base_version;
  int64_t bytes = 0;  // the wire bytes the tensors add up to
};

// The manifest's tensors, checked against `params` in manifest order: INVALID_ARGUMENT naming the
// first bad tensor (not a parameter, announced twice, another shape than the parameter's, or an
// unknown dtype). The bytes are counted from the parameters' shapes (numel x the dtype's size).
absl::StatusOr<Announcement> ReadManifest(const opd::v1::WeightManifest& m,
                                          const ParamShapes& params);

}  // namespace opd::rpc
