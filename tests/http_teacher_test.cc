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
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "fake_inference_server.h"
#include "lm/io/safetensors.h"
#include "lm/util/config.h"
#include "nlohmann/json.hpp"
#include "tests/testing.h"
#include "trainer/opd/opd_config.h"
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

absl::StatusOr<std::vector<lm::SequenceScore>> ScoreWith(const opd::rpc::ClientOptions& o,
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

absl::StatusOr<std::vector<lm::SequenceScore>> ScoreWith(
    const std::string& ep, int k = 0, float temp = 1.0f,
    absl::Duration timeout = absl::Seconds(10)) {
  return ScoreWith(Options(ep, timeout), Inputs(), k, temp);
}

void ExpectSynthetic(const std::vector<lm::SequenceScore>& out, int k) {
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

// opd-ctl run with `args`: its exit code and its output (stdout and stderr).
struct CtlRun {
  int code = -1;
  std::string output;
};

CtlRun RunCtl(const std::vector<std::string>& args) {
  static int n = 0;
  const auto log = testing_util::FreshDir("ctl") / ("ctl" + std::to_string(n++) + ".log");
  std::vector<std::string> argv = {std::string(OPD_BINARY_DIR) + "/ctl/opd-ctl"};
  argv.insert(argv.end(), args.begin(), args.end());
  testing_util::ChildProcess p(argv, log.string());
  CtlRun r;
  r.code = p.Wait(std::chrono::seconds(120));
  r.output = p.Log();
  return r;
}

TEST(HttpTeacher, ParsesSchemes) {
  auto a = opd::rpc::ParseHttpTeacherAddress("sglang+https://h:1/");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->kind, opd::rpc::HttpTeacherKind::kSglang);
  EXPECT_EQ(a->base_url, "https://h:1");
  EXPECT_TRUE(a->has_tokenizer);
  auto b = opd::rpc::ParseHttpTeacherAddress("vllm://h:2");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->kind, opd::rpc::HttpTeacherKind::kVllm);
  EXPECT_EQ(b->base_url, "http://h:2");
  EXPECT_FALSE(opd::rpc::IsHttpTeacherEndpoint("h:3"));
  EXPECT_FALSE(opd::rpc::ParseHttpTeacherAddress("h:3").ok());
  // The one option: a server without a tokenizer.
  auto c = opd::rpc::ParseHttpTeacherAddress("sglang://h:4/?tokenizer=none");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->base_url, "http://h:4");
  EXPECT_FALSE(c->has_tokenizer);
  for (const char* bad : {"vllm://h:5?tokenizer=yes", "sglang://?tokenizer=none", "vllm://"}) {
    EXPECT_TRUE(opd::rpc::IsHttpTeacherEndpoint(bad)) << bad;
    auto r = opd::rpc::ParseHttpTeacherAddress(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status();
  }
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
    // opd-ctl takes the TLS variants with --tls-ca.
    const CtlRun info = RunCtl({"info", "--addr", ep, "--tls-ca", certs->ca.string()});
    EXPECT_EQ(info.code, 0) << info.output;
    EXPECT_NE(info.output.find("\"architecture\":"), std::string::npos) << info.output;
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

// --- Replies checked field by field, and bounded -------------------------------------------------

// Each malformed reply of the fake (a field missing, mistyped or out of range) is DATA_LOSS naming
// the endpoint and the field, never a crash (a vLLM top-k entry without "logprob" aborted the
// learner) and never a wrong number (a key "5abc" read as id 5, an id of 2^32 + 5 as 5).
TEST(HttpTeacher, EveryReplyFieldIsCheckedBeforeUse) {
  struct Case {
    const char* mode;
    const char* field;  // what the message must name
  };
  const Case cases[] = {{"vllm_no_logprob", "logprob"},
                        {"vllm_logprob_string", "logprob"},
                        {"vllm_no_rank", "rank"},
                        {"vllm_key_junk", "abc"},
                        {"vllm_key_big", "4294967296"},
                        {"vllm_rank_repeated", "rank"},
                        {"vllm_choice_not_object", "choices[0]"},
                        {"sglang_id_big", "input_top_logprobs"},
                        {"sglang_id_string", "input_top_logprobs"},
                        {"sglang_meta_not_object", "meta_info"},
                        {"sglang_item_not_object", "meta_info"},
                        {"sglang_logprob_string", "input_token_logprobs"}};
  for (const Case& c : cases) {
    FakeServer s(c.mode);
    ASSERT_TRUE(s.ok()) << c.mode;
    const std::string ep = s.Endpoint(absl::StartsWith(c.mode, "vllm") ? "vllm" : "sglang");
    auto out = ScoreWith(ep, 2);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss) << c.mode << ": " << out.status();
    const std::string msg(out.status().message());
    EXPECT_NE(msg.find(ep), std::string::npos) << c.mode << ": " << msg;
    EXPECT_NE(msg.find(c.field), std::string::npos) << c.mode << ": " << msg;
  }
}

