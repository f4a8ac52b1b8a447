// The skeleton both learner jobs (sft/, opd/) are built on: the run directory and its
// checkpoints, the learner's ranks, the model with its (ZeRO-1) AdamW, metrics and progress, the
// non-finite step counter, stops at step boundaries and resume. Each job derives from it, adds its
// data and its step, and names its own part of the trainer state (JobState).
//
// A job's life: JoinGroup -> AgreeOnCheckpoint -> LoadModel or ResumeCommon (+ its own fields) ->
// OpenRecords -> steps (CountNonFinite after each) -> SaveCheckpoint / StopForSignal.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <torch/types.h>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lm/data/mixture.h"
#include "lm/dist/process_group.h"
#include "lm/model/model.h"
#include "lm/plan/plan.h"
#include "lm/util/config.h"
#include "trainer/common/checkpoint.h"
#include "trainer/common/job_args.h"
#include "trainer/common/metrics.h"
#include "trainer/common/mixed_precision.h"
#include "trainer/common/optim.h"
#include "trainer/common/progress.h"
#include "trainer/common/run_dir.h"
#include "trainer/common/sections.h"
#include "trainer/common/zero1.h"

namespace trainer {

class TrainingJob {
 public:
  TrainingJob(const TrainingJob&) = delete;
  TrainingJob& operator=(const TrainingJob&) = delete;
  virtual ~TrainingJob() = default;

  // Joins the ranks, loads or resumes, connects what the job needs.
  virtual absl::Status Init(const JobArgs& args) = 0;
  // Trains to the end: OK, CANCELLED after a stop signal (checkpointed), or the error.
  virtual absl::Status Run() = 0;
  // After an exception escaped Run(): checkpoints the last completed step when it can.
  virtual void CheckpointAfterException();

 protected:
  // `job` ("sft" | "opd") is recorded in every checkpoint and checked on resume.
  TrainingJob(std::string job, RunDir run, std::string config_yaml, const CheckpointConfig& ckpt,
              const OptimConfig& optim, const DistConfig& dist);

  // The job's own fields of trainer_state.json (the common ones are added by SaveCheckpoint).
  virtual nlohmann::json JobState() const = 0;
  // Files of the job's own written into each checkpoint directory `dir`, by every rank (each
  // writes only files of its own name), before rank 0 writes the state.
  virtual absl::Status WriteJobFiles(const std::string& /*dir*/) const { return absl::OkStatus(); }
  // Called by SaveCheckpoint on every rank before JobState: a job gathers there what its state
  // holds that only the ranks together know (collectives allowed).
  virtual absl::Status PrepareCheckpoint() { return absl::OkStatus(); }
  // Where the tokenizer files that travel with each checkpoint come from.
  virtual std::string TokenizerPath() const = 0;
  // What the memory plan takes from the job's config (trainer/common/learner_plan.h), for CUDA.
  virtual lm::plan::LearnerSettings PlanSettings(int64_t ranks, bool bf16_mixed) const = 0;

  // Threads, device and the learner's process group (LOCAL_RANK picks the GPU); every rank must
  // have resolved the same config.
  absl::Status JoinGroup(const LearnerTrainConfig& train, const DistConfig& dist);
  // Rank 0 removes incomplete checkpoints and picks the one to resume ("" for a fresh start) by
  // --resume / --resume=DIR / run.resume; every rank gets rank 0's answer or its error.
  absl::StatusOr<std::string> AgreeOnCheckpoint(const JobArgs& args, const RunConfig& run);
  // The model of an HF directory on this rank's device, in training mode, and its optimizer.
  // On a CUDA device the memory plan (lm/plan/plan.h) is checked first.
  absl::Status LoadModel(const std::string& dir);
  // dist.zero_stage for this rank's device and the model in `dir`: one rank is stage 1; auto is
  // stage 1 on the CPU and, on CUDA, when the memory plan fits the device with it, else 2.
  absl::StatusOr<ZeroStage> ResolveZeroStage(const std::string& dir) const;
  // RESOURCE_EXHAUSTED naming the term when the planned peak of this rank (the model in `dir`,
  // the job's micro-batch, this many ranks, ZeRO stage `stage`) exceeds its CUDA device; OK on
  // the CPU.
  absl::Status CheckPlannedMemory(const std::string& dir, ZeroStage stage) const;
  // The sharded optimizer's flat order (trainer/common/gradient_order.h), found on rank 0 and the
  // same on every rank; empty (reverse model order) when the probe fails, with a warning.
  absl::StatusOr<std::vector<std::string>> FlatOrder() const;
  // LoadModel plus the job's own checks of the model (a job may add them).
  virtual absl::Status LoadStudent(const std::string& dir) { return LoadModel(dir); }
  // Reads `checkpoint` (refusing another job's), loads its model (LoadStudent) and optimizer
  // state and restores the common counters and RNG; returns the state for the job's own fields.
  // An unusable checkpoint is an error that names it, and when it is the run's newest says that
  // no older one is taken in its place and which one is next.
  absl::StatusOr<nlohmann::json> ResumeCommon(const std::string& checkpoint);
  absl::StatusOr<nlohmann::json> LoadCheckpoint(const std::string& checkpoint);
  // Metrics (JSONL + TensorBoard, rank 0 only) and the progress line with ETA.
  absl::Status OpenRecords(int64_t total_steps, const LoggingConfig& logging, bool resumed);

