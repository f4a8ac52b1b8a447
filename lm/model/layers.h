// Building blocks shared by the model files: linear maps, RMSNorm, RoPE, dense SwiGLU MLP and
// variable-length causal attention. Parameter names match Hugging Face checkpoints.
#pragma once

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "lm/model/batch.h"

namespace lm {

// x W^T for x [rows, in], W [out, in]. A decode step has few rows, and for those (W x^T)^T is
// the faster CPU call: MKL then streams W instead of repacking it on every call (1.4-1.8x for <= 32
// rows: the attention projections at decode, and the experts and LM head where the kernels of
// kernels/cpu/cpu_inference.h do not apply). Other shapes and devices take the usual call. The
// result is contiguous either way.
torch::Tensor MatmulWeightT(const torch::Tensor& x, const torch::Tensor& w);
// The same into `out` [rows, out] (a slice of a larger buffer).
void MatmulWeightTOut(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w);

// y = x W^T, no bias (Qwen projections have none). Weights start uninitialised: they are loaded
// from a checkpoint or set by InitWeights. A block-wise FP8 checkpoint's weight kept in FP8
// (lm/model/fp8.h) comes with its block scales, and the forward is an FP8 GEMM.
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;            // [out, in]
  torch::Tensor weight_scale_inv;  // FP8 weights only: the buffer of their block scales
};
TORCH_MODULE(Linear);

// Token embedding table; `weight` [vocab, hidden].
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t vocab, int64_t hidden);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor weight;
};
TORCH_MODULE(Embedding);

// RMSNorm over the last dim, computed in fp32: x * rsqrt(mean(x^2) + eps), cast back, times w.
// `zero_centered` (Qwen3-Next) multiplies by (1 + w) instead, still in fp32, cast once at the end.
// Without autograd a device's fused kernel computes the same (FastPaths::add_rms_norm: one pass
// instead of 8 ops; fp32 statistics summed in another order); Reference() is the op chain.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, bool zero_centered = false);
  torch::Tensor forward(const torch::Tensor& x);
  // The residual stream's add and the next norm in one: residual = residual + delta (rounded as
  // that add rounds), returns forward(residual).
  torch::Tensor AddForward(const torch::Tensor& delta, torch::Tensor& residual);
  // The library op chain (the autograd path, and what the fused kernels are tested against).
  torch::Tensor Reference(const torch::Tensor& x);
  torch::Tensor weight;  // [dim]
  double eps;
  bool zero_centered;
};
TORCH_MODULE(RMSNorm);

// Dense SwiGLU MLP: down(silu(gate(x)) * up(x)).
class DenseMlpImpl : public torch::nn::Module {
 public:
  DenseMlpImpl(int64_t hidden, int64_t intermediate);
  torch::Tensor forward(const torch::Tensor& x);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(DenseMlp);

// Rotary position embedding, "halves" convention:
//   inv_freq[i] = theta^(-2i/d), emb = cat(freqs, freqs), x' = x cos + rotate_half(x) sin.
// Only the first `rotary_dim` of each head's dims rotate (partial RoPE); the rest pass through.
class Rope {
 public:
  Rope(int64_t rotary_dim, double theta);
  // cos/sin tables [T, rotary_dim] in fp32 for the given positions [T].
  std::pair<torch::Tensor, torch::Tensor> Tables(const torch::Tensor& positions) const;
  // x: [T, heads, head_dim]; tables from Tables() for the same T positions.
  torch::Tensor Apply(const torch::Tensor& x, const torch::Tensor& cos,
                      const torch::Tensor& sin) const;

 private:
  // inv_freq_ on `device`: copied there once (a copy per call would be a pageable host-to-device
  // copy, a sync, in every forward).
  torch::Tensor InvFreqOn(const torch::Device& device) const;
  int64_t rotary_dim_;
  torch::Tensor inv_freq_;  // [rotary_dim / 2] fp32, on the CPU
  struct DeviceCopies {
    std::mutex mu;
    std::vector<torch::Tensor> copies;  // inv_freq_ on each device it was asked for
  };
  std::shared_ptr<DeviceCopies> on_devices_ = std::make_shared<DeviceCopies>();
};

// Qwen3's q/k path: the per-head RMSNorms of q [T, Hq, D] and k [T, Hkv, D] (q_norm, k_norm over
// D), then `rope` at the positions of the tables. Without autograd a device's fused kernel does
// both in one pass, in fp32, rounding once to the dtype (FastPaths::qk_norm_rope), writing over
// q and k when `in_place` (they must then be free to overwrite: fresh projections); otherwise,
// and with autograd, the reference rope.Apply(q_norm(q), ...), rope.Apply(k_norm(k), ...).
std::pair<torch::Tensor, torch::Tensor> QkNormRope(const torch::Tensor& q, const torch::Tensor& k,
                                                   RMSNormImpl& q_norm, RMSNormImpl& k_norm,
                                                   const Rope& rope, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, bool in_place);

// Causal attention within each document of a packed batch; q [T, Hq, D], k/v [T, Hkv, D] with
// Hq a multiple of Hkv (GQA), cu_seqlens [B+1] from 0 to T. Returns [T, Hq, D]. No mask is built:
// on CUDA (bf16/fp16, head_dim % 8 == 0, <= 256) one FlashAttention varlen launch over the whole
// batch; elsewhere causal flash-style SDPA over buckets of similar-length documents padded on the
// right (causality alone keeps real queries off the padding), which tiles the scores and never
// builds a mask. Differentiable (autograd) on both paths.
torch::Tensor VarlenCausalAttention(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens,
                                    double scale);

// One decode step against a cache: q [B, Hq, D]; caches [B, capacity, Hkv, D]; slot b attends to
// its first `visible[b]` cached positions. Returns [B, Hq, D].
torch::Tensor CachedAttention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const std::vector<int64_t>& visible,
                              double scale);

// Writes per-document keys/values of a packed prefill into cache slots (slot b = document b,
// starting at position 0). k: [T, Hkv, D].
void FillCache(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k,
               const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens);

// Appends one token's k/v per slot at position lengths[b]. k: [B, Hkv, D].
void AppendCache(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k,
                 const torch::Tensor& v, const std::vector<int64_t>& lengths);

}  // namespace lm
