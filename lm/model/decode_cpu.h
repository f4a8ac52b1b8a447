// CPU fast paths for decode-sized inference (rollout sampling): few rows against large weights,
// where a library GEMM spends its time packing the weight and forking threads rather than
// computing. Both paths run the plain-array kernels of lm/model/cpu_kernels.h in one OpenMP region
// per call, and both are tested against the library path they replace (tests/model_test.cc).
//
// This is the one file of `lm` compiled with -fopenmp: at::parallel_for's region is compiled
// inline in its caller, and silently runs on one thread without the flag.
#pragma once

#include <cstdint>
#include <optional>

#include <torch/types.h>

namespace lm {

// Whether MoeExperts may take the fused path for these inputs: inference (no gradient needed), fp32
// on CPU, at most 64 tokens, dimensions the kernels handle, and an AVX2 CPU.
bool UseFusedCpuExperts(const torch::Tensor& x, const torch::Tensor& weights,
                        const torch::Tensor& gate_up, const torch::Tensor& down);

// MoeExperts (lm/model/moe.h) as one fused pass per expert that received tokens: both matmuls and
// the SwiGLU stream the expert's weights once. Slots are summed in a fixed order, so the result
// does not depend on the thread count.
torch::Tensor MoeExpertsFusedCpu(const torch::Tensor& x, const torch::Tensor& ids,
                                 const torch::Tensor& weights, const torch::Tensor& gate_up,
                                 const torch::Tensor& down);

// A weight [N, K] (fp32, CPU) packed for few-row products x W^T: the rollout worker's LM head, per
// weight version. Packing reads the weight once, about what one decode step's LM head costs
// through the library; the packed kernel is then ~2x the library at 32 rows (36 vs 73 ms for
// 151,936 x 512). Meant for decode-sized row counts (the sampler uses it up to 64 rows). The copy
// does not follow later changes to the weight: pack again after an update.
class PackedLinear {
 public:
  // nullopt where the kernel does not apply (not fp32 on CPU, no AVX2): use the library there.
  static std::optional<PackedLinear> Pack(const torch::Tensor& weight);
  // x [m, K] -> [m, N] in fp32.
  torch::Tensor operator()(const torch::Tensor& x) const;

 private:
  PackedLinear(torch::Tensor packed, int64_t n, int64_t k)
      : packed_(std::move(packed)), n_(n), k_(k) {}
  torch::Tensor packed_;
  int64_t n_, k_;
};

}  // namespace lm
