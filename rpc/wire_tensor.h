// A weight tensor on the wire: the one description of a tensor that the learner sends and the
// rollout worker receives, whether it is announced in a manifest (opd.v1.ManifestTensor) or
// carried, a piece at a time, in chunks (opd.v1.WeightChunk), and the one mapping of its dtype.
//
// Torch-free on purpose: the manifest check (rpc/weight_manifest.h) reads these from untrusted
// input, and the fuzz build (fuzz/, no LibTorch) runs it as the worker does. The torch side
// (rpc/tensor_codec.h, rpc/weight_wire.h) builds on this type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace opd::v1 {
class ManifestTensor;
class WeightChunk;
class ServiceInfo;
}  // namespace opd::v1

namespace opd::rpc {

// The dtypes a tensor may travel in (opd.v1.WireDtype). Their order indexes the tables in
// wire_tensor.cc and tensor_codec.cc.
enum class WireDtype { kFloat32, kBFloat16, kFloat16 };

// "float32" | "bfloat16" | "float16": the names flags, configs, logs and older peers use.
const char* WireDtypeName(WireDtype dtype);
// INVALID_ARGUMENT naming the unknown dtype and the known ones.
absl::StatusOr<WireDtype> WireDtypeFromName(std::string_view name);
int64_t WireDtypeSize(WireDtype dtype);

// One tensor of a weight update as it travels. Announced (in a manifest) it carries no bytes;
// in a chunk, `data` is the piece of its wire bytes that starts at byte `offset`.
struct WireTensor {
  std::string name;
  std::vector<int64_t> shape;  // the whole tensor's
  WireDtype dtype = WireDtype::kFloat32;
  std::optional<uint64_t>
      checksum;  // XXH64 of the whole wire bytes (rpc/weight_wire.h); unset: none
  int64_t offset = 0;
  std::string_view data;  // a view: into the message, or into the tensor it describes
};

// The tensors a manifest or a chunk describes. INVALID_ARGUMENT naming the tensor when its dtype
// is unknown: the enum field when set, else the name older senders send.
absl::StatusOr<WireTensor> FromProto(const opd::v1::ManifestTensor& m);
absl::StatusOr<WireTensor> FromProto(const opd::v1::WeightChunk& chunk);  // data: into `chunk`

// Fills the message's tensor fields, the dtype both as the enum and by name (for older workers).
// A manifest entry takes no data; a chunk takes `t.offset` and `t.data`.
void ToProto(const WireTensor& t, opd::v1::ManifestTensor* m);
void ToProto(const WireTensor& t, opd::v1::WeightChunk* chunk);

// The dtype a rollout worker serves, and so takes its updates in (ServiceInfo.dtype; workers that
// do not say, older ones, serve float32). INVALID_ARGUMENT for a dtype no tensor travels in.
absl::StatusOr<WireDtype> ServedDtype(const opd::v1::ServiceInfo& info);

}  // namespace opd::rpc
