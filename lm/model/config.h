// Model hyper-parameters parsed from a Hugging Face config.json.
//
// Supported `model_type`s: qwen3_moe (students and the stage-1 teacher), qwen3 (dense: the same
// code path with no MoE layers) and qwen3_next (the stage-2 teacher). Anything we do not implement
// (another model type, a RoPE scaling type, sliding windows, attention biases) is an error here,
// never a silently different model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/model/fp8_format.h"
#include "nlohmann/json.hpp"

namespace lm {

struct ModelConfig {
  std::string model_type;  // "qwen3_moe" | "qwen3" | "qwen3_next"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense MLP width (qwen3, and qwen3_moe's mlp_only_layers)
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // explicit in config.json; hidden/heads only when absent
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;  // qwen3_next: RoPE on the first head_dim * factor dims
  int64_t max_position_embeddings = 32768;
  bool tie_word_embeddings = false;

  // Mixture of experts.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.001;
  int64_t shared_expert_intermediate_size = 0;  // qwen3_next
  // Expert parallelism (lm/model/expert_parallel.h): this process holds only experts
  // [expert_first, expert_first + local_experts) of num_experts; 0 = all of them.
  int64_t expert_first = 0, local_experts = 0;
  int64_t LocalExperts() const { return local_experts > 0 ? local_experts : num_experts; }

  // qwen3_next: hybrid layers.
  std::vector<std::string> layer_types;  // "linear_attention" | "full_attention" per layer
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 4;

  // quantization_config of a block-wise FP8 checkpoint (lm/model/fp8_format.h); unset otherwise.
  std::optional<Fp8Format> fp8;

  nlohmann::json raw;  // the parsed file, written back unchanged (but for edits) on save

  // True when layer `i` uses the sparse MoE block rather than a dense MLP.
  bool IsMoeLayer(int64_t i) const;
  bool IsFullAttentionLayer(int64_t i) const;  // always true outside qwen3_next
  int64_t RotaryDim() const { return static_cast<int64_t>(head_dim * partial_rotary_factor); }
};

absl::StatusOr<ModelConfig> ParseModelConfig(const nlohmann::json& j);
// Reads and parses `dir/config.json`; errors name the file and the field.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

}  // namespace lm
