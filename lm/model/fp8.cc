#include "lm/model/fp8.h"

#include <torch/torch.h>

#include "lm/model/layers.h"
#include "lm/model/moe.h"
#include "lm/model/moe_grouped.h"

namespace lm {
namespace {

const Fp8Kernels& KernelsOrThrow(const torch::Tensor& x) {
  const Fp8Kernels* k = Fp8KernelsFor(x.device());
  TORCH_CHECK(k != nullptr, "FP8 weights on ", x.device(),
              ", where no FP8 GEMM runs (the loader dequantizes them there)");
  return *k;
}

// The GEMM's output dtype for activations of dtype `t`: bf16 stays bf16, everything else fp32.
torch::ScalarType OutDtype(torch::ScalarType t) {
  return t == torch::kBFloat16 ? torch::kBFloat16 : torch::kFloat32;
}

}  // namespace

const Fp8Kernels* Fp8KernelsFor(const torch::Device& device) {
  const Fp8Kernels& k = MutableFp8Kernels(device.type());
  if (k.block_gemm == nullptr || k.supports == nullptr || !k.supports(device)) return nullptr;
  return &k;
}

void DequantizeFp8Into(torch::Tensor& dest, const torch::Tensor& w, const torch::Tensor& scale,
                       int64_t block_rows, int64_t block_cols) {
  TORCH_CHECK(w.dim() == 2 && scale.dim() == 2 && dest.sizes() == w.sizes(),
              "DequantizeFp8Into: w [N, K], scale [NB, KB] and dest [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  const auto scale32 = scale.to(torch::kFloat32);
  for (int64_t b = 0; b < scale32.size(0); ++b) {
    const int64_t r0 = b * block_rows, rows = std::min(block_rows, N - r0);
    // The block row's scales along K, one per column: [1, K].
    auto col_scale =
        scale32[b].repeat_interleave(block_cols).narrow(0, 0, K).unsqueeze(0).to(w.device());
    auto block = w.narrow(0, r0, rows).to(torch::kFloat32) * col_scale;
    dest.narrow(0, r0, rows).copy_(block);
  }
}

torch::Tensor Fp8Linear(const torch::Tensor& x, const torch::Tensor& w,
                        const torch::Tensor& scale) {
  const Fp8Kernels& k = KernelsOrThrow(x);
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "Fp8Linear: x has ", x.size(-1), " features, the weight ", K);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const auto x2 = x.reshape({-1, K}).contiguous();
  torch::Tensor q, s;
  k.quantize_rows(x2, &q, &s);
  auto y = k.block_gemm(q, s, {}, x2.size(0), w.unsqueeze(0), scale.unsqueeze(0), {}, N,
                        OutDtype(x.scalar_type()));
  return y.to(x.scalar_type()).view(out_shape);
}

bool HoldsFp8(const ExpertsImpl& experts) {
  return experts.gate_up_proj_scale_inv.defined();
}

namespace {

int64_t Blocks(int64_t n) {
  return (n + kFp8Block - 1) / kFp8Block;
}

// `param` re-made as an uninitialised float8_e4m3fn tensor on `device`, without a gradient.
void ToFp8(torch::Tensor& param, const torch::Device& device) {
  param.set_data(torch::empty(param.sizes(),
                              torch::TensorOptions().dtype(torch::kFloat8_e4m3fn).device(device)));
  param.requires_grad_(false);
}

torch::Tensor ScaleBuffer(torch::nn::Module& m, const std::string& name, std::vector<int64_t> shape,
                          const torch::Device& device) {
  return m.register_buffer(
      name, torch::empty(shape, torch::TensorOptions().dtype(torch::kFloat32).device(device)));
}

}  // namespace

bool MakeFp8Holder(torch::nn::Module& module, const std::string& name,
                   const torch::Device& device) {
  if (auto* linear = module.as<LinearImpl>(); linear != nullptr && name == "weight") {
    const int64_t N = linear->weight.size(0), K = linear->weight.size(1);
    ToFp8(linear->weight, device);
    linear->weight_scale_inv =
        ScaleBuffer(module, "weight_scale_inv", {Blocks(N), Blocks(K)}, device);
    return true;
  }
  auto* experts = module.as<ExpertsImpl>();
  if (experts == nullptr) return false;
  if (name == "gate_up_proj") {
    const auto s = experts->gate_up_proj.sizes();  // [E, 2I, H]
    ToFp8(experts->gate_up_proj, device);
    experts->gate_up_proj_scale_inv = ScaleBuffer(
        module, "gate_up_proj_scale_inv", {s[0], 2 * Blocks(s[1] / 2), Blocks(s[2])}, device);
    return true;
  }
  if (name == "down_proj") {
    const auto s = experts->down_proj.sizes();  // [E, H, I]
    ToFp8(experts->down_proj, device);
    experts->down_proj_scale_inv =
        ScaleBuffer(module, "down_proj_scale_inv", {s[0], Blocks(s[1]), Blocks(s[2])}, device);
    return true;
  }
  return false;
}

torch::Tensor Fp8MoeExperts(const torch::Tensor& x, const torch::Tensor& ids,
                            const torch::Tensor& weights, const ExpertsImpl& experts,
                            bool fp32_sum) {
  const Fp8Kernels& k = KernelsOrThrow(x);
  torch::NoGradGuard no_grad;
  const torch::Tensor &gate_up = experts.gate_up_proj, &down = experts.down_proj;
  const int64_t T = x.size(0), H = x.size(1), top_k = ids.size(1);
  const int64_t E = gate_up.size(0), I = down.size(2);
  // Rows sorted by expert (on the device, no host sync), each expert's group padded to a tile.
  const ExpertRows rows = SortPairsByExpert(ids, E, kFp8GroupRows);
  const int64_t R = rows.pair_of_row.size(0);
  // Every row reads its token's quantized activations: a token is quantized once, whatever the
  // number of experts it goes to (the rule is per token, so the rows' values are the same).
  const auto token_of_row =
      torch::where(rows.pair_of_row.ge(0), torch::div(rows.pair_of_row, top_k, "floor"),
                   torch::full_like(rows.pair_of_row, -1));
  torch::Tensor qx, sx;
  k.quantize_rows(x.contiguous(), &qx, &sx);
  const auto gu = k.block_gemm(qx, sx, token_of_row, R, gate_up, experts.gate_up_proj_scale_inv,
                               rows.group_ends, I, OutDtype(x.scalar_type()));
  torch::Tensor qh, sh;
  k.quantize_swiglu(gu, &qh, &sh);
  // [R + 1, H]: the last row stays zero, the row of every pair without one (an id outside [0, E)).
  auto out = torch::zeros({R + 1, H}, x.options().dtype(torch::kFloat32));
  out.narrow(0, 0, R).copy_(k.block_gemm(qh, sh, {}, R, down, experts.down_proj_scale_inv,
                                         rows.group_ends, H, torch::kFloat32));
  const auto row =
      torch::where(rows.row_of_pair.ge(0), rows.row_of_pair, torch::full_like(rows.row_of_pair, R))
          .view({T, top_k});
  const auto w = weights.to(torch::kFloat32);
  // y_t = sum_s w_ts out[row(t, s)], slot by slot: fp32, in slot order, [T, H] at a time.
  auto y = torch::zeros({T, H}, x.options().dtype(torch::kFloat32));
  for (int64_t s = 0; s < top_k; ++s)
    y.add_(out.index_select(0, row.select(1, s)) * w.narrow(1, s, 1));
  return fp32_sum ? y : y.to(x.scalar_type());
}

}  // namespace lm
