// The cascaded OPD job (opd-trainer opd) inside: its step's types and the OpdJob class, shared
// by the job's three files. opd.cc holds the step (learning, statistics, logging, convergence,
// checkpoints, the run loop); opd_samples.cc drawing prompts, sampling, sharing the samples with
// the ranks and the one-step-off prefetch with its checkpoint; opd_teachers.cc the stage's teacher
// pools (by data domain), scoring, swaps and the held-out evaluation. The job's interface is
// trainer/opd/opd.h; nothing else includes this file.
#pragma once

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "lm/data/prompt_dataset.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/text/tokenizer.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rpc/auth.h"
#include "rpc/tls.h"
#include "trainer/common/checkpoint.h"
#include "trainer/common/job_main.h"
#include "trainer/common/job_util.h"
#include "trainer/common/metrics.h"
#include "trainer/common/optim.h"
#include "trainer/common/progress.h"
#include "trainer/common/run_dir.h"
#include "trainer/common/signals.h"
#include "trainer/common/training_job.h"
#include "trainer/common/zero1.h"
#include "trainer/opd/convergence.h"
#include "trainer/opd/learner_service.h"
#include "trainer/opd/opd.h"
#include "trainer/opd/opd_loss.h"
#include "trainer/opd/rollout_pool.h"
#include "trainer/opd/teacher_pool.h"

namespace trainer::opd_detail {

namespace fs = std::filesystem;

inline bool Contains(const std::vector<int64_t>& steps, int64_t step) {
  return std::find(steps.begin(), steps.end(), step) != steps.end();
}

// The metrics' name for the samples of domains without a pool of their own.
inline constexpr const char* kOtherDomain = "other";

// How errors name a domain's pool: "stage/domain".
inline std::string DomainPoolName(const std::string& stage, const std::string& domain) {
  return absl::StrCat(stage, "/", domain);
}

// Sums of one domain's samples in a step, in the order they are all-reduced.
enum DomainSum {
  kDomainSequences,
  kDomainTokens,
  kDomainKl,
  kDomainTeacherLp,
  kDomainStudentLp,
  kDomainSums
};

// One step's samples: the prompts, what the rollout workers returned, and the data cursor after
// these prompts were drawn (what a checkpoint of this step records).
struct Rollouts {
  std::vector<lm::PromptExample> prompts;
  std::vector<lm::Sample> samples;  // each with its prompt and its domain
  lm::DataCursor cursor_after;
  double seconds = 0;
};

// Sums over a step's response tokens, turned into the logged means.
struct StepStats {
  LossStats loss;
  double loss_value = 0;
  double teacher_lp_sum = 0, student_lp_sum = 0, entropy_sum = 0;
  double grad_norm = 0, lr = 0;
  bool skipped = false;
  int64_t response_tokens = 0, total_tokens = 0, max_response = 0;
  // Routing replay: replayed (token, MoE layer) pairs, and those whose learner top-k (as a set)
  // differs from the rollout's.
  double routing_pairs = 0, routing_mismatches = 0;
  // sample_s is the wait for this step's samples; sample_work_s how long sampling them took
  // (the same when synchronous; with one-step-off the work overlapped the previous step).
  double sample_s = 0, sample_work_s = 0, score_s = 0, learn_s = 0, push_s = 0, step_s = 0;
  SampleStats samples;  // weight-version lag and truncation of the step's samples
  // metric_domains_.size() x kDomainSums, row-major (DomainSum).
  std::vector<double> domain_sums;
};

// Response positions of one micro-batch: rows of the packed hidden states that predict the
// response tokens, the tokens, and where each sample's entries start in the step's flat arrays.
struct MicroBatch {
  std::vector<size_t> samples;  // indices into Rollouts::samples
  lm::PackedBatch batch;
  torch::Tensor rows, targets;
  int64_t response_tokens = 0;
  // Routing replay: [T, moe_layers, top_k] int32, packed as `batch`; -1 at each document's last
  // token (never fed to the rollout; its row predicts nothing): the learner's own routing there.
  torch::Tensor replay_experts;
};

class OpdJob : public TrainingJob {
 public:
  OpdJob(OpdConfig config, RunDir run, std::string yaml)
      : TrainingJob("opd", std::move(run), std::move(yaml), config.checkpoint, config.optim,
                    config.dist),
        c_(std::move(config)) {}

  absl::Status Init(const JobArgs& args) override;
  absl::Status Run() override;
  void CheckpointAfterException() override;

 private:
  nlohmann::json JobState() const override;
  absl::Status WriteJobFiles(const std::string& dir) const override;
  std::string TokenizerPath() const override {
    return c_.model.tokenizer.empty() ? c_.model.path : c_.model.tokenizer;
  }

  absl::Status LoadPrompts();
  absl::StatusOr<std::vector<double>> EvaluateHeldout();
  absl::StatusOr<std::vector<double>> HeldoutReverseKl();
  bool FinishStageOnHeldout(const std::vector<double>& kl);
  void LogHeldout(const std::vector<double>& kl);
  void RecordStageEnd();
  absl::Status ConnectRollout();
  absl::Status StartStage(size_t index, bool resumed);
  absl::Status Resume(const std::string& checkpoint);
  absl::Status ApplyPendingSwap();
  absl::StatusOr<std::optional<SwapRequest>> AnnounceSwap(const SwapRequest* mine);
  absl::StatusOr<std::unique_ptr<TeacherPool>> ConnectSwap(const SwapRequest& swap,
                                                           absl::Status* collective);
  void InstallSwap(const SwapRequest& swap, std::unique_ptr<TeacherPool> pool);

