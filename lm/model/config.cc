#include "lm/model/config.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lm/model/arch.h"
#include "lm/util/file.h"
#include "lm/util/status.h"

namespace lm {
namespace {

using nlohmann::json;

// Reads `key` into `out` if present; a present value of the wrong JSON type is an error.
template <typename T>
absl::Status Read(const json& j, const char* key, T* out, bool required = false) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required)
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: missing required field '", key, "'"));
    return absl::OkStatus();
  }
  try {
    if constexpr (std::is_same_v<T, bool>) {
      if (!it->is_boolean()) throw json::type_error::create(302, "expected a boolean", nullptr);
    } else if constexpr (std::is_integral_v<T>) {
      if (!it->is_number_integer())
        throw json::type_error::create(302, "expected an integer", nullptr);
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!it->is_number()) throw json::type_error::create(302, "expected a number", nullptr);
    }
    *out = it->get<T>();
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: field '", key, "' has the wrong type (", it->dump(), "): ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status Positive(const char* key, int64_t v) {
  if (v > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("config.json: '", key, "' must be > 0, got ", v));
}

// Upper bounds on the sizes a config.json may state. Each is far above every published model (the
// largest one in the comment), so no real checkpoint is refused; and each is low enough that the
// products sizing the tensors cannot overflow (the largest, an expert stack E x 2I x H, stays
// below 2^50 elements) and that loops over layers and experts end, before the checkpoint and the
// memory budget are checked (lm/io/hf_model_dir.h). A larger size is a mistyped or hostile file.
constexpr int64_t kMaxVocab = int64_t{1} << 24;   // 262,144 (Gemma 3); the tokenizer's id limit
constexpr int64_t kMaxHidden = int64_t{1} << 16;  // 16,384 (Llama 3.1 405B)
constexpr int64_t kMaxWidth = int64_t{1} << 20;   // MLP widths: 53,248 (Llama 3.1 405B)
constexpr int64_t kMaxLayers = 1024;              // 126 (Llama 3.1 405B)
constexpr int64_t kMaxHeads = 1024;               // 128 (attention and linear-attention heads)
constexpr int64_t kMaxHeadDim = 4096;             // 256 (Qwen3-Next); also its conv window
constexpr int64_t kMaxExperts = 4096;             // 512 (Qwen3-Next)
// 10,485,760 (Llama 4 Scout). RoPE computes positions in fp32, exact integers only up to 2^24.
constexpr int64_t kMaxPositions = int64_t{1} << 24;

absl::Status AtMost(const char* key, int64_t v, int64_t max) {
  if (v <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("config.json: '", key, "' is ", v,
                                                 ", more than the largest accepted, ", max,
                                                 " (published models stay far below it)"));
}

absl::Status AllAtMost(std::initializer_list<std::pair<const char*, int64_t>> fields, int64_t max) {
  for (auto [key, v] : fields) RETURN_IF_ERROR(AtMost(key, v, max));
  return absl::OkStatus();
}

// A float that must be > 0 (and finite, for a config built in code): an epsilon or a RoPE base of
// 0 or below turns every activation into NaN.
absl::Status FinitePositive(const char* key, double v) {
  if (std::isfinite(v) && v > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: '", key, "' must be finite and > 0, got ", v));
}

// RoPE: `rope_theta` at top level (transformers v4) or inside `rope_parameters` (v5). Only the
// default (unscaled) RoPE is implemented; any scaling type is refused rather than ignored.
absl::Status ReadRope(const json& j, ModelConfig* c) {
  RETURN_IF_ERROR(Read(j, "rope_theta", &c->rope_theta));
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_object())
      return absl::InvalidArgumentError(absl::StrCat("config.json: '", key, "' must be an object"));
    std::string type = "default";
    RETURN_IF_ERROR(Read(*it, "rope_type", &type));
    if (type == "default" && it->contains("type")) RETURN_IF_ERROR(Read(*it, "type", &type));
    if (type != "default") {
      return absl::UnimplementedError(
          absl::StrCat("config.json: ", key, ".rope_type '", type,
                       "' is not supported (only unscaled RoPE is implemented)"));
    }
    RETURN_IF_ERROR(Read(*it, "rope_theta", &c->rope_theta));
    RETURN_IF_ERROR(Read(*it, "partial_rotary_factor", &c->partial_rotary_factor));
  }
  return absl::OkStatus();
}