// A body that is not JSON is the server's fault and would come back the same: DATA_LOSS, which
// the pool does not retry (INTERNAL was retried max_attempts times).
TEST(HttpTeacher, ReplyThatIsNotJsonIsDataLoss) {
  FakeServer s("notjson");
  for (const char* scheme : {"sglang", "vllm"}) {
    auto out = ScoreWith(s.Endpoint(scheme));
    EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss) << scheme << ": " << out.status();
    EXPECT_FALSE(trainer::IsTransient(out.status()));
  }
}

// Peak resident memory since the last reset, in bytes (Linux: VmHWM; reset by clear_refs 5).
int64_t PeakRssBytes(bool reset) {
  if (reset) std::ofstream("/proc/self/clear_refs") << "5";
  std::ifstream in("/proc/self/status");
  for (std::string key; in >> key;) {
    int64_t kb = 0;
    if (key == "VmHWM:" && in >> kb) return kb * 1024;
  }
  return -1;
}

// The bound of a score reply, by hand: Inputs() has 5 + 4 + 2 tokens; with k = 2 each position
// has 3 entries.
TEST(HttpTeacher, ReplyBoundIsTheRequestsEntries) {
  const auto in = Inputs();
  EXPECT_EQ(opd::rpc::ReplyBytesBound(in, 0, in.size(), 2),
            opd::rpc::kReplyFixedBytes + 3 * opd::rpc::kReplySequenceBytes +
                11 * 3 * opd::rpc::kMaxReplyEntryBytes);
  EXPECT_EQ(opd::rpc::ReplyBytesBound(in, 1, 2, 0), opd::rpc::kReplyFixedBytes +
                                                        opd::rpc::kReplySequenceBytes +
                                                        4 * opd::rpc::kMaxReplyEntryBytes);
}

// A reply announcing 3 GB, and a chunked one that never ends, are refused once past what the
// request can return (here ~80 KiB): DATA_LOSS, and the client's memory does not grow with them.
// The fake sends as fast as loopback allows, so an unbounded client would take GBs in the 60 s
// timeout; 64 MiB is far above the bound and far below that.
TEST(HttpTeacher, ReplyBodyIsBoundedByTheRequest) {
  for (const char* mode : {"hugelength", "endless"}) {
    FakeServer s(mode);
    ASSERT_TRUE(s.ok()) << mode;
    for (const char* scheme : {"sglang", "vllm"}) {
      const int64_t before = PeakRssBytes(/*reset=*/true);
      auto out = ScoreWith(s.Endpoint(scheme), 2, 1.0f, absl::Seconds(60));
      const int64_t grew = PeakRssBytes(false) - before;
      EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss)
          << mode << " " << scheme << ": " << out.status();
      EXPECT_NE(out.status().message().find("larger than"), std::string::npos) << out.status();
      EXPECT_LT(grew, int64_t{64} << 20) << mode << " " << scheme;
    }
  }
}

// Ids of the right type but outside the student's vocabulary are refused by the pool.
TEST(HttpTeacherPool, TopKIdOutsideTheVocabularyRefused) {
  FakeServer s("sglang_id_vocab");
  const std::string ep = s.Endpoint("sglang");
  auto pool = trainer::TeacherPool::Connect("s", {ep}, {"", 96}, PoolOpts());
  ASSERT_TRUE(pool.ok()) << pool.status();
  opd::rpc::ScoreOptions so;
  so.top_k = 2;
  auto out = (*pool)->Score(Inputs(), so);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss) << out.status();
  EXPECT_NE(out.status().message().find("outside the vocabulary"), std::string::npos)
      << out.status();
}

// --- Connect-time checks of what the stage will ask ----------------------------------------------

