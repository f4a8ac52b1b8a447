// The OPD job's samples: drawing prompts, sampling them on the rollout workers, sharing rank 0's
// samples with the other ranks, and the one-step-off prefetch that checkpoints keep.
#include "trainer/opd/opd_job.h"

namespace trainer::opd_detail {

std::vector<lm::PromptExample> OpdJob::DrawPrompts(lm::DataCursor* cursor_after) {
  auto prompts = prompts_->NextBatch(static_cast<size_t>(c_.train.prompts_per_step));
  *cursor_after = prompts_->cursor();
  return prompts;
}

absl::StatusOr<Rollouts> OpdJob::Sample(std::vector<lm::PromptExample> prompts,
                                        lm::DataCursor cursor_after) {
  const auto t0 = Clock::now();
  Rollouts r;
  r.prompts = std::move(prompts);
  r.cursor_after = std::move(cursor_after);
  std::vector<std::vector<int32_t>> ids;
  for (const auto& p : r.prompts) ids.push_back(p.prompt_ids);
  opd::rpc::GenerateOptions g;
  g.samples_per_prompt = static_cast<int32_t>(c_.rollout.samples_per_prompt);
  g.temperature = static_cast<float>(c_.rollout.temperature);
  g.top_p = static_cast<float>(c_.rollout.top_p);
  g.top_k = static_cast<int32_t>(c_.rollout.top_k);
  g.max_new_tokens = static_cast<int32_t>(c_.rollout.max_new_tokens);
  ASSIGN_OR_RETURN(g.stop_token_ids, lm::ChatFormat::StopIds(*tokenizer_));
  // A fresh seed per step (the data cursor's position), reproducible across resumes.
  g.seed = static_cast<uint64_t>(c_.rollout.seed) * 1000003ULL + r.cursor_after.step;
  g.return_routing = c_.rollout.routing_replay;
  ASSIGN_OR_RETURN(r.samples, rollout_->Generate(ids, g));
  for (auto& s : r.samples) {
    if (s.response_length() == 0 ||
        s.response_length() != static_cast<int64_t>(s.logprobs.size())) {
      return absl::InternalError(
          absl::StrCat("rollout returned a malformed sample for prompt ", s.prompt_index));
    }
    s.domain = DomainOf(r.prompts[s.prompt_index]);
  }
  RETURN_IF_ERROR(CheckRouting(r));
  r.seconds = Seconds(t0);
  return r;
}

// Routing replay: every sample's routed_experts covers its fed positions (prompt + response - 1)
// x the student's MoE layers x top_k, with ids of its experts.
absl::Status OpdJob::CheckRouting(const Rollouts& r) const {
  if (!c_.rollout.routing_replay) return absl::OkStatus();
  const lm::ModelConfig& mc = model_->config();
  int64_t layers = 0;
  for (int64_t l = 0; l < mc.num_hidden_layers; ++l) layers += mc.IsMoeLayer(l);
  const int64_t k = mc.num_experts_per_tok;
  for (const auto& s : r.samples) {
    const int64_t positions = static_cast<int64_t>(s.tokens.size()) - 1;
    if (s.routing_layers != layers || s.routing_top_k != k ||
        static_cast<int64_t>(s.routed_experts.size()) != positions * layers * k)
      return absl::InvalidArgumentError(absl::StrCat(
          "rollout.routing_replay: routed_experts of prompt ", s.prompt_index, ", sample ",
          s.sample_index, " holds ", s.routed_experts.size(), " ids as [", s.routing_layers,
          " layers, top_k ", s.routing_top_k, "], expected ", positions, " positions x ", layers,
          " MoE layers x top_k ", k, " (does the worker serve this student's architecture?)"));
    for (int32_t e : s.routed_experts)
      if (e < 0 || e >= mc.num_experts)
        return absl::InvalidArgumentError(
            absl::StrCat("rollout.routing_replay: routed_experts of prompt ", s.prompt_index,
                         " names expert ", e, " of ", mc.num_experts));
  }
  return absl::OkStatus();
}

// Rank 0's samples (or its failure) on every rank; the others pass their drawn prompts.
absl::StatusOr<Rollouts> OpdJob::ShareRollouts(absl::StatusOr<Rollouts> mine) {
  if (group_->size() == 1) return mine;
  std::string verdict = group_->is_root() && !mine.ok() ? std::string(mine.status().message()) : "";
  RETURN_IF_ERROR(group_->BroadcastBytes(&verdict));
  if (!group_->is_root() && !verdict.empty())
    return absl::UnavailableError(absl::StrCat("rank 0: ", verdict));
  if (!mine.ok()) return mine;
  std::string bytes = group_->is_root() ? lm::EncodeSamples(mine->samples) : "";
  RETURN_IF_ERROR(group_->BroadcastBytes(&bytes));
  if (!group_->is_root()) {
    absl::StatusOr<std::vector<lm::Sample>> shared = lm::DecodeSamples(bytes);
    if (!shared.ok())
      return absl::DataLossError(
          absl::StrCat("the step's samples from rank 0: ", shared.status().message()));
    mine->samples = std::move(*shared);
    for (const auto& s : mine->samples) {
      if (s.prompt_index < 0 || static_cast<size_t>(s.prompt_index) >= mine->prompts.size())
        return absl::DataLossError(absl::StrCat("rank 0's samples name prompt ", s.prompt_index,
                                                " of ", mine->prompts.size(),
                                                ": the ranks drew different prompts"));
    }
    RETURN_IF_ERROR(CheckRouting(*mine));
  }
  return mine;
}

// Every rank draws the same prompts; rank 0 samples them (in the background) and shares the
// samples at the step.
std::future<absl::StatusOr<Rollouts>> OpdJob::LaunchSampling() {
  lm::DataCursor after;
  auto prompts = DrawPrompts(&after);
  if (!group_->is_root()) {
    return std::async(std::launch::deferred,
                      [p = std::move(prompts), after]() mutable -> absl::StatusOr<Rollouts> {
                        Rollouts r;
                        r.prompts = std::move(p);
                        r.cursor_after = std::move(after);
                        return r;
                      });
  }
  return std::async(std::launch::async, [this, p = std::move(prompts), after]() mutable {
    return Sample(std::move(p), std::move(after));
  });
}

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

// This step's samples: the prefetched ones (settled by a checkpoint or still being drawn), the
// ones a resumed checkpoint saved (rank 0; the others draw the same prompts), or new ones.
absl::StatusOr<Rollouts> OpdJob::NextRollouts() {
  if (settled_) {
    absl::StatusOr<Rollouts> r = std::move(*settled_);
    settled_.reset();
    return r;
  }
  if (prefetch_) {
    absl::StatusOr<Rollouts> r = prefetch_->get();
    prefetch_.reset();
    return r;
  }
  if (!resumed_samples_) return LaunchSampling().get();
  Rollouts r;
  r.prompts = DrawPrompts(&r.cursor_after);
  r.samples = std::move(*resumed_samples_);
  resumed_samples_.reset();
  if (PromptsHash(r.prompts) != resumed_prompts_hash_)
    return absl::FailedPreconditionError(
        "the checkpoint's prefetched samples answer other prompts than the data now gives (the "
        "prompt files or the mixture changed since): resume from a checkpoint taken without "
        "train.async, or restore the data");
  for (const auto& s : r.samples) {
    if (s.prompt_index < 0 || static_cast<size_t>(s.prompt_index) >= r.prompts.size())
      return absl::DataLossError(absl::StrCat("the checkpoint's prefetched samples name prompt ",
                                              s.prompt_index, " of ", r.prompts.size()));
  }
  RETURN_IF_ERROR(CheckRouting(r));
  return r;
}

// Waits for the prefetched samples so that a checkpoint can hold them. A prefetch that failed
// stays settled as its error: the next step fails as it would have.
void OpdJob::SettlePrefetch() {
  if (!prefetch_) return;
  settled_ = prefetch_->get();
  prefetch_.reset();
}

absl::Status OpdJob::WriteJobFiles(const std::string& dir) const {
  if (!settled_ || !settled_->ok()) return absl::OkStatus();
  return WriteFileAtomic(dir + "/" + kPrefetchedFile, lm::EncodeSamples((*settled_)->samples));
}

// Rank 0 takes the samples a one-step-off checkpoint saved for the next step.
absl::Status OpdJob::LoadPrefetched(const std::string& checkpoint, const nlohmann::json& state) {
  if (!state.contains("prefetched")) return absl::OkStatus();
  if (!c_.train.async) {
    lm::log::Info(
        "the checkpoint holds one-step-off samples; train.async is off, so the next "
        "step samples anew");
    return absl::OkStatus();
  }
  resumed_prompts_hash_ = std::stoull(state.at("prefetched").at("prompts_hash").get<std::string>());
  if (!group_->is_root()) return absl::OkStatus();
  const std::string path = checkpoint + "/" + kPrefetchedFile;
  ASSIGN_OR_RETURN(const std::string bytes, opd::rpc::ReadFile(path));
  absl::StatusOr<std::vector<lm::Sample>> samples = lm::DecodeSamples(bytes);
  if (absl::IsFailedPrecondition(samples.status())) {
    // Another build's samples: what a checkpoint without them does (the prompts are drawn again
    // from the saved cursor and sampled on the resumed weights), said once.
    lm::log::Warn(
        absl::StrCat(path, ": ", samples.status().message(), "; the next step samples anew"));
    return absl::OkStatus();
  }
  if (!samples.ok())
    return absl::DataLossError(absl::StrCat(path, ": ", samples.status().message()));
  resumed_samples_ = std::move(*samples);
  return absl::OkStatus();
}

}  // namespace trainer::opd_detail
