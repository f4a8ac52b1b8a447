// The FP8 tensors of a block-wise FP8 checkpoint (lm/model/fp8_format.h) and their block scales,
// found from the safetensors headers and checked against config.json's quantization_config
// before any weight is read. The scales themselves (one fp32 per 128 x 128 block: ~1/16000 of
// the weights' bytes, 20 MB for an 80B model) are read and checked here, so that the load can
// dequantize or place each FP8 weight the moment it reads it, whatever shard its scale is in.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "lm/io/safetensors.h"
#include "lm/model/fp8_format.h"

namespace lm {

class Fp8Checkpoint {
 public:
  // Every F8_E4M3 tensor W of `files` must be a 2-D weight whose module quantization_config
  // quantizes (not in modules_to_not_convert), with a tensor `W_scale_inv` (in any of the files)
  // of dtype F32, BF16 or F16 and shape [ceil(N / rows), ceil(K / cols)] for W [N, K] and the
  // config's weight_block_size [rows, cols], holding finite values >= 0; and every tensor named
  // `*_scale_inv` must be such a scale. Errors name the file and the tensor: an FP8 tensor when
  // `format` is unset (config.json has no quantization_config), a missing scale (NOT_FOUND), a
  // scale of the wrong shape or dtype, a NaN, infinite or negative scale, a scale without its
  // FP8 weight (INVALID_ARGUMENT).
  static absl::StatusOr<std::shared_ptr<const Fp8Checkpoint>> Scan(
      const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
      const std::optional<Fp8Format>& format);

  // The checked fp32 scales [ceil(N / rows), ceil(K / cols)] of FP8 tensor `weight` (CPU), or
  // null when `weight` is not an FP8 tensor of the checkpoint.
  const torch::Tensor* ScaleOf(const std::string& weight) const;
  // Whether `name` is the scale of one of the FP8 tensors (loaded with it, not on its own).
  bool IsScale(const std::string& name) const { return scale_names_.count(name) > 0; }
  bool empty() const { return scales_.empty(); }
  size_t size() const { return scales_.size(); }
  // The checkpoint's format; meaningful only when !empty().
  const Fp8Format& format() const { return format_; }

 private:
  Fp8Format format_;
  std::map<std::string, torch::Tensor> scales_;     // FP8 tensor -> its scales
  std::map<std::string, std::string> scale_names_;  // scale -> its FP8 tensor
};

// The number of NaN values of an FP8 tensor's bytes (e4m3fn has no infinity; 0x7F and 0xFF are
// its NaNs).
int64_t Fp8NanCount(const torch::Tensor& fp8);

}  // namespace lm