trainer::TeacherRequirements Scoring(float temperature, int top_k, int64_t prompt = 0,
                                     int64_t response = 0) {
  trainer::TeacherRequirements req;
  req.temperature = temperature;
  req.top_k = top_k;
  req.max_prompt_len = prompt;
  req.max_new_tokens = response;
  return req;
}

absl::Status ConnectWith(const std::string& ep, const trainer::TeacherRequirements& req) {
  return trainer::TeacherPool::Connect("stage_x", {ep}, req, PoolOpts()).status();
}

// vLLM cannot scale prompt log-probs: a teacher temperature other than 1 is refused at connect
// (a stage start or a swap), not when the stage first scores.
TEST(HttpTeacherConnect, VllmRefusedAtATemperatureOtherThanOne) {
  FakeServer s("ok");
  const std::string ep = s.Endpoint("vllm");
  EXPECT_TRUE(ConnectWith(ep, Scoring(1.0f, 0)).ok());
  const absl::Status st = ConnectWith(ep, Scoring(0.7f, 0));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("stage_x"), std::string::npos) << st;
  EXPECT_NE(st.message().find("vLLM"), std::string::npos) << st;
}

// SGLang at T != 1 must show on a probe that it scales its log-probs: the synthetic fake does (as
// a server with temperature-scaled input log-probs would), the notemp one scores at T = 1 whatever
// it is asked (stock SGLang) and is refused.
TEST(HttpTeacherConnect, SglangMustApplyTheTemperature) {
  FakeServer scales("ok"), ignores("notemp");
  for (float t : {0.7f, 1.5f}) {
    EXPECT_TRUE(ConnectWith(scales.Endpoint("sglang"), Scoring(t, 0)).ok()) << t;
    EXPECT_TRUE(ConnectWith(scales.Endpoint("sglang"), Scoring(t, 3)).ok()) << t;
    const absl::Status st = ConnectWith(ignores.Endpoint("sglang"), Scoring(t, 0));
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("does not apply"), std::string::npos) << st;
  }
  // At T = 1 there is nothing to check.
  EXPECT_TRUE(ConnectWith(ignores.Endpoint("sglang"), Scoring(1.0f, 0)).ok());
}

// A vLLM started with its default --max-logprobs (20) cannot serve loss.top_k 64: refused at
// connect, naming the flag, instead of failing the first step with HTTP 400.
TEST(HttpTeacherConnect, TopKAboveTheServersLimitRefusedNamingTheFlag) {
  FakeServer s("ok", {"--max-logprobs", "20"});
  const std::string ep = s.Endpoint("vllm");
  EXPECT_TRUE(ConnectWith(ep, Scoring(1.0f, 20)).ok());
  const absl::Status st = ConnectWith(ep, Scoring(1.0f, 64));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("--max-logprobs 64"), std::string::npos) << st;
  EXPECT_NE(st.message().find(ep), std::string::npos) << st;
}

// A context shorter than prompts.max_prompt_len + rollout.max_new_tokens is refused at connect,
// naming both. The fake, as vLLM, refuses a sequence of exactly max_model_len tokens (a request
// must leave room for one token), so the longest sequence it scores is max_model_len - 1.
TEST(HttpTeacherConnect, ContextShorterThanTheStagesSequencesRefused) {
  FakeServer s("ok", {"--max-model-len", "4096"});
  for (const char* scheme : {"sglang", "vllm"}) {
    const std::string ep = s.Endpoint(scheme);
    EXPECT_TRUE(ConnectWith(ep, Scoring(1.0f, 0, 2048, 2047)).ok()) << scheme;
    const absl::Status st = ConnectWith(ep, Scoring(1.0f, 0, 2048, 2048));
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("at most 4095 tokens"), std::string::npos) << st;
    EXPECT_NE(st.message().find("2048 + 2048 = 4096"), std::string::npos) << st;
    // What the check assumes of the server: 4095 tokens are scored, 4096 refused.
    std::vector<int32_t> longest(4095, 3);
    auto ok = ScoreWith(Options(ep), {lm::Sample::ToScore(longest, 4000)});
    EXPECT_TRUE(ok.ok()) << ok.status();
    longest.push_back(3);
    auto refused = ScoreWith(Options(ep), {lm::Sample::ToScore(longest, 4000)});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  }
}

