// The experts of a MoE layer as grouped GEMMs, for training on a device: the (token, slot) pairs
// sorted by expert into groups of rows, each expert's group padded to a multiple of
// kExpertGroupAlign rows, and every expert's GEMM of a step in one grouped-GEMM launch
// (at::_grouped_mm: LibTorch's CUTLASS grouped kernel for bf16 on sm90/sm100; its per-group loop
// elsewhere). Every shape is known on the host and every count and offset stays on the device, so
// on a bf16 Hopper GPU neither the forward nor the backward synchronises with the host.
//
//   forward:   gu = x_r Wgu_e^T        (grouped, rows r of expert e)
//              h  = silu(g) * u
//              o  = h Wd_e^T           (grouped)
//              y_t = sum_s w_ts o_r(t,s)
//   backward:  do_r  = dy_t Wd_e       (grouped; unweighted, so that dw_ts = <do_r, h_r>)
//              dh    = w_ts do_r
//              dgu   = [dh u silu'(g), dh silu(g)]
//              dx_r  = dgu Wgu_e       (grouped), dx_t = sum_s dx_r(t,s)
//              dWgu_e = dgu_e^T x_e,  dWd_e = (w dy)_e^T h_e   (grouped over the rows)
// The backward recomputes the first GEMM (keeping gu would cost [T k, 2I] per layer) but not the
// second: the routing weights' gradient comes from do and h.
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace lm {

// Rows per expert group are a multiple of this: 16 rows keep every group's start 16-byte aligned
// for 2- and 4-byte elements, as the grouped kernel requires when the rows are its reduction
// dimension (the weight gradients).
inline constexpr int64_t kExpertGroupAlign = 16;

// The pairs p = t * k + s of ids [T, k] sorted by expert (stable: increasing p within an expert),
// each expert's rows padded to a multiple of `align`. R = rows(T * k, E, align) rows in all, an
// upper bound known on the host; rows past group_ends[E - 1] belong to no group.
struct ExpertRows {
  torch::Tensor group_ends;   // [E] int32: one past the last row of each expert (grouped-GEMM offs)
  torch::Tensor pair_of_row;  // [R] int64: the pair of each row, -1 for padding
  torch::Tensor
      row_of_pair;  // [T * k] int64: the row of each pair, -1 where its id is not in [0, E)
  static int64_t Rows(int64_t pairs, int64_t experts, int64_t align);
};
ExpertRows SortPairsByExpert(const torch::Tensor& ids, int64_t experts,
                             int64_t align = kExpertGroupAlign);

// The experts computation (lm::MoeExperts' contract: x [T, H], ids/weights [T, k], gate_up
// [E, 2I, H], down [E, H, I] -> [T, H]), differentiable, computing in gate_up's dtype: the forward
// is `forward_kernel` where it is given and handles the inputs (a device's fused kernels, called
// without autograd), else the grouped GEMMs above; the backward is the grouped GEMMs above. Pairs
// whose id is outside [0, E) contribute nothing and get no gradient.
using MoeForwardKernel = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& ids,
                                           const torch::Tensor& weights,
                                           const torch::Tensor& gate_up, const torch::Tensor& down);
torch::Tensor MoeExpertsGrouped(const torch::Tensor& x, const torch::Tensor& ids,
                                const torch::Tensor& weights, const torch::Tensor& gate_up,
                                const torch::Tensor& down,
                                MoeForwardKernel forward_kernel = nullptr);

// The grouped forward alone, without autograd, its sum over a token's slots kept in fp32 (not
// rounded to x's dtype): an expert-parallel rank's partial output, whose ids of other ranks'
// experts (outside [0, E) once shifted to the local range) are dropped. Fixed shapes throughout.
torch::Tensor MoeExpertsGroupedFp32(const torch::Tensor& x, const torch::Tensor& ids,
                                    const torch::Tensor& weights, const torch::Tensor& gate_up,
                                    const torch::Tensor& down);

// Whether the grouped GEMMs take these experts: fp32, bf16 or fp16, and rows of 16 bytes (H of x
// [T, H] and I of down [E, H, I] multiples of 8).
bool GroupedGemmsFit(const torch::Tensor& x, const torch::Tensor& down);

// The backward alone: the gradients of sum(dy * MoeExperts(x, ids, weights, gate_up, down)) with
// respect to x, weights, gate_up and down (in their dtypes).
struct MoeExpertsGrads {
  torch::Tensor x, weights, gate_up, down;
};
MoeExpertsGrads MoeExpertsBackward(const torch::Tensor& x, const torch::Tensor& ids,
                                   const torch::Tensor& weights, const torch::Tensor& gate_up,
                                   const torch::Tensor& down, const torch::Tensor& dy);

}  // namespace lm
