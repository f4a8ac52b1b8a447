// LibTorch adapter of the fused small ops: checks, outputs from the caching allocator
// (stream-ordered), one launch on the current stream.
#include "kernels/cuda/fused_ops_cuda.h"

#include <torch/torch.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/fused_ops.cuh"

namespace kernels {
namespace {

bool DtypeOf(torch::ScalarType t, FusedDtype* out) {
  switch (t) {
    case torch::kFloat32:
      *out = FusedDtype::kFloat32;
      return true;
    case torch::kBFloat16:
      *out = FusedDtype::kBFloat16;
      return true;
    case torch::kHalf:
      *out = FusedDtype::kFloat16;
      return true;
    default:
      return false;
  }
}

bool NoGrad(const torch::Tensor& t) {
  return !(torch::GradMode::is_enabled() && t.requires_grad());
}

// Defined, contiguous, on `device`, of dtype `dtype`, needing no gradient.
bool Plain(const torch::Tensor& t, const torch::Device& device, torch::ScalarType dtype) {
  return t.defined() && t.device() == device && t.scalar_type() == dtype && t.is_contiguous() &&
         NoGrad(t);
}

cudaStream_t StreamOf(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

void Check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "kernels::", what, " failed: ", cudaGetErrorString(err));
}

}  // namespace

bool AddRmsNormCuda(const torch::Tensor& x, const torch::Tensor& residual,
                    const torch::Tensor& weight, double eps, torch::Tensor* out,
                    torch::Tensor* sum) {
  FusedDtype dtype;
  if (!x.defined() || !x.is_cuda() || x.dim() < 1 || !DtypeOf(x.scalar_type(), &dtype))
    return false;
  const auto device = x.device();
  if (!Plain(x, device, x.scalar_type()) || !Plain(weight, device, x.scalar_type()) ||
      weight.dim() != 1 || weight.size(0) != x.size(-1) || x.size(-1) < 1)
    return false;
  if (residual.defined() &&
      (!Plain(residual, device, x.scalar_type()) || residual.sizes() != x.sizes()))
    return false;
  const c10::cuda::CUDAGuard guard(device);
  AddRmsNormArgs a;
  a.hidden = x.size(-1);
  a.rows = x.numel() / a.hidden;
  a.eps = static_cast<float>(eps);
  a.dtype = dtype;
  auto o = torch::empty_like(x);
  torch::Tensor s;
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.out = o.data_ptr();
  if (residual.defined()) {
    s = torch::empty_like(x);
    a.residual = residual.data_ptr();
    a.sum = s.data_ptr();
  }
  Check(AddRmsNorm(a, StreamOf(x)), "AddRmsNorm");
  *out = o;
  if (residual.defined()) *sum = s;
  return true;
}

bool QkNormRopeCuda(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                    const torch::Tensor& k_weight, const torch::Tensor& cos,
                    const torch::Tensor& sin, double eps, const torch::Tensor& q_out,
                    const torch::Tensor& k_out) {
  FusedDtype dtype;
  if (!q.defined() || !q.is_cuda() || q.dim() != 3 || !DtypeOf(q.scalar_type(), &dtype))
    return false;
  const auto device = q.device();
  const auto st = q.scalar_type();
  for (const torch::Tensor* t : {&q, &k, &q_weight, &k_weight, &q_out, &k_out})
    if (!Plain(*t, device, st)) return false;
  for (const torch::Tensor* t : {&cos, &sin})
    if (!Plain(*t, device, torch::kFloat32) || t->dim() != 2 || t->size(0) != q.size(0))
      return false;
  const int64_t D = q.size(2), R = cos.size(1);
  if (k.dim() != 3 || k.size(0) != q.size(0) || k.size(2) != D || q_out.sizes() != q.sizes() ||
      k_out.sizes() != k.sizes() || q_weight.dim() != 1 || q_weight.size(0) != D ||
      k_weight.dim() != 1 || k_weight.size(0) != D || sin.size(1) != R || !QkNormRopeSupports(D, R))
    return false;
  const c10::cuda::CUDAGuard guard(device);
  QkNormRopeArgs a;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.q_weight = q_weight.data_ptr();
  a.k_weight = k_weight.data_ptr();
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.q_out = q_out.data_ptr();
  a.k_out = k_out.data_ptr();
  a.tokens = q.size(0);
  a.q_heads = q.size(1);
  a.kv_heads = k.size(1);
  a.head_dim = D;
  a.rotary_dim = R;
  a.eps = static_cast<float>(eps);
  a.dtype = dtype;
  Check(QkNormRope(a, StreamOf(q)), "QkNormRope");
  return true;
}

}  // namespace kernels
