// Model parameters <-> the wire: the wire dtypes as torch dtypes, and a module's named parameters
// (what rpc/weight_wire.h OutgoingTensorsOf takes).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "absl/status/statusor.h"
#include "rpc/wire_tensor.h"

namespace opd::rpc {

torch::Dtype TorchDtype(WireDtype dtype);
// INVALID_ARGUMENT for a dtype no tensor travels in.
absl::StatusOr<WireDtype> WireDtypeOf(torch::Dtype dtype);
// A wire dtype's name (WireDtypeName), else LibTorch's: for flags, ServiceInfo and messages.
std::string DtypeName(torch::Dtype dtype);

// `module`'s parameters by name, in its order (the tensors themselves, not copies).
std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(torch::nn::Module& module);

}  // namespace opd::rpc
