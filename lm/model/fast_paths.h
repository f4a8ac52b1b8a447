// Device fast paths for inference, registered by the backends that implement them (kernels/cpu
// for the CPU, kernels/cuda for CUDA tensors); lm/model keeps the reference math and never
// includes a backend. A model op asks FastPathsFor(its tensors' device) and calls the entry when
// there is one: an entry returns an undefined tensor (or false) for inputs it does not handle
// (shape, dtype, autograd, CPU features) and the reference runs instead.
//
// A backend registers with a static RegisterFastPaths object in its library; lm links those
// libraries whole (lm/CMakeLists.txt), so every program that links lm has them. The table lives
// in an inline function, so a backend's registration needs no symbol from lm.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

namespace lm {

// A weight [N, K] packed once for a device's few-row GEMM (the decode steps' LM head), opaque to
// lm: x [m, K] -> [m, N] in fp32.
class PackedWeight {
 public:
  virtual ~PackedWeight() = default;
  virtual torch::Tensor operator()(const torch::Tensor& x) const = 0;
};

struct FastPaths {
  // MoeExperts (lm/model/moe.h): x [T, H], ids/weights [T, k], gate_up [E, 2I, H], down [E, H, I],
  // without autograd (gradients are lm's: lm::MoeExpertsGrouped calls this as its forward).
  torch::Tensor (*moe_experts)(const torch::Tensor& x, const torch::Tensor& ids,
                               const torch::Tensor& weights, const torch::Tensor& gate_up,
                               const torch::Tensor& down) = nullptr;
  // The router's softmax + top-k (+ renormalisation) on fp32 logits [T, E], without autograd:
  // weights [T, k] fp32 and ids [T, k] int64, most probable first; among equal logits the lower
  // expert id first (torch.topk, the reference, leaves the order of equal values unspecified).
  bool (*route_topk)(const torch::Tensor& logits, int64_t top_k, bool renormalize,
                     torch::Tensor* weights, torch::Tensor* ids) = nullptr;
  // RouteForced's weights with the same arithmetic as route_topk: the softmax of fp32 logits
  // [T, E] at given expert ids [T, k] (int64, in [0, E)), renormalised over them when asked, fp32.
  // Replaying a row's own top-k then gives route_topk's weights bit for bit.
  bool (*route_weights)(const torch::Tensor& logits, const torch::Tensor& ids, bool renormalize,
                        torch::Tensor* weights) = nullptr;
  // RMSNorm with the residual add (RMSNormImpl::AddForward, lm/model/layers.h), without autograd:
  // *sum = x + residual rounded to their dtype as the library's add rounds (x alone when residual
  // is undefined; *sum is then left untouched), *out = RMSNorm(*sum) * weight as RMSNormImpl
  // computes it (fp32 statistics, the normalised row cast to the dtype, times the weight).
  // x, residual [rows, H] and weight [H] of one dtype.
  bool (*add_rms_norm)(const torch::Tensor& x, const torch::Tensor& residual,
                       const torch::Tensor& weight, double eps, torch::Tensor* out,
                       torch::Tensor* sum) = nullptr;
  // Qwen3's q/k path (QkNormRope, lm/model/layers.h), without autograd: per-head RMSNorm of
  // q [T, Hq, D] and k [T, Hkv, D] times q_weight/k_weight [D], then RoPE ("halves" convention)
  // over the first cos.size(1) dims with cos/sin [T, rotary_dim] fp32, all in fp32, rounded once
  // to the dtype; written into q_out/k_out (same shapes; they may be q and k: in place).
  bool (*qk_norm_rope)(const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& q_weight, const torch::Tensor& k_weight,
                       const torch::Tensor& cos, const torch::Tensor& sin, double eps,
                       const torch::Tensor& q_out, const torch::Tensor& k_out) = nullptr;
  // GatedDeltaRuleChunked (lm/model/gated_deltanet.h) with grouped key heads (value head h reads
  // key head h / (Hv / Hk)); `final_state`, when given, receives each document's final state.
  torch::Tensor (*gated_delta_rule)(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& g,
                                    const torch::Tensor& beta,
                                    const std::vector<int64_t>& cu_seqlens, int64_t chunk,
                                    torch::Tensor* final_state) = nullptr;
  // log p(target) per row of hidden [N, H] under weight [V, H] at `temperature`, for scoring.
  torch::Tensor (*token_logprobs)(const torch::Tensor& hidden, const torch::Tensor& weight,
                                  const torch::Tensor& targets, double temperature) = nullptr;
  // x [M, K] W^T for W [N, K], each row computed by products of one fixed shape whatever M is
  // (lm/model/batch_invariant.h), without autograd.
  torch::Tensor (*row_invariant_matmul)(const torch::Tensor& x, const torch::Tensor& w) = nullptr;
  // logsumexp of each row of logits [rows, V].
  torch::Tensor (*logsumexp_rows)(const torch::Tensor& logits) = nullptr;
  // The LM head [V, H] packed for the decode steps' logits; null where no kernel applies.
  std::shared_ptr<const PackedWeight> (*pack_lm_head)(const torch::Tensor& weight) = nullptr;
  // lm::SampleRows (lm/generate/sampler.h): logits [B, V] fp32 and SamplerRows' per-row tensors
  // (keys, positions, top_k [B] int64; temperature, top_p [B] float64; stop_ids [B, S] int64),
  // all on one device -> tokens [B] int64, logprobs [B] fp32, stopped [B] bool on that device,
  // with no host synchronisation. The same bits on every device that registers it.
  bool (*sample_rows)(const torch::Tensor& logits, const torch::Tensor& keys,
                      const torch::Tensor& positions, const torch::Tensor& temperature,
                      const torch::Tensor& top_k, const torch::Tensor& top_p,
                      const torch::Tensor& stop_ids, torch::Tensor* tokens, torch::Tensor* logprobs,
                      torch::Tensor* stopped) = nullptr;
  // PagedDecodeAttention (lm/model/paged_kv.h): q [B, Hq, D], pools [blocks, block_size, Hkv, D],
  // block_tables [B, max_blocks] and seq_lens [B] int32 on q's device -> [B, Hq, D] in q's dtype.
  torch::Tensor (*paged_decode)(const torch::Tensor& q, const torch::Tensor& k_pool,
                                const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                                const torch::Tensor& seq_lens, double scale) = nullptr;
};

inline FastPaths& MutableFastPaths(torch::DeviceType device) {
  static std::array<FastPaths,
                    static_cast<size_t>(torch::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
      table{};
  return table[static_cast<size_t>(device)];
}

inline const FastPaths& FastPathsFor(torch::DeviceType device) {
  return MutableFastPaths(device);
}

// `static const RegisterFastPaths r(torch::kCPU, [](FastPaths& p) { p.moe_experts = ...; });`
struct RegisterFastPaths {
  RegisterFastPaths(torch::DeviceType device, void (*fill)(FastPaths&)) {
    fill(MutableFastPaths(device));
  }
};

}  // namespace lm