// The common sizes: > 0 where a zero means no model, and within the bounds above.
absl::Status CheckSizes(const ModelConfig& c) {
  for (auto [key, v] : {std::pair{"vocab_size", c.vocab_size},
                        {"hidden_size", c.hidden_size},
                        {"num_hidden_layers", c.num_hidden_layers},
                        {"num_attention_heads", c.num_attention_heads},
                        {"num_key_value_heads", c.num_key_value_heads},
                        {"max_position_embeddings", c.max_position_embeddings}}) {
    RETURN_IF_ERROR(Positive(key, v));
  }
  RETURN_IF_ERROR(AtMost("vocab_size", c.vocab_size, kMaxVocab));
  RETURN_IF_ERROR(AtMost("hidden_size", c.hidden_size, kMaxHidden));
  RETURN_IF_ERROR(AtMost("intermediate_size", c.intermediate_size, kMaxWidth));
  RETURN_IF_ERROR(AtMost("num_hidden_layers", c.num_hidden_layers, kMaxLayers));
  RETURN_IF_ERROR(AllAtMost({{"num_attention_heads", c.num_attention_heads},
                             {"num_key_value_heads", c.num_key_value_heads}},
                            kMaxHeads));
  RETURN_IF_ERROR(AtMost("max_position_embeddings", c.max_position_embeddings, kMaxPositions));
  RETURN_IF_ERROR(FinitePositive("rms_norm_eps", c.rms_norm_eps));
  RETURN_IF_ERROR(FinitePositive("rope_theta", c.rope_theta));
  return absl::OkStatus();
}

absl::Status ReadCommon(const json& j, ModelConfig* c) {
  RETURN_IF_ERROR(Read(j, "vocab_size", &c->vocab_size, true));
  RETURN_IF_ERROR(Read(j, "hidden_size", &c->hidden_size, true));
  RETURN_IF_ERROR(Read(j, "intermediate_size", &c->intermediate_size));
  RETURN_IF_ERROR(Read(j, "num_hidden_layers", &c->num_hidden_layers, true));
  RETURN_IF_ERROR(Read(j, "num_attention_heads", &c->num_attention_heads, true));
  c->num_key_value_heads = c->num_attention_heads;
  RETURN_IF_ERROR(Read(j, "num_key_value_heads", &c->num_key_value_heads));
  RETURN_IF_ERROR(Read(j, "head_dim", &c->head_dim));
  RETURN_IF_ERROR(Read(j, "rms_norm_eps", &c->rms_norm_eps));
  RETURN_IF_ERROR(Read(j, "max_position_embeddings", &c->max_position_embeddings));
  RETURN_IF_ERROR(Read(j, "tie_word_embeddings", &c->tie_word_embeddings));
  RETURN_IF_ERROR(Read(j, "partial_rotary_factor", &c->partial_rotary_factor));
  RETURN_IF_ERROR(ReadRope(j, c));

  RETURN_IF_ERROR(CheckSizes(*c));
  if (c->head_dim == 0) {
    if (c->hidden_size % c->num_attention_heads != 0) {
      return absl::InvalidArgumentError(
          "config.json: no head_dim and hidden_size is not divisible by heads");
    }
    c->head_dim = c->hidden_size / c->num_attention_heads;
  }
  RETURN_IF_ERROR(Positive("head_dim", c->head_dim));
  RETURN_IF_ERROR(AtMost("head_dim", c->head_dim, kMaxHeadDim));
  if (c->num_attention_heads % c->num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: num_attention_heads (", c->num_attention_heads,
                     ") is not a multiple of num_key_value_heads (", c->num_key_value_heads, ")"));
  }
  if (!(c->partial_rotary_factor > 0 && c->partial_rotary_factor <= 1) || c->RotaryDim() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: partial_rotary_factor ", c->partial_rotary_factor,
                     " must be in (0, 1] and give an even rotary dimension"));
  }
  std::string act = "silu";
  RETURN_IF_ERROR(Read(j, "hidden_act", &act));
  if (act != "silu")
    return absl::UnimplementedError(
        absl::StrCat("config.json: hidden_act '", act, "' is not supported (only silu)"));
  bool attention_bias = false, use_sliding_window = false;
  RETURN_IF_ERROR(Read(j, "attention_bias", &attention_bias));
  RETURN_IF_ERROR(Read(j, "use_sliding_window", &use_sliding_window));
  if (attention_bias)
    return absl::UnimplementedError("config.json: attention_bias=true is not supported");
  if (use_sliding_window)
    return absl::UnimplementedError("config.json: use_sliding_window=true is not supported");
  return absl::OkStatus();
}