  // The learning rate of the next update. The schedule counts the updates applied (as AdamW's
  // bias correction does), not the steps run: a skipped step moves neither.
  double NextLr() const { return schedule_.LrAt(optimizer_->steps()); }
  // Ends a step's learning: applies the update at `lr` (none when `skipped`), clears the
  // gradients and advances step_ and cursor_ (to `after`) in the same move. So a checkpoint
  // written after it (a failed push, an exception, a stop) is of the new step and one written
  // before it of the old one: a resume never applies a batch twice or loses one. While the update
  // is half applied (an error inside it) no checkpoint can be written (SaveCheckpoint refuses).
  absl::Status ApplyUpdate(bool skipped, double lr, const lm::DataCursor& after);
  // Counts a finished step (step_ already advanced): a skipped update (non-finite loss or
  // gradient norm) is logged with both values.
  void CountNonFinite(bool skipped, double loss, double grad_norm);
  // ABORTED after `max_consecutive` non-finite steps in a row.
  absl::Status CheckNonFinite(int64_t max_consecutive) const;
  // A checkpoint of the completed step (collective; nothing when it is already on disk).
  absl::Status SaveCheckpoint();
  // After a stop signal (on any rank): checkpoints and returns CANCELLED saying how to resume.
  absl::Status StopForSignal();
  // A stop signal on any rank, agreed at a step boundary.
  absl::StatusOr<bool> StopAgreed();

  bool is_root() const { return group_->is_root(); }

  const std::string job_;
  RunDir run_;
  const std::string config_yaml_;
  CheckpointManager checkpoints_;
  torch::Device device_{torch::kCPU};
  Precision precision_ = Precision::kFp32;  // train.precision, resolved for device_
  bool checkpoint_layers_ = false;          // train.activation_checkpointing
  // The learner's ranks (one rank: the trivial group).
  std::unique_ptr<lm::dist::ProcessGroup> group_ = std::make_unique<lm::dist::ProcessGroup>();
  std::shared_ptr<lm::CausalLM> model_;
  std::unique_ptr<DistributedOptimizer> optimizer_;
  const OptimConfig optim_config_;
  const DistConfig dist_config_;
  CosineSchedule schedule_;
  std::unique_ptr<MetricsLogger> metrics_;  // rank 0 keeps the run's records
  std::unique_ptr<Progress> progress_;

  int64_t step_ = 0;       // completed steps
  lm::DataCursor cursor_;  // data cursor after the last completed step
  int64_t nonfinite_consecutive_ = 0, nonfinite_total_ = 0;
  int64_t last_checkpoint_step_ = -1;
  bool update_torn_ = false;  // an update failed half-way: the weights match no step
};

// What every job's entry point does around its job, after validating its config: the launch
// environment (RANK, WORLD_SIZE, ...), the run directory and its resolved config (rank 0), then
// Init and Run, with torch/JSON exceptions turned into errors naming them (after Init, the last
// completed step is checkpointed first).
using JobFactory = std::function<std::unique_ptr<TrainingJob>(RunDir run, std::string yaml)>;
absl::Status RunTrainingJob(const std::string& name, const RunConfig& run,
                            const std::string& config_yaml, const JobArgs& args,
                            const JobFactory& make);

}  // namespace trainer
