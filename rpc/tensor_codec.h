// Model parameters <-> the wire: dtype names, a module's named parameters (what
// rpc/weight_wire.h WireTensorsOf and rpc/weight_stream.h StreamWeights take) and byte views of
// them (what a weight store's chunks are made of in tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "absl/status/statusor.h"

namespace opd::rpc {

// "float32" | "bfloat16" | "float16" (the names WeightChunk.dtype uses).
std::string DtypeName(torch::Dtype dtype);
absl::StatusOr<torch::Dtype> DtypeFromName(const std::string& name);

// `module`'s parameters by name, in its order (the tensors themselves, not copies).
std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(torch::nn::Module& module);

// A tensor's raw bytes in row-major order, in its own dtype.
struct WeightTensor {
  std::string name;
  std::string dtype;  // "float32" | "bfloat16" | "float16"
  std::vector<int64_t> shape;
  const char* data = nullptr;
  size_t bytes = 0;
};

// Byte views of every named parameter of `module` (contiguous, on the CPU). `views[i]` points
// into `tensors[i]`: keep this object alive while the views are used.
struct ModuleWeights {
  std::vector<torch::Tensor> tensors;
  std::vector<WeightTensor> views;
};
ModuleWeights WeightsOf(torch::nn::Module& module);

}  // namespace opd::rpc
