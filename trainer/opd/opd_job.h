// The cascaded OPD job (opd-trainer opd) inside: a short loop over three collaborators that own
// their state and their part of the checkpoint.
//   SampleSource     (sample_source.h)     the prompts, this rank's share sampled on the rollout
//                                          workers as a StepPipeline, the one-step-off prefetch;
//   StageTeachers    (stage_teachers.h)    the running stage's pools by domain and the swaps;
//   StageConvergence (stage_convergence.h) when a stage is done, and what each stage did.
// With them: the held-out evaluation beside the step (heldout.h), the learner's part of a step
// (step_learner.h), and RankSync (lm/dist/rank_sync.h), where the ranks meet after each phase of
// variable length and agree on its outcome before any collective. The job's interface is
// trainer/opd/opd.h; nothing else includes this file.
#pragma once

#include <memory>
#include <string>

#include "lm/dist/rank_sync.h"
#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "rpc/client.h"
#include "trainer/common/training_job.h"
#include "trainer/opd/heldout.h"
#include "trainer/opd/learner_service.h"
#include "trainer/opd/opd_config.h"
#include "trainer/opd/sample_source.h"
#include "trainer/opd/stage_convergence.h"
#include "trainer/opd/stage_teachers.h"
#include "trainer/opd/step_learner.h"
#include "trainer/opd/weight_push.h"

namespace trainer::opd_detail {

class OpdJob : public TrainingJob {
 public:
  OpdJob(OpdConfig config, RunDir run, std::string yaml);
  ~OpdJob() override;

  absl::Status Init(const JobArgs& args) override;
  absl::Status Run() override;
  void CheckpointAfterException() override;

 private:
  nlohmann::json JobState() const override;
  absl::Status PrepareCheckpoint() override;
  absl::Status WriteJobFiles(const std::string& dir) const override;
  std::string TokenizerPath() const override;
  lm::plan::LearnerSettings PlanSettings(int64_t ranks, bool bf16_mixed) const override;

  // Start-up (opd_job.cc).
  absl::Status Connect(bool resumed);
  // Connect's steps, in the order it runs them.
  absl::Status LoadTokenizer();
  absl::StatusOr<std::unique_ptr<lm::PromptDataset>> LoadPrompts(const lm::PromptDatasetOptions& po,
                                                                 bool resumed);
  absl::StatusOr<std::unique_ptr<RolloutPool>> ConnectRollout();
  absl::StatusOr<lm::SamplingParams> RolloutSampling() const;
  absl::Status MakeHeldout(lm::PromptDatasetOptions po, const lm::SamplingParams& sampling);
  SampleSourceOptions SourceOptions(const lm::SamplingParams& sampling);
  TeacherPoolOptions TeacherOptions() const;
  absl::Status StartStage(size_t index);
  absl::Status Resume(const std::string& checkpoint);
  absl::Status StartAdmin();
  StepPipelineOptions PipelineOptions();
  ScoreStreamOptions ScoringOptions() const;

  // One step (opd_step.cc): the rank's own phases, then the agreed, collective end. Step runs
  // the named steps below in order.
  absl::Status Step();
  absl::Status ApplyTeacherSwap();
  absl::Status LearnAndAgree(int64_t step, StepLearner& learner,
                             std::unique_ptr<StepPipeline>& pipe, StepStats* st);
  absl::Status ReduceAndUpdate(int64_t step, StepLearner& learner, const StepPipeline& pipe,
                               StepStats* st);
  bool TrackStep(const StepStats& st);
  absl::Status PushStepWeights(StepStats* st);
  void ReportStep(const StepStats& st);
  absl::Status EndStageOrCheckpoint(bool stage_over);
  absl::Status LearnLocally(int64_t step, StepLearner& learner, std::unique_ptr<StepPipeline>& pipe,
                            std::vector<std::vector<size_t>>* held, StepStats* st);
  absl::Status LearnInLockstep(int64_t step, StepLearner& learner, const StepPipeline& pipe,
                               const std::vector<std::vector<size_t>>& held, StepStats* st);
  absl::Status PushWeights();
  absl::Status ApplyHeldout(bool* stage_over);
  void LogStep(const StepStats& st);
  void LogHeldout(int64_t evaluated_step, const std::vector<double>& kl);

  // Failures (opd_job.cc).
  absl::Status FailStep(const absl::Status& error, const std::string& what);

  OpdConfig c_;
  std::string secret_;
  std::unique_ptr<lm::Tokenizer> tokenizer_;
  std::unique_ptr<lm::dist::RankSync> sync_;
  std::unique_ptr<SampleSource> source_;
  std::unique_ptr<WeightPublisher> publisher_;  // after source_: it reports to source_'s pool
  std::unique_ptr<StageTeachers> teachers_;
  std::unique_ptr<StageConvergence> convergence_;
  std::unique_ptr<HeldoutEvaluator> heldout_;
  std::unique_ptr<LearnerServer> admin_;  // rank 0
  // Ends every Generate/Score/UpdateWeights in flight when the job stops (a signal or a failure).
  std::shared_ptr<opd::rpc::CallCanceller> canceller_ = std::make_shared<opd::rpc::CallCanceller>();
  size_t stage_ = 0;            // index into c_.stages (step_ counts over all stages)
  int64_t weight_version_ = 0;  // version the rollout workers serve
  bool done_ = false;
  nlohmann::json prefetched_record_, heldout_record_;  // the parts Checkpoint() gathered
};

}  // namespace trainer::opd_detail
