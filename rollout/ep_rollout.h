// opd-rollout under expert parallelism (rpc/ep_group.h), on the static sampler (the paged engine
// is single-process): rank 0 sends each Generate request (prompts and sampling parameters, seed
// included) to the followers as one command, and every rank runs SampleResponses on it with its
// own shard of the weights. The computation is the same on every rank (the MoE all-reduces give
// every rank the same bytes, the sampling is seeded per sample), so every rank draws the same
// tokens, takes the same number of decode steps and pairs its collectives with the others'; only
// rank 0 streams samples back. Cancellation (the client left) is agreed on at every decode step
// (one tiny all-reduce), so that all ranks stop at the same step.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "rollout/sampler.h"
#include "rollout/service.h"
#include "rollout/weights.h"
#include "rpc/ep_group.h"

namespace rollout {

// Rank 0's static sampler: each call runs on the whole group.
SampleFn LeaderSampler(opd::rpc::EpGroup* group);
// A follower's work: samples each request rank 0 sends with `store`'s current weights, and drops
// the samples.
opd::rpc::EpGroup::Work FollowerSampler(opd::rpc::EpGroup* group, WeightStore* store);

// The wire form of one request.
std::string EncodeGenerate(const std::vector<std::vector<int64_t>>& prompts,
                           const SamplingParams& params);
absl::Status DecodeGenerate(const std::string& bytes, std::vector<std::vector<int64_t>>* prompts,
                            SamplingParams* params);

}  // namespace rollout
