// Tensor helpers the LibTorch test binaries share (tests/testing.h has the rest).
#pragma once

#include <cmath>

#include <gtest/gtest.h>
#include <torch/types.h>

namespace testing_util {

// max |a - b| over the elements, in fp64 on the host (0 for empty tensors); the shapes must agree.
inline double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.numel() == 0 || a.sizes() != b.sizes()) return a.numel() == 0 ? 0.0 : INFINITY;
  return (a.to(torch::kCPU, torch::kFloat64) - b.to(torch::kCPU, torch::kFloat64))
      .abs()
      .max()
      .item<double>();
}

}  // namespace testing_util