absl::Status ReadMoe(const json& j, ModelConfig* c) {
  // transformers v5 writes `num_local_experts`, v4 and published checkpoints `num_experts`.
  RETURN_IF_ERROR(Read(j, "num_local_experts", &c->num_experts));
  RETURN_IF_ERROR(Read(j, "num_experts", &c->num_experts));
  RETURN_IF_ERROR(Read(j, "num_experts_per_tok", &c->num_experts_per_tok));
  RETURN_IF_ERROR(Read(j, "moe_intermediate_size", &c->moe_intermediate_size));
  RETURN_IF_ERROR(Read(j, "norm_topk_prob", &c->norm_topk_prob));
  RETURN_IF_ERROR(Read(j, "decoder_sparse_step", &c->decoder_sparse_step));
  RETURN_IF_ERROR(Read(j, "mlp_only_layers", &c->mlp_only_layers));
  RETURN_IF_ERROR(Read(j, "router_aux_loss_coef", &c->router_aux_loss_coef));
  if (!std::isfinite(c->router_aux_loss_coef))
    return absl::InvalidArgumentError("config.json: 'router_aux_loss_coef' must be finite");
  RETURN_IF_ERROR(
      AllAtMost({{"num_experts", c->num_experts}, {"num_experts_per_tok", c->num_experts_per_tok}},
                kMaxExperts));
  RETURN_IF_ERROR(AtMost("moe_intermediate_size", c->moe_intermediate_size, kMaxWidth));
  if (c->num_experts > 0) {
    RETURN_IF_ERROR(Positive("num_experts_per_tok", c->num_experts_per_tok));
    RETURN_IF_ERROR(Positive("moe_intermediate_size", c->moe_intermediate_size));
    RETURN_IF_ERROR(Positive("decoder_sparse_step", c->decoder_sparse_step));
    if (c->num_experts_per_tok > c->num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: num_experts_per_tok (", c->num_experts_per_tok,
                       ") exceeds num_experts (", c->num_experts, ")"));
    }
  }
  for (int64_t l : c->mlp_only_layers) {
    if (l < 0 || l >= c->num_hidden_layers) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: mlp_only_layers names layer ", l,
                                                     " of a model with ", c->num_hidden_layers,
                                                     " layers"));
    }
  }
  return absl::OkStatus();
}

// Dense layers need intermediate_size; checked once we know which layers are dense.
absl::Status CheckDenseWidth(const ModelConfig& c) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (!c.IsMoeLayer(i)) return Positive("intermediate_size", c.intermediate_size);
  }
  return absl::OkStatus();
}

