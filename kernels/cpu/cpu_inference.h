// CPU fast paths for inference (teacher scoring, rollout sampling). Each replaces a chain of small
// library ops with tasks that run whole on one thread, handed out busiest first: one parallel
// region per layer instead of a fork/join per op, and each task's working set stays in its core's
// cache. Each is tested against the library path it replaces (tests/model_test.cc,
// tests/qwen3_next_test.cc), which stays in use for gradients and other devices.
//   - MoE experts: tasks of up to 128 rows of one expert. Decode-sized tasks run the streaming
//     kernel of kernels/cpu/cpu_kernels.h, which reads the expert's weight once where a library
//     GEMM would spend its time packing it; larger ones run the library GEMM on their thread.
//     In batch-invariant mode (lm/model/batch_invariant.h) every task is kInvariantRows rows,
//     zero-padded, through the library GEMM.
//   - Gated delta rule (Qwen3-Next): one task per (document, value head), its chunks in order.
//   - LM-head log-probs for scoring: one task per vocabulary tile, each [rows, tile] block of
//     logits reduced to a log-sum-exp while still in cache; [rows, vocab] never exists. In
//     batch-invariant mode the last block of rows is padded to the others' height.
//   - Batch-invariant GEMMs: fixed-shape row and column tiles of x W^T.
//   - A packed LM head for decode-sized row counts.
//
// This is the one file of `lm` compiled with -fopenmp: at::parallel_for's region is compiled
// inline in its caller, and silently runs on one thread without the flag.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <torch/types.h>

#include "lm/model/fast_paths.h"

namespace lm {

// Whether MoeExperts may take MoeExpertsInferenceCpu: no gradient needed, fp32 on CPU, dimensions
// the kernels handle, an AVX2 CPU.
bool UseCpuInferenceExperts(const torch::Tensor& x, const torch::Tensor& weights,
                            const torch::Tensor& gate_up, const torch::Tensor& down);

// MoeExperts (lm/model/moe.h). Slots are summed in a fixed order, so the result does not depend
// on the thread count.
torch::Tensor MoeExpertsInferenceCpu(const torch::Tensor& x, const torch::Tensor& ids,
                                     const torch::Tensor& weights, const torch::Tensor& gate_up,
                                     const torch::Tensor& down);

// Whether the Gated DeltaNet may take GatedDeltaRuleInferenceCpu: no gradient needed, fp32 on CPU.
bool UseCpuInferenceDeltaRule(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& g,
                              const torch::Tensor& beta);

// GatedDeltaRuleChunked (lm/model/gated_deltanet.h), a short last chunk computed at its length. q,
// k [T, Hk, dk] may have fewer heads than v [T, Hv, dv]: value head h reads key head h / (Hv / Hk),
// so grouped heads need not be repeated. g, beta [T, Hv]; returns o [T, Hv, dv]. The result does
// not depend on the thread count. `final_state`, when given, receives each document's state after
// its last token, [B, Hv, dk, dv] fp32 (a decode cache's prefill).
torch::Tensor GatedDeltaRuleInferenceCpu(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor& g,
                                         const torch::Tensor& beta,
                                         const std::vector<int64_t>& cu_seqlens, int64_t chunk = 64,
                                         torch::Tensor* final_state = nullptr);

// Whether TokenLogprobs (lm/model/logprobs.h) may take TokenLogprobsInferenceCpu: no gradient
// needed, fp32 on CPU, an AVX2 CPU.
bool UseCpuInferenceLogprobs(const torch::Tensor& hidden, const torch::Tensor& weight);

// log p(target) per row: hidden [N, H], weight [V, H], targets [N] in [0, V) -> [N] fp32, from
// logits / temperature. Memory beyond the inputs: a 512 KiB block per thread and N x V / 512
// floats.
torch::Tensor TokenLogprobsInferenceCpu(const torch::Tensor& hidden, const torch::Tensor& weight,
                                        const torch::Tensor& targets, double temperature);

// Whether LogSumExpRowsCpu applies: fp32 CPU [rows, V] with contiguous rows, an AVX2 CPU.
bool UseCpuLogSumExpRows(const torch::Tensor& logits);

// logsumexp of each row of logits [rows, V] -> [rows], rows in parallel (cpu::LogSumExp): two
// reads of the logits instead of the library's four passes over memory, and no writes. The
// training path's chunked log-probs use it.
torch::Tensor LogSumExpRowsCpu(const torch::Tensor& logits);

// Whether RowInvariantMatmulCpu applies: no gradient needed, fp32 on CPU, x [M, K] and w [N, K],
// a BLAS library.
bool UseCpuRowInvariantMatmul(const torch::Tensor& x, const torch::Tensor& w);

// x W^T -> [M, N] for batch-invariant mode (lm/model/batch_invariant.h): x padded with zeros to
// whole blocks of kInvariantRows rows, every task one [kInvariantRows, K] x [K, <= kInvariantCols]
// single-threaded library product into an aligned tile, so a row's result does not depend on the
// other rows, their number, or the thread count.
torch::Tensor RowInvariantMatmulCpu(const torch::Tensor& x, const torch::Tensor& w);

// A weight [N, K] (fp32, CPU) packed for few-row products x W^T: the rollout worker's LM head, per
// weight version. Packing reads the weight once, about what one decode step's LM head costs
// through the library; the packed kernel is then ~2x the library at 32 rows (36 vs 73 ms for
// 151,936 x 512). Meant for decode-sized row counts (the sampler uses it up to 64 rows). The copy
// does not follow later changes to the weight: pack again after an update.
// lm reaches it through FastPaths::pack_lm_head (lm/model/fast_paths.h).
class PackedLinear final : public PackedWeight {
 public:
  // nullopt where the kernel does not apply (not fp32 on CPU, no AVX2): use the library there.
  static std::optional<PackedLinear> Pack(const torch::Tensor& weight);
  // x [m, K] -> [m, N] in fp32.
  torch::Tensor operator()(const torch::Tensor& x) const override;

 private:
  PackedLinear(torch::Tensor packed, int64_t n, int64_t k)
      : packed_(std::move(packed)), n_(n), k_(k) {}
  torch::Tensor packed_;
  int64_t n_, k_;
};

}  // namespace lm
