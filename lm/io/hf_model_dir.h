// Hugging Face model directories: safetensors tensors (single file or sharded with
// model.safetensors.index.json) mapped onto a model's parameters by name. (A run's training
// state, which holds one of these, is trainer/common/checkpoint.h.)
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "lm/io/fp8_checkpoint.h"
#include "lm/io/safetensors.h"
#include "lm/model/config.h"
#include "lm/model/model.h"

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
  // FP8 checkpoints (lm/io/fp8_checkpoint.h; counted by LoadParameters): FP8 tensors copied into
  // parameters kept in FP8, and FP8 tensors dequantized into their parameters' dtype. Their
  // scales count as loaded or ignored with them.
  int64_t fp8_kept = 0;
  int64_t fp8_dequantized = 0;
};

// Where a checkpoint's FP8 tensors go: the checkpoint's scales, and the scale buffer of each
// parameter kept in FP8 (lm/model/fp8.h MakeFp8Holder). An FP8 tensor whose parameter is kept
// in FP8 is copied as it is and its scales into the buffer (the slice of a fused expert
// parameter's); any other FP8 tensor is dequantized into its parameter's dtype.
struct Fp8Targets {
  std::shared_ptr<const Fp8Checkpoint> checkpoint;  // null: no FP8 tensor is accepted
  std::map<std::string, torch::Tensor> scales;      // parameter name -> its scale buffer
};

// Which checkpoint tensors LoadParameters skips, where experts go, and what FP8 tensors become.
struct LoadFilter {
  std::vector<std::string> ignore_names;     // skipped and counted (a tied lm_head copy)
  std::vector<std::string> ignore_prefixes;  // skipped and counted (Qwen3-Next mtp.*)
  // Expert parallelism: the row of fused parameter `param` that checkpoint expert `expert` fills
  // in this process, or -1 when another process holds that expert (its tensors are skipped and
  // counted as ignored). Unset: row = expert. Completeness is checked over the parameter's rows.
  std::function<int64_t(const std::string& param, int64_t expert)> expert_row;
  Fp8Targets fp8;  // set by LoadCheckpoint for an FP8 checkpoint
};

// Parameter name -> shape.
using ParameterShapes = std::map<std::string, std::vector<int64_t>>;

// The parameters of the model for `config`, as its architecture's constructors register them
// (fused experts [LocalExperts(), 2I, H] and [LocalExperts(), H, I]; no lm_head when tied), from
// the config alone: what a checkpoint and the memory budget are checked against before anything
// is allocated. ExpectedShapes tests (tests/model_test.cc) keep it equal to the constructors.
ParameterShapes ExpectedParameterShapes(const ModelConfig& config);
// The elements, and the bytes at `element_size` bytes each, of `shapes`; INT64_MAX on overflow.
int64_t ParameterCount(const ParameterShapes& shapes);
int64_t ShapeBytes(const ParameterShapes& shapes, int64_t element_size);

// What loading a model directory skips: its tied lm_head copy and its architecture's ignored
// prefixes (known from the config, before the model exists).
LoadFilter ModelLoadFilter(const ModelConfig& config);

// Checks the checkpoint's headers against `shapes`, reading no tensor's bytes: every tensor that
// `filter` keeps must fill a parameter (or an expert's slice of a fused one) of its exact shape,
// once, and every parameter must be filled. Errors name the tensor and its file (missing
// parameters: the directory). An FP8 tensor needs filter.fp8.checkpoint (Fp8Checkpoint::Scan
// checked it and its scales), else it is an error naming it. Returns the counts a load reports.
absl::StatusOr<LoadReport> CheckCheckpoint(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files, const ParameterShapes& shapes,
    const LoadFilter& filter);

// Copies checkpoint tensors into `params` (name -> parameter), through ForEachCheckpointTensor:
// each tensor is converted to its parameter's dtype and copied to its parameter's device as it is
// read, so nothing of the model is staged on the host beyond the tensor in hand. Per-expert
// tensors `...mlp.experts.E.{gate,up,down}_proj.weight` fill rows of the fused
// `...mlp.experts.gate_up_proj` [E, 2I, H] (gate first) and `...mlp.experts.down_proj` [E, H, I].
// Missing, unexpected, duplicate and mis-shaped tensors are errors naming the tensor (and file),
// found from the headers (CheckCheckpoint) before anything is copied; so is a tensor holding a
// NaN or an infinity once loaded (as read, or after conversion to the parameter's dtype).
absl::StatusOr<LoadReport> LoadParameters(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
    std::map<std::string, torch::Tensor>& params, const LoadFilter& filter);
absl::StatusOr<LoadReport> LoadParameters(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
    std::map<std::string, torch::Tensor>& params, const std::vector<std::string>& ignore_names,
    const std::vector<std::string>& ignore_prefixes);

// Called inside a catch block: the exception being handled as a status naming `what`. A failed
// allocation (c10::OutOfMemoryError, std::bad_alloc) is RESOURCE_EXHAUSTED, any other LibTorch or
// standard exception INTERNAL. The loaders return statuses: an exception out of one would end
// its process with an abort (exit 134) and no word of which model did not fit.
absl::Status ExceptionStatus(const std::string& what);

// The checkpoint of `dir` loaded into a new model for `config` (LoadModel, and LoadExpertShard with
// its experts' filter), refused before anything is allocated when CheckCheckpoint fails against
// ExpectedParameterShapes(config), or when a model on the CPU needs more bytes than the memory
// available (RESOURCE_EXHAUSTED naming `dir` and both counts). An allocation that fails anyway
// is RESOURCE_EXHAUSTED naming `dir`, not an exception. `report`, when set, receives the counts.
// A block-wise FP8 checkpoint (config.fp8) is checked by Fp8Checkpoint::Scan first; its FP8
// weights are kept in FP8 or dequantized as `opts.fp8` says (lm/model/model.h Fp8Weights): kept,
// they are allocated in FP8 from the start (an 80B teacher never exists in bf16 on its device).
absl::StatusOr<std::shared_ptr<CausalLM>> LoadCheckpoint(const std::string& dir,
                                                         const ModelConfig& config,
                                                         const LoadOptions& opts,
                                                         const LoadFilter& filter,
                                                         LoadReport* report = nullptr);

// Writes named tensors as HF safetensors into `dir`: one model.safetensors, or shards
// model-0000i-of-0000N.safetensors plus model.safetensors.index.json above `max_shard_bytes`.
// Fused expert tensors are written per expert, the layout published checkpoints use.
absl::Status SaveParameters(const std::string& dir,
                            const std::map<std::string, torch::Tensor>& params, torch::Dtype dtype,
                            int64_t max_shard_bytes);

}  // namespace lm
