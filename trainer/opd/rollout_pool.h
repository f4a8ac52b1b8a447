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
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "absl/status/statusor.h"
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

class RolloutPool {
 public:
  // Connects to every worker and checks that it serves the student's vocabulary and tokenizer;
  // with push.mode collective or auto, forms a weight group with each (trainer/opd/weight_push.h).
  static absl::StatusOr<std::unique_ptr<RolloutPool>> Connect(
      const std::vector<std::string>& endpoints, const opd::rpc::ClientOptions& base,
      const std::string& tokenizer_fingerprint, int64_t vocab_size,
      const WeightPushOptions& push = {}, torch::Device learner_device = torch::kCPU);

  // Samples `opts.samples_per_prompt` responses per prompt. Prompts are split into contiguous
  // shares, one per worker, sent in parallel; each share's seed is derived from (seed, first
  // prompt index) so a run is reproducible for a fixed number of workers. Returns samples in
  // (prompt, sample) order with global prompt indices, checked as the top of the file says.
  absl::StatusOr<std::vector<lm::Sample>> Generate(const std::vector<std::vector<int32_t>>& prompts,
                                                   const opd::rpc::GenerateOptions& opts);

  // Sends `model`'s parameters to every worker as weight version `version` (in parallel), each in
  // the worker's dtype and only those that changed since its last acknowledged push. An error
  // names the worker and the version.
  absl::Status PushWeights(torch::nn::Module& model, int64_t version);
  // What the last PushWeights sent to each worker (in endpoint order).
  const std::vector<PushReport>& last_push() const { return last_push_; }

  // The sample checks' versions when another pushes (WeightPublisher): `version` was sent (a
  // worker may serve it from now on) and, when `acknowledged`, every worker took it.
  void RecordPush(int64_t version, bool acknowledged);

  // The highest weight version any worker serves (a restarted learner continues above it).
  absl::StatusOr<int64_t> MaxWeightVersion();

  size_t size() const { return clients_.size(); }

 private:
  absl::Status CheckShare(const std::vector<lm::Sample>& samples, size_t prompts,
                          int32_t samples_per_prompt, int64_t min_version, int64_t max_version,
                          const std::string& address) const;

  std::vector<std::unique_ptr<opd::rpc::RolloutClient>> clients_;
  std::vector<std::unique_ptr<WeightPusher>> pushers_;  // one per client
  std::vector<PushReport> last_push_;
  int64_t vocab_size_ = 0;
  // Weight versions: the newest one every worker acknowledged, and the newest one sent (a worker
  // may serve it before the push returns). -1: nothing pushed yet, versions are not checked.
  std::atomic<int64_t> acked_version_{-1}, sent_version_{-1};
};

}  // namespace trainer