  // rollout.routing_replay: INVALID_ARGUMENT naming routed_experts when a sample's routing does
  // not fit its tokens and the student's MoE layers.
  absl::Status CheckRouting(const Rollouts& r) const;
  static void AddRoutingMismatch(const torch::Tensor& replayed,
                                 const std::vector<torch::Tensor>& own, StepStats* st);
  absl::StatusOr<Rollouts> Sample(std::vector<lm::PromptExample> prompts,
                                  lm::DataCursor cursor_after);
  std::vector<lm::PromptExample> DrawPrompts(lm::DataCursor* cursor_after);
  absl::StatusOr<Rollouts> ShareRollouts(absl::StatusOr<Rollouts> mine);
  std::future<absl::StatusOr<Rollouts>> LaunchSampling();
  absl::StatusOr<Rollouts> NextRollouts();
  void SettlePrefetch();
  absl::Status LoadPrefetched(const std::string& checkpoint, const nlohmann::json& state);
  absl::StatusOr<std::vector<opd::rpc::ScoreOutput>> Score(const Rollouts& r,
                                                           const std::vector<MicroBatch>& mine);
  const std::string& DomainOf(const lm::PromptExample& prompt) const;
  TeacherPool& PoolFor(const std::string& domain);
  size_t MetricRow(const std::string& domain) const;
  void AddDomainSums(const Rollouts& r, const MicroBatch& mb, const torch::Tensor& lp,
                     const std::vector<float>& teacher_lp, StepStats* st) const;
  bool FinishStageOnDomains(const StepStats& st);
  std::vector<MicroBatch> MyMicroBatches(const Rollouts& r);
  absl::Status ReduceStats(StepStats* st);
  std::vector<MicroBatch> MakeMicroBatches(const Rollouts& r);
  absl::Status Learn(const Rollouts& r, const std::vector<MicroBatch>& mine,
                     const std::vector<opd::rpc::ScoreOutput>& scores, StepStats* st);
  absl::Status PushWeights();
  void LogStep(const StepStats& st);
  Scalars DomainScalars(const StepStats& st) const;
  bool FinishStageIfConverged(double reverse_kl);

  absl::Status FailStep(const absl::Status& error, const std::string& what);

  OpdConfig c_;
  std::string secret_;
  std::unique_ptr<lm::Tokenizer> tokenizer_;
  std::unique_ptr<lm::PromptDataset> prompts_;
  std::vector<lm::PromptExample> heldout_prompts_;  // heldout.sources' fixed set (may be empty)
  // Rank 0 drives the rollout workers and the admin service; every rank scores and learns its
  // share of each step's micro-batches.
  std::unique_ptr<RolloutPool> rollout_;
  std::unique_ptr<TeacherPool> teachers_;  // the stage's default pool
  // The stage's pools by data domain (stages[].domains); a domain not named here uses teachers_.
  std::map<std::string, std::unique_ptr<TeacherPool>> domain_teachers_;
  // Domains with metrics of their own: the stage's, then kOtherDomain (none without domains).
  std::vector<std::string> metric_domains_;
  std::unique_ptr<ConvergenceTracker> tracker_;
  // plateau.per_domain: a rule per domain's KL; the stage ends once all have converged.
  std::map<std::string, std::unique_ptr<ConvergenceTracker>> domain_trackers_;
  std::unique_ptr<LearnerServer> admin_;
  // One-step-off sampling: the next step's samples while they are drawn (prefetch_), once a
  // checkpoint has waited for them (settled_), or as a resumed checkpoint saved them (rank 0's
  // resumed_samples_). A checkpoint holds them so that its resume samples nothing anew.
  std::optional<std::future<absl::StatusOr<Rollouts>>> prefetch_;
  std::optional<absl::StatusOr<Rollouts>> settled_;
  std::optional<std::vector<lm::Sample>> resumed_samples_;
  uint64_t resumed_prompts_hash_ = 0;
  // Ends every Generate/Score/UpdateWeights in flight when the job stops (a signal or a failure).
  std::shared_ptr<opd::rpc::CallCanceller> canceller_ = std::make_shared<opd::rpc::CallCanceller>();
  SampledTokenLossOptions loss_opts_;

  nlohmann::json swapped_domains_ = nlohmann::json::object();  // {stage: {domain: endpoints}}
  size_t stage_ = 0;            // index into c_.stages (step_ counts over all stages)
  int64_t weight_version_ = 0;  // version the rollout workers serve
  bool done_ = false;
  nlohmann::json stage_summaries_ = nlohmann::json::array();
  nlohmann::json swapped_ = nlohmann::json::object();  // stage -> endpoints set by swap-teacher
};

// FNV-1a over a step's prompts: a resume checks that the prompts it draws are the ones the
// checkpoint's samples answer (the data files or the mixture did not change in between).
uint64_t PromptsHash(const std::vector<lm::PromptExample>& prompts);

// The one-step-off samples a checkpoint holds (OpdJob::WriteJobFiles).
inline constexpr const char* kPrefetchedFile = "prefetched_samples.bin";

}  // namespace trainer::opd_detail
