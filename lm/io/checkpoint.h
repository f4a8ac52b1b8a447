// Hugging Face checkpoint directories: safetensors tensors (single file or sharded with
// model.safetensors.index.json) mapped onto a model's parameters by name.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "lm/io/safetensors.h"

namespace lm {

// The safetensors files of a model directory, opened (memory-mapped) in shard order.
absl::StatusOr<std::vector<std::shared_ptr<const SafetensorsFile>>> OpenCheckpointFiles(
    const std::string& dir);

// A zero-copy tensor over a view's bytes; the returned tensor keeps `file` mapped.
torch::Tensor TensorFromView(const TensorView& view, std::shared_ptr<const SafetensorsFile> file);

struct LoadReport {
  int64_t tensors_loaded = 0;
  int64_t tensors_ignored = 0;  // e.g. Qwen3-Next mtp.* or a tied lm_head copy
};

// Copies checkpoint tensors into `params` (name -> parameter). Per-expert tensors
// `...mlp.experts.E.{gate,up,down}_proj.weight` fill rows of the fused
// `...mlp.experts.gate_up_proj` [E, 2I, H] (gate first) and `...mlp.experts.down_proj` [E, H, I].
// `ignore_prefixes` name tensors that are skipped and counted. Missing, unexpected and mis-shaped
// tensors are errors naming the tensor (and file).
absl::StatusOr<LoadReport> LoadParameters(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
    std::map<std::string, torch::Tensor>& params, const std::vector<std::string>& ignore_names,
    const std::vector<std::string>& ignore_prefixes);

// Writes named tensors as HF safetensors into `dir`: one model.safetensors, or shards
// model-0000i-of-0000N.safetensors plus model.safetensors.index.json above `max_shard_bytes`.
// Fused expert tensors are written per expert, the layout published checkpoints use.
absl::Status SaveParameters(const std::string& dir,
                            const std::map<std::string, torch::Tensor>& params, torch::Dtype dtype,
                            int64_t max_shard_bytes);

}  // namespace lm
