#include "lm/model/moe_grouped.h"

#include <limits>

#include <torch/torch.h>

namespace lm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// One grouped GEMM over the expert groups: a [R, K] rows x b [E, K, N] -> [R, N], or, with both
// operands 2-D, a [M, R] x b [R, N] -> [E, M, N] (a reduction over each group's rows).
torch::Tensor GroupedMm(const torch::Tensor& a, const torch::Tensor& b, const ExpertRows& rows) {
  return at::_grouped_mm(a, b, rows.group_ends);
}

// The pair, token and padding mask of every row.
struct RowIndex {
  torch::Tensor pad;    // [R] bool: padding rows
  torch::Tensor pair;   // [R] int64: the row's pair (0 for padding)
  torch::Tensor token;  // [R] int64: the row's token (0 for padding)
  RowIndex(const ExpertRows& rows, int64_t top_k)
      : pad(rows.pair_of_row.lt(0)),
        pair(rows.pair_of_row.clamp_min(0)),
        token(torch::div(pair, top_k, "floor")) {}
};

// src [T, H] gathered to the rows [R, H], padding rows zero (whatever src holds).
torch::Tensor GatherRows(const torch::Tensor& src, const RowIndex& index) {
  return src.index_select(0, index.token).masked_fill_(index.pad.unsqueeze(1), 0);
}

// Per-row values [R, ...] back to the pairs [T * k, ...]; pairs that have no row get zero.
torch::Tensor ScatterToPairs(const torch::Tensor& per_row, const ExpertRows& rows) {
  auto missing = rows.row_of_pair.lt(0);
  auto out = per_row.index_select(0, rows.row_of_pair.clamp_min(0));
  return out.masked_fill_(per_row.dim() == 2 ? missing.unsqueeze(1) : missing, 0);
}

// An expert that received no rows gets an exact zero gradient, whatever the grouped kernel does
// with an empty reduction.
void ZeroIdleExperts(torch::Tensor& grad, const ExpertRows& rows) {
  auto ends = rows.group_ends.to(torch::kInt64);
  auto sizes =
      ends - torch::cat({torch::zeros({1}, ends.options()), ends.narrow(0, 0, ends.size(0) - 1)});
  grad.masked_fill_(sizes.eq(0).view({-1, 1, 1}), 0);
}

// The forward without a device kernel, in gate_up's dtype c: both GEMMs grouped, SwiGLU in fp32
// rounded to c (as the kernels round act), the weighted sum over a token's slots in fp32 (in slot
// order: deterministic), returned in fp32.
torch::Tensor GroupedForwardFp32(const torch::Tensor& x, const torch::Tensor& ids,
                                 const torch::Tensor& weights, const torch::Tensor& gate_up,
                                 const torch::Tensor& down) {
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), I = down.size(2);
  const auto c = gate_up.scalar_type(), acc = torch::kFloat32;
  const ExpertRows rows = SortPairsByExpert(ids, gate_up.size(0));
  const RowIndex index(rows, k);
  auto gu = GroupedMm(GatherRows(x.to(c), index), gate_up.transpose(1, 2), rows).to(acc);
  auto h = (torch::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I)).to(c);
  auto out = GroupedMm(h, down.transpose(1, 2), rows);  // [R, H]
  auto w = weights.reshape({-1, 1}).to(acc);
  auto y = ScatterToPairs(out, rows).to(acc) * w;
  return y.view({T, k, H}).sum(1);
}

class GroupedExperts : public torch::autograd::Function<GroupedExperts> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& ids, const torch::Tensor& weights,
                               const torch::Tensor& gate_up, const torch::Tensor& down,
                               MoeForwardKernel kernel) {
    ctx->save_for_backward({x, ids, weights, gate_up, down});
    torch::Tensor y = kernel ? kernel(x, ids, weights, gate_up, down) : torch::Tensor();
    return y.defined()
               ? y
               : GroupedForwardFp32(x, ids, weights, gate_up, down).to(gate_up.scalar_type());
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    const auto s = ctx->get_saved_variables();
    const MoeExpertsGrads g = MoeExpertsBackward(s[0], s[1], s[2], s[3], s[4], grad_outputs[0]);
    return {g.x, torch::Tensor(), g.weights, g.gate_up, g.down, torch::Tensor()};
  }
};

}  // namespace

bool GroupedGemmsFit(const torch::Tensor& x, const torch::Tensor& down) {
  const auto dt = down.scalar_type();
  return (dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf) &&
         x.size(-1) % 8 == 0 && down.size(2) % 8 == 0;
}

int64_t ExpertRows::Rows(int64_t pairs, int64_t experts, int64_t align) {
  return pairs + std::min(pairs, experts) * (align - 1);
}

