// Weight updates built by hand: a module's parameters as whole-tensor chunks, and the manifest
// announcing them, as the rollout worker's weight store takes them (weight_update_test,
// sampler_test, services_test).
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include "opd/v1/rollout.pb.h"
#include "rpc/tensor_codec.h"
#include "rpc/wire_tensor.h"

namespace testing_util {

// Every named parameter of `module` as one whole-tensor chunk in its own dtype (contiguous, on the
// CPU). `chunks[i].data` points into `tensors[i]`: keep this object alive while they are used.
struct ModuleWeights {
  std::vector<torch::Tensor> tensors;
  std::vector<opd::rpc::WireTensor> chunks;
};

inline ModuleWeights WeightsOf(torch::nn::Module& module) {
  ModuleWeights w;
  for (const auto& p : module.named_parameters()) {
    auto t = p.value().detach().to(torch::kCPU).contiguous();
    opd::rpc::WireTensor c;
    c.name = p.key();
    c.shape = t.sizes().vec();
    c.dtype = opd::rpc::WireDtypeOf(t.scalar_type()).value();
    c.data = std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes());
    w.tensors.push_back(std::move(t));
    w.chunks.push_back(std::move(c));
  }
  return w;
}

// The manifest announcing `tensors` (without their data), in their order.
inline opd::v1::WeightManifest ManifestOf(const std::vector<opd::rpc::WireTensor>& tensors,
                                          std::optional<int64_t> base_version = std::nullopt) {
  opd::v1::WeightManifest m;
  for (const auto& t : tensors) opd::rpc::ToProto(t, m.add_tensors());
  if (base_version.has_value()) m.set_base_version(*base_version);
  return m;
}

}  // namespace testing_util
