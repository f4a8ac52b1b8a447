// Helpers the FP8 tests share (tests/fp8_test.cc: the format, the codec and the GEMMs;
// tests/fp8_model_test.cc: loading, the fixtures, the plan): block-wise quantization of weights as
// the published converter does it, the twin's activations, elementwise bounds, and the GPU guard.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/status/status.h"
#include "lm/model/fp8.h"
#include "nlohmann/json.hpp"
#include "tests/gpu.h"

namespace lm::fp8_testing {

// fp32's unit roundoff.
inline constexpr double kU = 1.0 / (1 << 24);

inline bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

inline void ExpectError(const absl::Status& st, absl::StatusCode code,
                        const std::vector<std::string>& words) {
  EXPECT_EQ(st.code(), code) << st;
  for (const auto& w : words) EXPECT_TRUE(Contains(std::string(st.message()), w)) << st;
}

// The quantization_config Qwen publishes with its -FP8 models.
inline nlohmann::json PublishedQuantization() {
  return {{"activation_scheme", "dynamic"},
          {"fmt", "e4m3"},
          {"quant_method", "fp8"},
          {"weight_block_size", {128, 128}}};
}

struct QuantWeight {
  torch::Tensor q;      // [N, K] float8_e4m3fn
  torch::Tensor scale;  // [ceil(N/128), ceil(K/128)] fp32
  torch::Tensor deq;    // [N, K] fp32: q x scale
};

// W [N, K] quantized by br x bc blocks as the published converter does (amax / 448).
inline QuantWeight QuantizeWeight(const torch::Tensor& w, int64_t br = 128, int64_t bc = 128) {
  const int64_t N = w.size(0), K = w.size(1), NB = (N + br - 1) / br, KB = (K + bc - 1) / bc;
  auto padded = torch::zeros({NB * br, KB * bc});
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  auto amax = padded.view({NB, br, KB, bc}).abs().amax({1, 3});
  auto scale = torch::where(amax.gt(0), amax / 448.0, torch::ones_like(amax));
  auto expanded = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1);
  auto q = (padded / expanded).clamp(-448, 448).to(torch::kFloat8_e4m3fn);
  QuantWeight out;
  out.q = q.narrow(0, 0, N).narrow(1, 0, K).contiguous();
  out.scale = scale.contiguous();
  out.deq = out.q.to(torch::kFloat32) * expanded.narrow(0, 0, N).narrow(1, 0, K);
  return out;
}

// A fused gate/up weight: the two halves quantized on their own, their block grids stacked.
inline QuantWeight QuantizeFused(const torch::Tensor& gate, const torch::Tensor& up) {
  QuantWeight g = QuantizeWeight(gate), u = QuantizeWeight(up);
  return {torch::cat({g.q, u.q}), torch::cat({g.scale, u.scale}), torch::cat({g.deq, u.deq})};
}

struct Quantized {
  torch::Tensor q, s, deq;  // [M, K] e4m3, [M, KB], q x s in fp32
};

inline Quantized QuantizeActivations(const Fp8Kernels& k, const torch::Tensor& x) {
  Quantized a;
  k.quantize_rows(x, &a.q, &a.s);
  const int64_t K = x.size(1);
  a.deq = a.q.to(torch::kFloat32) * a.s.repeat_interleave(128, 1).narrow(1, 0, K);
  return a;
}

// Elementwise |got - want| <= bound, reporting the worst ratio.
inline void ExpectWithin(const torch::Tensor& got, const torch::Tensor& want,
                         const torch::Tensor& bound, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto err = (got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs();
  auto ratio = err / (bound.to(torch::kFloat64) + 1e-300);
  EXPECT_LE(ratio.max().item<double>(), 1.0) << what << ": worst |error| / bound";
}

inline const Fp8Kernels& CpuKernels() {
  const Fp8Kernels* k = Fp8KernelsFor(torch::kCPU);
  EXPECT_NE(k, nullptr) << "the CPU twin is not registered";
  return *k;
}

// (K + KB + 132) u S: the twin against an fp32 GEMM of the dequantized operands (header).
inline torch::Tensor TwinBound(const torch::Tensor& qs, const torch::Tensor& wdeq) {
  const int64_t K = qs.size(1), KB = (K + 127) / 128;
  auto S = torch::mm(qs.abs().to(torch::kFloat64), wdeq.abs().to(torch::kFloat64).t());
  return S * (static_cast<double>(K + KB + 132) * kU * 1.01) + 1e-30;
}

// The activation term of the bound against unquantized x (header).
inline torch::Tensor ActivationBound(const torch::Tensor& x, const Quantized& a,
                                     const torch::Tensor& wdeq) {
  const int64_t K = x.size(1);
  auto sg = a.s.repeat_interleave(128, 1).narrow(1, 0, K).to(torch::kFloat64);
  auto dx = (std::ldexp(1.0, -4) + std::ldexp(1.0, -22)) * x.abs().to(torch::kFloat64) +
            std::ldexp(1.0, -10) * sg;
  return torch::mm(dx, wdeq.abs().to(torch::kFloat64).t());
}

// ---------------------------------------------------------------------------------------------
// CUDA (compute capability 8.9+): the kernels against the twin, the model against its dequantized
// self. The GEMM bound: on top of the twin's fp32 rounding (twice, one per side), the tensor
// cores' accumulation of a block's 128 products in 4 MMAs of 32 keeps at least 13 bits per MMA
// (Hopper's FP8 path keeps about 14, DeepSeek-V3 measured; fp16 HMMA, which sm_90 runs
// mma.sync e4m3 on, keeps fp32): |gpu - twin| <= (2^-11 + 2 (K + KB + 132) u) S.

inline torch::Device Gpu() {
  return torch::Device(torch::kCUDA, 0);
}

// In a TEST body: `k` = the GPU's FP8 kernels, or skip (no device, or one below 8.9); under
// OPD_REQUIRE_GPU=1 a build without them (no nvcc) fails.
#define GPU_FP8_KERNELS_OR_SKIP(k)                                                             \
  SKIP_WITHOUT_CUDA();                                                                         \
  const ::lm::Fp8Kernels* k##_ptr = ::lm::Fp8KernelsFor(::lm::fp8_testing::Gpu());             \
  if (k##_ptr == nullptr) {                                                                    \
    if (opd_test::RequireGpu() && ::lm::MutableFp8Kernels(torch::kCUDA).block_gemm == nullptr) \
      FAIL() << "OPD_REQUIRE_GPU=1: this build has no CUDA FP8 GEMMs";                         \
    GTEST_SKIP() << "no FP8 GEMMs on this device (they need compute capability 8.9)";          \
  }                                                                                            \
  const ::lm::Fp8Kernels& k = *k##_ptr

inline double GpuGemmFactor(int64_t K) {
  const int64_t KB = (K + 127) / 128;
  return std::ldexp(1.0, -11) + 2.0 * static_cast<double>(K + KB + 132) * kU * 1.01;
}

}  // namespace lm::fp8_testing