ExpertRows SortPairsByExpert(const torch::Tensor& ids, int64_t experts, int64_t align) {
  TORCH_CHECK(ids.dim() == 2, "SortPairsByExpert: ids must be [T, k], got ", ids.sizes());
  TORCH_CHECK(experts >= 1 && align >= 1, "SortPairsByExpert: experts ", experts, ", align ",
              align);
  const int64_t P = ids.numel(), E = experts, R = ExpertRows::Rows(P, E, align);
  TORCH_CHECK(R < std::numeric_limits<int32_t>::max(), "SortPairsByExpert: ", R,
              " rows do not fit the grouped GEMM's int32 offsets");
  const auto i64 = ids.options().dtype(torch::kInt64);
  auto flat = ids.reshape({-1}).to(torch::kInt64);
  // Pairs with an id outside [0, E) sort last, as an expert E that gets no rows.
  auto key = flat.masked_fill(flat.lt(0) | flat.ge(E), E);
  auto order = std::get<1>(key.sort(/*stable=*/true, 0, /*descending=*/false));
  // Integer counts: scatter_add_ is exact in any order, so deterministic on every device.
  auto counts =
      torch::zeros({E + 1}, i64).scatter_add_(0, key, torch::ones_like(key)).narrow(0, 0, E);
  auto padded = torch::div(counts + (align - 1), align, "floor") * align;
  auto group_ends = padded.cumsum(0);
  auto group_starts = group_ends - padded, count_starts = counts.cumsum(0) - counts;
  // The i-th pair in sorted order is the (i - count_start)-th row of its expert's group.
  auto sorted_key = key.index_select(0, order);
  auto dropped = sorted_key.ge(E);
  auto e = sorted_key.clamp_max(E - 1);
  auto row =
      torch::arange(P, i64) - count_starts.index_select(0, e) + group_starts.index_select(0, e);
  ExpertRows rows;
  rows.group_ends = group_ends.to(torch::kInt32);
  // Dropped pairs land in one spare slot past the end, cut off below.
  rows.pair_of_row =
      torch::full({R + 1}, -1, i64).scatter_(0, row.masked_fill(dropped, R), order).narrow(0, 0, R);
  rows.row_of_pair = torch::full({P}, -1, i64).scatter_(0, order, row.masked_fill(dropped, -1));
  return rows;
}

MoeExpertsGrads MoeExpertsBackward(const torch::Tensor& x, const torch::Tensor& ids,
                                   const torch::Tensor& weights, const torch::Tensor& gate_up,
                                   const torch::Tensor& down, const torch::Tensor& dy) {
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), I = down.size(2);
  const auto c = gate_up.scalar_type(), acc = torch::kFloat32;
  const ExpertRows rows = SortPairsByExpert(ids, gate_up.size(0));
  const RowIndex index(rows, k);
  auto xs = GatherRows(x.to(c), index);    // [R, H]
  auto dys = GatherRows(dy.to(c), index);  // [R, H]
  auto ws = weights.reshape({-1}).to(acc).index_select(0, index.pair).masked_fill_(index.pad, 0);
  ws = ws.unsqueeze(1);  // [R, 1]

  auto gu = GroupedMm(xs, gate_up.transpose(1, 2), rows).to(acc);  // recomputed, [R, 2I]
  auto g = gu.narrow(1, 0, I), u = gu.narrow(1, I, I);
  auto sg = torch::sigmoid(g);
  auto act = g * sg;         // silu(g)
  auto h = (act * u).to(c);  // the down GEMM's input, rounded as in the forward
  auto dout = GroupedMm(dys, down, rows).to(acc);  // dy Wd: [R, I], unweighted
  auto dw_rows = (dout * h.to(acc)).sum(1);        // <dy, o> = <dy Wd, h>
  auto dh = dout * ws;
  auto dgu = torch::cat({dh * u * (sg * (1 + g * (1 - sg))), dh * act}, 1).to(c);  // [R, 2I]

  MoeExpertsGrads grads;
  grads.gate_up = GroupedMm(dgu.t(), xs, rows);                   // [E, 2I, H]
  grads.down = GroupedMm((dys.to(acc) * ws).to(c).t(), h, rows);  // [E, H, I]
  ZeroIdleExperts(grads.gate_up, rows);
  ZeroIdleExperts(grads.down, rows);
  auto dxs = GroupedMm(dgu, gate_up, rows);  // [R, H]
  grads.x = ScatterToPairs(dxs, rows).view({T, k, H}).sum(1, false, acc).to(x.scalar_type());
  grads.weights = ScatterToPairs(dw_rows, rows).view({T, k}).to(weights.scalar_type());
  return grads;
}

torch::Tensor MoeExpertsGroupedFp32(const torch::Tensor& x, const torch::Tensor& ids,
                                    const torch::Tensor& weights, const torch::Tensor& gate_up,
                                    const torch::Tensor& down) {
  TORCH_CHECK(GroupedGemmsFit(x, down) && down.scalar_type() == gate_up.scalar_type(),
              "MoeExpertsGroupedFp32: the grouped GEMM takes fp32, bf16 or fp16 experts with H "
              "and I multiples of 8, got ",
              gate_up.scalar_type(), " ", gate_up.sizes());
  torch::NoGradGuard no_grad;
  return GroupedForwardFp32(x, ids, weights, gate_up, down);
}

torch::Tensor MoeExpertsGrouped(const torch::Tensor& x, const torch::Tensor& ids,
                                const torch::Tensor& weights, const torch::Tensor& gate_up,
                                const torch::Tensor& down, MoeForwardKernel forward_kernel) {
  TORCH_CHECK(down.scalar_type() == gate_up.scalar_type(), "MoeExpertsGrouped: gate_up is ",
              gate_up.scalar_type(), ", down ", down.scalar_type());
  TORCH_CHECK(GroupedGemmsFit(x, down),
              "MoeExpertsGrouped: the grouped GEMM takes fp32, bf16 "
              "or fp16 experts with H and I multiples of 8, got ",
              gate_up.scalar_type(), " ", gate_up.sizes());
  auto y = GroupedExperts::apply(x.to(gate_up.scalar_type()), ids, weights, gate_up, down,
                                 forward_kernel);
  return y.to(x.scalar_type());
}

}  // namespace lm
