// An opd.v1.Rollout service in the test's own process over its own weight store, on loopback with
// a secret: the weight push tests read the store's weights after a push (weight_sync_test,
// weight_publish_test). The model is the moe_tied_topk8 fixture's (vocab 96, 256 positions).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/model/model.h"
#include "rollout/service.h"
#include "rollout/weights.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "rpc/tensor_codec.h"

namespace testing_util {

class LocalRollout {
 public:
  // Serves `model`, whose parameters are in `dtype`, accepting `secret`.
  LocalRollout(std::shared_ptr<lm::CausalLM> model, torch::Dtype dtype, const std::string& secret)
      : store_(std::move(model)), auth_(secret), service_(&store_, &auth_, Options(), Info(dtype)) {
    opd::rpc::ServerOptions so;
    so.has_secret = true;
    auto running = opd::rpc::StartServer(so, {&service_}, {"opd.v1.Rollout"});
    EXPECT_TRUE(running.ok()) << running.status();
    if (running.ok()) {
      server_ = std::move(*running);
      address_ = "127.0.0.1:" + std::to_string(server_.port);
    }
  }
  ~LocalRollout() {
    if (server_.server) server_.server->Shutdown();
  }
  LocalRollout(const LocalRollout&) = delete;
  LocalRollout& operator=(const LocalRollout&) = delete;

  const std::string& address() const { return address_; }
  rollout::WeightStore& store() { return store_; }
  const rollout::WeightSyncReceiver& sync() const { return service_.weight_sync(); }

 private:
  static rollout::ServiceOptions Options() {
    rollout::ServiceOptions o;
    o.limits.vocab_size = 96;
    o.limits.max_seq_len = 256;
    return o;
  }
  static opd::v1::ServiceInfo Info(torch::Dtype dtype) {
    opd::v1::ServiceInfo i;
    i.set_service("opd.v1.Rollout");
    i.set_vocab_size(96);
    i.set_dtype(opd::rpc::DtypeName(dtype));
    return i;
  }

  rollout::WeightStore store_;
  opd::rpc::Authenticator auth_;
  rollout::RolloutService service_;
  opd::rpc::RunningServer server_;
  std::string address_;
};

}  // namespace testing_util
