// Model parameters <-> the wire: dtype names, and the byte views of a model's tensors that
// RolloutClient::UpdateWeights streams.
#pragma once

#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "absl/status/statusor.h"
#include "rpc/client.h"

namespace opd::rpc {

// "float32" | "bfloat16" | "float16" (the names WeightChunk.dtype uses).
std::string DtypeName(torch::Dtype dtype);
absl::StatusOr<torch::Dtype> DtypeFromName(const std::string& name);

// Byte views of every named parameter of `module` (contiguous, on the CPU). `views[i]` points
// into `tensors[i]`: keep this object alive while the views are used.
struct ModuleWeights {
  std::vector<torch::Tensor> tensors;
  std::vector<WeightTensor> views;
};
ModuleWeights WeightsOf(torch::nn::Module& module);

}  // namespace opd::rpc
