// The manifest of an announced weight update (WeightChunk.manifest, SyncWeightsRequest.manifest)
// checked against the model's parameters, before anything is staged or copied.
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
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace opd::v1 {
class WeightManifest;
}

namespace opd::rpc {

// The dtypes a tensor may travel in (WeightChunk.dtype, ManifestTensor.dtype).
enum class WireDtype { kFloat32, kBFloat16, kFloat16 };

// "float32" | "bfloat16" | "float16"; INVALID_ARGUMENT otherwise, worded as DtypeFromName
// (rpc/tensor_codec.h) so that both paths report an unknown dtype alike.
absl::StatusOr<WireDtype> WireDtypeFromName(std::string_view name);
int64_t WireDtypeSize(WireDtype dtype);

// One tensor of an announced update, as the control plane named it.
struct AnnouncedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;                 // wire dtype
  std::optional<uint64_t> checksum;  // XXH64 of the wire bytes (rpc/weight_wire.h); unset: none
};

// The manifest's tensors, in manifest order, and its base version (unset: whatever serves).
std::vector<AnnouncedTensor> Announced(const opd::v1::WeightManifest& m);
std::optional<int64_t> BaseVersion(const opd::v1::WeightManifest& m);

// What a manifest is checked against: every parameter of the model, name -> shape.
using ParamShapes = std::map<std::string, std::vector<int64_t>, std::less<>>;

// The wire bytes the announced tensors add up to (numel of the parameter x size of the announced
// dtype). INVALID_ARGUMENT naming the first bad tensor, checked in manifest order: not a
// parameter, announced twice, another shape than the parameter's, or an unknown dtype.
absl::StatusOr<int64_t> CheckAnnounced(const std::vector<AnnouncedTensor>& announced,
                                       const ParamShapes& params);

}  // namespace opd::rpc
