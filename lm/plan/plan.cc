#include "lm/plan/plan.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lm/plan/layer_rules.h"

namespace lm::plan {
namespace {

using internal::CeilDiv;
using internal::IsFull;
using internal::IsMoe;

bool IsNext(const ModelConfig& c) {
  return c.model_type == "qwen3_next";
}

int64_t FullLayers(const ModelConfig& c) {
  int64_t n = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) n += IsFull(c, i);
  return n;
}

// Parameters of one layer's parts, as lm/io/hf_model_dir.cc registers them.
struct LayerCounts {
  int64_t matmul = 0;  // bf16 under bf16-mixed
  int64_t fp32 = 0;    // norms, routers, the conv, A_log, dt_bias
};

// Attention: q [Hq*D (x2 gated: Qwen3-Next's output gate), H], k and v [Hkv*D, H], o [H, Hq*D];
// q_norm and k_norm [D].
LayerCounts Attention(const ModelConfig& c) {
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  return {(IsNext(c) ? 2 * q : q) * c.hidden_size + 2 * kv * c.hidden_size + c.hidden_size * q,
          2 * c.head_dim};
}

// Gated DeltaNet: in_proj_qkvz [2K + 2V, H], in_proj_ba [2 Hv, H], out_proj [H, V] (K, V the key
// and value widths); conv1d [2K + V, 1, kernel], dt_bias and A_log [Hv], norm [dv].
LayerCounts LinearAttention(const ModelConfig& c) {
  const int64_t k = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t v = c.linear_num_value_heads * c.linear_value_head_dim;
  const int64_t h = c.hidden_size;
  return {(2 * k + 2 * v) * h + 2 * c.linear_num_value_heads * h + h * v,
          (2 * k + v) * c.linear_conv_kernel_dim + 2 * c.linear_num_value_heads +
              c.linear_value_head_dim};
}

// A SwiGLU MLP of width w: gate and up [w, H], down [H, w].
int64_t Mlp(int64_t hidden, int64_t width) {
  return 3 * hidden * width;
}

// What the backward keeps of one layer per token, a = activation bytes (2 under bf16 autocast):
//   the layer's fp32 residual input 4H and its normed copy aH, twice (attention and MLP halves);
//   attention: q and k before their norms, q, k after norm and RoPE, v, and the attention output
//     a D (3 Hq + 3 Hkv) (Qwen3-Next's gate and its sigmoid a D 2 Hq more); linear attention: the
//     qkvz projection, the conv output and the gated norm's input a (2K + 2V + 2K + V + 2V);
//   MoE: router logits and probabilities in fp32 8E, and for each of the k experts a token goes to
//     its gathered input aH, gate/up output a 2I, SiLU and product a 2I, down output aH;
//     Qwen3-Next's shared expert a (H + 4 I_s); a dense MLP a (H + 4 I).
int64_t LayerActivationBytes(const ModelConfig& c, int64_t i, int64_t a) {
  const int64_t h = c.hidden_size;
  int64_t bytes = 2 * (4 * h + a * h);
  if (IsFull(c, i)) {
    bytes += a * c.head_dim * (3 * c.num_attention_heads + 3 * c.num_key_value_heads);
    if (IsNext(c)) bytes += a * c.head_dim * 2 * c.num_attention_heads;
  } else {
    const int64_t k = c.linear_num_key_heads * c.linear_key_head_dim;
    const int64_t v = c.linear_num_value_heads * c.linear_value_head_dim;
    bytes += a * (4 * k + 5 * v);
  }
  if (!IsMoe(c, i)) return bytes + a * (h + 4 * c.intermediate_size);
  bytes += 8 * c.num_experts + c.num_experts_per_tok * a * (2 * h + 4 * c.moe_intermediate_size);
  if (IsNext(c)) bytes += a * (h + 4 * c.shared_expert_intermediate_size);
  return bytes;
}

// The largest tensor lm/io/hf_model_dir.cc registers: the embedding or LM head, a layer's fused
// experts (gate_up [E, 2I, H]), its attention or linear-attention projections, a dense MLP's.
int64_t LargestParameter(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  int64_t n = c.vocab_size * h;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const int64_t q = c.num_attention_heads * c.head_dim;
    const int64_t k = c.linear_num_key_heads * c.linear_key_head_dim;
    const int64_t v = c.linear_num_value_heads * c.linear_value_head_dim;
    n = std::max(n, IsFull(c, i) ? (IsNext(c) ? 2 * q : q) * h : (2 * k + 2 * v) * h);
    n = std::max(n, IsMoe(c, i) ? c.LocalExperts() * 2 * c.moe_intermediate_size * h
                                : c.intermediate_size * h);
    if (IsMoe(c, i) && IsNext(c)) n = std::max(n, c.shared_expert_intermediate_size * h);
  }
  return n;
}

}  // namespace

int64_t MemoryPlan::peak() const {
  int64_t sum = 0;
  for (const Term& t : terms) sum += t.bytes;
  return sum;
}

