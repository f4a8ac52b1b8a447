#include "rpc/tensor_codec.h"

#include <iterator>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace opd::rpc {

namespace {

// Each wire dtype's LibTorch dtype, in WireDtype's order.
constexpr torch::Dtype kTorchDtypes[] = {torch::kFloat32, torch::kBFloat16, torch::kFloat16};

}  // namespace

torch::Dtype TorchDtype(WireDtype dtype) {
  return kTorchDtypes[static_cast<size_t>(dtype)];
}

absl::StatusOr<WireDtype> WireDtypeOf(torch::Dtype dtype) {
  for (size_t i = 0; i < std::size(kTorchDtypes); ++i)
    if (kTorchDtypes[i] == dtype) return static_cast<WireDtype>(i);
  return absl::InvalidArgumentError(absl::StrCat(
      "dtype ", c10::toString(dtype), " does not travel (float32, bfloat16 or float16)"));
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
