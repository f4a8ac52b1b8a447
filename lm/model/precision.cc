#include "lm/model/precision.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include "lm/model/batch_invariant.h"
#include "lm/model/layers.h"

namespace lm {
namespace {

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The inputs of a bf16 GEMM as the CPU multiplies them: rounded to bf16, held in fp32.
torch::Tensor RoundedFp32(const torch::Tensor& t, torch::ScalarType compute) {
  if (t.scalar_type() == compute) return t.to(torch::kFloat32);
  return t.to(compute).to(torch::kFloat32);
}

}  // namespace

bool HoldsBf16ComputeCopy(const std::string& name, const torch::Tensor& param) {
  if (param.dim() < 2) return false;
  for (const char* fp32 : {"mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight"})
    if (EndsWith(name, fp32)) return false;
  return true;
}

torch::Tensor MatmulFp32(const torch::Tensor& a, const torch::Tensor& b,
                         torch::ScalarType compute) {
  if (compute == torch::kFloat32) return torch::mm(a.to(torch::kFloat32), b.to(torch::kFloat32));
  if (a.is_cuda()) return at::mm(a.to(compute), b.to(compute), torch::kFloat32);
  return torch::mm(RoundedFp32(a, compute), RoundedFp32(b, compute));
}

void AddMatmulFp32(torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b,
                   torch::ScalarType compute) {
  if (compute != torch::kFloat32 && acc.is_cuda()) {
    acc.add_(at::mm(a.to(compute), b.to(compute), torch::kFloat32));
    return;
  }
  acc.addmm_(RoundedFp32(a, compute), RoundedFp32(b, compute));
}

torch::Tensor LogitsFp32(const torch::Tensor& hidden, const torch::Tensor& weight) {
  if (hidden.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32)
    return MatmulWeightT(hidden, weight);
  // Autocast would run CPU mm in bf16 (a bf16 output) even on fp32 operands.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto rows = hidden.reshape({-1, hidden.size(-1)});  // a 1-D hidden state is one row
  auto sizes = hidden.sizes().vec();
  sizes.back() = weight.size(0);
  if (BatchInvariant() && rows.is_cpu()) {  // the same fp32 product of the rounded operands
    const auto compute = ComputeDtype(weight);
    return InvariantMatmulWeightT(RoundedFp32(rows, compute), RoundedFp32(weight, compute))
        .view(sizes);
  }
  return MatmulFp32(rows, weight.t(), ComputeDtype(weight)).view(sizes);
}

Bf16Autocast::Bf16Autocast(bool enabled, torch::Device device)
    : enabled_(enabled), type_(device.type()) {
  if (!enabled_) return;
  was_enabled_ = at::autocast::is_autocast_enabled(type_);
  was_dtype_ = at::autocast::get_autocast_dtype(type_);
  at::autocast::set_autocast_dtype(type_, at::kBFloat16);
  at::autocast::set_autocast_enabled(type_, true);
}

Bf16Autocast::~Bf16Autocast() {
  if (!enabled_) return;
  at::autocast::set_autocast_enabled(type_, was_enabled_);
  at::autocast::set_autocast_dtype(type_, was_dtype_);
  if (!was_enabled_) at::autocast::clear_cache();
}

}  // namespace lm
