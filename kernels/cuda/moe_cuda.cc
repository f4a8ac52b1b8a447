// LibTorch adapter of the CUDA MoE kernels: shape and dtype checks, device buffers from the
// caching allocator (stream-ordered, CUDA-graph safe), launches on the current stream.
#include "kernels/cuda/moe_cuda.h"

#include <torch/torch.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/moe_kernels.cuh"

namespace kernels {
namespace {

void Check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "kernels::", what, " failed: ", cudaGetErrorString(err));
}

cudaStream_t CurrentStream(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Contiguous and 16-byte aligned (cp.async and vector loads need it; a view can start anywhere).
torch::Tensor Aligned(const torch::Tensor& t) {
  auto c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

template <typename T>
T* Ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

bool IsBf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16;
}

TileConfig ConfigFor(const torch::Tensor& x, int64_t pairs, int64_t experts, int forced) {
  if (forced >= 0) return static_cast<TileConfig>(forced);
  return ChooseTileConfig(IsBf16(x), pairs, experts);
}

void CheckConfigMatchesDtype(TileConfig config, const torch::Tensor& x) {
  TORCH_CHECK((config == TileConfig::kFp32) == (x.scalar_type() == torch::kFloat32),
              "kernels: tile configuration ", static_cast<int>(config), " does not fit dtype ",
              x.scalar_type());
}

// Device buffers of one layer call (torch tensors keep them alive while the kernels run).
struct LayerBuffers {
  torch::Tensor chunk_counts, expert_offsets, sorted_rows, tile_expert, row_of_pair, act,
      expert_out;
  MoeBuffers Raw() const {
    MoeBuffers b{};
    b.chunk_counts = chunk_counts.defined() ? Ptr<int32_t>(chunk_counts) : nullptr;
    b.expert_offsets = expert_offsets.defined() ? Ptr<int32_t>(expert_offsets) : nullptr;
    b.sorted_rows = sorted_rows.defined() ? Ptr<int32_t>(sorted_rows) : nullptr;
    b.tile_expert = tile_expert.defined() ? Ptr<int32_t>(tile_expert) : nullptr;
    b.row_of_pair = row_of_pair.defined() ? Ptr<int32_t>(row_of_pair) : nullptr;
    b.act = act.defined() ? act.data_ptr() : nullptr;
    b.expert_out = expert_out.defined() ? expert_out.data_ptr() : nullptr;
    return b;
  }
};

LayerBuffers AllocateAlign(const MoePlan& p, const torch::Device& device) {
  auto i32 = torch::TensorOptions().dtype(torch::kInt32).device(device);
  LayerBuffers b;
  b.chunk_counts = torch::empty({std::max<int64_t>(1, p.num_chunks * p.experts)}, i32);
  b.expert_offsets = torch::empty({p.experts + 1}, i32);
  b.sorted_rows = torch::empty({std::max<int64_t>(1, p.max_rows)}, i32);
  b.tile_expert = torch::empty({std::max<int64_t>(1, p.max_tiles)}, i32);
  b.row_of_pair = torch::empty({std::max<int64_t>(1, p.pairs)}, i32);
  return b;
}

void CheckLayerShapes(const torch::Tensor& x, const torch::Tensor& ids,
                      const torch::Tensor& weights, const torch::Tensor& gate_up,
                      const torch::Tensor& down) {
  TORCH_CHECK(x.dim() == 2, "kernels: x must be [T, H], got ", x.sizes());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0), "kernels: ids must be [T, k], got ",
              ids.sizes());
  TORCH_CHECK(weights.sizes() == ids.sizes(), "kernels: weights ", weights.sizes(),
              " must match ids ", ids.sizes());
  TORCH_CHECK(weights.device() == x.device(), "kernels: weights on ", weights.device(), ", x on ",
              x.device());
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(2) == x.size(1) && gate_up.size(1) % 2 == 0,
              "kernels: gate_up must be [E, 2I, H], got ", gate_up.sizes());
  TORCH_CHECK(down.dim() == 3 && down.size(0) == gate_up.size(0) && down.size(1) == x.size(1) &&
                  down.size(2) * 2 == gate_up.size(1),
              "kernels: down must be [E, H, I], got ", down.sizes());
}

