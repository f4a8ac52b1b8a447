// GPU test cases: they skip where there is no CUDA device, and fail there instead under
// OPD_REQUIRE_GPU=1 (scripts/gpu_check.sh sets it on a GPU machine, so a missing device or
// driver cannot pass as a skip).
#pragma once

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>
#include <torch/cuda.h>

namespace opd_test {

inline bool RequireGpu() {
  const char* v = std::getenv("OPD_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace opd_test

// In a TEST body: returns from the test (skipped, or failed under OPD_REQUIRE_GPU=1) without CUDA.
#define SKIP_WITHOUT_CUDA()                                                         \
  do {                                                                              \
    if (!torch::cuda::is_available()) {                                             \
      if (opd_test::RequireGpu()) FAIL() << "OPD_REQUIRE_GPU=1 but no CUDA device"; \
      GTEST_SKIP() << "no CUDA device";                                             \
    }                                                                               \
  } while (0)
