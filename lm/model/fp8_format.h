// Block-wise FP8 checkpoints (the DeepSeek-V3 format Qwen ships its -FP8 models in), as config.json
// describes them:
//
//   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
//                           "weight_block_size": [128, 128], "modules_to_not_convert": [...]}
//
// A quantized linear weight W [N, K] is stored as float8_e4m3fn (safetensors F8_E4M3) with
// `<name>_scale_inv` [ceil(N / bn), ceil(K / bk)] (F32, or BF16 in some exports): one scale per
// bn x bk block, the edge blocks ragged when N or K is not a multiple of the block. The weight is
//   W[n, k] = fp8(W)[n, k] * scale_inv[n / bn, k / bk]        (fp32 product).
// Activations are quantized at run time ("dynamic"), per token in groups of bk along K
// (lm/model/fp8.h). Modules listed in modules_to_not_convert, and any tensor a checkpoint simply
// stores in another dtype, stay unquantized.
//
// No LibTorch here: the memory plan (lm/plan) reads this too.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace lm {

// The largest finite float8_e4m3fn magnitude (0x7E: 1.75 x 2^8).
inline constexpr float kFp8E4m3Max = 448.0f;

class Fp8NotConvertedPatterns;

struct Fp8Format {
  int64_t block_rows = 128;  // weight_block_size[0]: output rows (N) sharing a scale
  int64_t block_cols = 128;  // weight_block_size[1]: input columns (K) sharing a scale
  std::vector<std::string> modules_to_not_convert;

  // Scale grid of a [rows, cols] weight: ceil(rows / block_rows) x ceil(cols / block_cols).
  int64_t ScaleRows(int64_t rows) const { return (rows + block_rows - 1) / block_rows; }
  int64_t ScaleCols(int64_t cols) const { return (cols + block_cols - 1) / block_cols; }

  // Whether module `name` (e.g. "model.layers.3.mlp.gate", no ".weight") is quantized, by the
  // rule transformers applies to modules_to_not_convert: a pattern excludes a module when it
  // matches the name from its start up to a module boundary (as a regular expression, so
  // "model.layers.1" excludes "model.layers.1.mlp" but not "model.layers.11.mlp", and
  // "model.layers.*.mlp.gate" every layer's router but not its "mlp.gate_proj"), or when the name
  // ends with it ("mlp.gate" excludes "model.layers.3.mlp.gate", "lm_head" the LM head).
  bool Converts(const std::string& module) const;

  // The compiled patterns (shared by copies; set by ParseFp8QuantizationConfig).
  std::shared_ptr<const Fp8NotConvertedPatterns> patterns;
};

// The quantization_config of config.json `root`: nullopt when there is none (or it is null).
// INVALID_ARGUMENT naming the field for a malformed one (weight_block_size not two positive
// integers, a pattern that is not a string or not a valid regular expression) and UNIMPLEMENTED
// for a valid one this project does not run: another quant_method, an `fmt` other than e4m3
// (e5m2, or an unknown name), activation_scheme "static" (per-tensor activation scales stored in
// the checkpoint), or power-of-two scales (scale_fmt "ue8m0").
absl::StatusOr<std::optional<Fp8Format>> ParseFp8QuantizationConfig(const nlohmann::json& root);

}  // namespace lm