absl::Status ReadQwen3Next(const json& j, ModelConfig* c) {
  RETURN_IF_ERROR(Read(j, "shared_expert_intermediate_size", &c->shared_expert_intermediate_size));
  RETURN_IF_ERROR(Read(j, "linear_num_key_heads", &c->linear_num_key_heads, true));
  RETURN_IF_ERROR(Read(j, "linear_num_value_heads", &c->linear_num_value_heads, true));
  RETURN_IF_ERROR(Read(j, "linear_key_head_dim", &c->linear_key_head_dim, true));
  RETURN_IF_ERROR(Read(j, "linear_value_head_dim", &c->linear_value_head_dim, true));
  RETURN_IF_ERROR(Read(j, "linear_conv_kernel_dim", &c->linear_conv_kernel_dim));
  for (auto [key, v] : {std::pair{"linear_num_key_heads", c->linear_num_key_heads},
                        {"linear_num_value_heads", c->linear_num_value_heads},
                        {"linear_key_head_dim", c->linear_key_head_dim},
                        {"linear_value_head_dim", c->linear_value_head_dim},
                        {"linear_conv_kernel_dim", c->linear_conv_kernel_dim}}) {
    RETURN_IF_ERROR(Positive(key, v));
  }
  RETURN_IF_ERROR(AllAtMost({{"linear_num_key_heads", c->linear_num_key_heads},
                             {"linear_num_value_heads", c->linear_num_value_heads}},
                            kMaxHeads));
  RETURN_IF_ERROR(AllAtMost({{"linear_key_head_dim", c->linear_key_head_dim},
                             {"linear_value_head_dim", c->linear_value_head_dim},
                             {"linear_conv_kernel_dim", c->linear_conv_kernel_dim}},
                            kMaxHeadDim));
  if (c->shared_expert_intermediate_size < 0)  // 0: no shared expert
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: 'shared_expert_intermediate_size' must be >= 0, got ",
                     c->shared_expert_intermediate_size));
  RETURN_IF_ERROR(
      AtMost("shared_expert_intermediate_size", c->shared_expert_intermediate_size, kMaxWidth));
  if (c->linear_num_value_heads % c->linear_num_key_heads != 0) {
    return absl::InvalidArgumentError(
        "config.json: linear_num_value_heads must be a multiple of linear_num_key_heads");
  }
  RETURN_IF_ERROR(Read(j, "layer_types", &c->layer_types));
  if (c->layer_types.empty()) {
    int64_t interval = 4;
    RETURN_IF_ERROR(Read(j, "full_attention_interval", &interval));
    RETURN_IF_ERROR(Positive("full_attention_interval", interval));
    for (int64_t i = 0; i < c->num_hidden_layers; ++i) {
      c->layer_types.push_back((i + 1) % interval ? "linear_attention" : "full_attention");
    }
  }
  if (static_cast<int64_t>(c->layer_types.size()) != c->num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: layer_types has ",
                                                   c->layer_types.size(), " entries for ",
                                                   c->num_hidden_layers, " layers"));
  }
  for (const auto& t : c->layer_types) {
    if (t != "linear_attention" && t != "full_attention") {
      return absl::InvalidArgumentError(absl::StrCat("config.json: unknown layer type '", t, "'"));
    }
  }
  c->norm_topk_prob = true;
  RETURN_IF_ERROR(Read(j, "norm_topk_prob", &c->norm_topk_prob));
  return absl::OkStatus();
}

// qwen3/qwen3_moe configs from transformers v5 carry layer_types too; only full attention exists.
absl::Status CheckNoSlidingLayers(const json& j) {
  std::vector<std::string> types;
  RETURN_IF_ERROR(Read(j, "layer_types", &types));
  for (const auto& t : types) {
    if (t != "full_attention") {
      return absl::UnimplementedError(
          absl::StrCat("config.json: layer type '", t, "' is not supported"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool ModelConfig::IsMoeLayer(int64_t i) const {
  // The same rule for qwen3_moe and qwen3_next (transformers' Qwen3NextDecoderLayer uses it too).
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end())
    return false;
  return (i + 1) % decoder_sparse_step == 0;
}

bool ModelConfig::IsFullAttentionLayer(int64_t i) const {
  return layer_types.empty() || layer_types[i] == "full_attention";
}

absl::StatusOr<ModelConfig> ParseModelConfig(const json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  ModelConfig c;
  c.raw = j;
  RETURN_IF_ERROR(Read(j, "model_type", &c.model_type, true));
  const Architecture* arch = FindArchitecture(c.model_type);
  if (arch == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: model_type '", c.model_type,
                                                   "' is not supported (expected ",
                                                   KnownModelTypes(), ")"));
  }
  if (arch->set_defaults) arch->set_defaults(c);
  RETURN_IF_ERROR(ReadCommon(j, &c));
  if (arch->moe) RETURN_IF_ERROR(ReadMoe(j, &c));
  if (arch->hybrid_attention) {
    RETURN_IF_ERROR(ReadQwen3Next(j, &c));
  } else {
    RETURN_IF_ERROR(CheckNoSlidingLayers(j));
  }
  RETURN_IF_ERROR(CheckDenseWidth(c));
  ASSIGN_OR_RETURN(c.fp8, ParseFp8QuantizationConfig(j));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok())
    return absl::Status(text.status().code(),
                        absl::StrCat(text.status().message(), " (is this a model directory?)"));
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  auto c = ParseModelConfig(j);
  if (!c.ok())
    return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

}  // namespace lm
