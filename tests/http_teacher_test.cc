// The SGLang / vLLM teacher clients (rpc/http_teacher.h) against a fake server that speaks their
// wire format (tests/python/fake_inference_server.py, synthetic log-probs), alone and in a pool.
#include "rpc/http_teacher.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "child_process.h"
#include "trainer/opd/teacher_pool.h"

namespace {

float Lp(int t) {
  return -((t % 7) + 1) / 10.0f;
}

struct FakeServer {
  std::string port_file;
  std::unique_ptr<testing_util::ChildProcess> proc;
  std::string port;
  explicit FakeServer(const std::string& mode) {
    static int n = 0;
    const std::string dir = ::testing::TempDir();
    port_file = dir + "/fake_port_" + std::to_string(getpid()) + "_" + std::to_string(n++);
    std::filesystem::remove(port_file);
    proc = std::make_unique<testing_util::ChildProcess>(
        std::vector<std::string>{
            OPD_PYTHON, OPD_SOURCE_DIR "/tests/python/fake_inference_server.py", port_file, mode},
        port_file + ".log");
    for (int i = 0; i < 200 && !std::filesystem::exists(port_file); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::ifstream(port_file) >> port;
  }
  std::string Endpoint(const std::string& scheme) const { return scheme + "://127.0.0.1:" + port; }
};

std::vector<opd::rpc::ScoreInput> Inputs() {
  return {{{1, 2, 3, 4, 5}, 2}, {{9, 8, 7, 6}, 3}, {{11, 12}, 1}};
}

absl::StatusOr<std::vector<opd::rpc::ScoreOutput>> ScoreWith(
    const std::string& ep, int k = 0, float temp = 1.0f,
    absl::Duration timeout = absl::Seconds(10)) {
  opd::rpc::ClientOptions o;
  o.address = ep;
  o.timeout = timeout;
  auto c = opd::rpc::CreateTeacherEndpoint(o);
  if (!c.ok()) return c.status();
  if (auto info = (*c)->Info(); !info.ok()) return info.status();
  opd::rpc::ScoreOptions so;
  so.top_k = k;
  so.temperature = temp;
  return (*c)->Score(Inputs(), so);
}

void ExpectSynthetic(const std::vector<opd::rpc::ScoreOutput>& out, int k) {
  auto in = Inputs();
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const size_t n = in[i].tokens.size() - in[i].response_start;
    ASSERT_EQ(out[i].logprobs.size(), n) << i;
    for (size_t p = 0; p < n; ++p)
      EXPECT_FLOAT_EQ(out[i].logprobs[p], Lp(in[i].tokens[in[i].response_start + p]));
    ASSERT_EQ(out[i].topk_ids.size(), n * k);
    for (size_t p = 0; p < n * k; ++p) EXPECT_EQ(out[i].topk_ids[p], 7 * static_cast<int>(p % k));
  }
}

TEST(HttpTeacher, ParsesSchemes) {
  opd::rpc::HttpTeacherKind kind;
  std::string base;
  ASSERT_TRUE(opd::rpc::ParseHttpTeacherEndpoint("sglang+https://h:1/", &kind, &base));
  EXPECT_EQ(kind, opd::rpc::HttpTeacherKind::kSglang);
  EXPECT_EQ(base, "https://h:1");
  ASSERT_TRUE(opd::rpc::ParseHttpTeacherEndpoint("vllm://h:2", &kind, &base));
  EXPECT_EQ(kind, opd::rpc::HttpTeacherKind::kVllm);
  EXPECT_EQ(base, "http://h:2");
  EXPECT_FALSE(opd::rpc::ParseHttpTeacherEndpoint("h:3", &kind, &base));
}

TEST(HttpTeacher, SglangAndVllmScores) {
  FakeServer s("ok");
  for (const char* scheme : {"sglang", "vllm"}) {
    for (int k : {0, 3}) {
      auto out = ScoreWith(s.Endpoint(scheme), k);
      ASSERT_TRUE(out.ok()) << scheme << ": " << out.status();
      ExpectSynthetic(*out, k);
    }
  }
}

TEST(HttpTeacher, VllmRefusesTemperature) {
  FakeServer s("ok");
  auto out = ScoreWith(s.Endpoint("vllm"), 0, 0.7f);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_TRUE(ScoreWith(s.Endpoint("sglang"), 0, 0.7f).ok());
}

TEST(HttpTeacher, MalformedRepliesRefused) {
  FakeServer shrt("short"), reorder("reorder");
  auto a = ScoreWith(shrt.Endpoint("sglang"));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss) << a.status();
  EXPECT_NE(a.status().message().find("input_token_logprobs"), std::string::npos) << a.status();
  auto b = ScoreWith(shrt.Endpoint("vllm"));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDataLoss) << b.status();
  EXPECT_NE(b.status().message().find("choices"), std::string::npos) << b.status();
  // Choices out of order are matched by index.
  auto c = ScoreWith(reorder.Endpoint("vllm"), 2);
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectSynthetic(*c, 2);
}

TEST(HttpTeacher, TransportErrors) {
  FakeServer e500("error500"), slow("slow"), drop("drop");
  EXPECT_EQ(ScoreWith(e500.Endpoint("sglang")).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ScoreWith(slow.Endpoint("vllm"), 0, 1.0f, absl::Milliseconds(500)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  auto d = ScoreWith(drop.Endpoint("sglang"));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable) << d.status();
}

trainer::TeacherPoolOptions PoolOpts() {
  trainer::TeacherPoolOptions o;
  o.backoff_initial = absl::Milliseconds(1);
  o.readmit_after = absl::Seconds(60);
  o.client.timeout = absl::Seconds(10);
  return o;
}

TEST(HttpTeacherPool, NonFiniteRefusedByValidation) {
  FakeServer nan("nan"), m9999("minus9999");
  for (const auto& ep : {nan.Endpoint("sglang"), m9999.Endpoint("vllm")}) {
    auto pool = trainer::TeacherPool::Connect("s", {ep}, {}, PoolOpts());
    ASSERT_TRUE(pool.ok()) << pool.status();
    auto out = (*pool)->Score(Inputs(), {});
    EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss) << out.status();
    EXPECT_NE(out.status().message().find(ep), std::string::npos) << out.status();
  }
}

TEST(HttpTeacherPool, FailsOverFrom500) {
  FakeServer bad("error500"), good("ok");
  auto pool = trainer::TeacherPool::Connect("s", {bad.Endpoint("sglang"), good.Endpoint("vllm")},
                                            {}, PoolOpts());
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto out = (*pool)->Score(Inputs(), {});
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectSynthetic(*out, 0);
  EXPECT_GE((*pool)->failovers(), 1);
  EXPECT_EQ((*pool)->healthy_count(), 1);
}

}  // namespace