// The tokenize requests a fake has answered (its --tokenize-log file).
int TokenizeRequests(const fs::path& log) {
  std::ifstream in(log);
  int n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// /tokenize: a 5xx is retried (a server starting up is not a server without a tokenizer); a 4xx
// other than 404 refuses the endpoint, unless it says it has no tokenizer (?tokenizer=none: then
// it is not asked); a 404 (no /tokenize) lets it through with a warning, as before.
TEST(HttpTeacherConnect, TokenizerProbeRetries5xxAndRefuses4xx) {
  trainer::TeacherRequirements req;
  req.probe_text = trainer::kTokenizerProbe;
  req.probe_ids = {1, 2, 3};
  const trainer::TeacherPoolOptions po = PoolOpts();
  const auto dir = testing_util::FreshDir("tokenize");
  auto fake = [&](const std::string& tag, const std::vector<std::string>& flags) {
    std::vector<std::string> f = {"--tokenize-log", (dir / tag).string()};
    f.insert(f.end(), flags.begin(), flags.end());
    return std::make_unique<FakeServer>("ok", f);
  };
  // 503 once, then 404 (this fake has no tokenizer): asked twice, then let through.
  auto once = fake("once", {"--tokenize-status", "503", "--tokenize-failures", "1"});
  EXPECT_TRUE(ConnectWith(once->Endpoint("sglang"), req).ok());
  EXPECT_EQ(TokenizeRequests(dir / "once"), 2);
  // 503 always: refused after max_attempts tries, UNAVAILABLE.
  auto always = fake("always", {"--tokenize-status", "503"});
  absl::Status st = ConnectWith(always->Endpoint("vllm"), req);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ(TokenizeRequests(dir / "always"), po.max_attempts);
  // 400: refused at once, naming the option that declares a server without a tokenizer.
  auto bad = fake("bad", {"--tokenize-status", "400"});
  for (const char* scheme : {"sglang", "vllm"}) {
    st = ConnectWith(bad->Endpoint(scheme), req);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("?tokenizer=none"), std::string::npos) << st;
  }
  EXPECT_EQ(TokenizeRequests(dir / "bad"), 2);
  // Declared without a tokenizer: connects, and /tokenize is never asked.
  EXPECT_TRUE(ConnectWith(bad->Endpoint("sglang") + "?tokenizer=none", req).ok());
  EXPECT_EQ(TokenizeRequests(dir / "bad"), 2);
}

// The config refuses a vLLM teacher at T != 1 and a malformed external endpoint, naming the key.
TEST(HttpTeacherConfig, VllmAtTemperatureAndBadEndpointsRefused) {
  auto validate = [](const std::vector<std::string>& sets) {
    auto root = lm::ParseYaml(
        "model: {path: m}\nprompts: {sources: [{files: [p.jsonl]}]}\n"
        "rollout: {endpoints: [r:1]}\nstages: [{name: s1, teachers: [t:1], max_steps: 3}]\n"
        "run: {dir: r}\n",
        "test");
    EXPECT_TRUE(root.ok());
    for (const auto& s : sets) EXPECT_TRUE(lm::ApplyOverride(*root, s).ok()) << s;
    trainer::OpdConfig c;
    EXPECT_TRUE(lm::DecodeConfig(*root, &c).ok());
    return trainer::ValidateOpdConfig(c);
  };
  EXPECT_TRUE(validate({"stages.0.teachers=[\"vllm://h:1\"]"}).ok());
  EXPECT_TRUE(
      validate({"stages.0.teachers=[\"sglang://h:1\"]", "loss.teacher_temperature=0.7"}).ok());
  absl::Status st = validate(
      {"stages.0.teachers=[\"t:1\", \"vllm+https://h:1\"]", "loss.teacher_temperature=0.7"});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("stages[0].teachers[1]:", 0), 0u) << st;
  st = validate({"stages.0.domains=[{domain: math, teachers: [\"vllm://h:2\"]}]",
                 "loss.teacher_temperature=2.0"});
  EXPECT_EQ(st.message().rfind("stages[0].domains[0].teachers[0]:", 0), 0u) << st;
  st = validate({"stages.0.teachers=[\"sglang://h:1?tokenizer=no\"]"});
  EXPECT_EQ(st.message().rfind("stages[0].teachers[0]:", 0), 0u) << st;
}

// --- Balance over replicas -----------------------------------------------------------------------

