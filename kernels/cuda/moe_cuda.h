// LibTorch adapter of the CUDA MoE kernels (moe_kernels.cuh): tensors in, tensors out, on the
// current CUDA stream of the inputs' device. lm/model/moe.cc registers MoeExpertsCuda for CUDA
// tensors and uses RouteTopkCuda inside lm::Route, so models pick the kernels up automatically.
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

namespace kernels {

// lm::FastPaths::moe_experts: x [T, H], ids [T, k] (int64 or int32), weights [T, k], gate_up
// [E, 2I, H] (gate rows first), down [E, H, I] -> [T, H] in x's dtype, without autograd. Returns an
// undefined tensor for inputs it does not handle (not CUDA, dtype other than bf16/fp32, E > 512,
// k > 16, H or I not a multiple of 8, or gradients needed); the caller then runs lm's path (for
// training, lm::MoeExpertsGrouped: this forward and a grouped-GEMM backward).
torch::Tensor MoeExpertsCuda(const torch::Tensor& x, const torch::Tensor& ids,
                             const torch::Tensor& weights, const torch::Tensor& gate_up,
                             const torch::Tensor& down);

// Fused router softmax + top-k (+ renormalisation): logits [T, E] (fp32 or bf16, CUDA) ->
// weights [T, k] fp32 and ids [T, k] int64; ties go to the lower expert id. False (outputs
// untouched) when unsupported. Not differentiable: lm::Route uses it only without autograd.
bool RouteTopkCuda(const torch::Tensor& logits, int64_t top_k, bool renormalize,
                   torch::Tensor* weights, torch::Tensor* ids);

// ---- The pieces, for tests and benchmarks (no autograd) ----

// Whether MoeExpertsCuda handles these inputs (see above).
bool MoeCudaSupports(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& gate_up,
                     const torch::Tensor& down);

// The GEMM tile configurations (kernels::TileConfig, as int): -1 picks what the layer would.
struct MoeCudaOptions {
  int tile_config = -1;
};

// Forward only (the layer without autograd), optionally with a forced tile configuration.
torch::Tensor MoeExpertsCudaForward(const torch::Tensor& x, const torch::Tensor& ids,
                                    const torch::Tensor& weights, const torch::Tensor& gate_up,
                                    const torch::Tensor& down, const MoeCudaOptions& opts = {});

// AlignRows' outputs (int32 tensors) for ids [T, k] over `experts` experts, padded to the tile
// height of `tile_config`.
struct AlignedRows {
  int64_t tokens = 0, top_k = 0, experts = 0;
  int tile_config = 0;
  int64_t block_m = 0;
  torch::Tensor expert_offsets;  // [E + 1] padded first row of each expert; [E]: rows in use
  torch::Tensor sorted_rows;     // [max_rows] pair (token * k + slot) of each row, -1: padding
  torch::Tensor tile_expert;     // [max_tiles] expert of each tile, -1: unused
  torch::Tensor row_of_pair;     // [T * k] row of each pair
};
AlignedRows AlignCuda(const torch::Tensor& ids, int64_t experts, int tile_config);

// The grouped GEMMs on aligned rows: act [max_rows, I] = SwiGLU(x gathered, gate_up); expert
// outputs [max_rows, H] = act down^T. x, gate_up, down, act: bf16 for the bf16 configurations,
// fp32 for the fp32 one.
torch::Tensor GroupedSwiGluCuda(const torch::Tensor& x, const AlignedRows& rows,
                                const torch::Tensor& gate_up);
torch::Tensor GroupedDownCuda(const torch::Tensor& act, const AlignedRows& rows,
                              const torch::Tensor& down);

// The tile configuration the layer picks, and its tile height.
int ChooseTileConfigFor(torch::ScalarType dtype, int64_t pairs, int64_t experts);
int TileRows(int tile_config);

// The SM architectures compiled in, e.g. "800,900".
std::string CompiledCudaArchitectures();

}  // namespace kernels
