#include "trainer/opd/step_pipeline.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "lm/util/status.h"
#include "trainer/opd/rollout_pool.h"

namespace trainer {

void StepPrompts::SetShare(int rank, int ranks) {
  const size_t n = prompts.size(), r = static_cast<size_t>(rank), k = static_cast<size_t>(ranks);
  begin = n * r / k;
  end = n * (r + 1) / k;
}

StepPipeline::StepPipeline(StepPrompts prompts, StepPipelineOptions options)
    : prompts_(std::move(prompts)),
      opts_(std::move(options)),
      slots_((prompts_.end - prompts_.begin) * static_cast<size_t>(opts_.samples_per_prompt)),
      samples_(slots_),
      scores_(slots_),
      start_ns_(absl::GetCurrentTimeNanos()) {
  absl::MutexLock lock(&mu_);
  arrived_.assign(slots_, false);
  scored_.assign(slots_, false);
  last_sample_ns_ = start_ns_;
}

std::unique_ptr<StepPipeline> StepPipeline::Sample(StepPrompts prompts, StepPipelineOptions options,
                                                   RolloutPool& rollout, lm::SamplingParams params,
                                                   const StepPipeline* after) {
  std::unique_ptr<StepPipeline> p(new StepPipeline(std::move(prompts), std::move(options)));
  StepPipeline* self = p.get();
  params.samples_per_prompt = self->opts_.samples_per_prompt;
  std::shared_ptr<absl::Notification> gate = after ? after->sampling_ended_ : nullptr;
  self->sampler_ = std::thread([self, &rollout, params = std::move(params), gate] {
    if (gate) gate->WaitForNotification();
    std::vector<IndexedPrompt> share;
    for (size_t i = self->prompts_.begin; i < self->prompts_.end; ++i)
      share.push_back({static_cast<int64_t>(i), self->prompts_.prompts[i].prompt_ids});
    absl::Status st =
        share.empty()
            ? absl::OkStatus()
            : rollout.Stream(share, params, [self](lm::Sample s) { self->OnSample(std::move(s)); });
    self->SamplingDone(st);
  });
  return p;
}

absl::StatusOr<std::unique_ptr<StepPipeline>> StepPipeline::FromSamples(
    StepPrompts prompts, StepPipelineOptions options, std::vector<lm::Sample> samples) {
  std::unique_ptr<StepPipeline> p(new StepPipeline(std::move(prompts), std::move(options)));
  for (lm::Sample& s : samples) {
    if (s.prompt_index < static_cast<int64_t>(p->prompts_.begin) ||
        s.prompt_index >= static_cast<int64_t>(p->prompts_.end))
      continue;  // another rank's share
    p->OnSample(std::move(s));
  }
  p->SamplingDone(absl::OkStatus());
  RETURN_IF_ERROR(p->WaitSampled());
  return p;
}

StepPipeline::~StepPipeline() {
  Cancel(absl::CancelledError("the step was abandoned"));
  if (sampler_.joinable()) sampler_.join();
  if (!sampling_ended_->HasBeenNotified()) sampling_ended_->Notify();
  std::unique_ptr<ScoreStream> scoring;
  {
    absl::MutexLock lock(&mu_);
    scoring = std::move(scoring_);
  }
}

void StepPipeline::OnSample(lm::Sample s) {
  const size_t p = static_cast<size_t>(s.prompt_index);
  if (p < prompts_.begin || p >= prompts_.end || s.sample_index < 0 ||
      s.sample_index >= opts_.samples_per_prompt)
    return Fail(absl::InternalError(
        absl::StrCat("a sample of prompt ", s.prompt_index, " outside this rank's share")));
  const lm::PromptExample& prompt = prompts_.prompts[p];
  s.domain = opts_.domain_of ? opts_.domain_of(prompt) : std::string();
  if (opts_.check) {
    if (absl::Status st = opts_.check(s); !st.ok()) return Fail(st);
  }
  const size_t slot = (p - prompts_.begin) * static_cast<size_t>(opts_.samples_per_prompt) +
                      static_cast<size_t>(s.sample_index);
  absl::MutexLock lock(&mu_);
  if (arrived_[slot]) return;  // RolloutPool hands each pair out once; a resumed file may repeat
  samples_[slot] = std::move(s);
  arrived_[slot] = true;
  ++arrived_count_;
  last_sample_ns_ = absl::GetCurrentTimeNanos();
  if (scoring_ && opts_.overlap) scoring_->Add(slot, &samples_[slot]);
  PackLocked();
}

void StepPipeline::SamplingDone(absl::Status st) {
  if (st.ok()) {
    absl::MutexLock lock(&mu_);
    if (arrived_count_ != slots_)
      st = absl::DataLossError(absl::StrCat("sampling ended with ", arrived_count_, " of ", slots_,
                                            " samples of the step's share"));
  }
  if (!st.ok()) {
    Fail(st);
    sampling_ended_->Notify();
    return;
  }
  absl::MutexLock lock(&mu_);
  sampled_ = true;
  sampling_ended_->Notify();
  if (scoring_ && !opts_.overlap) {  // phase by phase: scoring starts now, with every sample
    std::vector<std::pair<size_t, const lm::Sample*>> all;
    for (size_t i = 0; i < slots_; ++i) all.emplace_back(i, &samples_[i]);
    scoring_->AddAll(all);
  }
  if (scoring_) scoring_->Close();
  PackLocked();
}

void StepPipeline::StartScoring(TeacherPools pools, ScoreStreamOptions options,
                                int64_t generation) {
  std::unique_ptr<ScoreStream> old;
  {
    absl::MutexLock lock(&mu_);
    old = std::move(scoring_);
    if (old) score_busy_before_ += old->busy_seconds();
    generation_ = generation;
    scored_.assign(slots_, false);
    scored_count_ = 0;
    scoring_ = std::make_unique<ScoreStream>(
        std::move(pools), std::move(options),
        [this, generation](size_t slot, lm::SequenceScore s) {
          absl::MutexLock l(&mu_);
          if (generation != generation_ || scored_[slot]) return;  // a replaced stream's
          scores_[slot] = std::move(s);
          scored_[slot] = true;
          ++scored_count_;
        },
        [this, generation](const absl::Status& st) {
          if (generation == scoring_generation()) Fail(st);
        });
    if (opts_.overlap || sampled_) {
      std::vector<std::pair<size_t, const lm::Sample*>> arrived;
      for (size_t i = 0; i < slots_; ++i)
        if (arrived_[i]) arrived.emplace_back(i, &samples_[i]);
      scoring_->AddAll(arrived);
    }
    if (sampled_) scoring_->Close();
  }
  if (old) old->Cancel();  // joined outside the lock: its callbacks take it
}

int64_t StepPipeline::scoring_generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

void StepPipeline::Fail(const absl::Status& st) {
  absl::MutexLock lock(&mu_);
  if (error_.ok()) error_ = st;
  if (scoring_) scoring_->Cancel();
}

void StepPipeline::Cancel(const absl::Status& why) {
  Fail(why);
}

absl::Status StepPipeline::WaitSampled() {
  absl::MutexLock lock(&mu_);
  const auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return sampled_ || !error_.ok(); };
  mu_.Await(absl::Condition(&done));
  return error_;
}

