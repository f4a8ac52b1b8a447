// opd.v1.Rollout over gRPC: converts messages, checks the secret, and hands work to its generator
// (lm/generate/generator.h) and the weight store. Generations run on their own threads (a bounded
// number); samples are streamed back as they finish.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "lm/generate/generator.h"
#include "lm/generate/sampler.h"
#include "opd/v1/rollout.grpc.pb.h"
#include "rollout/generate_request.h"
#include "rollout/weight_sync.h"
#include "rollout/weights.h"
#include "rpc/auth.h"

namespace rollout {

class EpRollout;

struct ServiceOptions {
  GenerateLimits limits;
  int max_concurrent = 4;  // generations at once; more get RESOURCE_EXHAUSTED
  // What runs every generation (not owned): the paged engine (rollout/engine.h) or, under expert
  // parallelism, the group (rollout/ep_rollout.h); null: the static sampler (lm::StaticSampler).
  lm::Generator* generator = nullptr;
  // The static sampler's largest batch cache, bytes (lm::StaticSampler; 0: one batch a request).
  int64_t static_batch_kv_bytes = 0;
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
  lm::StaticSampler static_sampler_;  // the generator when opts_ names none
  opd::v1::ServiceInfo info_;
  std::atomic<int> running_{0};               // generations in flight
  std::unique_ptr<WeightSyncReceiver> sync_;  // collective weight sync (rollout/weight_sync.h)

 public:
  const WeightSyncReceiver& weight_sync() const { return *sync_; }
};

}  // namespace rollout
