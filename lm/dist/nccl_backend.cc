// The NCCL backend: compiled wherever the CUDA toolkit exists (so a compile error fails every
// build), run on GPU machines. Linked against libtorch_cuda, where ProcessGroupNCCL lives.
#define USE_C10D_NCCL 1
#define USE_DISTRIBUTED 1

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "absl/strings/str_cat.h"
#include "lm/dist/backends.h"

namespace lm::dist {

absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> MakeNcclBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const c10::Device& device) {
  if (!device.is_cuda() || !device.has_index())
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, ": the nccl backend needs an indexed CUDA device, got ", device.str()));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  nccl->setBoundDeviceId(device);
  nccl->eagerConnectSingleDevice(device);
  return c10::intrusive_ptr<c10d::Backend>(nccl);
}

}  // namespace lm::dist
