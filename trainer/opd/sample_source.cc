#include "trainer/opd/sample_source.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "lm/util/file.h"
#include "lm/util/limits.h"
#include "lm/util/log.h"
#include "lm/util/splitmix.h"
#include "lm/util/status.h"
#include "rpc/codec.h"

namespace trainer {

uint64_t PromptsHash(const std::vector<lm::PromptExample>& prompts) {
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](uint64_t v) {
    for (int b = 0; b < 8; ++b) h = (h ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ULL;
  };
  for (const auto& p : prompts) {
    mix(p.prompt_ids.size());
    for (int32_t id : p.prompt_ids) mix(static_cast<uint32_t>(id));
  }
  return h;
}

SampleSource::SampleSource(std::unique_ptr<lm::PromptDataset> prompts,
                           std::unique_ptr<RolloutPool> rollout, SampleSourceOptions options)
    : prompts_(std::move(prompts)), rollout_(std::move(rollout)), opts_(std::move(options)) {}

StepPrompts SampleSource::Draw(int64_t step) {
  StepPrompts p;
  p.step = step;
  p.prompts = prompts_->NextBatch(static_cast<size_t>(opts_.prompts_per_step));
  p.cursor_after = prompts_->cursor();
  p.SetShare(opts_.rank, opts_.ranks);
  return p;
}

std::unique_ptr<StepPipeline> SampleSource::Launch(StepPrompts prompts, const StepPipeline* after) {
  lm::SamplingParams params = opts_.sampling;
  // A fresh seed per step (the data cursor's position), reproducible across resumes.
  params.seed = static_cast<int64_t>(
      lm::MixSeed(static_cast<uint64_t>(opts_.sampling.seed), prompts.cursor_after.step));
  return StepPipeline::Sample(std::move(prompts), opts_.pipeline, *rollout_, std::move(params),
                              after);
}

void SampleSource::Prefetch(int64_t step, const StepPipeline* current) {
  if (opts_.prefetch) prefetch_ = Launch(Draw(step), current);
}

absl::StatusOr<std::unique_ptr<StepPipeline>> SampleSource::Next(int64_t step) {
  if (prefetch_) {
    if (prefetch_->prompts().step != step)
      return absl::InternalError(absl::StrCat("the prefetched samples are for step ",
                                              prefetch_->prompts().step, ", not ", step));
    return std::move(prefetch_);
  }
  if (!resumed_) return Launch(Draw(step));
  StepPrompts prompts = Draw(step);
  std::vector<lm::Sample> samples = std::move(*resumed_);
  resumed_.reset();
  if (PromptsHash(prompts.prompts) != resumed_hash_)
    return absl::FailedPreconditionError(
        "the checkpoint's prefetched samples answer other prompts than the data now gives (the "
        "prompt files or the mixture changed since): resume from a checkpoint taken without "
        "train.async, or restore the data");
  for (const auto& s : samples) {
    if (s.prompt_index < 0 || static_cast<size_t>(s.prompt_index) >= prompts.prompts.size())
      return absl::DataLossError(absl::StrCat("the checkpoint's prefetched samples name prompt ",
                                              s.prompt_index, " of ", prompts.prompts.size()));
  }
  return StepPipeline::FromSamples(std::move(prompts), opts_.pipeline, std::move(samples));
}

absl::StatusOr<nlohmann::json> SampleSource::Settle(lm::dist::RankSync& sync,
                                                    lm::dist::ProcessGroup& group) {
  settled_bytes_.clear();
  ASSIGN_OR_RETURN(const bool any, group.AnyRank(prefetch_ != nullptr));
  if (!any) return nlohmann::json();
  const absl::Status mine = prefetch_ ? prefetch_->WaitSampled() : absl::OkStatus();
  // A failed prefetch is not the checkpoint's failure: it is kept out of it, and the next step
  // (which takes the failed pipeline) fails as it would have.
  const absl::Status agreed = sync.Agree("prefetched samples settled", mine);
  if (sync.broken()) return agreed;
  if (!agreed.ok()) return nlohmann::json();
  settled_bytes_ = lm::EncodeSamples(prefetch_->samples());
  ASSIGN_OR_RETURN(std::vector<double> total,
                   group.AllReduceDoubles({static_cast<double>(prefetch_->samples().size())}));
  return nlohmann::json{
      {"files", group.size()},
      {"samples", static_cast<int64_t>(total[0])},
      {"prompts_hash", std::to_string(PromptsHash(prefetch_->prompts().prompts))}};
}

std::string PrefetchedFileName(int rank) {
  return absl::StrCat("prefetched_samples.rank", rank, ".bin");
}

absl::Status SampleSource::LoadPrefetched(const std::string& checkpoint,
                                          const nlohmann::json& state) {
  if (!state.contains("prefetched")) return absl::OkStatus();
  if (!opts_.prefetch) {
    lm::log::Info(
        "the checkpoint holds one-step-off samples; train.async is off, so the next "
        "step samples anew");
    return absl::OkStatus();
  }
  // Every rank's file (or the one file of an older checkpoint): this rank's share is taken from
  // all of them, whatever the number of ranks that wrote them.
  const nlohmann::json& record = state.at("prefetched");
  std::vector<std::string> paths;
  if (record.contains("files")) {
    const int64_t files = record.at("files").get<int64_t>();
    if (files < 1 || files > lm::limits::kMaxBatch)
      return absl::DataLossError(absl::StrCat(checkpoint, "/trainer_state.json: prefetched.files ",
                                              files, " is outside [1, ", lm::limits::kMaxBatch,
                                              "]"));
    for (int64_t r = 0; r < files; ++r)
      paths.push_back(checkpoint + "/" + PrefetchedFileName(static_cast<int>(r)));
  } else {
    paths.push_back(checkpoint + "/" + kPrefetchedFile);
  }
  std::vector<lm::Sample> all;
  for (const std::string& path : paths) {
    ASSIGN_OR_RETURN(const std::string bytes, lm::ReadFile(path));
    absl::StatusOr<std::vector<lm::Sample>> samples = lm::DecodeSamples(bytes);
    if (absl::IsFailedPrecondition(samples.status())) {
      // Another build's samples: what a checkpoint without them does (the prompts are drawn
      // again from the saved cursor and sampled on the resumed weights), said once.
      lm::log::Warn(
          absl::StrCat(path, ": ", samples.status().message(), "; the next step samples anew"));
      return absl::OkStatus();
    }
    if (!samples.ok())
      return absl::DataLossError(absl::StrCat(path, ": ", samples.status().message()));
    for (lm::Sample& s : *samples) all.push_back(std::move(s));
  }
  uint64_t hash = 0;
  if (!absl::SimpleAtoi(state.at("prefetched").at("prompts_hash").get<std::string>(), &hash))
    return absl::DataLossError(absl::StrCat(checkpoint,
                                            "/trainer_state.json: prefetched."
                                            "prompts_hash is not a number"));
  resumed_hash_ = hash;
  resumed_ = std::move(all);
  return absl::OkStatus();
}

}  // namespace trainer
