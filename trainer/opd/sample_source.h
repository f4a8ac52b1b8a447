// Where an OPD step's samples come from: the prompt stream (every rank draws the same prompts and
// samples its own share on the rollout workers, so no rank waits on another's sampling and no
// sample travels between ranks), the one-step-off prefetch (the next step's share sampled on the
// current weights while this step learns), and the prefetched samples a checkpoint keeps so that
// its resume samples nothing anew.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/data/prompt_dataset.h"
#include "lm/dist/process_group.h"
#include "lm/dist/rank_sync.h"
#include "nlohmann/json.hpp"
#include "rpc/client.h"
#include "trainer/opd/rollout_pool.h"
#include "trainer/opd/step_pipeline.h"

namespace trainer {

// FNV-1a over a step's prompts: a resume checks that the prompts it draws are the ones the
// checkpoint's samples answer (the data files or the mixture did not change in between).
uint64_t PromptsHash(const std::vector<lm::PromptExample>& prompts);

// The one-step-off samples a checkpoint holds: each learner rank writes its own share (with its
// routing, for routing replay) to a file of its own, so that no sample crosses ranks to be saved
// (OpdJob::WriteJobFiles); a resume on any number of ranks reads them all and takes its share.
std::string PrefetchedFileName(int rank);
// The single file of checkpoints written before the per-rank files.
inline constexpr const char* kPrefetchedFile = "prefetched_samples.bin";

struct SampleSourceOptions {
  int64_t prompts_per_step = 512;
  // The rollout section's sampling, the stop ids and return_routing; its seed is the run's, each
  // step samples with MixSeed(seed, the step's data position).
  lm::SamplingParams sampling;
  StepPipelineOptions pipeline;
  bool prefetch = false;  // train.async
  int rank = 0, ranks = 1;
};

class SampleSource {
 public:
  SampleSource(std::unique_ptr<lm::PromptDataset> prompts, std::unique_ptr<RolloutPool> rollout,
               SampleSourceOptions options);

  // Repositions the prompt stream (a resume: the cursor after the last completed step).
  absl::Status Seek(const lm::DataCursor& cursor) { return prompts_->Seek(cursor); }
  RolloutPool& rollout() { return *rollout_; }

  // This rank's samples of step `step`: the prefetched pipeline, the share a resumed checkpoint
  // saved, or a pipeline that starts sampling now.
  absl::StatusOr<std::unique_ptr<StepPipeline>> Next(int64_t step);
  // One-step-off: draws step `step`'s prompts now and starts sampling them once `current`'s
  // sampling has ended (on the weights the workers serve then). Nothing when prefetch is off.
  void Prefetch(int64_t step, const StepPipeline* current);
  // The prefetch's pipeline, to score while it samples (null when none).
  StepPipeline* prefetched() { return prefetch_.get(); }

  // Collective, before a checkpoint: waits for the prefetch's sampling on every rank (progress-
  // aware) and gathers every rank's samples on rank 0; its record for the trainer state, or null
  // when no prefetch runs. A prefetch that failed stays failed: the next step fails as it would.
  absl::StatusOr<nlohmann::json> Settle(lm::dist::RankSync& sync, lm::dist::ProcessGroup& group);
  // This rank's prefetched samples as the last Settle encoded them, for its file in the checkpoint.
  const std::string& settled_bytes() const { return settled_bytes_; }

  // A checkpoint's prefetched samples (its state's record), for the first step after a resume.
  absl::Status LoadPrefetched(const std::string& checkpoint, const nlohmann::json& state);

 private:
  StepPrompts Draw(int64_t step);
  std::unique_ptr<StepPipeline> Launch(StepPrompts prompts, const StepPipeline* after = nullptr);

  std::unique_ptr<lm::PromptDataset> prompts_;
  std::unique_ptr<RolloutPool> rollout_;
  const SampleSourceOptions opts_;
  std::unique_ptr<StepPipeline> prefetch_;
  std::optional<std::vector<lm::Sample>> resumed_;  // a checkpoint's, for the next step
  uint64_t resumed_hash_ = 0;
  std::string settled_bytes_;
};

}  // namespace trainer
