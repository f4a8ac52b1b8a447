// Block-wise FP8 weights (lm/model/fp8_format.h) in a model: dequantized on load, or kept in FP8
// and multiplied by FP8 GEMMs with block scales.
//
// Where FP8 GEMMs run (on CUDA, compute capability 8.9 and up: kernels/cuda/fp8_cuda.cc; on the
// CPU, the twin the tests hold the GPU to: kernels/cpu/fp8_register.cc), the loader keeps each
// quantized linear layer's and each MoE layer's expert weights as float8_e4m3fn tensors with
// their fp32 block scales (Fp8Layers: the Linear's `weight_scale_inv`, the experts'
// `*_scale_inv` buffers), and the layers' forwards call Fp8Linear / Fp8MoeExperts:
//   - activations are quantized per token in groups of 128 (kernels/cpu/fp8_gemm.h states the
//     rule and the GEMM's arithmetic: each 128-wide block's dot product on its own, scaled by the
//     token's and the weight block's scales, summed in fp32);
//   - a linear layer's output comes back in its input's dtype; the experts' SwiGLU is computed in
//     fp32 from the gate/up GEMM's output and quantized again for the down GEMM, whose output is
//     summed over a token's experts in fp32, as the unquantized experts are.
// Elsewhere the weights are dequantized on load to the placement's dtype (DequantizeFp8Into).
// The LM head, the embedding, the routers and anything not a Linear or the experts are always
// dequantized: they are read directly as weights, not only through a GEMM.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include <torch/nn/module.h>
#include <torch/types.h>

namespace lm {

class ExpertsImpl;

// The edge of the weight blocks and activation groups the FP8 GEMMs take (the published format's
// weight_block_size [128, 128]); a checkpoint with other blocks is dequantized on load.
inline constexpr int64_t kFp8Block = 128;
// Expert groups of the grouped GEMM start at multiples of this many rows (the CUDA kernel's tile
// height: no tile holds two experts).
inline constexpr int64_t kFp8GroupRows = 64;

// The FP8 GEMM operations of one device type (the contract of kernels/cpu/fp8_gemm.h), registered
// by a backend as lm/model/fast_paths.h's entries are.
struct Fp8Kernels {
  // Whether `device` runs them (CUDA: compute capability >= 8.9, for the e4m3 tensor cores).
  bool (*supports)(const torch::Device& device) = nullptr;
  // x [M, K] (fp32, bf16 or fp16) -> q [M, K] float8_e4m3fn and s [M, ceil(K / 128)] fp32.
  void (*quantize_rows)(const torch::Tensor& x, torch::Tensor* q, torch::Tensor* s) = nullptr;
  // gu [M, 2I] (fp32 or bf16), rows [gate | up] -> q, s of silu(gate) * up in fp32.
  void (*quantize_swiglu)(const torch::Tensor& gu, torch::Tensor* q, torch::Tensor* s) = nullptr;
  // The block-scaled GEMM: q [*, K] e4m3 with s, rows gathered by row_index (int64 [rows], -1
  // padding; undefined: row r is q's row r), weights w [E, N, K] e4m3 with ws [E, NB, KB],
  // grouped by group_ends (int32 [E], each group starting at a multiple of kFp8GroupRows;
  // undefined when E == 1), split as in fp8_gemm.h ->
  // [rows, N] in out_dtype (fp32 or bf16).
  torch::Tensor (*block_gemm)(const torch::Tensor& q, const torch::Tensor& s,
                              const torch::Tensor& row_index, int64_t rows, const torch::Tensor& w,
                              const torch::Tensor& ws, const torch::Tensor& group_ends,
                              int64_t split, torch::ScalarType out_dtype) = nullptr;
};

inline Fp8Kernels& MutableFp8Kernels(torch::DeviceType device) {
  static std::array<Fp8Kernels,
                    static_cast<size_t>(torch::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
      table{};
  return table[static_cast<size_t>(device)];
}

// `static const RegisterFp8Kernels r(torch::kCUDA, [](Fp8Kernels& k) { ... });`
struct RegisterFp8Kernels {
  RegisterFp8Kernels(torch::DeviceType device, void (*fill)(Fp8Kernels&)) {
    fill(MutableFp8Kernels(device));
  }
};

// The FP8 GEMMs of `device`'s type when they are registered and run on `device`, else null.
const Fp8Kernels* Fp8KernelsFor(const torch::Device& device);

// W[n, k] = fp8(W)[n, k] x scale[n / block_rows, k / block_cols], in fp32 (each value exact, its
// product with the scale rounded once), written into `dest` (any dtype and device; converted as
// copy_ converts) a block row at a time, so that no fp32 copy of a whole large tensor is made.
// w: [N, K] float8_e4m3fn (CPU); scale: [ceil(N / block_rows), ceil(K / block_cols)] fp32.
void DequantizeFp8Into(torch::Tensor& dest, const torch::Tensor& w, const torch::Tensor& scale,
                       int64_t block_rows, int64_t block_cols);

// x [..., K] through a linear layer of FP8 weight w [N, K] with scales [ceil(N/128), ceil(K/128)]
// -> [..., N] in x's dtype. Throws (c10::Error) where no FP8 GEMM runs on x's device.
torch::Tensor Fp8Linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale);

// The experts computation (lm::MoeExperts' contract: x [T, H], ids/weights [T, k]) over
// `experts`' FP8 tensors, without autograd. Pairs whose id is outside [0, E) contribute nothing
// (an expert-parallel rank's other experts, once shifted to its local range). Returns the sum
// over a token's slots in fp32 when `fp32_sum` (an expert-parallel partial), else in x's dtype.
torch::Tensor Fp8MoeExperts(const torch::Tensor& x, const torch::Tensor& ids,
                            const torch::Tensor& weights, const ExpertsImpl& experts,
                            bool fp32_sum = false);

// Whether `experts` holds FP8 weights (the loader set its scale buffers).
bool HoldsFp8(const ExpertsImpl& experts);

// Makes `module` hold its parameter `name` in FP8 on `device`: the parameter becomes an
// uninitialised float8_e4m3fn tensor of its shape (no gradient), and its block scales an
// uninitialised fp32 buffer `<name>_scale_inv` (the checkpoint's name for them) that the
// module's forward reads: a Linear's "weight" [N, K] (scales [ceil(N/128), ceil(K/128)]), the
// experts' "gate_up_proj" [E, 2I, H] (scales [E, 2 ceil(I/128), ceil(H/128)]: the gate's block
// grid, then the up's) and "down_proj" [E, H, I] (scales [E, ceil(H/128), ceil(I/128)]). Returns
// false, changing nothing, for any other module or parameter.
bool MakeFp8Holder(torch::nn::Module& module, const std::string& name, const torch::Device& device);

}  // namespace lm
