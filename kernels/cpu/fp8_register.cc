// The CPU twin of the FP8 GEMMs (kernels/cpu/fp8_gemm.h), registered for CPU tensors
// (lm/model/fp8.h): what a model loaded with Fp8Weights::kKeep runs on the CPU, and what the
// tests hold the CUDA kernels (kernels/cuda/fp8_cuda.cc) to. The loader's default on the CPU is
// still to dequantize (Fp8Weights::kAuto): these loops are a reference, not a fast path.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "kernels/cpu/fp8_gemm.h"
#include "lm/model/fp8.h"

namespace lm {
namespace {

int64_t Blocks(int64_t n) {
  return (n + cpu::kFp8Group - 1) / cpu::kFp8Group;
}

uint8_t* Bytes(const torch::Tensor& t) {
  return static_cast<uint8_t*>(t.data_ptr());
}

void CheckFp8(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat8_e4m3fn && t.is_contiguous(), "FP8 GEMM: ", what,
              " must be a contiguous float8_e4m3fn tensor");
}

void QuantizeRows(const torch::Tensor& x, torch::Tensor* q, torch::Tensor* s) {
  TORCH_CHECK(x.dim() == 2, "FP8 quantize: x must be [M, K]");
  const auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  *q = torch::empty({M, K}, xf.options().dtype(torch::kFloat8_e4m3fn));
  *s = torch::empty({M, Blocks(K)}, xf.options());
  const float* px = xf.data_ptr<float>();
  uint8_t* pq = Bytes(*q);
  float* ps = s->data_ptr<float>();
  at::parallel_for(0, M, 16,
                   [&](int64_t m0, int64_t m1) { cpu::Fp8QuantizeRows(px, K, K, m0, m1, pq, ps); });
}

void QuantizeSwiGlu(const torch::Tensor& gu, torch::Tensor* q, torch::Tensor* s) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "FP8 quantize: gu must be [M, 2I]");
  const auto gf = gu.to(torch::kFloat32).contiguous();
  const int64_t M = gf.size(0), I = gf.size(1) / 2;
  *q = torch::empty({M, I}, gf.options().dtype(torch::kFloat8_e4m3fn));
  *s = torch::empty({M, Blocks(I)}, gf.options());
  const float* pg = gf.data_ptr<float>();
  uint8_t* pq = Bytes(*q);
  float* ps = s->data_ptr<float>();
  at::parallel_for(
      0, M, 16, [&](int64_t m0, int64_t m1) { cpu::Fp8QuantizeSwiGluRows(pg, I, m0, m1, pq, ps); });
}

torch::Tensor BlockGemm(const torch::Tensor& q, const torch::Tensor& s,
                        const torch::Tensor& row_index, int64_t rows, const torch::Tensor& w,
                        const torch::Tensor& ws, const torch::Tensor& group_ends, int64_t split,
                        torch::ScalarType out_dtype) {
  CheckFp8(q, "q");
  CheckFp8(w, "w");
  TORCH_CHECK(q.dim() == 2 && w.dim() == 3 && w.size(2) == q.size(1),
              "FP8 GEMM: q [M, K] and w [E, N, K]");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(split > 0 && split <= N, "FP8 GEMM: split ", split, " outside (0, ", N, "]");
  const auto sa = s.to(torch::kFloat32).contiguous(), sw = ws.to(torch::kFloat32).contiguous();
  TORCH_CHECK(sa.dim() == 2 && sa.size(0) == q.size(0) && sa.size(1) == Blocks(K),
              "FP8 GEMM: s must be [M, ceil(K / 128)]");
  TORCH_CHECK(sw.dim() == 3 && sw.size(0) == E && sw.size(1) == cpu::Fp8ScaleRows(N, split) &&
                  sw.size(2) == Blocks(K),
              "FP8 GEMM: ws has shape ", sw.sizes(), " for w ", w.sizes(), " split at ", split);
  cpu::Fp8GemmArgs a;
  torch::Tensor index, ends;
  if (row_index.defined()) {
    index = row_index.to(torch::kInt64).contiguous();
    TORCH_CHECK(index.numel() == rows, "FP8 GEMM: row_index must have ", rows, " entries");
    TORCH_CHECK(rows == 0 || index.max().item<int64_t>() < q.size(0),
                "FP8 GEMM: row_index past q's ", q.size(0), " rows");
    a.row_index = index.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(rows <= q.size(0), "FP8 GEMM: ", rows, " rows of a q of ", q.size(0));
  }
  if (group_ends.defined()) {
    ends = group_ends.to(torch::kInt32).contiguous();
    TORCH_CHECK(ends.numel() == E, "FP8 GEMM: group_ends must have ", E, " entries");
    // The contract the CUDA kernel needs (its 64-row tiles hold one expert each).
    TORCH_CHECK(
        E == 1 || ends.narrow(0, 0, E - 1).remainder(kFp8GroupRows).eq(0).all().item<bool>(),
        "FP8 GEMM: expert groups must start at multiples of ", kFp8GroupRows, " rows");
    a.group_ends = ends.data_ptr<int32_t>();
  } else {
    TORCH_CHECK(E == 1, "FP8 GEMM: ", E, " experts need group_ends");
  }
  a.a = Bytes(q);
  a.a_scale = sa.data_ptr<float>();
  a.rows = rows;
  a.n = N;
  a.k = K;
  a.w = Bytes(w);
  a.w_scale = sw.data_ptr<float>();
  a.experts = E;
  a.split = split;
  auto out = torch::empty({rows, N}, q.options().dtype(torch::kFloat32));
  float* po = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { cpu::Fp8BlockGemm(a, r0, r1, po); });
  return out_dtype == torch::kFloat32 ? out : out.to(out_dtype);
}

const RegisterFp8Kernels kCpuFp8(torch::kCPU, [](Fp8Kernels& k) {
  k.supports = [](const torch::Device&) { return true; };
  k.quantize_rows = &QuantizeRows;
  k.quantize_swiglu = &QuantizeSwiGlu;
  k.block_gemm = &BlockGemm;
});

}  // namespace
}  // namespace lm
