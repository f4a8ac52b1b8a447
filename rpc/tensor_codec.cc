#include "rpc/tensor_codec.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace opd::rpc {

std::string DtypeName(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kFloat32:
      return "float32";
    case torch::kBFloat16:
      return "bfloat16";
    case torch::kFloat16:
      return "float16";
    default:
      return std::string(c10::toString(dtype));
  }
}

absl::StatusOr<torch::Dtype> DtypeFromName(const std::string& name) {
  if (name == "float32") return torch::kFloat32;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "' (float32, bfloat16 or float16)"));
}

std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : module.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

ModuleWeights WeightsOf(torch::nn::Module& module) {
  ModuleWeights w;
  for (const auto& p : module.named_parameters()) {
    auto t = p.value().detach().to(torch::kCPU).contiguous();
    WeightTensor v;
    v.name = p.key();
    v.dtype = DtypeName(t.scalar_type());
    v.shape = t.sizes().vec();
    v.data = static_cast<const char*>(t.data_ptr());
    v.bytes = t.nbytes();
    w.tensors.push_back(std::move(t));
    w.views.push_back(std::move(v));
  }
  return w;
}

}  // namespace opd::rpc
