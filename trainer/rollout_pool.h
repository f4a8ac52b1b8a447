// The student rollout workers: sampling spread over all of them, versioned weight pushes to all.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "absl/status/statusor.h"
#include "rpc/client.h"

namespace opd {

class RolloutPool {
 public:
  // Connects to every worker and checks that it serves the student's vocabulary and tokenizer.
  static absl::StatusOr<std::unique_ptr<RolloutPool>> Connect(
      const std::vector<std::string>& endpoints, const rpc::ClientOptions& base,
      const std::string& tokenizer_fingerprint, int64_t vocab_size);

  // Samples `opts.samples_per_prompt` responses per prompt. Prompts are split into contiguous
  // shares, one per worker, sent in parallel; each share's seed is derived from (seed, first
  // prompt index) so a run is reproducible for a fixed number of workers. Returns samples in
  // (prompt, sample) order with global prompt indices.
  absl::StatusOr<std::vector<rpc::GeneratedSample>> Generate(
      const std::vector<std::vector<int32_t>>& prompts, const rpc::GenerateOptions& opts);

  // Sends every parameter of `model` to every worker as weight version `version` (in parallel).
  absl::Status PushWeights(torch::nn::Module& model, int64_t version);

  // The highest weight version any worker serves (a restarted learner continues above it).
  absl::StatusOr<int64_t> MaxWeightVersion();

  size_t size() const { return clients_.size(); }

 private:
  std::vector<std::unique_ptr<rpc::RolloutClient>> clients_;
};

}  // namespace opd
