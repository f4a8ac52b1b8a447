// The SGLang / vLLM teacher clients (rpc/http_teacher.h) against a fake server that speaks their
// wire format (tests/python/fake_inference_server.py), alone and in a pool: the wire shapes and
// their faults on synthetic log-probs; parity with opd-teacher when the fake serves a real fixture
// model; HTTPS with a CA (and a wrong CA refused); cancellation of a request in flight.
#include "rpc/http_teacher.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <limits>
#include <optional>
#include <thread>

#include "fake_inference_server.h"
#include "lm/io/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/testing.h"
#include "trainer/opd/teacher_pool.h"

namespace {

namespace fs = std::filesystem;
using testing_util::FakeInferenceServer;
using FakeServer = FakeInferenceServer;

float Lp(int t) {
  return -((t % 7) + 1) / 10.0f;
}

std::vector<lm::Sample> Inputs() {
  using testing_util::ToScore;
  return {ToScore({1, 2, 3, 4, 5}, 2), ToScore({9, 8, 7, 6}, 3), ToScore({11, 12}, 1)};
}

opd::rpc::ClientOptions Options(const std::string& ep, absl::Duration timeout = absl::Seconds(10),
                                const std::string& ca_file = "") {
  opd::rpc::ClientOptions o;
  o.address = ep;
  o.timeout = timeout;
  o.tls.ca_file = ca_file;
  return o;
}

absl::StatusOr<std::vector<opd::rpc::ScoreOutput>> ScoreWith(const opd::rpc::ClientOptions& o,
                                                             const std::vector<lm::Sample>& inputs,
                                                             int k = 0, float temp = 1.0f) {
  auto c = opd::rpc::CreateTeacherEndpoint(o);
  if (!c.ok()) return c.status();
  if (auto info = (*c)->Info(); !info.ok()) return info.status();
  opd::rpc::ScoreOptions so;
  so.top_k = k;
  so.temperature = temp;
  return (*c)->Score(inputs, so);
}

absl::StatusOr<std::vector<opd::rpc::ScoreOutput>> ScoreWith(
    const std::string& ep, int k = 0, float temp = 1.0f,
    absl::Duration timeout = absl::Seconds(10)) {
  return ScoreWith(Options(ep, timeout), Inputs(), k, temp);
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

// The canceller ends a request the server holds. The test cancels once the fake has read the
// request (its marker file), and the fake never replies, so the outcome does not depend on speed.
TEST(HttpTeacher, CancelEndsARequestInFlight) {
  for (const char* scheme : {"sglang", "vllm"}) {
    const fs::path marker = testing_util::FreshDir("cancel") / "received";
    FakeServer hang("hang", {"--marker", marker.string()});
    ASSERT_TRUE(hang.ok());
    opd::rpc::ClientOptions o = Options(hang.Endpoint(scheme), absl::Minutes(10));
    o.canceller = std::make_shared<opd::rpc::CallCanceller>();
    auto done = std::async(std::launch::async, [&] { return ScoreWith(o, Inputs()); });
    // A failure bound, not a synchronisation: the marker says the request is being held.
    for (int i = 0; i < 600 && !fs::exists(marker); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(fs::exists(marker)) << scheme << ": the request never reached the server";
    o.canceller->Cancel();
    // libcurl polls the canceller at least once a second while it waits; 30 s is a failure bound.
    ASSERT_EQ(done.wait_for(std::chrono::seconds(30)), std::future_status::ready) << scheme;
    auto out = done.get();
    EXPECT_EQ(out.status().code(), absl::StatusCode::kCancelled) << scheme << ": " << out.status();
    // And later calls fail at once.
    EXPECT_EQ(ScoreWith(o, Inputs()).status().code(), absl::StatusCode::kCancelled);
  }
}

// A CA, a server certificate for 127.0.0.1 signed by it, and another CA that signed nothing,
// made with the openssl CLI.
struct Certs {
  fs::path ca, other_ca, cert, key;
};

bool Shell(const std::string& cmd) {
  return std::system((cmd + " > /dev/null 2>&1").c_str()) == 0;
}

std::optional<Certs> MakeCerts(const fs::path& d) {
  const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string ca_ext =
      " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign";
  Certs c{d / "ca.pem", d / "other_ca.pem", d / "server.pem", d / "server.key"};
  std::ofstream(d / "san.ext") << "subjectAltName=IP:127.0.0.1\n";
  const std::string p = d.string() + "/";
  const bool ok =
      Shell("openssl req -x509" + ec + " -keyout " + p + "ca.key -out " + c.ca.string() +
            " -days 2 -subj /CN=opd-test-ca" + ca_ext) &&
      Shell("openssl req -x509" + ec + " -keyout " + p + "other_ca.key -out " +
            c.other_ca.string() + " -days 2 -subj /CN=opd-other-ca" + ca_ext) &&
      Shell("openssl req" + ec + " -keyout " + c.key.string() + " -out " + p +
            "server.csr -subj /CN=127.0.0.1") &&
      Shell("openssl x509 -req -in " + p + "server.csr -CA " + c.ca.string() + " -CAkey " + p +
            "ca.key -CAcreateserial -days 2 -extfile " + p + "san.ext -out " + c.cert.string());
  if (!ok) return std::nullopt;
  return c;
}

TEST(HttpTeacher, HttpsWithTheServersCaScoresAndAnotherCaIsRefused) {
  if (!Shell("command -v openssl")) GTEST_SKIP() << "no openssl CLI to make certificates";
  auto certs = MakeCerts(testing_util::FreshDir("certs"));
  ASSERT_TRUE(certs.has_value());
  FakeServer tls("ok", {"--tls-cert", certs->cert.string(), "--tls-key", certs->key.string()});
  ASSERT_TRUE(tls.ok()) << tls.Log();
  for (const char* scheme : {"sglang+https", "vllm+https"}) {
    const std::string ep = tls.Endpoint(scheme);
    auto out = ScoreWith(Options(ep, absl::Seconds(10), certs->ca.string()), Inputs(), 2);
    ASSERT_TRUE(out.ok()) << scheme << ": " << out.status();
    ExpectSynthetic(*out, 2);
    // A certificate that the given CA did not sign: refused, and not as a transient failure.
    auto wrong = ScoreWith(Options(ep, absl::Seconds(10), certs->other_ca.string()), Inputs());
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
    EXPECT_NE(wrong.status().message().find(certs->other_ca.string()), std::string::npos)
        << wrong.status();
    trainer::TeacherPoolOptions po;
    po.client = Options("", absl::Seconds(10), certs->other_ca.string());
    auto pool = trainer::TeacherPool::Connect("s", {ep}, {}, po);
    EXPECT_EQ(pool.status().code(), absl::StatusCode::kFailedPrecondition) << pool.status();
    EXPECT_NE(pool.status().message().find(ep), std::string::npos) << pool.status();
  }
  // Plain HTTP to a TLS port is not a reply.
  EXPECT_FALSE(ScoreWith(tls.Endpoint("sglang")).ok());
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

// --- Parity with opd-teacher on a real model ---------------------------------------------------

constexpr const char* kFixture = "moe_tied_topk8";  // vocab 96, tied head, top-8 of 16 experts

std::string FixtureDir() {
  return std::string(OPD_FIXTURES_DIR) + "/" + kFixture;
}

// The fixture's sequences (lengths 7, 13, 20; the 1-token one has nothing to score), each scored
// from a third of its length on, so that SGLang's logprob_start_len is not always 0.
std::vector<lm::Sample> FixtureInputs() {
  std::ifstream in(FixtureDir() + "/inputs.json");
  const auto seqs = nlohmann::json::parse(in)["sequences"].get<std::vector<std::vector<int32_t>>>();
  std::vector<lm::Sample> out;
  for (const auto& s : seqs) {
    if (s.size() < 2) continue;
    out.push_back(lm::Sample::ToScore(s, std::max<int64_t>(1, static_cast<int64_t>(s.size()) / 3)));
  }
  return out;
}

// max|logit| over the fixture's sequences, from transformers' reference logits (make_fixtures.py).
double MaxAbsLogit() {
  auto f = lm::SafetensorsFile::Open(FixtureDir() + "/ref.safetensors");
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return std::numeric_limits<double>::infinity();
  auto t = (*f)->Get("logits");
  EXPECT_TRUE(t.ok() && t->dtype == lm::DType::kF32);
  const float* v = reinterpret_cast<const float*>(t->data);
  double m = 0;
  for (int64_t i = 0; i < t->numel(); ++i) m = std::max(m, std::abs(static_cast<double>(v[i])));
  return m;
}

// The tolerance, from the arithmetic. Both sides compute the same fp32 function (our libtorch
// model code in opd-teacher, transformers' eager modules in the fake), so they differ only in
// reduction orders and kernels. A reordered fp32 sum of n terms differs by about sqrt(n) * eps *
// sum|terms| (random rounding; n * eps at worst). A logit of this model passes through ~700
// accumulations (2 layers of RMSNorm over 48, q/k/v/o projections over 48-64, attention over <= 20
// positions, the router and experts over 48 and 24, the head over 48): sqrt(700) ~ 26, so we allow
// C = 64 times eps relative to the largest logit M / T. log_softmax adds the log-sum-exp's error,
// which is at most the largest logit error (it is 1-Lipschitz in the max norm), hence the 2:
//   |d logprob| <= 2 * C * eps_fp32 * M / T      (~1.5e-5 * M: about 1e-4 for M ~ 7).
double Tolerance(double temperature) {
  constexpr double kC = 64.0;
  const double eps = std::numeric_limits<float>::epsilon();
  return 2.0 * kC * eps * MaxAbsLogit() / temperature;
}

struct Parity {
  double logprob = 0, topk = 0;  // the largest differences seen
  int reordered = 0;             // top-k positions whose ids differ (near-ties only)
  size_t tokens = 0;
};

// `got` against `ref`, per scored token and per top-k entry. Top-k ids may differ only where two
// entries are tied within the tolerance (their order is then the kernels' to choose).
Parity Compare(const std::vector<opd::rpc::ScoreOutput>& ref,
               const std::vector<opd::rpc::ScoreOutput>& got, int k, double tol) {
  Parity p;
  EXPECT_EQ(ref.size(), got.size());
  for (size_t s = 0; s < std::min(ref.size(), got.size()); ++s) {
    p.logprob = std::max(p.logprob, testing_util::MaxAbsDiff(ref[s].logprobs, got[s].logprobs));
    p.topk = std::max(p.topk, testing_util::MaxAbsDiff(ref[s].topk_logprobs, got[s].topk_logprobs));
    p.tokens += ref[s].logprobs.size();
    EXPECT_EQ(ref[s].topk_ids.size(), got[s].topk_ids.size());
    for (size_t j = 0; j < std::min(ref[s].topk_ids.size(), got[s].topk_ids.size()); ++j) {
      if (ref[s].topk_ids[j] == got[s].topk_ids[j]) continue;
      ++p.reordered;
      const auto& lp = ref[s].topk_logprobs;
      const size_t row = j - j % k;
      const bool tie_before = j > row && lp[j - 1] - lp[j] <= 2 * tol;
      const bool tie_after = j + 1 < row + k ? lp[j] - lp[j + 1] <= 2 * tol : true;
      EXPECT_TRUE(tie_before || tie_after)
          << "sequence " << s << " top-k entry " << j << ": id " << got[s].topk_ids[j]
          << " where opd-teacher has " << ref[s].topk_ids[j] << " with no tie";
    }
  }
  return p;
}

TEST(HttpTeacherParity, SglangAndVllmServingAFixtureModelAgreeWithOpdTeacher) {
  const std::string model = FixtureDir() + "/model";
  testing_util::OpdTeacherProcess teacher(model);
  FakeServer fake("ok", {"--model", model});
  ASSERT_TRUE(teacher.ok() && fake.ok()) << fake.Log();
  const auto inputs = FixtureInputs();
  constexpr int kTopK = 5;
  struct Case {
    const char* scheme;
    float temperature;
  };
  for (const Case& c : {Case{"sglang", 1.0f}, Case{"sglang", 0.7f}, Case{"vllm", 1.0f}}) {
    auto ref = ScoreWith(teacher.Options(), inputs, kTopK, c.temperature);
    ASSERT_TRUE(ref.ok()) << ref.status();
    auto got = ScoreWith(Options(fake.Endpoint(c.scheme)), inputs, kTopK, c.temperature);
    ASSERT_TRUE(got.ok()) << c.scheme << ": " << got.status();
    const double tol = Tolerance(c.temperature);
    const Parity p = Compare(*ref, *got, kTopK, tol);
    EXPECT_LE(p.logprob, tol) << c.scheme << " T=" << c.temperature;
    EXPECT_LE(p.topk, tol) << c.scheme << " T=" << c.temperature;
    EXPECT_GT(p.tokens, 20u);
    std::cout << "[parity] " << c.scheme << " T=" << c.temperature << ": " << p.tokens
              << " tokens, max |d logprob| " << p.logprob << ", max |d top-" << kTopK
              << " logprob| " << p.topk << ", reordered top-k ids " << p.reordered << ", tolerance "
              << tol << "\n";
    ::testing::Test::RecordProperty(
        std::string(c.scheme) + "_T" + std::to_string(c.temperature) + "_max_d_logprob",
        std::to_string(p.logprob));
  }
}

}  // namespace
