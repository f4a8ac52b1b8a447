// The rollout client's reading of what a worker sends, where the sizes come from the wire: the
// routing of a sample (positions x routing_layers x routing_top_k ids) is checked without
// multiplying the sizes, so sizes near 2^31 cannot overflow the expected count into one that
// passes. No model: an in-process Rollout service that sends one crafted sample.
#include <gtest/gtest.h>

#include <climits>
#include <vector>

#include "rpc/client.h"
#include "rpc/codec.h"
#include "rpc/server.h"

namespace {

// Sends one sample of a 3-token prompt and 2 response tokens (4 routed positions) with the given
// routing sizes and `ids` expert ids.
class CraftedRouting final : public opd::v1::Rollout::Service {
 public:
  CraftedRouting(int32_t layers, int32_t top_k, size_t ids)
      : layers_(layers), top_k_(top_k), ids_(ids) {}
  grpc::Status Generate(grpc::ServerContext*, const opd::v1::GenerateRequest*,
                        grpc::ServerWriter<opd::v1::Sample>* writer) override {
    opd::v1::Sample m;
    m.add_tokens(5);
    m.add_tokens(6);
    *m.mutable_logprobs() = opd::rpc::PackArray(std::vector<float>{-1.0f, -1.0f});
    m.set_finish_reason(opd::v1::FINISH_REASON_STOP);
    *m.mutable_routed_experts() = opd::rpc::PackArray(std::vector<int32_t>(ids_, 0));
    m.set_routing_layers(layers_);
    m.set_routing_top_k(top_k_);
    writer->Write(m);
    return grpc::Status::OK;
  }

 private:
  int32_t layers_, top_k_;
  size_t ids_;
};

absl::StatusOr<std::vector<lm::Sample>> GenerateFrom(CraftedRouting* service) {
  opd::rpc::ServerOptions so;
  so.listen = "127.0.0.1:0";
  auto running = opd::rpc::StartServer(so, {service}, {"opd.v1.Rollout"});
  if (!running.ok()) return running.status();
  opd::rpc::ClientOptions co;
  co.address = "127.0.0.1:" + std::to_string(running->port);
  auto client = opd::rpc::RolloutClient::Create(co);
  if (!client.ok()) return client.status();
  lm::SamplingParams g;
  g.max_new_tokens = 256;
  g.return_routing = true;
  auto out = (*client)->Generate({{1, 2, 3}}, g);
  running->server->Shutdown(std::chrono::system_clock::now());
  return out;
}

TEST(RolloutClientRouting, RightSizeIsAccepted) {
  CraftedRouting service(2, 2, 16);  // 4 positions x 2 layers x 2
  auto got = GenerateFrom(&service);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].routed_experts.size(), 16u);
}

// 4 x (2^31 - 1)^2 wraps int64 to a negative count, which the size check used to skip: 15 ids
// were accepted as a sample's routing. Now it is DATA_LOSS naming the field and the sizes.
TEST(RolloutClientRouting, SizesThatOverflowTheProductAreRefused) {
  for (const auto& [layers, top_k] : {std::pair<int32_t, int32_t>{INT32_MAX, INT32_MAX},
                                      {INT32_MAX, 2},
                                      {2, INT32_MAX},
                                      {-1, 2},
                                      {2, 0}}) {
    CraftedRouting service(layers, top_k, 15);
    auto got = GenerateFrom(&service);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss)
        << layers << " x " << top_k << ": " << got.status();
    EXPECT_NE(got.status().message().find("routed_experts"), std::string::npos) << got.status();
  }
}

}  // namespace
