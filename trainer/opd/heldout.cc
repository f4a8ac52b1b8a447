#include "trainer/opd/heldout.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lm/util/bytes.h"
#include "lm/util/status.h"
#include "trainer/opd/rollout_pool.h"
#include "trainer/opd/stage_teachers.h"

namespace trainer {

HeldoutEvaluator::HeldoutEvaluator(std::vector<lm::PromptExample> prompts, int64_t every,
                                   lm::SamplingParams params, StepPipelineOptions pipeline,
                                   int rank, int ranks)
    : prompts_(std::move(prompts)),
      every_(std::max<int64_t>(every, 1)),
      params_(std::move(params)),
      pipeline_opts_(std::move(pipeline)),
      rank_(rank),
      ranks_(ranks) {}

void HeldoutEvaluator::Launch(int64_t step, RolloutPool& rollout, StageTeachers& teachers,
                              const ScoreStreamOptions& scoring) {
  StepPrompts share;
  share.step = step;
  share.prompts = prompts_;
  share.SetShare(rank_, ranks_);
  StepPipelineOptions o = pipeline_opts_;
  o.samples_per_prompt = 1;
  o.overlap = true;  // each response is scored as soon as it is sampled
  running_ = StepPipeline::Sample(std::move(share), std::move(o), rollout, params_);
  running_->StartScoring(teachers.pools(), scoring, teachers.generation());
  pending_step_ = step;
  owed_ = false;
  restored_.reset();
}

void HeldoutEvaluator::Owe(int64_t step) {
  running_.reset();
  restored_.reset();
  pending_step_ = step;
  owed_ = true;
}

void HeldoutEvaluator::Relaunch(RolloutPool& rollout, StageTeachers& teachers,
                                const ScoreStreamOptions& scoring) {
  if (pending_step_ >= 0 && owed_) Launch(pending_step_, rollout, teachers, scoring);
}

absl::StatusOr<std::vector<std::pair<int64_t, double>>> HeldoutEvaluator::MyValues() {
  if (!running_) return absl::FailedPreconditionError("no held-out evaluation is running");
  RETURN_IF_ERROR(running_->WaitScored());
  std::vector<std::pair<int64_t, double>> out;
  for (size_t slot = 0; slot < running_->samples().size(); ++slot) {
    const lm::Sample& s = running_->samples()[slot];
    const std::vector<float>& teacher = running_->scores(slot).logprobs;
    if (s.logprobs.empty() || teacher.size() != s.logprobs.size())
      return absl::InternalError(absl::StrCat("held-out prompt ", s.prompt_index, ": ",
                                              teacher.size(), " teacher log-probs for ",
                                              s.logprobs.size(), " sampled tokens"));
    double sum = 0;
    for (size_t t = 0; t < teacher.size(); ++t) sum += s.logprobs[t] - teacher[t];
    out.emplace_back(s.prompt_index, sum / static_cast<double>(teacher.size()));
  }
  return out;
}

namespace {

// Every rank's (prompt index, value) pairs, merged in prompt order.
absl::StatusOr<std::vector<double>> GatherValues(
    lm::dist::ProcessGroup& group, const std::vector<std::pair<int64_t, double>>& mine) {
  std::vector<int64_t> indices;
  std::vector<double> values;
  for (const auto& [index, value] : mine) {
    indices.push_back(index);
    values.push_back(value);
  }
  lm::ByteWriter w;
  w.PutVector(indices);
  w.PutVector(values);
  ASSIGN_OR_RETURN(std::vector<std::string> all, group.AllGatherBytes(w.bytes()));
  std::vector<std::pair<int64_t, double>> merged;
  for (size_t r = 0; r < all.size(); ++r) {
    lm::ByteReader reader(all[r]);
    indices.clear();
    values.clear();
    if (!reader.GetVector(&indices) || !reader.GetVector(&values) || !reader.done() ||
        indices.size() != values.size())
      return absl::DataLossError(
          absl::StrCat("learner rank ", r, "'s held-out values are unreadable"));
    for (size_t i = 0; i < indices.size(); ++i) merged.emplace_back(indices[i], values[i]);
  }
  std::sort(merged.begin(), merged.end());
  std::vector<double> out;
  for (const auto& [index, value] : merged) out.push_back(value);
  return out;
}

}  // namespace

absl::StatusOr<std::vector<double>> HeldoutEvaluator::Collect(lm::dist::RankSync& sync,
                                                              lm::dist::ProcessGroup& group) {
  const int64_t step = pending_step_;
  pending_step_ = -1;
  if (restored_) {
    std::vector<double> values = std::move(*restored_);
    restored_.reset();
    return values;
  }
  absl::StatusOr<std::vector<std::pair<int64_t, double>>> mine =
      owed_ ? absl::FailedPreconditionError(
                  absl::StrCat("the held-out evaluation of step ", step, " never ran"))
            : MyValues();
  running_.reset();
  owed_ = false;
  RETURN_IF_ERROR(sync.Agree(absl::StrCat("held-out evaluation of step ", step), mine.status()));
  return GatherValues(group, *mine);
}

absl::StatusOr<nlohmann::json> HeldoutEvaluator::Checkpoint(lm::dist::ProcessGroup& group) {
  if (pending_step_ < 0) return nlohmann::json();
  nlohmann::json record = {{"step", pending_step_}, {"values", nullptr}};
  if (restored_) {
    record["values"] = *restored_;
    return record;
  }
  // Every rank's share must be done to keep the values; a share still running is not waited for.
  absl::StatusOr<std::vector<std::pair<int64_t, double>>> mine =
      absl::FailedPreconditionError("not finished");
  if (!owed_ && running_ && running_->scored()) mine = MyValues();
  ASSIGN_OR_RETURN(const bool any_missing, group.AnyRank(!mine.ok()));
  if (any_missing) return record;
  ASSIGN_OR_RETURN(record["values"], GatherValues(group, *mine));
  return record;
}

void HeldoutEvaluator::Restore(const nlohmann::json& record) {
  running_.reset();
  restored_.reset();
  pending_step_ = -1;
  owed_ = false;
  if (record.is_null()) return;
  pending_step_ = record.at("step").get<int64_t>();
  if (record.at("values").is_null()) {
    owed_ = true;
  } else {
    restored_ = record.at("values").get<std::vector<double>>();
  }
}

}  // namespace trainer
