#include "rollout/ep_rollout.h"

#include <stdexcept>

#include "nlohmann/json.hpp"

namespace rollout {

std::string EncodeGenerate(const std::vector<std::vector<int64_t>>& prompts,
                           const SamplingParams& params) {
  // Requests are small (token ids); JSON keeps the format obvious. Doubles round-trip exactly.
  nlohmann::json j = {{"prompts", prompts},
                      {"samples_per_prompt", params.samples_per_prompt},
                      {"temperature", params.temperature},
                      {"top_k", params.top_k},
                      {"top_p", params.top_p},
                      {"max_new_tokens", params.max_new_tokens},
                      {"stop_ids", params.stop_ids},
                      {"seed", params.seed}};
  return j.dump();
}

absl::Status DecodeGenerate(const std::string& bytes, std::vector<std::vector<int64_t>>* prompts,
                            SamplingParams* params) {
  try {
    const nlohmann::json j = nlohmann::json::parse(bytes);
    *prompts = j.at("prompts").get<std::vector<std::vector<int64_t>>>();
    params->samples_per_prompt = j.at("samples_per_prompt").get<int64_t>();
    params->temperature = j.at("temperature").get<double>();
    params->top_k = j.at("top_k").get<int64_t>();
    params->top_p = j.at("top_p").get<double>();
    params->max_new_tokens = j.at("max_new_tokens").get<int64_t>();
    params->stop_ids = j.at("stop_ids").get<std::vector<int64_t>>();
    params->seed = j.at("seed").get<uint64_t>();
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(std::string("malformed generate command: ") + e.what());
  }
  return absl::OkStatus();
}

SampleFn LeaderSampler(opd::rpc::EpGroup* group) {
  return [group](const Snapshot& snapshot, const std::vector<std::vector<int64_t>>& prompts,
                 const SamplingParams& params, const std::function<void(Sample)>& on_sample,
                 const std::function<bool()>& cancelled) -> absl::Status {
    return group->Run(EncodeGenerate(prompts, params), [&](const std::string&) {
      return SampleResponses(
                 *snapshot.model, prompts, params, on_sample,
                 [&] { return group->AnyRank(cancelled && cancelled()); }, snapshot.lm_head.get())
          .status();
    });
  };
}

opd::rpc::EpGroup::Work FollowerSampler(opd::rpc::EpGroup* group, WeightStore* store) {
  return [group, store](const std::string& command) -> absl::Status {
    std::vector<std::vector<int64_t>> prompts;
    SamplingParams params;
    if (absl::Status st = DecodeGenerate(command, &prompts, &params); !st.ok())
      throw std::runtime_error(std::string(st.message()));
    const Snapshot snapshot = store->Current();
    return SampleResponses(
               *snapshot.model, prompts, params, [](Sample) {},
               [group] { return group->AnyRank(false); }, snapshot.lm_head.get())
        .status();
  };
}

}  // namespace rollout
