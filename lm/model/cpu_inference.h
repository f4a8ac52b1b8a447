// CPU fast paths for inference (rollout sampling, teacher scoring), each tested against the
// library path it replaces (tests/model_test.cc):
//   - the MoE experts, parallel over experts rather than inside each GEMM: one OpenMP region per
//     layer instead of two per expert, each thread keeping its expert's rows in its own cache.
//     Decode-sized experts run the plain-array kernel of lm/model/cpu_kernels.h, which streams the
//     weight once where a library GEMM would spend its time packing it;
//   - a packed LM head for decode-sized row counts.
//
// This is the one file of `lm` compiled with -fopenmp: at::parallel_for's region is compiled
// inline in its caller, and silently runs on one thread without the flag.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <torch/types.h>

namespace lm {

// Whether the Gated DeltaNet may take GatedDeltaRuleInferenceCpu: no gradient needed, fp32 on CPU.
bool UseCpuInferenceDeltaRule(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& g,
                              const torch::Tensor& beta);

// GatedDeltaRuleChunked (lm/model/qwen3_next.h) for inference, with (document, value head) pairs
// as the parallel tasks: each runs its chunks in order on one thread, its chunk matrices and state
// staying in that thread's cache, instead of every small batched op forking the thread pool.
// q, k [T, Hk, dk] may have fewer heads than v [T, Hv, dv]: value head h reads key head
// h / (Hv / Hk), so grouped heads need not be repeated. g, beta [T, Hv]; returns o [T, Hv, dv].
torch::Tensor GatedDeltaRuleInferenceCpu(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor& g,
                                         const torch::Tensor& beta,
                                         const std::vector<int64_t>& cu_seqlens,
                                         int64_t chunk = 64);

// Whether MoeExperts may take the inference path for these inputs: no gradient needed, fp32 on
// CPU, dimensions the kernels handle, and an AVX2 CPU.
bool UseCpuInferenceExperts(const torch::Tensor& x, const torch::Tensor& weights,
                            const torch::Tensor& gate_up, const torch::Tensor& down);

// MoeExperts (lm/model/moe.h) with experts as the parallel tasks: each task gathers up to 128 of
// an expert's rows and runs its whole SwiGLU MLP on one thread (the streaming kernel for up to 32
// rows, the library GEMM above). Slots are summed in a fixed order, so the result does not depend
// on the thread count.
torch::Tensor MoeExpertsInferenceCpu(const torch::Tensor& x, const torch::Tensor& ids,
                                     const torch::Tensor& weights, const torch::Tensor& gate_up,
                                     const torch::Tensor& down);

// Whether LogSumExpRowsCpu applies: fp32 CPU [rows, V] with contiguous rows, an AVX2 CPU.
bool UseCpuLogSumExpRows(const torch::Tensor& logits);

// logsumexp of each row of logits [rows, V] -> [rows], rows in parallel (cpu::LogSumExp): two
// reads of the logits instead of the library's four passes over memory, and no writes. Scoring
// runs it on every chunk of [rows, vocab] logits.
torch::Tensor LogSumExpRowsCpu(const torch::Tensor& logits);

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
