#include "lm/model/batch_invariant.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include <torch/torch.h>

#include "lm/model/fast_paths.h"

namespace lm {
namespace {

bool NeedsGrad(const torch::Tensor& t) {
  return torch::GradMode::is_enabled() && t.requires_grad();
}

int64_t RoundUp(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

// `op` on every kPointwiseBlock-element block of x, zero-padded to whole blocks, one call per
// block: each call stays below LibTorch's grain (so it runs on this thread, in one range) and
// covers whole vectors, so every element goes through the vector code whatever its position.
torch::Tensor BlockedPointwise(
    const torch::Tensor& x, const std::function<void(torch::Tensor&, const torch::Tensor&)>& op) {
  const int64_t n = x.numel();
  auto in = torch::zeros({RoundUp(std::max<int64_t>(n, 1), kPointwiseBlock)}, x.options());
  in.narrow(0, 0, n).copy_(x.reshape({-1}));
  auto out = torch::empty_like(in);
  for (int64_t b = 0; b < in.numel(); b += kPointwiseBlock) {
    auto o = out.narrow(0, b, kPointwiseBlock);
    op(o, in.narrow(0, b, kPointwiseBlock));
  }
  return out.narrow(0, 0, n).view(x.sizes());
}

// The library's op, or BlockedPointwise in batch-invariant mode on the CPU.
torch::Tensor Pointwise(const torch::Tensor& x,
                        const std::function<torch::Tensor(const torch::Tensor&)>& library,
                        const std::function<void(torch::Tensor&, const torch::Tensor&)>& out) {
  if (!BatchInvariant() || !x.is_cpu() || NeedsGrad(x)) return library(x);
  return BlockedPointwise(x, out);
}

// Row r of x [M, K] W^T with x padded to whole kInvariantRows-row blocks, one library product per
// block: every block has the same shape and alignment, so a row's result does not depend on the
// others. Used where the CPU fast path does not apply (dtypes other than fp32).
torch::Tensor BlockedMatmulWeightT(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t padded = RoundUp(std::max<int64_t>(M, 1), kInvariantRows);
  auto xp = torch::zeros({padded, K}, x.options());
  xp.narrow(0, 0, M).copy_(x);
  auto y = torch::empty({padded, N}, x.options());
  const auto wt = w.t();
  for (int64_t r = 0; r < padded; r += kInvariantRows) {
    auto yr = y.narrow(0, r, kInvariantRows);
    torch::mm_out(yr, xp.narrow(0, r, kInvariantRows), wt);
  }
  return y.narrow(0, 0, M);
}

}  // namespace

ScopedBatchInvariant::ScopedBatchInvariant(bool enabled)
    : previous_(batch_invariant_internal::enabled) {
  batch_invariant_internal::enabled = enabled;
}

ScopedBatchInvariant::~ScopedBatchInvariant() {
  batch_invariant_internal::enabled = previous_;
}

torch::Tensor InvariantMatmulWeightT(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "InvariantMatmulWeightT: expected x [M, K] and w [N, K], got ", x.sizes(), " and ",
              w.sizes());
  if (!x.is_cpu() || NeedsGrad(x) || NeedsGrad(w)) return torch::mm(x, w.t());
  if (const auto fast = FastPathsFor(torch::kCPU).row_invariant_matmul) {
    torch::Tensor y = fast(x, w);
    if (y.defined()) return y;
  }
  return BlockedMatmulWeightT(x, w);
}

torch::Tensor InvariantLogSumExpRows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "InvariantLogSumExpRows: expected [rows, V], got ",
              logits.sizes());
  if (!logits.is_cpu()) return logits.to(torch::kFloat32).logsumexp(1);
  if (const auto fast = FastPathsFor(torch::kCPU).logsumexp_rows) {
    torch::Tensor l = fast(logits);
    if (l.defined()) return l;
  }
  // Max, then the sum of exp(x - max) in double, left to right: one fixed order per row.
  const auto x = logits.to(torch::kFloat32).contiguous();
  const int64_t rows = x.size(0), V = x.size(1);
  auto out = torch::empty({rows}, x.options());
  const float* p = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = p + r * V;
    const float mx = V > 0 ? *std::max_element(row, row + V) : -INFINITY;
    if (std::isinf(mx)) {
      o[r] = mx;
      continue;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
    o[r] = mx + static_cast<float>(std::log(sum));
  }
  return out;
}

namespace pointwise {

torch::Tensor Silu(const torch::Tensor& x) {
  return Pointwise(
      x, [](const torch::Tensor& t) { return torch::silu(t); },
      [](torch::Tensor& o, const torch::Tensor& t) { torch::silu_out(o, t); });
}

torch::Tensor Sigmoid(const torch::Tensor& x) {
  return Pointwise(
      x, [](const torch::Tensor& t) { return torch::sigmoid(t); },
      [](torch::Tensor& o, const torch::Tensor& t) { torch::sigmoid_out(o, t); });
}

torch::Tensor Softplus(const torch::Tensor& x) {
  return Pointwise(
      x, [](const torch::Tensor& t) { return torch::softplus(t); },
      [](torch::Tensor& o, const torch::Tensor& t) { torch::softplus_out(o, t); });
}

torch::Tensor Cos(const torch::Tensor& x) {
  return Pointwise(
      x, [](const torch::Tensor& t) { return t.cos(); },
      [](torch::Tensor& o, const torch::Tensor& t) { torch::cos_out(o, t); });
}

torch::Tensor Sin(const torch::Tensor& x) {
  return Pointwise(
      x, [](const torch::Tensor& t) { return t.sin(); },
      [](torch::Tensor& o, const torch::Tensor& t) { torch::sin_out(o, t); });
}

}  // namespace pointwise
}  // namespace lm
