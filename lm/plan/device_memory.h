// The memory of a CUDA device, for the start-up checks of lm/plan/plan.h, without linking CUDA:
// the driver library (libcuda.so.1, present wherever a CUDA device is) is opened at run time, so
// this stays in the torch-free core library and works in builds without the CUDA toolkit.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace lm::plan {

// Total bytes of CUDA device `index` (cuDeviceTotalMem); UNAVAILABLE when there is no driver or no
// such device.
absl::StatusOr<int64_t> CudaDeviceMemoryBytes(int index);

}  // namespace lm::plan
