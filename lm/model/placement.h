// Where a process's model lives: the --device / --dtype flags of the model servers (and the
// learner's train.device) and LOCAL_RANK, resolved into a torch device and dtype, with errors
// that name the flag.
//
//   device: "cpu" | "cuda" | "cuda:N"; "" means cpu. A plain "cuda" with LOCAL_RANK set (a
//           launcher's per-node rank) means cuda:LOCAL_RANK, so one command line serves every
//           rank of a node; an explicit index wins over LOCAL_RANK.
//   dtype:  "float32" | "bfloat16"; "" means bfloat16 on CUDA and float32 on CPU.
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

#include "absl/status/statusor.h"

namespace lm {

struct Placement {
  torch::Device device = torch::kCPU;
  torch::Dtype dtype = torch::kFloat32;
};

// `spec` as above. `local_rank`: -1 when LOCAL_RANK is unset. `cuda_devices`: how many CUDA
// devices this process sees. Errors (INVALID_ARGUMENT, or FAILED_PRECONDITION when CUDA is asked
// for and there is none) name `flag`.
absl::StatusOr<torch::Device> ResolveDevice(const std::string& spec, int local_rank,
                                            int64_t cuda_devices,
                                            const std::string& flag = "--device");

// `spec` as above, for a model on `device`; any other dtype is an error naming `flag`.
absl::StatusOr<torch::Dtype> ResolveDtype(const std::string& spec, const torch::Device& device,
                                          const std::string& flag = "--dtype");

// LOCAL_RANK from the environment: -1 when unset or empty; an error naming it when it is not a
// non-negative integer.
absl::StatusOr<int> LocalRankFromEnv();

// Both, from the flags' values, LOCAL_RANK and the CUDA devices LibTorch sees.
absl::StatusOr<Placement> ResolvePlacement(const std::string& device, const std::string& dtype,
                                           const std::string& device_flag = "--device",
                                           const std::string& dtype_flag = "--dtype");

// Makes `device` the calling thread's current CUDA device (a no-op for the CPU). CUDA's current
// device is per thread and starts at 0: every process calls it once its device is resolved, and
// every thread it starts that launches work calls it first, so that nothing (streams, the
// caching allocator's pools, NCCL, cuBLAS handles) silently lands on device 0.
void BindThreadToDevice(const torch::Device& device);

}  // namespace lm
