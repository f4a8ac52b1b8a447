#include "lm/model/arch.h"

#include "absl/strings/str_join.h"
#include "lm/model/config.h"
#include "lm/model/qwen3_moe.h"
#include "lm/model/qwen3_next.h"

namespace lm {
namespace {

std::shared_ptr<CausalLM> CreateQwen3Moe(const ModelConfig& c) {
  return std::make_shared<Qwen3MoeForCausalLM>(c);
}

std::shared_ptr<CausalLM> CreateQwen3Next(const ModelConfig& c) {
  return std::make_shared<Qwen3NextForCausalLM>(c);
}

// Qwen3NextConfig's defaults that differ from the common ones (not hidden/heads, not 1.0, not 0).
void Qwen3NextDefaults(ModelConfig& c) {
  c.head_dim = 256;
  c.partial_rotary_factor = 0.25;
  c.shared_expert_intermediate_size = 512;
}

const std::vector<Architecture>& Table() {
  static const std::vector<Architecture> table = {
      {"qwen3_moe", "Qwen3MoeForCausalLM", true, false, nullptr, {}, CreateQwen3Moe},
      // Dense Qwen3 runs as Qwen3-MoE without experts (num_experts 0: every MLP is dense).
      {"qwen3", "Qwen3ForCausalLM", false, false, nullptr, {}, CreateQwen3Moe},
      {"qwen3_next",
       "Qwen3NextForCausalLM",
       true,
       true,
       Qwen3NextDefaults,
       {"mtp."},
       CreateQwen3Next},
  };
  return table;
}

}  // namespace

const Architecture* FindArchitecture(std::string_view model_type) {
  for (const Architecture& a : Table())
    if (a.model_type == model_type) return &a;
  return nullptr;
}

std::string KnownModelTypes() {
  std::vector<std::string> names;
  for (const Architecture& a : Table()) names.push_back(a.model_type);
  const std::string last = names.back();
  names.pop_back();
  return absl::StrJoin(names, ", ") + " or " + last;
}

}  // namespace lm
