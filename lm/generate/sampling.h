// What generation takes and gives, without tensors: the sampling parameters of a request and
// the samples it produces. Shared by the sampler and the engines (lm/generate/generator.h), the
// rollout's request validation (rollout/generate_request.h) and its wire conversion.
#pragma once

#include <cstdint>
#include <vector>

namespace lm {

struct SamplingParams {
  int64_t samples_per_prompt = 1;
  double temperature = 1.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // >= 1 or <= 0: off
  int64_t max_new_tokens = 16;
  std::vector<int64_t> stop_ids;
  uint64_t seed = 0;
  // Routing replay (R3): record the top-k experts every MoE layer picked for every input
  // position (Sample::routed_experts). Models whose MoE routing is not recordable refuse it.
  bool return_routing = false;
};

enum class FinishReason { kStop, kLength };

struct Sample {
  int64_t prompt_index = 0;
  int64_t sample_index = 0;
  std::vector<int64_t> tokens;  // the response
  std::vector<float> logprobs;  // one per response token
  FinishReason finish = FinishReason::kLength;
  // With return_routing: [positions, routing_layers, routing_top_k] expert ids, positions =
  // prompt length + tokens.size() - 1: every token that was fed to the model (the prompt in the
  // prefill, then each response token but the last, which is drawn and never fed).
  std::vector<int32_t> routed_experts;
  int64_t routing_layers = 0, routing_top_k = 0;
};

}  // namespace lm
