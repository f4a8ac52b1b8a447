// One OPD step's samples on one learner rank, as a pipeline: the rank's share of the step's
// prompts is sampled on the rollout workers, every sample streams into the stage's teachers as
// soon as it arrives, and the learner takes micro-batches as soon as theirs are scored.
//
// Order never depends on arrival. The rank's samples are packed in (prompt, sample) order into
// micro-batches of at most micro_batch_tokens tokens (a longer sample alone); a micro-batch is
// handed out once every sample before its end has arrived (so its boundaries are final) and its
// own samples are scored, in that order. So a step learns the same micro-batches in the same
// order whether it ran as a pipeline or phase by phase (sample all, score all, learn all:
// `overlap` off), and the same whatever order the workers and teachers answered in.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "lm/data/mixture.h"
#include "lm/data/prompt_dataset.h"
#include "lm/generate/sampling.h"
#include "rpc/client.h"
#include "trainer/opd/score_stream.h"

namespace trainer {

class RolloutPool;

// A step's prompts: every rank draws the same ones and samples its own contiguous share.
struct StepPrompts {
  int64_t step = 0;  // the step they are for (1-based)
  std::vector<lm::PromptExample> prompts;
  lm::DataCursor cursor_after;  // the data cursor once they are drawn
  size_t begin = 0, end = 0;    // this rank's share [begin, end)

  // Rank `rank` of `ranks` gets prompts [P r / N, P (r + 1) / N).
  void SetShare(int rank, int ranks);
};

struct StepPipelineOptions {
  int32_t samples_per_prompt = 2;
  int64_t micro_batch_tokens = 16384;
  // Score while sampling, learn while scoring; off: sample all, then score all, then learn all.
  bool overlap = true;
  // The domain of a prompt's samples (their teacher pool and metrics).
  std::function<std::string(const lm::PromptExample&)> domain_of;
  // Checks one sample before it is kept (routing replay's shape); an error fails the step.
  std::function<absl::Status(const lm::Sample&)> check;
};

class StepPipeline {
 public:
  // Starts sampling the share on a thread of its own, with `params` (its seed the step's); when
  // `after` is set, once that pipeline's sampling has ended (one-step-off: the workers finish
  // the current step first).
  static std::unique_ptr<StepPipeline> Sample(StepPrompts prompts, StepPipelineOptions options,
                                              RolloutPool& rollout, lm::SamplingParams params,
                                              const StepPipeline* after = nullptr);
  // The share's samples as a checkpoint kept them (already sampled).
  static absl::StatusOr<std::unique_ptr<StepPipeline>> FromSamples(StepPrompts prompts,
                                                                   StepPipelineOptions options,
                                                                   std::vector<lm::Sample> samples);
  ~StepPipeline();  // cancels scoring and waits for the sampling thread
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;

  // Scores every sample (those arrived and those to come) on `pools`; called again (a teacher
  // swap, a new stage) it drops the scores so far and scores everything anew. `generation` names
  // the teacher set (StageTeachers::generation()).
  void StartScoring(TeacherPools pools, ScoreStreamOptions options, int64_t generation);
  int64_t scoring_generation() const;

  // Blocks until every sample of the share arrived (or sampling failed).
  absl::Status WaitSampled();
  // Blocks until every sample is scored (or scoring or sampling failed).
  absl::Status WaitScored();
  // Whether every sample is sampled and scored, now (no wait).
  bool scored() const;
  // The next micro-batch, in order, once its samples are scored: its slots (indices into
  // samples()) and whether it is the step's last; nullopt when none is left; an error when
  // sampling or scoring failed.
  struct MicroBatchSlots {
    std::vector<size_t> slots;
    bool last = false;
  };
  absl::StatusOr<std::optional<MicroBatchSlots>> NextMicroBatch();
  // Ends scoring and makes NextMicroBatch fail (the step is abandoned).
  void Cancel(const absl::Status& why);

  const StepPrompts& prompts() const { return prompts_; }
  // Slot (p - begin) * samples_per_prompt + s. Complete once WaitSampled returned OK.
  const std::vector<lm::Sample>& samples() const { return samples_; }
  const lm::SequenceScore& scores(size_t slot) const { return scores_[slot]; }
  // Seconds from the pipeline's start to its last sample, and teacher-busy seconds.
  double sample_seconds() const;
  double score_busy_seconds() const;
  // Samples a down domain pool handed to the default pool (on_domain_down: default_pool).
  int64_t score_fallbacks() const;

 private:
  StepPipeline(StepPrompts prompts, StepPipelineOptions options);
  void OnSample(lm::Sample s);
  void SamplingDone(absl::Status st);
  void OnScored(size_t slot, lm::SequenceScore scores);
  void Fail(const absl::Status& st);
  // Moves the packing cursor over arrived samples, closing micro-batches that are final.
  void PackLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StepPrompts prompts_;
  const StepPipelineOptions opts_;
  const size_t slots_;
  std::vector<lm::Sample> samples_;        // written once per slot, before `arrived_`
  std::vector<lm::SequenceScore> scores_;  // written once per slot, before `scored_`
  mutable absl::Mutex mu_;
  std::vector<bool> arrived_ ABSL_GUARDED_BY(mu_), scored_ ABSL_GUARDED_BY(mu_);
  size_t arrived_count_ ABSL_GUARDED_BY(mu_) = 0, scored_count_ ABSL_GUARDED_BY(mu_) = 0;
  bool sampled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  // Packing: the next slot to place, the micro-batch being filled and those closed.
  size_t next_slot_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t open_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<size_t> open_ ABSL_GUARDED_BY(mu_);
  std::deque<std::vector<size_t>> closed_ ABSL_GUARDED_BY(mu_);
  // Scoring: the stream of the current teacher set.
  std::unique_ptr<ScoreStream> scoring_ ABSL_GUARDED_BY(mu_);
  int64_t generation_ ABSL_GUARDED_BY(mu_) = -1;
  double score_busy_before_ ABSL_GUARDED_BY(mu_) = 0;  // of streams replaced by a rescore
  // Notified once sampling has ended (or the pipeline is gone), for a pipeline started `after`.
  std::shared_ptr<absl::Notification> sampling_ended_ = std::make_shared<absl::Notification>();
  int64_t start_ns_ = 0;
  int64_t last_sample_ns_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread sampler_;
};

}  // namespace trainer
