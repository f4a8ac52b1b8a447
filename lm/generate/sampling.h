// What generation takes and gives, without tensors: the sampling parameters of a request and
// the samples it produces (the one sample type of the project). Shared by the sampler and the
// engines (lm/generate/generator.h), the rollout's request validation (rollout/generate_request.h)
// and its wire conversion.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "lm/util/config_fields.h"

namespace lm {

// The one sampling type: what a generator takes, what a GenerateRequest carries (converted once
// each way: rpc/client.cc to the wire, rollout/generate_request.cc from it) and the sampling
// settings of a job config. The settings a config writes are its fields (lm/util/config.h: an
// OPD job's rollout section derives from this struct, so `rollout.temperature` and the rest are
// these); the members after them belong to one request and no config sets them.
struct SamplingParams {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(int64_t, samples_per_prompt) = 1;
  OPD_FIELD(double, temperature) = 1.0;  // 0: greedy (argmax)
  OPD_FIELD(double, top_p) = 1.0;        // >= 1 or <= 0: off
  OPD_FIELD(int64_t, top_k) = 0;         // 0: off
  OPD_FIELD(int64_t, max_new_tokens) = 16;
  // The streams' seed. int64 as every config integer (the wire's uint64 carries the same bits);
  // a job that samples many times (OPD) derives each call's seed from it (lm::MixSeed).
  OPD_FIELD(int64_t, seed) = 0;
  OPD_CONFIG_FIELDS_END;

  // Per request. A sampled stop id ends its sample (and is kept): the tokenizer's end ids.
  std::vector<int32_t> stop_ids;
  // Per prompt, the index its samples' streams are keyed by: sample s of prompt p draws with
  // SampleSeed(seed, SeedIndex(p), s), so a prompt gets the same tokens whatever request,
  // worker or position it is sent in. Empty: each prompt's position in the request.
  std::vector<int64_t> seed_indices;
  // Routing replay (R3): record the top-k experts every MoE layer picked for every input
  // position (Sample::routed_experts). Models whose MoE routing is not recordable refuse it.
  bool return_routing = false;

  int64_t SeedIndex(int64_t prompt) const {
    return seed_indices.empty() ? prompt : seed_indices[static_cast<size_t>(prompt)];
  }
};

enum class FinishReason { kStop, kLength };

// One sampled response with its prompt: the one shape a sample keeps from the generator that
// draws it, through the rollout's reply, the rank broadcast and a checkpoint's prefetched samples,
// to the learner's micro-batches, the teachers' scoring and evaluation. A sequence to score alone
// (no sampler) is a Sample without log-probs (ToScore).
struct Sample {
  int64_t prompt_index = 0;
  int64_t sample_index = 0;
  std::vector<int32_t> tokens;  // the prompt, then the response
  int64_t response_start = 0;   // the prompt's length: where the response begins in `tokens`
  std::vector<float> logprobs;  // the sampler's, one per response token
  int64_t weight_version = 0;   // the weights that drew it
  FinishReason finish = FinishReason::kLength;
  std::string domain;  // the prompt's data domain ("" where none applies)
  // With return_routing: [positions, routing_layers, routing_top_k] expert ids, positions =
  // tokens.size() - 1: every token that was fed to the model (the prompt in the prefill, then
  // each response token but the last, which is drawn and never fed).
  std::vector<int32_t> routed_experts;
  int64_t routing_layers = 0, routing_top_k = 0;

  static Sample ToScore(std::vector<int32_t> tokens, int64_t response_start) {
    Sample s;
    s.tokens = std::move(tokens);
    s.response_start = response_start;
    return s;
  }
  int64_t response_length() const { return static_cast<int64_t>(tokens.size()) - response_start; }
  absl::Span<const int32_t> prompt() const {
    return absl::MakeConstSpan(tokens).subspan(0, static_cast<size_t>(response_start));
  }
  absl::Span<const int32_t> response() const {
    return absl::MakeConstSpan(tokens).subspan(static_cast<size_t>(response_start));
  }
  // Starts the sample of `prompt` (tokens = the prompt; the generator appends the response).
  // `prompt`: any range of ids (the learner's int32 spans; the rollout's int64 prompts).
  template <class Ids>
  void SetPrompt(const Ids& prompt) {
    tokens.assign(prompt.begin(), prompt.end());
    response_start = static_cast<int64_t>(prompt.size());
  }
};

// The samples as bytes (lm/util/bytes.h), for the learner's rank broadcast and the samples a
// one-step-off checkpoint keeps, behind a format tag. Decode checks every count against the bytes
// and every sample's shape (log-probs per response token, response_start in range, the routing's
// size), and fails DATA_LOSS naming the first that is wrong; bytes without this build's tag
// (another format, or not samples) fail FAILED_PRECONDITION.
std::string EncodeSamples(const std::vector<Sample>& samples);
absl::StatusOr<std::vector<Sample>> DecodeSamples(std::string_view bytes);

}  // namespace lm
