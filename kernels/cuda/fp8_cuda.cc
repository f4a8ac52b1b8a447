// LibTorch adapter of the CUDA FP8 GEMMs (kernels/cuda/fp8_gemm.cuh), registered for CUDA tensors
// (lm/model/fp8.h): shape and dtype checks (none that reads device memory: no host sync),
// outputs from the caching allocator, launches on the current stream of the inputs' device.
#include <array>
#include <atomic>

#include <torch/torch.h>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/fp8_gemm.cuh"
#include "lm/model/fp8.h"

namespace kernels {
namespace {

static_assert(kFp8GroupRows == lm::kFp8GroupRows, "the grouped GEMM's tile height");

void Check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "kernels::", what, " failed: ", cudaGetErrorString(err));
}

cudaStream_t Stream(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

Fp8Element ElementOf(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return Fp8Element::kFloat32;
    case torch::kBFloat16:
      return Fp8Element::kBFloat16;
    case torch::kHalf:
      return Fp8Element::kFloat16;
    default:
      TORCH_CHECK(false, "FP8 quantize: activations of dtype ", t.scalar_type(),
                  " (expected float32, bfloat16 or float16)");
  }
}

int64_t Blocks(int64_t n) {
  return (n + lm::kFp8Block - 1) / lm::kFp8Block;
}

// Per device: 0 unknown, 1 runs, 2 does not.
bool Supports(const torch::Device& device) {
  if (!device.is_cuda()) return false;
  static std::array<std::atomic<int>, 64> known{};
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  if (index < 0 || index >= 64) return false;
  int state = known[index].load();
  if (state == 0) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    state = Fp8GemmRunsOnCurrentDevice() ? 1 : 2;
    known[index].store(state);
  }
  return state == 1;
}

void Quantize(bool swiglu, const torch::Tensor& x, torch::Tensor* q, torch::Tensor* s) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "FP8 quantize: x must be a [M, K] CUDA tensor");
  TORCH_CHECK(!swiglu || x.size(1) % 2 == 0, "FP8 quantize: gu must be [M, 2I]");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = swiglu ? xc.size(1) / 2 : xc.size(1);
  c10::cuda::CUDAGuard guard(xc.device());
  *q = torch::empty({M, K}, xc.options().dtype(torch::kFloat8_e4m3fn));
  *s = torch::empty({M, Blocks(K)}, xc.options().dtype(torch::kFloat32));
  auto* pq = static_cast<uint8_t*>(q->data_ptr());
  if (swiglu) {
    Check(Fp8QuantizeSwiGluCuda(xc.data_ptr(), ElementOf(xc), M, K, pq, s->data_ptr<float>(),
                                Stream(xc)),
          "Fp8QuantizeSwiGluCuda");
  } else {
    Check(Fp8QuantizeRowsCuda(xc.data_ptr(), ElementOf(xc), K, M, K, pq, s->data_ptr<float>(),
                              Stream(xc)),
          "Fp8QuantizeRowsCuda");
  }
}

void QuantizeRows(const torch::Tensor& x, torch::Tensor* q, torch::Tensor* s) {
  Quantize(false, x, q, s);
}

void QuantizeSwiGlu(const torch::Tensor& gu, torch::Tensor* q, torch::Tensor* s) {
  Quantize(true, gu, q, s);
}

torch::Tensor BlockGemm(const torch::Tensor& q, const torch::Tensor& s,
                        const torch::Tensor& row_index, int64_t rows, const torch::Tensor& w,
                        const torch::Tensor& ws, const torch::Tensor& group_ends, int64_t split,
                        torch::ScalarType out_dtype) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == torch::kFloat8_e4m3fn && q.dim() == 2 &&
                  w.scalar_type() == torch::kFloat8_e4m3fn && w.dim() == 3 &&
                  w.size(2) == q.size(1) && w.device() == q.device(),
              "FP8 GEMM: q [M, K] and w [E, N, K], float8_e4m3fn on one CUDA device");
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              "FP8 GEMM: output dtype ", out_dtype, " (float32 or bfloat16)");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  const int64_t NB = Blocks(split) + Blocks(N - split);
  TORCH_CHECK(split > 0 && split <= N, "FP8 GEMM: split ", split, " outside (0, ", N, "]");
  TORCH_CHECK(s.dim() == 2 && s.size(0) == q.size(0) && s.size(1) == Blocks(K),
              "FP8 GEMM: s must be [M, ceil(K / 128)]");
  TORCH_CHECK(ws.dim() == 3 && ws.size(0) == E && ws.size(1) == NB && ws.size(2) == Blocks(K),
              "FP8 GEMM: ws has shape ", ws.sizes(), " for w ", w.sizes(), " split at ", split);
  c10::cuda::CUDAGuard guard(q.device());
  const auto qc = q.contiguous(), wc = w.contiguous();
  const auto sc = s.to(torch::kFloat32).contiguous(), wsc = ws.to(torch::kFloat32).contiguous();
  Fp8GemmCudaArgs a;
  torch::Tensor index, ends;
  if (row_index.defined()) {
    index = row_index.to(q.device(), torch::kInt64).contiguous();
    TORCH_CHECK(index.numel() == rows, "FP8 GEMM: row_index must have ", rows, " entries");
    a.row_index = index.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(rows <= q.size(0), "FP8 GEMM: ", rows, " rows of a q of ", q.size(0));
  }
  if (group_ends.defined()) {
    ends = group_ends.to(q.device(), torch::kInt32).contiguous();
    TORCH_CHECK(ends.numel() == E, "FP8 GEMM: group_ends must have ", E, " entries");
    a.group_ends = ends.data_ptr<int32_t>();
  } else {
    TORCH_CHECK(E == 1, "FP8 GEMM: ", E, " experts need group_ends");
  }
  auto out = torch::empty({rows, N}, q.options().dtype(out_dtype));
  a.a = static_cast<const uint8_t*>(qc.data_ptr());
  a.a_scale = sc.data_ptr<float>();
  a.rows = rows;
  a.n = N;
  a.k = K;
  a.w = static_cast<const uint8_t*>(wc.data_ptr());
  a.w_scale = wsc.data_ptr<float>();
  a.experts = E;
  a.split = split;
  a.out = out.data_ptr();
  a.out_type = out_dtype == torch::kBFloat16 ? Fp8Element::kBFloat16 : Fp8Element::kFloat32;
  Check(Fp8BlockGemmCuda(a, Stream(qc)), "Fp8BlockGemmCuda");
  return out;
}

const lm::RegisterFp8Kernels kCudaFp8(torch::kCUDA, [](lm::Fp8Kernels& k) {
  k.supports = &Supports;
  k.quantize_rows = &QuantizeRows;
  k.quantize_swiglu = &QuantizeSwiGlu;
  k.block_gemm = &BlockGemm;
});

}  // namespace
}  // namespace kernels
