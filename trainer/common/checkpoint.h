// Training checkpoints: one directory per step under <run>/checkpoints,
//
//   step_000100/
//     model/                  HF model directory (lm::SaveModel, fp32: the master weights),
//                             plus the tokenizer files, so transformers loads it as it is
//     optimizer.safetensors   AdamW moments by parameter name (exp_avg.<name>, exp_avg_sq.<name>),
//                             or with N ranks optimizer-RRRRR-of-NNNNN.safetensors, one per rank
//                             (trainer/common/zero1.h); either loads on any world size
//     trainer_state.json      step, scheduler, RNG states, data cursor, counters, config (the job
//                             decides what goes in; see trainer/sft/sft.cc)
//
// Written under a temporary name (.tmp-step_000100), flushed to disk, then renamed: a crash
// mid-write leaves a .tmp- directory that is never mistaken for a checkpoint (and is removed by
// the next run). After each save only the last `keep_last` checkpoints are kept. With several ranks
// (a shared file system) rank 0 writes the model and the state, every rank its optimizer shard,
// and rank 0 renames the directory once every shard is on disk.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "trainer/common/zero1.h"

namespace lm::dist {
class ProcessGroup;
}

namespace trainer {

constexpr int kTrainerStateVersion = 1;

std::string StepDirName(int64_t step);  // "step_000100"

class CheckpointManager {
 public:
  CheckpointManager(std::string dir, int64_t keep_last)
      : dir_(std::move(dir)), keep_last_(keep_last) {}

  // Saves a checkpoint for `step` (a no-op when a complete one for that step exists); weights that
  // are not all finite are refused (FAILED_PRECONDITION naming a parameter and the checkpoint
  // kept), before anything is written. `state`
  // becomes trainer_state.json (a "version", "step" and "world_size" are added);
  // `model_extra_files` (tokenizer files) are copied into model/; `job_files`, when given, writes
  // the job's own files into the checkpoint directory on rank 0. Collective over `group`.
  using JobFilesWriter = std::function<absl::Status(const std::string& dir)>;
  absl::Status Save(int64_t step, lm::CausalLM& model, DistributedOptimizer& optimizer,
                    nlohmann::json state, const std::vector<std::string>& model_extra_files,
                    lm::dist::ProcessGroup& group, const JobFilesWriter& job_files = nullptr);

  // Complete checkpoints, oldest first: (step, directory).
  std::vector<std::pair<int64_t, std::string>> List() const;
  // The newest complete checkpoint's directory, or NotFound.
  absl::StatusOr<std::string> Latest() const;
  // The newest checkpoint whose files are all readable (CheckCheckpointFiles); a newer one that is
  // not is moved aside as DIR.unreadable with a warning (rank 0, before any rank loads).
  absl::StatusOr<std::string> LatestReadable() const;
  // Deletes .tmp- leftovers of interrupted saves.
  void RemoveIncomplete() const;

  const std::string& dir() const { return dir_; }

 private:
  void Prune() const;
  std::string dir_;
  int64_t keep_last_;
};

// A checkpoint's trainer_state.json (its version checked).
// The fields every job's trainer state holds, each present, of its type and in range: DATA_LOSS
// naming the file and the field otherwise (ReadTrainerState runs it).
absl::Status CheckTrainerState(const nlohmann::json& state, const std::string& path);
absl::StatusOr<nlohmann::json> ReadTrainerState(const std::string& checkpoint_dir);
// DATA_LOSS naming the file when a checkpoint's trainer state does not parse or one of its
// safetensors files is not whole (a header that does not parse, a tensor past the file's end).
absl::Status CheckCheckpointFiles(const std::string& checkpoint);

// The default generators' states (CPU, and CUDA when present) as JSON (base64), and back.
nlohmann::json CaptureRngState();
absl::Status RestoreRngState(const nlohmann::json& state);

}  // namespace trainer