absl::Status StepPipeline::WaitScored() {
  absl::MutexLock lock(&mu_);
  const auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !error_.ok() || (sampled_ && scored_count_ == slots_);
  };
  mu_.Await(absl::Condition(&done));
  return error_;
}

bool StepPipeline::scored() const {
  absl::MutexLock lock(&mu_);
  return error_.ok() && sampled_ && scored_count_ == slots_;
}

void StepPipeline::PackLocked() {
  while (next_slot_ < slots_ && arrived_[next_slot_]) {
    const int64_t len = static_cast<int64_t>(samples_[next_slot_].tokens.size());
    if (!open_.empty() && open_tokens_ + len > opts_.micro_batch_tokens) {
      closed_.push_back(std::move(open_));
      open_.clear();
      open_tokens_ = 0;
    }
    open_.push_back(next_slot_++);
    open_tokens_ += len;
  }
  if (next_slot_ == slots_ && !open_.empty()) {
    closed_.push_back(std::move(open_));
    open_.clear();
  }
}

absl::StatusOr<std::optional<StepPipeline::MicroBatchSlots>> StepPipeline::NextMicroBatch() {
  absl::MutexLock lock(&mu_);
  const auto front_ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (closed_.empty()) return false;
    if (!opts_.overlap) return scored_count_ == slots_;  // phase by phase: learning comes last
    for (size_t slot : closed_.front())
      if (!scored_[slot]) return false;
    return true;
  };
  const auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !error_.ok() || front_ready() ||
           (sampled_ && next_slot_ == slots_ && closed_.empty() && open_.empty());
  };
  mu_.Await(absl::Condition(&ready));
  RETURN_IF_ERROR(error_);
  if (closed_.empty()) return std::nullopt;
  MicroBatchSlots mb;
  mb.slots = std::move(closed_.front());
  closed_.pop_front();
  // Every sample has arrived and none is left to pack: nothing comes after this one.
  mb.last = next_slot_ == slots_ && closed_.empty() && open_.empty();
  return mb;
}

double StepPipeline::sample_seconds() const {
  absl::MutexLock lock(&mu_);
  return static_cast<double>(last_sample_ns_ - start_ns_) * 1e-9;
}

int64_t StepPipeline::score_fallbacks() const {
  absl::MutexLock lock(&mu_);
  return scoring_ ? scoring_->fallbacks() : 0;
}

double StepPipeline::score_busy_seconds() const {
  absl::MutexLock lock(&mu_);
  return score_busy_before_ + (scoring_ ? scoring_->busy_seconds() : 0.0);
}

}  // namespace trainer
