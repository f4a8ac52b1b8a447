// Backends that need more than LibTorch's CPU headers, each in its own file so that only it pays
// for them (nccl_backend.cc: CUDA and NCCL headers). Internal to lm/dist.
#pragma once

#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"

namespace lm::dist {

// c10d's ProcessGroupNCCL over `store`, bound to `device` (this rank's CUDA device: the
// communicator is created on it at once, as torch.distributed does with a device_id, rather than
// on whatever device is current at the first collective); an error where this build has no CUDA
// toolkit.
absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> MakeNcclBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const c10::Device& device);

}  // namespace lm::dist