// Sequence tokens each replica scored (the fakes' --record files).
int64_t TokensScored(const fs::path& record) {
  int64_t n = 0;
  if (!fs::exists(record)) return 0;
  for (const auto& j : testing_util::ReadJsonl(record))
    n += static_cast<int64_t>(j["tokens"].size());
  return n;
}

// Four learner ranks, each with its own pool of the same two replicas and one small share (one
// call's worth): together the replicas each score half of the step's tokens, within one sequence.
// (Each rank's share used to go to its pool's first healthy replica: the second got nothing.)
TEST(HttpTeacherPool, RanksSpreadAStepOverTheReplicasByTokens) {
  const auto dir = testing_util::FreshDir("spread");
  FakeServer a("ok", {"--record", (dir / "a").string()});
  FakeServer b("ok", {"--record", (dir / "b").string()});
  ASSERT_TRUE(a.ok() && b.ok());
  std::mt19937 rng(5);
  std::vector<std::vector<lm::Sample>> ranks(4);
  std::vector<int64_t> tokens(4, 0);
  int64_t total = 0, longest = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (int i = 0; i < 3 + static_cast<int>(r % 2); ++i) {
      std::vector<int32_t> t(10 + rng() % 40);
      for (auto& x : t) x = static_cast<int32_t>(1 + rng() % 90);
      longest = std::max<int64_t>(longest, static_cast<int64_t>(t.size()));
      tokens[r] += static_cast<int64_t>(t.size());
      ranks[r].push_back(lm::Sample::ToScore(std::move(t), 3));
    }
    total += tokens[r];
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    auto pool = trainer::TeacherPool::Connect("s", {a.Endpoint("sglang"), b.Endpoint("vllm")}, {},
                                              PoolOpts());
    ASSERT_TRUE(pool.ok()) << pool.status();
    auto out = (*pool)->Score(ranks[r], {}, nullptr, trainer::SpreadAmong(tokens, r));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), ranks[r].size());
  }
  const int64_t on_a = TokensScored(dir / "a"), on_b = TokensScored(dir / "b");
  EXPECT_EQ(on_a + on_b, total);
  EXPECT_LE(std::abs(2 * on_a - total), 2 * longest) << on_a << " of " << total;
  EXPECT_LE(std::abs(2 * on_b - total), 2 * longest) << on_b << " of " << total;
  std::cout << "[spread] " << total << " tokens: " << on_a << " on replica a, " << on_b
            << " on b (longest sequence " << longest << ")\n";
}

// --- opd-ctl speaks to external teachers ---------------------------------------------------------

// `opd-ctl score` and `opd-ctl info` take sglang:// and vllm:// endpoints (they spoke gRPC only:
// "DNS resolution failed").
TEST(HttpTeacherCtl, ScoreAndInfoTakeExternalEndpoints) {
  FakeServer s("ok");
  const auto dir = testing_util::FreshDir("ctl_input");
  const fs::path input = dir / "in.jsonl";
  {
    std::ofstream f(input);
    for (const auto& seq : Inputs())
      f << nlohmann::json{{"tokens", seq.tokens}, {"response_start", seq.response_start}}.dump()
        << "\n";
  }
  for (const char* scheme : {"sglang", "vllm"}) {
    const CtlRun r =
        RunCtl({"score", "--addr", s.Endpoint(scheme), "--input", input.string(), "--top-k", "2"});
    ASSERT_EQ(r.code, 0) << r.output;
    std::vector<lm::SequenceScore> got;
    std::istringstream lines(r.output);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] != '{') continue;
      const auto j = nlohmann::json::parse(line);
      lm::SequenceScore o;
      o.logprobs = j["logprobs"].get<std::vector<float>>();
      for (const auto& row : j["topk_ids"])
        for (int id : row) o.topk_ids.push_back(id);
      got.push_back(std::move(o));
    }
    ExpectSynthetic(got, 2);
    const CtlRun info = RunCtl({"info", "--addr", s.Endpoint(scheme)});
    ASSERT_EQ(info.code, 0) << info.output;
    EXPECT_NE(info.output.find(std::string("\"architecture\":\"") + scheme + "\""),
              std::string::npos)
        << info.output;
    EXPECT_NE(info.output.find("\"max_seq_len\":\"4095\""), std::string::npos) << info.output;
  }
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
Parity Compare(const std::vector<lm::SequenceScore>& ref, const std::vector<lm::SequenceScore>& got,
               int k, double tol) {
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
