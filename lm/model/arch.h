// The architectures this library implements, in one table: everything that depends on a
// checkpoint's `model_type` is looked up here rather than tested for by name across files.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lm {

struct ModelConfig;
class CausalLM;

struct Architecture {
  std::string model_type;  // config.json's model_type
  std::string hf_class;    // the `architectures` entry a saved config.json gets
  // Reads the sparse-MoE fields (num_experts, moe_intermediate_size, ...); false: a dense model.
  bool moe = true;
  // Qwen3-Next's hybrid layout: Gated DeltaNet and gated full-attention layers (layer_types,
  // linear_* fields), zero-centred RMSNorm weights (scale 1 + w, so a fresh norm is 0).
  bool hybrid_attention = false;
  // The config's defaults where config.json is silent (as the HF config class has them).
  void (*set_defaults)(ModelConfig& config) = nullptr;
  // Checkpoint tensors that are not part of the causal LM (Qwen3-Next's multi-token-prediction
  // head, "mtp."): loading skips them.
  std::vector<std::string> ignored_prefixes;
  // A model with uninitialised weights.
  std::shared_ptr<CausalLM> (*create)(const ModelConfig& config) = nullptr;
};

// The entry for `model_type`, or null.
const Architecture* FindArchitecture(std::string_view model_type);
// "qwen3_moe, qwen3 or qwen3_next": for error messages.
std::string KnownModelTypes();

}  // namespace lm
