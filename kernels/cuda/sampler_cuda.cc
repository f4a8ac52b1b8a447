// LibTorch adapter of the keyed token draw: checks, outputs from the caching allocator
// (stream-ordered), one launch on the current stream.
#include "kernels/cuda/sampler_cuda.h"

#include <torch/torch.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/sampler.cuh"

namespace kernels {
namespace {

bool Row(const torch::Tensor& t, int64_t B, torch::ScalarType dtype, const torch::Device& d) {
  return t.defined() && t.device() == d && t.dim() == 1 && t.size(0) == B &&
         t.scalar_type() == dtype;
}

}  // namespace

bool SampleRowsCuda(const torch::Tensor& logits, const torch::Tensor& keys,
                    const torch::Tensor& positions, const torch::Tensor& temperature,
                    const torch::Tensor& top_k, const torch::Tensor& top_p,
                    const torch::Tensor& stop_ids, torch::Tensor* tokens, torch::Tensor* logprobs,
                    torch::Tensor* stopped) {
  if (!logits.defined() || !logits.is_cuda() || logits.dim() != 2 ||
      logits.scalar_type() != torch::kFloat32 || logits.size(1) < 1 || logits.size(0) > 0x7fffffff)
    return false;
  const auto d = logits.device();
  const int64_t B = logits.size(0);
  if (!Row(keys, B, torch::kInt64, d) || !Row(positions, B, torch::kInt64, d) ||
      !Row(temperature, B, torch::kFloat64, d) || !Row(top_k, B, torch::kInt64, d) ||
      !Row(top_p, B, torch::kFloat64, d) || !stop_ids.defined() || stop_ids.device() != d ||
      stop_ids.dim() != 2 || stop_ids.size(0) != B || stop_ids.scalar_type() != torch::kInt64)
    return false;
  const c10::cuda::CUDAGuard guard(d);
  const auto l = logits.contiguous(), k = keys.contiguous(), p = positions.contiguous();
  const auto t = temperature.contiguous(), kk = top_k.contiguous(), pp = top_p.contiguous();
  const auto s = stop_ids.contiguous();
  auto tok = torch::empty({B}, l.options().dtype(torch::kInt64));
  auto lp = torch::empty({B}, l.options());
  auto st = torch::empty({B}, l.options().dtype(torch::kBool));
  SampleRowsArgs a;
  a.logits = l.data_ptr<float>();
  a.keys = k.data_ptr<int64_t>();
  a.positions = p.data_ptr<int64_t>();
  a.temperature = t.data_ptr<double>();
  a.top_k = kk.data_ptr<int64_t>();
  a.top_p = pp.data_ptr<double>();
  a.stop_ids = s.data_ptr<int64_t>();
  a.num_stop = s.size(1);
  a.tokens = tok.data_ptr<int64_t>();
  a.logprobs = lp.data_ptr<float>();
  a.stopped = st.data_ptr<bool>();
  a.batch = B;
  a.vocab = l.size(1);
  const cudaError_t err = SampleRows(a, c10::cuda::getCurrentCUDAStream(d.index()).stream());
  TORCH_CHECK(err == cudaSuccess, "kernels::SampleRows failed: ", cudaGetErrorString(err));
  *tokens = tok;
  *logprobs = lp;
  *stopped = st;
  return true;
}

}  // namespace kernels