double TimePlan::total() const {
  double sum = 0;
  for (const TimeTerm& t : terms) sum += t.seconds;
  return sum;
}

ParameterCounts CountParameters(const ModelConfig& c) {
  ParameterCounts n;
  const int64_t h = c.hidden_size;
  n.embedding = c.vocab_size * h;
  n.lm_head = c.tie_word_embeddings ? 0 : c.vocab_size * h;
  n.one_expert = Mlp(h, c.moe_intermediate_size);
  int64_t matmul = n.embedding + n.lm_head;
  n.fp32 = h;  // the final norm
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerCounts attn = IsFull(c, i) ? Attention(c) : LinearAttention(c);
    matmul += attn.matmul;
    n.fp32 += attn.fp32 + 2 * h;  // input and post-attention norms
    if (!IsMoe(c, i)) {
      matmul += Mlp(h, c.intermediate_size);
      continue;
    }
    ++n.moe_layers;
    n.experts += c.LocalExperts() * n.one_expert;
    n.fp32 += c.num_experts * h;  // the router [E, H]
    if (IsNext(c)) {
      matmul += Mlp(h, c.shared_expert_intermediate_size);
      n.fp32 += h;  // shared_expert_gate [1, H]
    }
  }
  matmul += n.experts;
  n.total = matmul + n.fp32;
  n.largest = LargestParameter(c);
  // A token's matmuls: everything but the embedding lookup and the experts it is not routed to,
  // plus the LM head (the embedding again when tied). Norm and router FLOPs are left out (the
  // routers' E x H is 0.1% of Marco-Nano's active count).
  n.dense_matmul = matmul - n.experts - n.embedding - n.lm_head + c.vocab_size * h;
  n.active = n.dense_matmul + n.moe_layers * c.num_experts_per_tok * n.one_expert;
  return n;
}

int64_t KvBytesPerToken(const ModelConfig& c, int64_t element_bytes) {
  return FullLayers(c) * 2 * c.num_key_value_heads * c.head_dim * element_bytes;
}

int64_t StateBytesPerSequence(const ModelConfig& c, int64_t element_bytes) {
  const int64_t linear = c.num_hidden_layers - FullLayers(c);
  if (linear == 0) return 0;
  const int64_t conv_channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                                c.linear_num_value_heads * c.linear_value_head_dim;
  return linear * ((c.linear_conv_kernel_dim - 1) * conv_channels * element_bytes +
                   c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4);
}

double ForwardFlops(const ModelConfig& c, int64_t len) {
  const ParameterCounts n = CountParameters(c);
  const double l = static_cast<double>(len);
  // Causal attention: QK^T and PV over the L (L + 1) / 2 visible pairs, 2 FLOPs per multiply-add.
  const double attention = 2.0 * c.num_attention_heads * c.head_dim * l * (l + 1) * FullLayers(c);
  // The delta rule per token and value head: decay and update the [dk, dv] state, read it twice.
  const double linear = 6.0 * c.linear_num_value_heads * c.linear_key_head_dim *
                        c.linear_value_head_dim * l * (c.num_hidden_layers - FullLayers(c));
  return 2.0 * static_cast<double>(n.active) * l + attention + linear;
}

int64_t TrainActivationBytesPerToken(const ModelConfig& c, int64_t act_bytes, bool checkpointing) {
  int64_t bytes = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    bytes += checkpointing ? 4 * c.hidden_size : LayerActivationBytes(c, i, act_bytes);
  return bytes;
}

// Per token: residual and normed copy 2aH; attention q, k, v and output a D (2 Hq + 2 Hkv)
// (Qwen3-Next's gate a D Hq more); linear attention a (2K + 2V) projections and a (2K + V) conv
// output; MoE fp32 router logits and probabilities 8E and, per chosen expert, the gathered row
// aH, gate/up a 2I, product a I and down output aH; a dense MLP a 3I.
int64_t InferenceActivationBytesPerToken(const ModelConfig& c, int64_t act_bytes) {
  const int64_t a = act_bytes, h = c.hidden_size, d = c.head_dim;
  const int64_t k = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t v = c.linear_num_value_heads * c.linear_value_head_dim;
  int64_t attention = a * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads);
  if (IsNext(c)) {
    attention += a * d * c.num_attention_heads;
    attention = std::max(attention, a * (4 * k + 3 * v));
  }
  int64_t mlp = a * 3 * c.intermediate_size;
  if (c.num_experts > 0) {
    mlp = std::max(
        mlp, 8 * c.num_experts + c.num_experts_per_tok * a * (2 * h + 3 * c.moe_intermediate_size));
  }
  return 2 * a * h + std::max(attention, mlp);
}

double ExpectedExpertsTouched(const ModelConfig& c, int64_t tokens) {
  if (c.num_experts <= 0) return 0;
  const double miss = 1.0 - static_cast<double>(c.num_experts_per_tok) / c.num_experts;
  return c.num_experts * (1.0 - std::pow(miss, static_cast<double>(tokens)));
}

}  // namespace lm::plan
