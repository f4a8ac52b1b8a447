#include "rpc/tensor_codec.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace opd::rpc {

torch::Dtype TorchDtype(WireDtype dtype) {
  switch (dtype) {
    case WireDtype::kFloat32:
      return torch::kFloat32;
    case WireDtype::kBFloat16:
      return torch::kBFloat16;
    case WireDtype::kFloat16:
      return torch::kFloat16;
  }
  return torch::kFloat32;
}

absl::StatusOr<WireDtype> WireDtypeOf(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kFloat32:
      return WireDtype::kFloat32;
    case torch::kBFloat16:
      return WireDtype::kBFloat16;
    case torch::kFloat16:
      return WireDtype::kFloat16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype ", c10::toString(dtype), " does not travel (float32, bfloat16 or float16)"));
  }
}

std::string DtypeName(torch::Dtype dtype) {
  auto wire = WireDtypeOf(dtype);
  return wire.ok() ? std::string(WireDtypeName(*wire)) : std::string(c10::toString(dtype));
}

std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : module.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

}  // namespace opd::rpc