// The layer forward on the kernels (no autograd).
torch::Tensor Forward(const torch::Tensor& x_in, const torch::Tensor& ids_in,
                      const torch::Tensor& weights_in, const torch::Tensor& gate_up_in,
                      const torch::Tensor& down_in, int forced_config) {
  CheckLayerShapes(x_in, ids_in, weights_in, gate_up_in, down_in);
  TORCH_CHECK(MoeCudaSupports(x_in, ids_in, gate_up_in, down_in),
              "kernels: unsupported MoE inputs (CUDA bf16/fp32, E <= ", kMaxExperts,
              ", k <= ", kMaxTopK, ", H and I multiples of 8)");
  c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t T = x_in.size(0), H = x_in.size(1), k = ids_in.size(1), E = gate_up_in.size(0),
                I = down_in.size(2);
  auto y = torch::empty({T, H}, x_in.options());
  if (T == 0) return y;

  auto x = Aligned(x_in), gate_up = Aligned(gate_up_in), down = Aligned(down_in);
  auto ids = ids_in.scalar_type() == torch::kInt32 ? ids_in.contiguous()
                                                   : ids_in.to(torch::kInt64).contiguous();
  // Routing weights are read as they come when they are in x's dtype (bf16 from lm::Route),
  // else as fp32.
  const bool bf16_weights = IsBf16(x) && IsBf16(weights_in);
  auto weights =
      bf16_weights ? weights_in.contiguous() : weights_in.to(torch::kFloat32).contiguous();
  const TileConfig config = ConfigFor(x, T * k, E, forced_config);
  CheckConfigMatchesDtype(config, x);
  const MoePlan plan = MakeMoePlan(T, k, E, H, I, config);
  LayerBuffers b = AllocateAlign(plan, x.device());
  b.act = torch::empty({plan.max_rows, I}, x.options());
  b.expert_out = torch::empty({plan.max_rows, H}, x.options());
  const cudaStream_t stream = CurrentStream(x);
  const bool i32 = ids.scalar_type() == torch::kInt32;
  cudaError_t err;
  if (IsBf16(x)) {
    using B = __nv_bfloat16;
    auto run = [&](auto id_tag, auto weight_tag) {
      using IdT = decltype(id_tag);
      using WT = decltype(weight_tag);
      return MoeExpertsForward<B, IdT, WT>(plan, Ptr<B>(x), Ptr<IdT>(ids), Ptr<WT>(weights),
                                           Ptr<B>(gate_up), Ptr<B>(down), b.Raw(), Ptr<B>(y),
                                           stream);
    };
    if (bf16_weights) {
      err = i32 ? run(int32_t{}, B{}) : run(int64_t{}, B{});
    } else {
      err = i32 ? run(int32_t{}, float{}) : run(int64_t{}, float{});
    }
  } else {
    err = i32 ? MoeExpertsForward<float, int32_t, float>(
                    plan, Ptr<float>(x), Ptr<int32_t>(ids), Ptr<float>(weights),
                    Ptr<float>(gate_up), Ptr<float>(down), b.Raw(), Ptr<float>(y), stream)
              : MoeExpertsForward<float, int64_t, float>(
                    plan, Ptr<float>(x), Ptr<int64_t>(ids), Ptr<float>(weights),
                    Ptr<float>(gate_up), Ptr<float>(down), b.Raw(), Ptr<float>(y), stream);
  }
  Check(err, "MoeExpertsForward");
  return y;
}

}  // namespace

bool MoeCudaSupports(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& gate_up,
                     const torch::Tensor& down) {
  if (!x.is_cuda() || x.dim() != 2 || ids.dim() != 2 || gate_up.dim() != 3 || down.dim() != 3) {
    return false;
  }
  const auto dt = x.scalar_type();
  if (dt != torch::kBFloat16 && dt != torch::kFloat32) return false;
  if (gate_up.scalar_type() != dt || down.scalar_type() != dt) return false;
  if (ids.scalar_type() != torch::kInt64 && ids.scalar_type() != torch::kInt32) return false;
  if (ids.device() != x.device() || gate_up.device() != x.device() || down.device() != x.device()) {
    return false;
  }
  const int64_t H = x.size(1), k = ids.size(1), E = gate_up.size(0), I = down.size(2);
  return E >= 1 && E <= kMaxExperts && k >= 1 && k <= kMaxTopK && k <= E && H > 0 && H % 8 == 0 &&
         I > 0 && I % 8 == 0;
}

