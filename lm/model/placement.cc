#include "lm/model/placement.h"

#include <cstdlib>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "lm/util/status.h"

namespace lm {

absl::StatusOr<torch::Device> ResolveDevice(const std::string& spec, int local_rank,
                                            int64_t cuda_devices, const std::string& flag) {
  if (spec.empty() || spec == "cpu") return torch::Device(torch::kCPU);
  const std::string cuda = "cuda";
  if (spec.rfind(cuda, 0) != 0 || (spec.size() > cuda.size() && spec[cuda.size()] != ':')) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " '", spec, "' is not a device (cpu, cuda or cuda:N)"));
  }
  int64_t index = -1;
  std::string why;  // how the index was chosen, for the messages below
  if (spec.size() > cuda.size()) {
    const std::string digits = spec.substr(cuda.size() + 1);
    if (!absl::SimpleAtoi(digits, &index) || index < 0 || digits.empty() ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, " '", spec, "': the device index must be a non-negative integer (cuda:N)"));
    }
  } else if (local_rank >= 0) {
    index = local_rank;
    why = absl::StrCat(" (cuda with LOCAL_RANK=", local_rank, ")");
  } else {
    index = 0;
  }
  if (cuda_devices <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, " ", spec, why, ": no CUDA device is available to this process (use ",
                     flag, " cpu, or check CUDA_VISIBLE_DEVICES and the driver)"));
  }
  if (index >= cuda_devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", spec, why, ": device index ", index, " is out of range: this process sees ",
        cuda_devices, " CUDA device(s), 0..", cuda_devices - 1));
  }
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

absl::StatusOr<torch::Dtype> ResolveDtype(const std::string& spec, const torch::Device& device,
                                          const std::string& flag) {
  if (spec.empty()) return device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
  if (spec == "float32") return torch::kFloat32;
  if (spec == "bfloat16") return torch::kBFloat16;
  return absl::InvalidArgumentError(absl::StrCat(
      flag, " '", spec, "' is not supported (float32 or bfloat16; default: bfloat16 on CUDA, ",
      "float32 on CPU)"));
}

absl::StatusOr<int> LocalRankFromEnv() {
  const char* v = std::getenv("LOCAL_RANK");
  if (v == nullptr || *v == '\0') return -1;
  int rank = -1;
  if (!absl::SimpleAtoi(v, &rank) || rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LOCAL_RANK '", v, "' is not a non-negative integer"));
  }
  return rank;
}

absl::StatusOr<Placement> ResolvePlacement(const std::string& device, const std::string& dtype,
                                           const std::string& device_flag,
                                           const std::string& dtype_flag) {
  ASSIGN_OR_RETURN(const int local_rank, LocalRankFromEnv());
  // Asking LibTorch for CUDA devices initialises nothing on a CPU placement.
  const bool wants_cuda = device.rfind("cuda", 0) == 0;
  const int64_t cuda_devices = wants_cuda && torch::cuda::is_available()
                                   ? static_cast<int64_t>(torch::cuda::device_count())
                                   : 0;
  Placement p;
  ASSIGN_OR_RETURN(p.device, ResolveDevice(device, local_rank, cuda_devices, device_flag));
  ASSIGN_OR_RETURN(p.dtype, ResolveDtype(dtype, p.device, dtype_flag));
  return p;
}

void BindThreadToDevice(const torch::Device& device) {
  if (!device.is_cuda()) return;
  // Through the device-guard registry rather than c10::cuda: lm links no CUDA header, and the
  // CUDA guard is registered by libc10_cuda wherever a CUDA device can exist at all.
  const torch::Device indexed(torch::kCUDA, device.has_index() ? device.index() : 0);
  c10::impl::getDeviceGuardImpl(torch::kCUDA)->setDevice(indexed);
}

}  // namespace lm
