// The FP8 weight term of the plan (lm/plan/plan.h CountFp8WeightBytes): which linear layers a
// block-wise FP8 checkpoint's quantization_config converts, as lm/io/hf_model_dir.cc keeps them.
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "lm/plan/layer_rules.h"
#include "lm/plan/plan.h"

namespace lm::plan {
namespace {

using internal::CeilDiv;
using internal::IsFull;
using internal::IsMoe;

// Adds the linear layers of one layer that `f` converts: `copies` of a [rows, cols] weight each,
// which the bf16 count held at `counted` bytes per parameter.
class Counter {
 public:
  Counter(const Fp8Format& f, int64_t weight_bytes, Fp8WeightBytes* out)
      : f_(f), wb_(weight_bytes), out_(out) {}
  void Add(const std::string& module, int64_t rows, int64_t cols, int64_t copies = 1,
           int64_t counted = 0) {
    if (!f_.Converts(module)) return;
    const int64_t params = rows * cols * copies;
    out_->fp8 += params;
    out_->scales += 4 * f_.ScaleRows(rows) * f_.ScaleCols(cols) * copies;
    out_->rest -= params * (counted > 0 ? counted : wb_);
  }

 private:
  const Fp8Format& f_;
  int64_t wb_;
  Fp8WeightBytes* out_;
};

}  // namespace

Fp8WeightBytes CountFp8WeightBytes(const ModelConfig& c, int64_t weight_bytes,
                                   int64_t expert_parallel) {
  const ParameterCounts n = CountParameters(c);
  const int64_t wb = weight_bytes, ep = std::max<int64_t>(expert_parallel, 1);
  Fp8WeightBytes out;
  // What the unquantized model holds (WeightBytes in process_plans.cc, 1/ep of the experts);
  // each converted weight then moves from there to `fp8`.
  out.rest = (wb == 4 ? 4 * n.total : 2 * (n.total - n.fp32) + 4 * n.fp32) - n.experts * wb +
             CeilDiv(n.experts, ep) * wb;
  if (!c.fp8) return out;
  Counter add(*c.fp8, wb, &out);
  const bool next = c.model_type == "qwen3_next";
  const int64_t h = c.hidden_size, local = CeilDiv(c.LocalExperts(), ep);
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  const int64_t lk = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t lv = c.linear_num_value_heads * c.linear_value_head_dim;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    if (IsFull(c, i)) {
      add.Add(p + "self_attn.q_proj", next ? 2 * q : q, h);
      add.Add(p + "self_attn.k_proj", kv, h);
      add.Add(p + "self_attn.v_proj", kv, h);
      add.Add(p + "self_attn.o_proj", h, q);
    } else {
      add.Add(p + "linear_attn.in_proj_qkvz", 2 * lk + 2 * lv, h);
      add.Add(p + "linear_attn.in_proj_ba", 2 * c.linear_num_value_heads, h);
      add.Add(p + "linear_attn.out_proj", h, lv);
    }
    if (!IsMoe(c, i)) {
      for (const char* m : {"gate_proj", "up_proj"})
        add.Add(absl::StrCat(p, "mlp.", m), c.intermediate_size, h);
      add.Add(p + "mlp.down_proj", h, c.intermediate_size);
      continue;
    }
    // Experts: one name stands for all (a list that names single experts is not modelled).
    const int64_t I = c.moe_intermediate_size;
    add.Add(p + "mlp.experts.0.gate_proj", I, h, local);
    add.Add(p + "mlp.experts.0.up_proj", I, h, local);
    add.Add(p + "mlp.experts.0.down_proj", h, I, local);
    if (!next) continue;
    const int64_t s = c.shared_expert_intermediate_size;
    add.Add(p + "mlp.shared_expert.gate_proj", s, h);
    add.Add(p + "mlp.shared_expert.up_proj", s, h);
    add.Add(p + "mlp.shared_expert.down_proj", h, s);
    add.Add(p + "mlp.shared_expert_gate", 1, h, 1, /*counted=*/4);  // counted with the fp32 ones
  }
  return out;
}

}  // namespace lm::plan
