#include "lm/plan/device_memory.h"

#include <dlfcn.h>

#include <cstddef>

#include "absl/strings/str_cat.h"

namespace lm::plan {
namespace {

// The three driver entry points used, with the driver API's C types (CUresult is an int enum,
// CUdevice an int); their ABI is stable across driver versions.
using InitFn = int (*)(unsigned int);
using DeviceGetFn = int (*)(int*, int);
using TotalMemFn = int (*)(size_t*, int);

}  // namespace

absl::StatusOr<int64_t> CudaDeviceMemoryBytes(int index) {
  // Never closed: the driver stays loaded for the process's life anyway (LibTorch uses it).
  void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (lib == nullptr) return absl::UnavailableError("no CUDA driver (libcuda.so.1)");
  auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
  auto device_get = reinterpret_cast<DeviceGetFn>(dlsym(lib, "cuDeviceGet"));
  auto total_mem = reinterpret_cast<TotalMemFn>(dlsym(lib, "cuDeviceTotalMem_v2"));
  if (!init || !device_get || !total_mem)
    return absl::UnavailableError("libcuda.so.1 lacks cuInit, cuDeviceGet or cuDeviceTotalMem_v2");
  int device = 0;
  size_t bytes = 0;
  if (int rc = init(0); rc != 0) return absl::UnavailableError(absl::StrCat("cuInit: error ", rc));
  if (int rc = device_get(&device, index); rc != 0)
    return absl::UnavailableError(absl::StrCat("cuDeviceGet(", index, "): error ", rc));
  if (int rc = total_mem(&bytes, device); rc != 0)
    return absl::UnavailableError(absl::StrCat("cuDeviceTotalMem(", index, "): error ", rc));
  return static_cast<int64_t>(bytes);
}

}  // namespace lm::plan
