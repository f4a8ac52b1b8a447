// The held-out evaluation, beside the step: a fixed prompt set, one response each from the weights
// pushed at step s (the same seed every time), each scored by the teacher pool of its domain, as
// the training samples are; the per-response mean of log p_student - log p_teacher.
//
// It runs on the rollout and teacher capacity while the learner trains step s + 1, every rank
// sampling and scoring its own share, and is applied to the stage's rule at the end of step
// s + 1, always that step: so a resumed run decides exactly as an uninterrupted one. A checkpoint
// of step s keeps the evaluation's values when every rank has them, and otherwise its step alone,
// so that a resume evaluates the same weights again (a push that failed, a stop, a failure while
// it ran): an evaluation is never lost and never applied twice.
#pragma once

#include <cstdint>
#include <functional>
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
#include "trainer/opd/step_pipeline.h"

namespace trainer {

class RolloutPool;
class StageTeachers;

class HeldoutEvaluator {
 public:
  // `params` samples one response per prompt with the held-out seed.
  HeldoutEvaluator(std::vector<lm::PromptExample> prompts, int64_t every, lm::SamplingParams params,
                   StepPipelineOptions pipeline, int rank, int ranks);

  bool enabled() const { return !prompts_.empty(); }
  // Whether the weights of `step` are evaluated.
  bool Due(int64_t step) const { return enabled() && step > 0 && step % every_ == 0; }
  // The step whose evaluation is pending (launched or owed, not yet applied), or -1.
  int64_t pending_step() const { return pending_step_; }

  // Starts evaluating the weights of `step` (just pushed) on this rank's share.
  void Launch(int64_t step, RolloutPool& rollout, StageTeachers& teachers,
              const ScoreStreamOptions& scoring);
  // Owes the evaluation of `step`: its weights were never pushed (a failed push).
  void Owe(int64_t step);

  // Collective: waits (progress-aware, through `sync`) for every rank's share of the pending
  // evaluation and returns every response's value in prompt order; then nothing is pending.
  absl::StatusOr<std::vector<double>> Collect(lm::dist::RankSync& sync,
                                              lm::dist::ProcessGroup& group);

  // Collective: the pending evaluation for a checkpoint: {"step", "values" (null unless every rank
  // has finished its share)}, or null when none is pending. Nothing waits for a running share.
  absl::StatusOr<nlohmann::json> Checkpoint(lm::dist::ProcessGroup& group);
  // A checkpoint's record: values to apply, or an evaluation to run again (Relaunch).
  void Restore(const nlohmann::json& record);
  // After a resume's first push: runs an evaluation the checkpoint owes.
  void Relaunch(RolloutPool& rollout, StageTeachers& teachers, const ScoreStreamOptions& scoring);

 private:
  // This rank's values: (prompt index, per-response KL), once its share is scored.
  absl::StatusOr<std::vector<std::pair<int64_t, double>>> MyValues();

  const std::vector<lm::PromptExample> prompts_;
  const int64_t every_;
  const lm::SamplingParams params_;
  const StepPipelineOptions pipeline_opts_;
  const int rank_, ranks_;
  int64_t pending_step_ = -1;
  bool owed_ = false;                            // pending but not launched
  std::unique_ptr<StepPipeline> running_;        // the pending evaluation's share
  std::optional<std::vector<double>> restored_;  // a checkpoint's values for pending_step_
};

}  // namespace trainer
