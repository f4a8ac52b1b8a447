// Hugging Face checkpoint directories: safetensors tensors (single file or sharded with
// model.safetensors.index.json) mapped onto a model's parameters by name.
#pragma once

#include <functional>
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

// Calls `fn` with every tensor of `files`, one at a time: file by file, in the order of the
// tensors' bytes (sequential reads). `tensor` is a CPU tensor over the mapped bytes in the file's
// dtype, valid during the call (copy what must outlive it). After each call the tensor's pages
// are handed back (SafetensorsFile::ReleasePages), so walking a checkpoint keeps about one tensor
// of it resident, however large its shards. The first non-OK status of `fn` ends the walk.
using CheckpointTensorFn = std::function<absl::Status(
    const SafetensorsFile& file, const std::string& name, const torch::Tensor& tensor)>;
absl::Status ForEachCheckpointTensor(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files, const CheckpointTensorFn& fn);

struct LoadReport {
  int64_t tensors_loaded = 0;
  int64_t tensors_ignored = 0;  // e.g. Qwen3-Next mtp.* or a tied lm_head copy
};

// Which checkpoint tensors LoadParameters skips, and where experts go.
struct LoadFilter {
  std::vector<std::string> ignore_names;     // skipped and counted (a tied lm_head copy)
  std::vector<std::string> ignore_prefixes;  // skipped and counted (Qwen3-Next mtp.*)
  // Expert parallelism: the row of fused parameter `param` that checkpoint expert `expert` fills
  // in this process, or -1 when another process holds that expert (its tensors are skipped and
  // counted as ignored). Unset: row = expert. Completeness is checked over the parameter's rows.
  std::function<int64_t(const std::string& param, int64_t expert)> expert_row;
};

// Copies checkpoint tensors into `params` (name -> parameter), through ForEachCheckpointTensor:
// each tensor is converted to its parameter's dtype and copied to its parameter's device as it is
// read, so nothing of the model is staged on the host beyond the tensor in hand. Per-expert
// tensors `...mlp.experts.E.{gate,up,down}_proj.weight` fill rows of the fused
// `...mlp.experts.gate_up_proj` [E, 2I, H] (gate first) and `...mlp.experts.down_proj` [E, H, I].
// Missing, unexpected, duplicate and mis-shaped tensors are errors naming the tensor (and file).
absl::StatusOr<LoadReport> LoadParameters(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
    std::map<std::string, torch::Tensor>& params, const LoadFilter& filter);
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
