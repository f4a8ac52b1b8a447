// A GenerateRequest as the sampler takes it (prompts and sampling parameters), and the checks a
// request must pass before any sampling starts.
//
// Torch-free on purpose: this is what turns untrusted bytes from the network into work for the
// sampler, so the fuzz build (fuzz/, no LibTorch) exercises exactly the code the rollout
// worker runs (rollout/service.cc; lm/generate/generator.h's generators take its results).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "lm/generate/sampling.h"

namespace opd::v1 {
class GenerateRequest;
}

namespace rollout {

// What a request may ask for; Validate() turns a violation into INVALID_ARGUMENT naming it.
struct GenerateLimits {
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;  // prompt + new tokens
  int64_t max_samples_per_prompt = 64;
  // Prompts x samples per request: a bound on what one request holds in host memory (its
  // prompts, and each finished sample until it is sent), not on the KV cache. The generators
  // queue a request's sequences through their KV cache however many there are.
  int64_t max_slots = 1024;
};

// Checks a request against the limits: INVALID_ARGUMENT naming the field (and the prompt). There
// is no summed KV budget: the generator schedules the sequences through its cache and refuses
// only a sequence that could never fit it (RESOURCE_EXHAUSTED, lm/generate/generator.h).
absl::Status Validate(const std::vector<std::vector<int32_t>>& prompts,
                      const lm::SamplingParams& params, const GenerateLimits& limits);

// One Generate call's work, as the request asked for it (not yet validated).
struct GenerateJob {
  std::vector<std::vector<int32_t>> prompts;
  lm::SamplingParams params;
};

// The proto's defaults become the sampler's: samples_per_prompt 0 means 1, an unset temperature
// 1.0, top_p 0 off (1.0). Prompts' seed_index go to params.seed_indices when any prompt sets one
// (the others keep their position); when none does, seed_indices stays empty (positions).
GenerateJob JobFromRequest(const opd::v1::GenerateRequest& req);

}  // namespace rollout
