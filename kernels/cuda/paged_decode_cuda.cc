// LibTorch adapter of the paged decode kernels: checks, fp32 partials from the caching allocator
// (stream-ordered), both launches on the current stream.
#include "kernels/cuda/paged_decode_cuda.h"

#include <cstdlib>
#include <string>

#include <torch/torch.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/paged_decode.cuh"

namespace kernels {
namespace {

bool KvDtypeOf(torch::ScalarType t, KvDtype* out) {
  switch (t) {
    case torch::kFloat32:
      *out = KvDtype::kFloat32;
      return true;
    case torch::kBFloat16:
      *out = KvDtype::kBFloat16;
      return true;
    case torch::kHalf:
      *out = KvDtype::kFloat16;
      return true;
    default:
      return false;
  }
}

// The kernels load 16-byte vectors straight from the pools, so they must be whole, dense and
// aligned (views of a pool are not).
bool DensePool(const torch::Tensor& p, const torch::Tensor& q) {
  return p.dim() == 4 && p.is_contiguous() && p.device() == q.device() &&
         reinterpret_cast<uintptr_t>(p.data_ptr()) % 16 == 0;
}

bool Supports(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
              const torch::Tensor& block_tables, const torch::Tensor& seq_lens) {
  KvDtype dtype;
  if (!q.is_cuda() || q.dim() != 3 || q.requires_grad()) return false;
  if (!DensePool(k_pool, q) || !DensePool(v_pool, q) || !KvDtypeOf(k_pool.scalar_type(), &dtype))
    return false;
  if (v_pool.scalar_type() != k_pool.scalar_type() || v_pool.sizes() != k_pool.sizes())
    return false;
  const int64_t B = q.size(0);
  if (block_tables.scalar_type() != torch::kInt32 || block_tables.dim() != 2 ||
      block_tables.size(0) != B || block_tables.device() != q.device())
    return false;
  if (seq_lens.scalar_type() != torch::kInt32 || seq_lens.numel() != B ||
      seq_lens.device() != q.device())
    return false;
  return k_pool.size(3) == q.size(2) && PagedDecodeSupports(q.size(2), q.size(1), k_pool.size(2)) &&
         B <= 65535 && PagedDecodeNumSplits(block_tables.size(1), k_pool.size(1)) <= 12 * 1024;
}

// OPD_PAGED_DECODE_CUDA=cores|tensor forces a form of the split kernel (benchmarks and tests
// compare them); unset or anything else: the automatic choice.
PagedDecodePath PathFromEnvironment() {
  const char* v = std::getenv("OPD_PAGED_DECODE_CUDA");
  if (v == nullptr) return PagedDecodePath::kAuto;
  const std::string s(v);
  if (s == "cores") return PagedDecodePath::kCudaCores;
  if (s == "tensor") return PagedDecodePath::kTensorCores;
  return PagedDecodePath::kAuto;
}

}  // namespace

torch::Tensor PagedDecodeCuda(const torch::Tensor& q, const torch::Tensor& k_pool,
                              const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_lens, double scale) {
  if (!Supports(q, k_pool, v_pool, block_tables, seq_lens)) return {};
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  PagedDecodeArgs a;
  a.batch = B;
  a.q_heads = Hq;
  a.kv_heads = k_pool.size(2);
  a.head_dim = D;
  a.block_size = k_pool.size(1);
  a.max_blocks = block_tables.size(1);
  a.num_splits = PagedDecodeNumSplits(a.max_blocks, a.block_size);
  a.scale = static_cast<float>(scale);
  KvDtypeOf(k_pool.scalar_type(), &a.dtype);
  a.q_in_kv_dtype = q.scalar_type() == k_pool.scalar_type();
  a.path = PathFromEnvironment();
  // A forced form that does not apply to these inputs: not handled (the caller's reference runs).
  if (PagedDecodeChosenPath(a) == PagedDecodePath::kAuto) return {};
  // q is tiny next to the pools: one fp32 copy keeps the kernels to one element type per pool.
  const auto qf = q.to(torch::kFloat32).contiguous();
  const auto tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  auto out = torch::empty({B, Hq, D}, qf.options());
  if (B == 0) return out.to(q.scalar_type());
  if (a.num_splits == 0) return out.zero_().to(q.scalar_type());
  auto part_acc = torch::empty({B, Hq, a.num_splits, D}, qf.options());
  auto part_ml = torch::empty({B, Hq, a.num_splits, 2}, qf.options());
  a.q = qf.data_ptr<float>();
  a.k_pool = k_pool.data_ptr();
  a.v_pool = v_pool.data_ptr();
  a.block_tables = tables.data_ptr<int32_t>();
  a.seq_lens = lens.data_ptr<int32_t>();
  a.out = out.data_ptr<float>();
  a.part_acc = part_acc.data_ptr<float>();
  a.part_ml = part_ml.data_ptr<float>();
  const cudaError_t err = PagedDecode(a, c10::cuda::getCurrentCUDAStream(q.device().index()));
  TORCH_CHECK(err == cudaSuccess, "kernels::PagedDecode failed: ", cudaGetErrorString(err));
  return out.to(q.scalar_type());
}

}  // namespace kernels