torch::Tensor MoeExpertsCuda(const torch::Tensor& x, const torch::Tensor& ids,
                             const torch::Tensor& weights, const torch::Tensor& gate_up,
                             const torch::Tensor& down) {
  if (!MoeCudaSupports(x, ids, gate_up, down) || weights.device() != x.device()) return {};
  // No autograd here: a call that needs gradients goes to lm::MoeExpertsGrouped, which runs this
  // forward without autograd and its grouped-GEMM backward.
  if (torch::GradMode::is_enabled() && (x.requires_grad() || weights.requires_grad() ||
                                        gate_up.requires_grad() || down.requires_grad())) {
    return {};
  }
  return Forward(x, ids, weights, gate_up, down, -1);
}

torch::Tensor MoeExpertsCudaForward(const torch::Tensor& x, const torch::Tensor& ids,
                                    const torch::Tensor& weights, const torch::Tensor& gate_up,
                                    const torch::Tensor& down, const MoeCudaOptions& opts) {
  torch::NoGradGuard no_grad;
  return Forward(x, ids, weights, gate_up, down, opts.tile_config);
}

bool RouteTopkCuda(const torch::Tensor& logits, int64_t top_k, bool renormalize,
                   torch::Tensor* weights, torch::Tensor* ids) {
  if (!logits.is_cuda() || logits.dim() != 2) return false;
  const auto dt = logits.scalar_type();
  if (dt != torch::kFloat32 && dt != torch::kBFloat16) return false;
  const int64_t T = logits.size(0), E = logits.size(1);
  if (E < 1 || E > kMaxExperts || top_k < 1 || top_k > kMaxTopK || top_k > E) return false;
  c10::cuda::CUDAGuard guard(logits.device());
  auto l = logits.contiguous();
  auto w = torch::empty({T, top_k}, l.options().dtype(torch::kFloat32));
  auto i = torch::empty({T, top_k}, l.options().dtype(torch::kInt64));
  if (T > 0) {
    const cudaStream_t stream = CurrentStream(l);
    const int e = static_cast<int>(E), kk = static_cast<int>(top_k);
    cudaError_t err =
        dt == torch::kFloat32
            ? TopkSoftmax<float, int64_t>(Ptr<float>(l), T, e, kk, renormalize, Ptr<float>(w),
                                          Ptr<int64_t>(i), stream)
            : TopkSoftmax<__nv_bfloat16, int64_t>(Ptr<__nv_bfloat16>(l), T, e, kk, renormalize,
                                                  Ptr<float>(w), Ptr<int64_t>(i), stream);
    Check(err, "TopkSoftmax");
  }
  *weights = w;
  *ids = i;
  return true;
}

AlignedRows AlignCuda(const torch::Tensor& ids_in, int64_t experts, int tile_config) {
  TORCH_CHECK(ids_in.is_cuda() && ids_in.dim() == 2, "kernels: ids must be [T, k] on CUDA");
  TORCH_CHECK(tile_config >= 0 && tile_config <= static_cast<int>(TileConfig::kFp32),
              "kernels: no tile configuration ", tile_config);
  c10::cuda::CUDAGuard guard(ids_in.device());
  auto ids = ids_in.scalar_type() == torch::kInt32 ? ids_in.contiguous()
                                                   : ids_in.to(torch::kInt64).contiguous();
  AlignedRows r;
  r.tokens = ids.size(0);
  r.top_k = ids.size(1);
  r.experts = experts;
  r.tile_config = tile_config;
  // Align needs no H and I; 8 stands in for them.
  const MoePlan plan =
      MakeMoePlan(r.tokens, r.top_k, experts, 8, 8, static_cast<TileConfig>(tile_config));
  r.block_m = plan.block_m;
  LayerBuffers b = AllocateAlign(plan, ids.device());
  if (plan.pairs > 0) {
    const cudaStream_t stream = CurrentStream(ids);
    Check(ids.scalar_type() == torch::kInt32
              ? AlignRows<int32_t>(plan, Ptr<int32_t>(ids), b.Raw(), stream)
              : AlignRows<int64_t>(plan, Ptr<int64_t>(ids), b.Raw(), stream),
          "AlignRows");
  }
  r.expert_offsets = b.expert_offsets;
  r.sorted_rows = b.sorted_rows.narrow(0, 0, plan.max_rows);
  r.tile_expert = b.tile_expert.narrow(0, 0, plan.max_tiles);
  r.row_of_pair = b.row_of_pair.narrow(0, 0, plan.pairs);
  return r;
}

