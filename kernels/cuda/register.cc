// The CUDA MoE kernels (kernels/cuda/moe_cuda.h), paged decode attention
// (kernels/cuda/paged_decode_cuda.h), the fused small ops (kernels/cuda/fused_ops_cuda.h) and
// the keyed token draw (kernels/cuda/sampler_cuda.h), registered for CUDA tensors.
#include "kernels/cuda/fused_ops_cuda.h"
#include "kernels/cuda/moe_cuda.h"
#include "kernels/cuda/paged_decode_cuda.h"
#include "kernels/cuda/sampler_cuda.h"
#include "lm/model/fast_paths.h"

namespace kernels {
namespace {

// The kernels compute in one dtype, the weights' (bf16-mixed training: bf16); the result goes
// back in x's.
torch::Tensor Experts(const torch::Tensor& x, const torch::Tensor& ids,
                      const torch::Tensor& weights, const torch::Tensor& gate_up,
                      const torch::Tensor& down) {
  torch::Tensor y = MoeExpertsCuda(x.to(gate_up.scalar_type()), ids, weights, gate_up, down);
  return y.defined() ? y.to(x.scalar_type()) : y;
}

const lm::RegisterFastPaths kCuda(torch::kCUDA, [](lm::FastPaths& p) {
  p.moe_experts = &Experts;
  p.route_topk = &RouteTopkCuda;
  p.paged_decode = &PagedDecodeCuda;
  p.add_rms_norm = &AddRmsNormCuda;
  p.qk_norm_rope = &QkNormRopeCuda;
  p.sample_rows = &SampleRowsCuda;
});

}  // namespace
}  // namespace kernels
