// The CPU fast paths (kernels/cpu/cpu_inference.h, kernels/cpu/paged_decode.h,
// kernels/cpu/fused_ops.h, kernels/cpu/sampler_cpu.h), registered for CPU tensors: each applies
// where its Use* predicate says (no gradient needed, the dtypes and shapes the kernels handle,
// AVX2) and leaves everything else to lm/model's reference math.
#include "kernels/cpu/cpu_inference.h"
#include "kernels/cpu/fused_ops.h"
#include "kernels/cpu/paged_decode.h"
#include "kernels/cpu/sampler_cpu.h"
#include "lm/model/fast_paths.h"

namespace lm {
namespace {

torch::Tensor Experts(const torch::Tensor& x, const torch::Tensor& ids,
                      const torch::Tensor& weights, const torch::Tensor& gate_up,
                      const torch::Tensor& down) {
  if (!UseCpuInferenceExperts(x, weights, gate_up, down)) return {};
  return MoeExpertsInferenceCpu(x, ids, weights, gate_up, down);
}

torch::Tensor DeltaRule(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& g, const torch::Tensor& beta,
                        const std::vector<int64_t>& cu_seqlens, int64_t chunk,
                        torch::Tensor* final_state) {
  if (!UseCpuInferenceDeltaRule(q, k, v, g, beta)) return {};
  return GatedDeltaRuleInferenceCpu(q, k, v, g, beta, cu_seqlens, chunk, final_state);
}

torch::Tensor Logprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                       const torch::Tensor& targets, double temperature) {
  if (!UseCpuInferenceLogprobs(hidden, weight)) return {};
  return TokenLogprobsInferenceCpu(hidden, weight, targets, temperature);
}

torch::Tensor LogSumExp(const torch::Tensor& logits) {
  return UseCpuLogSumExpRows(logits) ? LogSumExpRowsCpu(logits) : torch::Tensor();
}

torch::Tensor PagedDecode(const torch::Tensor& q, const torch::Tensor& k_pool,
                          const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, double scale) {
  if (!UseCpuPagedDecode(q, k_pool, v_pool, block_tables, seq_lens)) return {};
  return PagedDecodeCpu(q, k_pool, v_pool, block_tables, seq_lens, scale);
}

torch::Tensor RowInvariantMatmul(const torch::Tensor& x, const torch::Tensor& w) {
  if (!UseCpuRowInvariantMatmul(x, w)) return {};
  return RowInvariantMatmulCpu(x, w);
}

bool AddRmsNorm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                double eps, torch::Tensor* out, torch::Tensor* sum) {
  if (!UseCpuAddRmsNorm(x, residual, weight)) return false;
  AddRmsNormCpu(x, residual, weight, eps, out, sum);
  return true;
}

bool QkNormRope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                const torch::Tensor& k_weight, const torch::Tensor& cos, const torch::Tensor& sin,
                double eps, const torch::Tensor& q_out, const torch::Tensor& k_out) {
  if (!UseCpuQkNormRope(q, k, q_weight, k_weight, cos, sin, q_out, k_out)) return false;
  QkNormRopeCpu(q, k, q_weight, k_weight, cos, sin, eps, q_out, k_out);
  return true;
}

std::shared_ptr<const PackedWeight> PackLmHead(const torch::Tensor& weight) {
  std::optional<PackedLinear> packed = PackedLinear::Pack(weight);
  if (!packed) return nullptr;
  return std::make_shared<const PackedLinear>(std::move(*packed));
}

const RegisterFastPaths kCpu(torch::kCPU, [](FastPaths& p) {
  p.pack_lm_head = &PackLmHead;
  p.moe_experts = &Experts;
  p.gated_delta_rule = &DeltaRule;
  p.token_logprobs = &Logprobs;
  p.logsumexp_rows = &LogSumExp;
  p.paged_decode = &PagedDecode;
  p.row_invariant_matmul = &RowInvariantMatmul;
  p.route_topk = &RouteTopkCpu;
  p.route_weights = &RouteWeightsCpu;
  p.add_rms_norm = &AddRmsNorm;
  p.qk_norm_rope = &QkNormRope;
  p.sample_rows = &SampleRowsCpu;
});

}  // namespace
}  // namespace lm
