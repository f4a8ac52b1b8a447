// The student rollout workers: sampling spread over all of them, versioned weight pushes to all.
//
// Everything a worker sends back is checked before the learner uses it: every (prompt, sample)
// pair exactly once with prompt_index and sample_index in range, a non-empty response of token
// ids inside the vocabulary, one finite log-prob <= 0 per token, and a weight_version between
// the last version every worker acknowledged when the call started and the newest version sent
// when it ended. A violation is a DATA_LOSS error naming the worker, the sample and the field.
// Calls take the ClientOptions' canceller, so a stop request ends them at once.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "lm/generate/sampling.h"
#include "rpc/client.h"
#include "trainer/opd/opd_config.h"
#include "trainer/opd/weight_push.h"

namespace trainer {

// What a step's samples say about the sampler: how many weight versions behind the learner they
// were drawn (one-step-off sampling makes this 1), and how many hit max_new_tokens.
struct SampleStats {
  double staleness_mean = 0, staleness_max = 0;
  double truncated_frac = 0;
};
SampleStats SummarizeSamples(const std::vector<lm::Sample>& samples, int64_t learner_version);

// The weight push settings of the rollout section (validated by ValidateOpdConfig).
WeightPushOptions PushOptionsOf(const OpdRolloutConfig& r);

// A prompt to sample and the index that names it in its step (or its held-out set).
struct IndexedPrompt {
  int64_t index = 0;
  absl::Span<const int32_t> tokens;  // the prompt where the step holds it (never copied here)
};

class RolloutPool {
 public:
  // Connects to every worker and checks that it serves the student's vocabulary and tokenizer.
  // Weights reach the workers through trainer/opd/weight_push.h (WeightPublisher), which tells
  // the pool each version it pushed (RecordPush) for the sample checks.
  static absl::StatusOr<std::unique_ptr<RolloutPool>> Connect(
      const std::vector<std::string>& endpoints, const opd::rpc::ClientOptions& base,
      const std::string& tokenizer_fingerprint, int64_t vocab_size);

  // Samples `params.samples_per_prompt` responses for every prompt and hands each sample to
  // `on_sample` as it arrives (from the workers' call threads, possibly at once; every (prompt,
  // sample) exactly once, its prompt_index the prompt's `index`, checked as the top of the file
  // says). Prompt i goes to worker index % W, so that every rank's share spreads over every
  // worker; its samples draw from the seed stream of (params.seed, index), so they do not depend on
  // which worker or call samples them. A call that fails transiently (the worker went away, a
  // deadline, an internal error) has its unfinished prompts sent again, to the next worker that
  // has not failed, up to `max_rounds` rounds; samples already received are kept and a repeat is
  // dropped, so nothing is counted twice. Other errors, a round limit reached or every worker
  // failed end the call with the error naming the worker.
  absl::Status Stream(const std::vector<IndexedPrompt>& prompts, const lm::SamplingParams& params,
                      const std::function<void(lm::Sample)>& on_sample, int max_rounds = 3);
  // Stream, collected in (prompt, sample) order.
  absl::StatusOr<std::vector<lm::Sample>> Generate(const std::vector<IndexedPrompt>& prompts,
                                                   const lm::SamplingParams& params);
  // Calls to workers that were retried elsewhere (over all Stream calls).
  int64_t failovers() const { return failovers_.load(); }

  // The sample checks' versions when weights are pushed (WeightPublisher): `version` was sent (a
  // worker may serve it from now on) and, when `acknowledged`, every worker took it.
  void RecordPush(int64_t version, bool acknowledged);

  // The highest weight version any worker serves (a restarted learner continues above it).
  absl::StatusOr<int64_t> MaxWeightVersion();
  // Version `v` reached every worker (pushed by another rank): samples are checked against it.
  void NoteVersions(int64_t v);

  size_t size() const { return clients_.size(); }

 private:
  struct Round;
  // One sample against the contract at the top of the file (the version range of the call).
  absl::Status CheckSample(const lm::Sample& s, int32_t samples_per_prompt, int64_t min_version,
                           const std::string& address) const;
  // One worker's call of a round: its prompts, the samples it sends (new ones to `on_sample`).
  absl::Status CallWorker(size_t worker, const std::vector<size_t>& which, Round& round,
                          const lm::SamplingParams& params,
                          const std::function<void(lm::Sample)>& on_sample);
  // One round: a call per worker with prompts in `by_worker`, each collected before returning.
  // The first error that is not failed over ends the round.
  absl::Status RunRound(const std::vector<std::vector<size_t>>& by_worker, Round& round,
                        const lm::SamplingParams& params,
                        const std::function<void(lm::Sample)>& on_sample);
  // A transient failure of `worker` (not a stop, not a bad reply): marks it failed, counts and
  // logs the failover, and returns true, so its unfinished prompts go to the next round.
  bool FailOver(size_t worker, const absl::Status& st, Round& round);

  std::vector<std::unique_ptr<opd::rpc::RolloutClient>> clients_;
  int64_t vocab_size_ = 0;
  // Weight versions: the newest one every worker acknowledged, and the newest one sent (a worker
  // may serve it before the push returns). -1: nothing pushed yet, versions are not checked.
  std::atomic<int64_t> acked_version_{-1}, sent_version_{-1};
  std::atomic<int64_t> failovers_{0};
  std::shared_ptr<opd::rpc::CallCanceller> canceller_;  // a stop: failures are not retried
};

}  // namespace trainer
