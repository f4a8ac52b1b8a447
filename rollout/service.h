// opd.v1.Rollout over gRPC: converts messages, checks the secret, and hands work to the sampler
// and the weight store. Generations run on their own threads (a bounded number); samples are
// streamed back as they finish.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "opd/v1/rollout.grpc.pb.h"
#include "rollout/sampler.h"
#include "rollout/weight_sync.h"
#include "rollout/weights.h"
#include "rpc/auth.h"

namespace rollout {

class Engine;
class EpRollout;

// A static sampler call (SampleResponses' contract) for a request on `snapshot`.
using SampleFn = std::function<absl::Status(
    const Snapshot& snapshot, const std::vector<std::vector<int64_t>>& prompts,
    const SamplingParams& params, const std::function<void(Sample)>& on_sample,
    const std::function<bool()>& cancelled)>;

struct ServiceOptions {
  GenerateLimits limits;
  int max_concurrent = 4;  // generations at once; more get RESOURCE_EXHAUSTED
  // When set (not owned), generations run on the continuous-batching engine (rollout/engine.h);
  // else each on the static sampler (SampleResponses).
  Engine* engine = nullptr;
  // When set (and no engine), the static sampler's calls go through it: expert parallelism runs
  // each request on every rank (rollout/ep_rollout.h).
  SampleFn sample;
  // Expert parallelism (not owned): UpdateWeights streams go to every rank through it.
  EpRollout* expert_parallel = nullptr;
};

class RolloutService final : public opd::v1::Rollout::CallbackService {
 public:
  // `store` and `auth` are not owned and must outlive the service.
  RolloutService(WeightStore* store, const opd::rpc::Authenticator* auth, ServiceOptions opts,
                 opd::v1::ServiceInfo info);
  ~RolloutService() override;

  grpc::ServerWriteReactor<opd::v1::Sample>* Generate(grpc::CallbackServerContext* ctx,
                                                      const opd::v1::GenerateRequest* req) override;
  grpc::ServerReadReactor<opd::v1::WeightChunk>* UpdateWeights(
      grpc::CallbackServerContext* ctx, opd::v1::UpdateWeightsResponse* resp) override;
  grpc::ServerUnaryReactor* JoinWeightGroup(grpc::CallbackServerContext* ctx,
                                            const opd::v1::JoinWeightGroupRequest* req,
                                            opd::v1::JoinWeightGroupResponse* resp) override;
  grpc::ServerUnaryReactor* SyncWeights(grpc::CallbackServerContext* ctx,
                                        const opd::v1::SyncWeightsRequest* req,
                                        opd::v1::SyncWeightsResponse* resp) override;
  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx, const opd::v1::InfoRequest* req,
                                 opd::v1::ServiceInfo* resp) override;

 private:
  WeightStore* store_;
  const opd::rpc::Authenticator* auth_;
  ServiceOptions opts_;
  opd::v1::ServiceInfo info_;
  std::atomic<int> running_{0};               // generations in flight
  std::unique_ptr<WeightSyncReceiver> sync_;  // collective weight sync (rollout/weight_sync.h)

 public:
  const WeightSyncReceiver& weight_sync() const { return *sync_; }
};

}  // namespace rollout