torch::Tensor GroupedSwiGluCuda(const torch::Tensor& x_in, const AlignedRows& rows,
                                const torch::Tensor& gate_up_in) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2 && gate_up_in.dim() == 3 &&
                  gate_up_in.size(2) == x_in.size(1) && gate_up_in.size(0) == rows.experts,
              "kernels: GroupedSwiGluCuda shapes");
  c10::cuda::CUDAGuard guard(x_in.device());
  auto x = Aligned(x_in), gate_up = Aligned(gate_up_in.to(x_in.scalar_type()));
  const auto config = static_cast<TileConfig>(rows.tile_config);
  CheckConfigMatchesDtype(config, x);
  const int64_t H = x.size(1), I = gate_up.size(1) / 2;
  const MoePlan plan = MakeMoePlan(rows.tokens, rows.top_k, rows.experts, H, I, config);
  LayerBuffers b;
  b.sorted_rows = rows.sorted_rows;
  b.tile_expert = rows.tile_expert;
  b.act = torch::empty({plan.max_rows, I}, x.options());
  const cudaStream_t stream = CurrentStream(x);
  Check(IsBf16(x) ? GroupedSwiGlu<__nv_bfloat16>(plan, Ptr<__nv_bfloat16>(x),
                                                 Ptr<__nv_bfloat16>(gate_up), b.Raw(), stream)
                  : GroupedSwiGlu<float>(plan, Ptr<float>(x), Ptr<float>(gate_up), b.Raw(), stream),
        "GroupedSwiGlu");
  return b.act;
}

torch::Tensor GroupedDownCuda(const torch::Tensor& act_in, const AlignedRows& rows,
                              const torch::Tensor& down_in) {
  TORCH_CHECK(act_in.is_cuda() && act_in.dim() == 2 && down_in.dim() == 3 &&
                  down_in.size(2) == act_in.size(1) && down_in.size(0) == rows.experts,
              "kernels: GroupedDownCuda shapes");
  c10::cuda::CUDAGuard guard(act_in.device());
  auto act = Aligned(act_in), down = Aligned(down_in.to(act_in.scalar_type()));
  const auto config = static_cast<TileConfig>(rows.tile_config);
  CheckConfigMatchesDtype(config, act);
  const int64_t I = act.size(1), H = down.size(1);
  const MoePlan plan = MakeMoePlan(rows.tokens, rows.top_k, rows.experts, H, I, config);
  TORCH_CHECK(act.size(0) == plan.max_rows, "kernels: act must have ", plan.max_rows, " rows");
  LayerBuffers b;
  b.sorted_rows = rows.sorted_rows;
  b.tile_expert = rows.tile_expert;
  b.act = act;
  b.expert_out = torch::empty({plan.max_rows, H}, act.options());
  const cudaStream_t stream = CurrentStream(act);
  Check(IsBf16(act) ? GroupedDown<__nv_bfloat16>(plan, Ptr<__nv_bfloat16>(down), b.Raw(), stream)
                    : GroupedDown<float>(plan, Ptr<float>(down), b.Raw(), stream),
        "GroupedDown");
  return b.expert_out;
}

int ChooseTileConfigFor(torch::ScalarType dtype, int64_t pairs, int64_t experts) {
  return static_cast<int>(ChooseTileConfig(dtype == torch::kBFloat16, pairs, experts));
}

int TileRows(int tile_config) {
  return BlockRows(static_cast<TileConfig>(tile_config));
}

std::string CompiledCudaArchitectures() {
  return CompiledArchitectures();
}

}  // namespace kernels
