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
  int64_t max_slots = 1024;  // prompts x samples per request
  // The KV cache one request may need: every sequence (prompt x sample) holds prompt +
  // max_new_tokens tokens of kv_bytes_per_token each. 0: no budget.
  int64_t kv_bytes_per_token = 0;
  double max_kv_bytes = 0;
};

// Checks a request against the limits: a KV cache over the budget is RESOURCE_EXHAUSTED naming
// its size, everything else INVALID_ARGUMENT naming the field (and the prompt).
absl::Status Validate(const std::vector<std::vector<int64_t>>& prompts,
                      const lm::SamplingParams& params, const GenerateLimits& limits);

// One Generate call's work, as the request asked for it (not yet validated).
struct GenerateJob {
  std::vector<std::vector<int64_t>> prompts;
  lm::SamplingParams params;
};

// The proto's defaults become the sampler's: samples_per_prompt 0 means 1, an unset temperature
// 1.0, top_p 0 off (1.0).
GenerateJob JobFromRequest(const opd::v1::GenerateRequest& req);

}  // namespace rollout
