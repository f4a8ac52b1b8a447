// Multi-process tests of the OPD services: real opd-teacher / opd-rollout processes on ephemeral
// loopback ports, driven through the client library (and opd-ctl), stopped at the end.
//
// Covered: scores equal the in-process `opd-ctl logprobs`; seeded sampling is reproducible;
// temperature -> 0 is greedy decoding; Generate's log-probs equal the teacher's for the same
// tokens; UpdateWeights switches models atomically, and wrong, interrupted, stale or
// unauthenticated updates change nothing; bad input gets the right status code and the server
// keeps serving; 16 concurrent clients for OPD_LOAD_SECONDS (default 30) see only
// RESOURCE_EXHAUSTED as errors, serial-equal results and bounded memory; health, reflection and
// TLS work. The Scorer is also tested in-process (batching, cancellation, queue bound).
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "child_process.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "rpc/client.h"
#include "rpc/tensor_codec.h"
#include "rpc/weight_stream.h"
#include "teacher_service/scorer.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "tests/wire_testing.h"

using testing_util::MaxAbsDiff;
using testing_util::ReadFile;
using testing_util::Shell;
using testing_util::TempDir;
using testing_util::ToScore;

namespace {

namespace fs = std::filesystem;
using opd::rpc::ClientOptions;

constexpr const char* kModel = "moe_tied_topk8";  // vocab 96, 256 positions
constexpr const char* kSecret = "s3cret-for-tests";

std::string FixtureModel(const std::string& name = kModel) {
  return std::string(OPD_FIXTURES_DIR) + "/" + name + "/model";
}

// A secret file as an operator would write it: mode 0600.
fs::path WriteSecret(const fs::path& dir, const std::string& secret, mode_t mode = 0600) {
  const fs::path p = dir / "secret";
  { std::ofstream(p) << secret << "\n"; }
  chmod(p.c_str(), mode);
  return p;
}

// A server process on 127.0.0.1:<ephemeral>, killed (SIGTERM, then SIGKILL) when destroyed, so a
// failing test never leaks a process.
class ServerProcess {
 public:
  // `probe_tls`: how the health probe connects (a TLS server refuses plaintext).
  static std::unique_ptr<ServerProcess> Start(const std::string& binary,
                                              std::vector<std::string> args,
                                              const std::vector<std::string>& extra_env = {},
                                              const opd::rpc::TlsClientOptions& probe_tls = {}) {
    auto p = std::unique_ptr<ServerProcess>(new ServerProcess());
    p->dir_ = TempDir("server");
    args.insert(args.begin(), binary);
    // One compute thread unless asked otherwise (see LoadLocal).
    if (std::none_of(args.begin(), args.end(),
                     [](const std::string& a) { return a.rfind("--threads", 0) == 0; })) {
      args.push_back("--threads=1");
    }
    // Up to 60 s for the port file (model load), failing early if the process died.
    p->served_ =
        testing_util::StartServed(p->dir_, "server", args, std::chrono::seconds(60), extra_env);
    if (p->served_.address.empty()) return nullptr;
    ClientOptions o;
    o.address = p->address();
    o.tls = probe_tls;
    absl::Status st = opd::rpc::WaitUntilServing(o, absl::Seconds(30));
    if (!st.ok()) {
      ADD_FAILURE() << st << "\n" << p->log();
      return nullptr;
    }
    return p;
  }

  ~ServerProcess() {
    Stop();
    fs::remove_all(dir_);
  }

  // SIGTERM (graceful), then SIGKILL after 10 s; returns the exit code (128 + signal).
  int Stop() { return served_.process ? served_.process->Stop() : -1; }
  bool Running() { return served_.process && served_.process->Running(); }
  int64_t RssKb() const { return served_.process->RssKb(); }

  const std::string& address() const { return served_.address; }
  std::string log() const { return served_.process->Log(); }

 private:
  ServerProcess() = default;
  testing_util::Served served_;
  fs::path dir_;
};

std::string Binary(const std::string& rel) {
  return std::string(OPD_BINARY_DIR) + "/" + rel;
}

ClientOptions Options(const ServerProcess& s, const std::string& secret = kSecret) {
  ClientOptions o;
  o.address = s.address();
  o.secret = secret;
  o.timeout = absl::Seconds(60);
  return o;
}

// Runs a shell command; returns its exit code, with stdout/stderr in the given files.
std::vector<std::vector<int64_t>> FixtureSequences(const std::string& name = kModel) {
  std::ifstream in(std::string(OPD_FIXTURES_DIR) + "/" + name + "/inputs.json");
  return nlohmann::json::parse(in)["sequences"].get<std::vector<std::vector<int64_t>>>();
}

// A sample's response tokens.
std::vector<int32_t> Response(const lm::Sample& s) {
  return std::vector<int32_t>(s.response().begin(), s.response().end());
}

std::vector<int32_t> To32(const std::vector<int64_t>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}
std::vector<int64_t> To64(const std::vector<int32_t>& v) {
  return std::vector<int64_t>(v.begin(), v.end());
}

std::shared_ptr<lm::CausalLM> LoadLocal(const std::string& dir) {
  // One thread, here and in the servers: tiny models gain nothing from more, and OpenMP's
  // spinning threads crawl on a machine whose cores are busy with other work.
  torch::set_num_threads(1);
  auto m = lm::LoadModel(dir);
  EXPECT_TRUE(m.ok()) << m.status();
  (*m)->eval();
  return *m;
}

// Greedy decoding by full forwards, no KV cache: an independent reference.
std::vector<int32_t> GreedyByForward(lm::CausalLM& model, std::vector<int64_t> seq, int64_t n) {
  torch::NoGradGuard no_grad;
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) {
    auto h = model.Forward(lm::PackedBatch::FromSequences({seq}));
    const int64_t next = model.Logits(h[h.size(0) - 1]).argmax().item<int64_t>();
    out.push_back(static_cast<int32_t>(next));
    seq.push_back(next);
  }
  return out;
}

// In-process teacher-path log-probs of `response` after `prompt`.
std::vector<float> TeacherPath(lm::CausalLM& model, const std::vector<int32_t>& prompt,
                               const std::vector<int32_t>& response, double temperature = 1.0) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> seq = To64(prompt);
  seq.insert(seq.end(), response.begin(), response.end());
  auto lp = lm::SequenceLogprobs(model, lm::PackedBatch::FromSequences({seq}), temperature);
  auto tail =
      lp.narrow(0, static_cast<int64_t>(prompt.size()) - 1, static_cast<int64_t>(response.size()))
          .contiguous();
  return std::vector<float>(tail.data_ptr<float>(), tail.data_ptr<float>() + tail.numel());
}

// ---------------------------------------------------------------------------------------------
// Teacher

class TeacherService : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(TempDir("teacher"));
    const auto secret = WriteSecret(*dir_, kSecret);
    teacher_ =
        ServerProcess::Start(Binary("teacher_service/opd-teacher"),
                             {"--model=" + FixtureModel(), "--secret-file=" + secret.string(),
                              "--threads=1", "--max-batch-tokens=64", "--max-message-mb=1"})
            .release();
  }
  static void TearDownTestSuite() {
    delete teacher_;
    fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override { ASSERT_NE(teacher_, nullptr); }

  std::unique_ptr<opd::rpc::TeacherClient> Client(const std::string& secret = kSecret) {
    auto c = opd::rpc::TeacherClient::Create(Options(*teacher_, secret));
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }

  static ServerProcess* teacher_;
  static fs::path* dir_;
};
ServerProcess* TeacherService::teacher_ = nullptr;
fs::path* TeacherService::dir_ = nullptr;

TEST_F(TeacherService, InfoDescribesTheModel) {
  auto info = Client()->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->service(), "opd.v1.Teacher");
  EXPECT_EQ(info->model_name(), "model");
  EXPECT_EQ(info->architecture(), "qwen3_moe");
  EXPECT_EQ(info->vocab_size(), 96);
  EXPECT_EQ(info->tokenizer_fingerprint(), "none");
  EXPECT_EQ(info->max_seq_len(), 256);
  EXPECT_EQ(info->dtype(), "float32");
  EXPECT_FALSE(info->build_version().empty());
}

TEST_F(TeacherService, ScoresEqualInProcessLogprobs) {
  const auto seqs = FixtureSequences();
  const fs::path dir = TempDir("score");
  {
    std::ofstream in(dir / "in.jsonl");
    for (const auto& s : seqs) in << nlohmann::json{{"tokens", s}}.dump() << "\n";
  }
  ASSERT_EQ(Shell(Binary("ctl/opd-ctl") + " logprobs --threads 1 --model " + FixtureModel() +
                  " --input " + (dir / "in.jsonl").string() + " > " + (dir / "ref.jsonl").string()),
            0);
  std::vector<std::vector<float>> ref;
  {
    std::ifstream out(dir / "ref.jsonl");
    std::string line;
    while (std::getline(out, line))
      ref.push_back(nlohmann::json::parse(line)["logprobs"].get<std::vector<float>>());
  }
  ASSERT_EQ(ref.size(), seqs.size());

  std::vector<lm::Sample> inputs;
  for (const auto& s : seqs) inputs.push_back(ToScore(To32(s), 1));
  auto scores = Client()->Score(inputs);
  ASSERT_TRUE(scores.ok()) << scores.status();
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_LE(MaxAbsDiff((*scores)[i].logprobs, ref[i]), 1e-5) << "sequence " << i;
  }

  // The same through `opd-ctl score` (JSON lines in and out).
  const std::string cmd = Binary("ctl/opd-ctl") + " score --addr " + teacher_->address() +
                          " --secret-file " + (*dir_ / "secret").string() + " --input " +
                          (dir / "in.jsonl").string() + " > " + (dir / "out.jsonl").string();
  ASSERT_EQ(Shell(cmd), 0) << cmd;
  std::ifstream out(dir / "out.jsonl");
  std::string line;
  for (size_t i = 0; std::getline(out, line); ++i) {
    ASSERT_LT(i, ref.size());
    EXPECT_LE(MaxAbsDiff(nlohmann::json::parse(line)["logprobs"].get<std::vector<float>>(), ref[i]),
              1e-5);
  }
  fs::remove_all(dir);
}

TEST_F(TeacherService, ResponseStartTemperatureAndTopK) {
  auto model = LoadLocal(FixtureModel());
  const auto seqs = FixtureSequences();
  const auto& s = seqs[3];  // 20 tokens
  opd::rpc::ScoreOptions so;
  so.temperature = 0.6f;
  so.top_k = 5;
  auto scores =
      Client()->Score(ToScore({{To32(s), 12}, {To32(s), static_cast<int64_t>(s.size())}}), so);
  ASSERT_TRUE(scores.ok()) << scores.status();
  const auto& r = (*scores)[0];
  ASSERT_EQ(r.logprobs.size(), s.size() - 12);
  EXPECT_TRUE((*scores)[1].logprobs.empty());  // response_start = len scores nothing

  torch::NoGradGuard no_grad;
  auto hidden = model->Forward(lm::PackedBatch::FromSequences({s}));
  auto rows = hidden.narrow(0, 11, static_cast<int64_t>(s.size()) - 12);
  lm::LogprobOptions lo;
  lo.temperature = 0.6;
  auto targets = torch::tensor(std::vector<int64_t>(s.begin() + 12, s.end()));
  auto lp = lm::TokenLogprobs(rows, model->LmHeadWeight(), targets, lo).contiguous();
  EXPECT_LE(MaxAbsDiff(r.logprobs,
                       std::vector<float>(lp.data_ptr<float>(), lp.data_ptr<float>() + lp.numel())),
            1e-5);
  auto top = lm::TopK(rows, model->LmHeadWeight(), 5, lo);
  auto ids = top.ids.to(torch::kInt32).contiguous();
  EXPECT_EQ(r.topk_ids,
            std::vector<int32_t>(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + ids.numel()));
  auto tlp = top.logprobs.contiguous();
  EXPECT_LE(MaxAbsDiff(r.topk_logprobs, std::vector<float>(tlp.data_ptr<float>(),
                                                           tlp.data_ptr<float>() + tlp.numel())),
            1e-5);
}

TEST_F(TeacherService, UnauthenticatedCallsAreRejected) {
  const std::vector<lm::Sample> in = ToScore({{{1, 2, 3}, 1}});
  for (const std::string& secret :
       {std::string(), std::string("wrong"), std::string(kSecret) + "x"}) {
    auto c = Client(secret);
    EXPECT_EQ(c->Score(in).status().code(), absl::StatusCode::kUnauthenticated)
        << "'" << secret << "'";
    EXPECT_EQ(c->Info().status().code(), absl::StatusCode::kUnauthenticated);
  }
  // Health needs no secret.
  auto health = opd::rpc::CheckHealth(Options(*teacher_, ""), "opd.v1.Teacher");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(Client()->Score(in).ok());
}

TEST_F(TeacherService, BadInputGetsInvalidArgumentAndServerKeepsServing) {
  auto c = Client();
  auto expect = [&](std::initializer_list<std::pair<std::vector<int32_t>, int64_t>> in,
                    opd::rpc::ScoreOptions so, const std::string& needle) {
    auto r = c->Score(ToScore(in), so);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << needle << ": " << r.status();
    EXPECT_NE(std::string(r.status().message()).find(needle), std::string::npos) << r.status();
  };
  expect({}, {}, "empty batch");
  expect({{{1, 2}, 1}, {{}, 1}}, {}, "sequence 1: empty");
  expect({{{1, 2}, 1}, {{1, 96, 3}, 1}}, {}, "sequence 1: token id 96");
  expect({{{-5, 2}, 1}}, {}, "token id -5");
  expect({{std::vector<int32_t>(257, 1), 1}}, {}, "longer than the maximum 256");
  expect({{{1, 2, 3}, 0}}, {}, "response_start 0");
  expect({{{1, 2, 3}, 4}}, {}, "response_start 4");
  opd::rpc::ScoreOptions so;
  so.temperature = 0;
  expect({{{1, 2}, 1}}, so, "temperature");
  so.temperature = -1;
  expect({{{1, 2}, 1}}, so, "temperature");
  // Temperatures that underflow (1e-45 gave NaN log-probs with OK), NaN and infinity: refused
  // naming the minimum; the minimum itself, as a float, is taken.
  for (float t : {1e-45f, 1e-6f, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::infinity()}) {
    so.temperature = t;
    expect({{{1, 2}, 1}}, so, "temperature must be finite and at least 0.0001");
  }
  so.temperature = 1e-4f;
  auto coldest = c->Score(ToScore({{{1, 2, 3}, 1}}), so);
  ASSERT_TRUE(coldest.ok()) << coldest.status();
  for (float lp : (*coldest)[0].logprobs) EXPECT_TRUE(std::isfinite(lp)) << lp;
  so = {};
  so.top_k = 1000000;
  expect({{{1, 2}, 1}}, so, "top_k");
  // A request above the server's message limit (1 MiB here) is RESOURCE_EXHAUSTED.
  auto huge = c->Score(ToScore({{std::vector<int32_t>(1500000, 1), 1}}));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  // An expired deadline is the client's DEADLINE_EXCEEDED. The deadline is already past when the
  // call starts (not merely short, which a fast enough machine could meet).
  auto opts = Options(*teacher_);
  opts.timeout = -absl::Seconds(1);
  auto hurried = *opd::rpc::TeacherClient::Create(opts);
  EXPECT_EQ(hurried->Score(ToScore({{{1, 2, 3}, 1}})).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // Still serving.
  auto ok = c->Score(ToScore({{{1, 2, 3}, 1}}));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)[0].logprobs.size(), 2u);
}

TEST_F(TeacherService, HealthAndReflectionForGrpcurl) {
  // Reflection, as grpcurl uses it, spoken as raw protobuf bytes through Python's grpcio:
  // list_services (field 7) and file_containing_symbol (field 4).
  const fs::path dir = TempDir("refl");
  {
    std::ofstream py(dir / "refl.py");
    py << "import grpc, sys\n"
          "ch = grpc.insecure_channel(sys.argv[1])\n"
          "call = "
          "ch.stream_stream('/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo')\n"
          "def req(field, s):\n"
          "    b = s.encode()\n"
          "    return bytes([field << 3 | 2, len(b)]) + b\n"
          "out = b''.join(call(iter([req(7, '*'), req(4, 'opd.v1.Teacher')]), timeout=20))\n"
          "sys.stdout.write(out.decode('latin-1'))\n";
  }
  const std::string cmd = std::string(OPD_PYTHON) + " " + (dir / "refl.py").string() + " " +
                          teacher_->address() + " > " + (dir / "out.txt").string();
  ASSERT_EQ(Shell(cmd), 0) << cmd;
  const std::string out = ReadFile(dir / "out.txt");
  EXPECT_NE(out.find("opd.v1.Teacher"), std::string::npos);
  EXPECT_NE(out.find("grpc.health.v1.Health"), std::string::npos);
  EXPECT_NE(out.find("opd/v1/teacher.proto"), std::string::npos);  // the file descriptor
  // opd-ctl health.
  EXPECT_EQ(Shell(Binary("ctl/opd-ctl") + " health --addr " + teacher_->address() + " > " +
                  (dir / "h.txt").string()),
            0);
  EXPECT_NE(ReadFile(dir / "h.txt").find("SERVING"), std::string::npos);
  fs::remove_all(dir);
}

// 16 concurrent clients against one teacher with a small queue: the only error is
// RESOURCE_EXHAUSTED, every result equals serial scoring, memory stays bounded.
TEST(TeacherLoad, ConcurrentClientsMatchSerialScoring) {
  const char* env = std::getenv("OPD_LOAD_SECONDS");
  const double seconds = env ? std::atof(env) : 30.0;
  const fs::path dir = TempDir("load");
  const auto secret = WriteSecret(dir, kSecret);
  auto teacher =
      ServerProcess::Start(Binary("teacher_service/opd-teacher"),
                           {"--model=" + FixtureModel(), "--secret-file=" + secret.string(),
                            "--threads=1", "--max-queue=6", "--max-batch-tokens=256"});
  ASSERT_NE(teacher, nullptr);
  // A pool of requests of varied shapes, scored one at a time first.
  std::mt19937 rng(11);
  std::vector<std::vector<lm::Sample>> pool(24);
  for (auto& req : pool) {
    const int n = 1 + rng() % 4;
    for (int i = 0; i < n; ++i) {
      std::vector<int32_t> t(2 + rng() % 60);
      for (auto& x : t) x = rng() % 96;
      req.push_back(ToScore(t, 1 + static_cast<int64_t>(rng() % (t.size() - 1))));
    }
  }
  auto serial_client = *opd::rpc::TeacherClient::Create(Options(*teacher));
  std::vector<std::vector<lm::SequenceScore>> serial;
  for (const auto& req : pool) {
    auto r = serial_client->Score(req, {1.0f, 3});
    ASSERT_TRUE(r.ok()) << r.status();
    serial.push_back(*r);
  }
  const int64_t rss_start = teacher->RssKb();
  std::atomic<int64_t> ok{0}, exhausted{0}, other{0}, mismatched{0};
  std::atomic<double> worst{0};
  std::mutex err_mu;
  std::string first_error;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::thread> clients;
  for (int c = 0; c < 16; ++c) {
    clients.emplace_back([&, c] {
      auto client = *opd::rpc::TeacherClient::Create(Options(*teacher));
      std::mt19937 r(c);
      while (std::chrono::steady_clock::now() < end) {
        const size_t k = r() % pool.size();
        auto res = client->Score(pool[k], {1.0f, 3});
        if (res.ok()) {
          ++ok;
          for (size_t i = 0; i < res->size(); ++i) {
            const double d =
                std::max(MaxAbsDiff((*res)[i].logprobs, serial[k][i].logprobs),
                         MaxAbsDiff((*res)[i].topk_logprobs, serial[k][i].topk_logprobs));
            if (d > 1e-5 || (*res)[i].topk_ids != serial[k][i].topk_ids) ++mismatched;
            double w = worst.load();
            while (d > w && !worst.compare_exchange_weak(w, d)) {
            }
          }
        } else if (res.status().code() == absl::StatusCode::kResourceExhausted) {
          ++exhausted;
          std::this_thread::sleep_for(
              std::chrono::milliseconds(5));  // back off, as a client should
        } else {
          ++other;
          std::lock_guard<std::mutex> l(err_mu);
          if (first_error.empty()) first_error = res.status().ToString();
        }
      }
    });
  }
  int64_t rss_peak = 0;
  while (std::chrono::steady_clock::now() < end) {
    rss_peak = std::max(rss_peak, teacher->RssKb());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  for (auto& t : clients) t.join();
  const int64_t rss_end = teacher->RssKb();
  std::printf(
      "load: %.0f s, %lld ok, %lld RESOURCE_EXHAUSTED, %lld other, max |diff| vs serial %.2e, "
      "RSS start %lld kB, peak %lld kB, end %lld kB\n",
      seconds, (long long)ok, (long long)exhausted, (long long)other, worst.load(),
      (long long)rss_start, (long long)rss_peak, (long long)rss_end);
  EXPECT_EQ(other, 0) << first_error;
  EXPECT_EQ(mismatched, 0);
  EXPECT_GT(ok, 16);
  EXPECT_LT(rss_peak - rss_start, 256 * 1024) << "memory grew by more than 256 MiB";
  // Still serving afterwards.
  EXPECT_TRUE(serial_client->Score(pool[0]).ok());
  fs::remove_all(dir);
}

TEST(TeacherStartup, SecretFromEnvironmentAndFilePermissions) {
  const fs::path dir = TempDir("env");
  // $OPD_SECRET instead of a file.
  {
    auto teacher = ServerProcess::Start(Binary("teacher_service/opd-teacher"),
                                        {"--model=" + FixtureModel()}, {"OPD_SECRET=from-env"});
    ASSERT_NE(teacher, nullptr);
    EXPECT_TRUE((*opd::rpc::TeacherClient::Create(Options(*teacher, "from-env")))->Info().ok());
    EXPECT_EQ(
        (*opd::rpc::TeacherClient::Create(Options(*teacher, kSecret)))->Info().status().code(),
        absl::StatusCode::kUnauthenticated);
  }
  // A secret file others can read is refused at start, as a bad value (exit 2).
  const auto loose = WriteSecret(dir, kSecret, 0644);
  const std::string cmd = Binary("teacher_service/opd-teacher") + " --threads 1 --model " +
                          FixtureModel() + " --listen 127.0.0.1:0 --secret-file " + loose.string() +
                          " 2> " + (dir / "err").string();
  EXPECT_EQ(Shell(cmd), 2);
  EXPECT_NE(ReadFile(dir / "err").find("chmod 600"), std::string::npos) << ReadFile(dir / "err");
  fs::remove_all(dir);
}

TEST(TeacherStartup, TlsWithServerCertificate) {
  if (Shell("command -v openssl > /dev/null") != 0) GTEST_SKIP() << "openssl not installed";
  const fs::path dir = TempDir("tls");
  const std::string d = dir.string();
  const std::string gen =
      "cd " + d +
      " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca -keyout ca.key "
      "-out ca.pem 2>/dev/null && openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout "
      "server.key "
      "-out server.csr 2>/dev/null && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > "
      "ext.cnf && "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -extfile "
      "ext.cnf "
      "-out server.pem 2>/dev/null && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "
      "/CN=other-ca -keyout other_ca.key -out other_ca.pem 2>/dev/null";
  ASSERT_EQ(Shell(gen), 0);
  const auto secret = WriteSecret(dir, kSecret);
  opd::rpc::TlsClientOptions tls;
  tls.ca_file = d + "/ca.pem";
  tls.server_name = "localhost";
  auto teacher =
      ServerProcess::Start(Binary("teacher_service/opd-teacher"),
                           {"--model=" + FixtureModel(), "--secret-file=" + secret.string(),
                            "--tls-cert=" + d + "/server.pem", "--tls-key=" + d + "/server.key"},
                           {}, tls);
  ASSERT_NE(teacher, nullptr);
  auto opts = Options(*teacher);
  opts.tls = tls;
  auto info = (*opd::rpc::TeacherClient::Create(opts))->Info();
  EXPECT_TRUE(info.ok()) << info.status();
  auto scores = (*opd::rpc::TeacherClient::Create(opts))->Score(ToScore({{{1, 2, 3}, 1}}));
  EXPECT_TRUE(scores.ok()) << scores.status();
  // Plaintext to a TLS port fails; so does TLS with a CA that did not sign the server's
  // certificate.
  opts = Options(*teacher);
  opts.timeout = absl::Seconds(5);
  EXPECT_EQ((*opd::rpc::TeacherClient::Create(opts))->Info().status().code(),
            absl::StatusCode::kUnavailable);
  opts.tls = tls;
  opts.tls.ca_file = d + "/other_ca.pem";
  EXPECT_EQ((*opd::rpc::TeacherClient::Create(opts))->Info().status().code(),
            absl::StatusCode::kUnavailable);
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Rollout

class RolloutService : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(TempDir("rollout"));
    const auto secret = WriteSecret(*dir_, kSecret);
    rollout_ = ServerProcess::Start(
                   Binary("rollout/opd-rollout"),
                   {"--model=" + FixtureModel(), "--secret-file=" + secret.string(), "--threads=1"})
                   .release();
    teacher_ = ServerProcess::Start(
                   Binary("teacher_service/opd-teacher"),
                   {"--model=" + FixtureModel(), "--secret-file=" + secret.string(), "--threads=1"})
                   .release();
    // Model B: the same architecture with other weights.
    auto b = LoadLocal(FixtureModel());
    b->InitWeights(0.2, 4242);
    ASSERT_TRUE(lm::SaveModel(*b, (*dir_ / "model_b").string()).ok());
  }
  static void TearDownTestSuite() {
    delete rollout_;
    delete teacher_;
    fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override {
    ASSERT_NE(rollout_, nullptr);
    ASSERT_NE(teacher_, nullptr);
  }

  std::unique_ptr<opd::rpc::RolloutClient> Client(const std::string& secret = kSecret) {
    auto c = opd::rpc::RolloutClient::Create(Options(*rollout_, secret));
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }
  int64_t ServingVersion() {
    auto info = Client()->Info();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->weight_version() : -1;
  }
  // Pushes the weights of the model in `dir` as `version`.
  absl::StatusOr<opd::v1::UpdateWeightsResponse> Push(const std::string& dir, int64_t version,
                                                      const std::string& secret = kSecret) {
    auto model = LoadLocal(dir);
    opd::rpc::StreamOptions small;
    small.chunk_bytes = 1000;  // small chunks: many per tensor
    auto pushed =
        opd::rpc::StreamWeights(Options(*rollout_, secret), version,
                                opd::rpc::OutgoingTensorsOf(opd::rpc::NamedParameters(*model),
                                                            opd::rpc::WireDtype::kFloat32),
                                small);
    if (!pushed.ok()) return pushed.status();
    return pushed->applied;
  }

  static ServerProcess* rollout_;
  static ServerProcess* teacher_;
  static fs::path* dir_;
};
ServerProcess* RolloutService::rollout_ = nullptr;
ServerProcess* RolloutService::teacher_ = nullptr;
fs::path* RolloutService::dir_ = nullptr;

const std::vector<std::vector<int32_t>> kPrompts = {
    {1, 5, 9, 13, 2}, {7, 3}, {40, 41, 42, 43, 44, 45}};

lm::SamplingParams Sampling(uint64_t seed, float temperature = 1.0f, int n = 2, int max_new = 12) {
  lm::SamplingParams g;
  g.samples_per_prompt = n;
  g.temperature = temperature;
  g.max_new_tokens = max_new;
  g.seed = seed;
  return g;
}

TEST_F(RolloutService, SeededSamplesAreReproducible) {
  auto c = Client();
  auto a = c->Generate(kPrompts, Sampling(17));
  auto b = c->Generate(kPrompts, Sampling(17));
  auto other = c->Generate(kPrompts, Sampling(18));
  ASSERT_TRUE(a.ok() && b.ok() && other.ok()) << a.status() << b.status() << other.status();
  ASSERT_EQ(a->size(), 6u);
  int differ = 0;
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_EQ((*a)[i].prompt_index, static_cast<int>(i / 2));
    EXPECT_EQ((*a)[i].sample_index, static_cast<int>(i % 2));
    EXPECT_EQ((*a)[i].tokens, (*b)[i].tokens);
    EXPECT_EQ((*a)[i].logprobs, (*b)[i].logprobs);
    EXPECT_EQ((*a)[i].response_length(), 12);
    EXPECT_EQ((*a)[i].finish, lm::FinishReason::kLength);
    differ += (*a)[i].tokens != (*other)[i].tokens;
  }
  EXPECT_GE(differ, 4);
}

// Prompt.seed_index over the wire (RolloutClient's seed_indices): the last prompt sent alone
// with seed index 2 gets the samples it gets at position 2 of the whole request, still named
// prompt 0 of its own; a seed index count that does not match the prompts' is refused before
// anything is sent, a negative one by the worker, naming the prompt.
TEST_F(RolloutService, SeedIndexKeysAPromptOverTheWire) {
  auto c = Client();
  auto all = c->Generate(kPrompts, Sampling(23));
  auto g = Sampling(23);
  g.seed_indices = {2};
  auto alone = c->Generate({kPrompts[2]}, g);
  ASSERT_TRUE(all.ok() && alone.ok()) << all.status() << alone.status();
  ASSERT_EQ(alone->size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ((*alone)[s].prompt_index, 0);
    EXPECT_EQ((*alone)[s].tokens, (*all)[4 + s].tokens) << "sample " << s;
    // Batched with the other prompts or alone: the same draws, logits rounded alike to ~1e-7.
    EXPECT_LE(MaxAbsDiff((*alone)[s].logprobs, (*all)[4 + s].logprobs), 1e-5) << "sample " << s;
  }
  g.seed_indices = {2, 3};
  EXPECT_EQ(c->Generate({kPrompts[2]}, g).status().code(), absl::StatusCode::kInvalidArgument);
  g.seed_indices = {-1};
  auto negative = c->Generate({kPrompts[2]}, g);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument) << negative.status();
  EXPECT_NE(std::string(negative.status().message()).find("prompt 0: seed_index -1"),
            std::string::npos)
      << negative.status();
}

TEST_F(RolloutService, TemperatureToZeroIsGreedy) {
  auto model = LoadLocal(FixtureModel());
  for (float t : {0.0f, 1e-4f}) {
    auto out = Client()->Generate(kPrompts, Sampling(1, t, 2, 10));
    ASSERT_TRUE(out.ok()) << out.status();
    for (const auto& s : *out) {
      EXPECT_EQ(Response(s), GreedyByForward(*model, To64(kPrompts[s.prompt_index]), 10))
          << "temperature " << t;
    }
  }
}

TEST_F(RolloutService, GenerateLogprobsEqualTeacherScores) {
  auto teacher = *opd::rpc::TeacherClient::Create(Options(*teacher_));
  for (float t : {1.0f, 0.8f}) {
    auto out = Client()->Generate(kPrompts, Sampling(3, t, 2, 24));
    ASSERT_TRUE(out.ok()) << out.status();
    for (const auto& s : *out) {  // the samples carry their prompts: they are what is scored
      EXPECT_EQ(s.prompt(), absl::MakeConstSpan(kPrompts[s.prompt_index]));
      EXPECT_EQ(s.response_start, static_cast<int64_t>(kPrompts[s.prompt_index].size()));
    }
    auto scores = teacher->Score(*out, {t, 0});
    ASSERT_TRUE(scores.ok()) << scores.status();
    double worst = 0;
    for (size_t i = 0; i < out->size(); ++i)
      worst = std::max(worst, MaxAbsDiff((*out)[i].logprobs, (*scores)[i].logprobs));
    EXPECT_LE(worst, 1e-4) << "temperature " << t;
  }
}

TEST_F(RolloutService, StopIdsEndSamples) {
  auto greedy = Client()->Generate({kPrompts[0]}, Sampling(0, 0.0f, 1, 16));
  ASSERT_TRUE(greedy.ok());
  const std::vector<int32_t> free_run = Response((*greedy)[0]);
  size_t at = 2;
  while (at < free_run.size() && std::find(free_run.begin(), free_run.begin() + at, free_run[at]) !=
                                     free_run.begin() + at) {
    ++at;
  }
  ASSERT_LT(at, free_run.size());
  auto g = Sampling(0, 0.0f, 1, 16);
  g.stop_ids = {free_run[at]};
  auto stopped = Client()->Generate({kPrompts[0]}, g);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ((*stopped)[0].finish, lm::FinishReason::kStop);
  EXPECT_EQ(Response((*stopped)[0]),
            std::vector<int32_t>(free_run.begin(), free_run.begin() + at + 1));
}

TEST_F(RolloutService, BadInputGetsInvalidArgumentAndServerKeepsServing) {
  auto c = Client();
  auto expect = [&](const std::vector<std::vector<int32_t>>& prompts, const lm::SamplingParams& g,
                    const std::string& needle) {
    auto r = c->Generate(prompts, g);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << needle << ": " << r.status();
    EXPECT_NE(std::string(r.status().message()).find(needle), std::string::npos) << r.status();
  };
  expect({}, Sampling(0), "no prompts");
  expect({{1}, {}}, Sampling(0), "prompt 1: empty");
  expect({{1, 99}}, Sampling(0), "token id 99");
  expect({{1}}, Sampling(0, 1.0f, 1, 0), "max_new_tokens");
  expect({{1}}, Sampling(0, 1.0f, 1, 1 << 30), "max_new_tokens");
  expect({{1}}, Sampling(0, 1.0f, 1000000, 4), "samples_per_prompt");
  expect({{1}}, Sampling(0, -0.5f), "temperature");
  // Temperatures that underflow (1e-45 gave NaN log-probs and token 0 with OK), NaN, infinity.
  for (float t : {1e-45f, 1e-6f, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::infinity()})
    expect({{1}}, Sampling(0, t), "temperature must be 0 (greedy) or finite and at least 0.0001");
  auto g = Sampling(0);
  g.top_p = 2;
  expect({{1}}, g, "top_p");
  g = Sampling(0);
  g.stop_ids = {1000};
  expect({{1}}, g, "stop token id 1000");
  EXPECT_EQ(Client("")->Generate({{1}}, Sampling(0)).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(c->Generate({{1, 2}}, Sampling(0)).ok());
}

TEST_F(RolloutService, UpdateWeightsSwitchesModelsAndCheckers) {
  const std::string model_b = (*dir_ / "model_b").string();
  auto a = LoadLocal(FixtureModel()), b = LoadLocal(model_b);
  const auto greedy = Sampling(0, 0.0f, 1, 10);
  auto before = Client()->Generate(kPrompts, greedy);
  ASSERT_TRUE(before.ok());
  const int64_t v0 = ServingVersion();

  // Unauthenticated or wrongly authenticated: UNAUTHENTICATED, nothing changes.
  EXPECT_EQ(Push(model_b, v0 + 1, "").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Push(model_b, v0 + 1, "not-the-secret").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(ServingVersion(), v0);

  // Model B as version v0 + 1: Generate and its log-probs follow B.
  auto resp = Push(model_b, v0 + 1);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->version(), v0 + 1);
  EXPECT_EQ(resp->tensors(), static_cast<int64_t>(b->parameters().size()));
  EXPECT_EQ(ServingVersion(), v0 + 1);
  auto after = Client()->Generate(kPrompts, greedy);
  ASSERT_TRUE(after.ok());
  for (const auto& s : *after) {
    EXPECT_EQ(s.weight_version, v0 + 1);
    EXPECT_EQ(Response(s), GreedyByForward(*b, To64(kPrompts[s.prompt_index]), 10));
  }
  auto sampled = Client()->Generate(kPrompts, Sampling(9, 1.0f, 2, 16));
  ASSERT_TRUE(sampled.ok());
  double worst = 0;
  for (const auto& s : *sampled) {
    worst = std::max(
        worst, MaxAbsDiff(s.logprobs, TeacherPath(*b, kPrompts[s.prompt_index], Response(s))));
  }
  EXPECT_LE(worst, 1e-4);

  // A stale version is FAILED_PRECONDITION; back to A through `opd-ctl push-weights`.
  EXPECT_EQ(Push(FixtureModel(), v0 + 1).status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string cmd = Binary("ctl/opd-ctl") + " push-weights --addr " + rollout_->address() +
                          " --secret-file " + (*dir_ / "secret").string() + " --from " +
                          FixtureModel() + " --version " + std::to_string(v0 + 2) +
                          " --chunk-mb 0.01 > /dev/null";
  ASSERT_EQ(Shell(cmd), 0) << cmd;
  EXPECT_EQ(ServingVersion(), v0 + 2);
  auto back = Client()->Generate(kPrompts, greedy);
  ASSERT_TRUE(back.ok());
  for (size_t i = 0; i < back->size(); ++i) EXPECT_EQ((*back)[i].tokens, (*before)[i].tokens);
}

// Sends chunks through the raw stub; `cancel` interrupts the stream instead of closing it.
grpc::Status RawUpdate(const ServerProcess& s, const std::vector<opd::v1::WeightChunk>& chunks,
                       bool cancel) {
  auto channel = *opd::rpc::MakeChannel(Options(s));
  auto stub = opd::v1::Rollout::NewStub(channel);
  grpc::ClientContext ctx;
  opd::rpc::PrepareContext(Options(s), &ctx);
  opd::v1::UpdateWeightsResponse resp;
  auto writer = stub->UpdateWeights(&ctx, &resp);
  for (const auto& c : chunks) {
    if (!writer->Write(c)) break;
  }
  if (cancel) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the server take the chunks
    ctx.TryCancel();
  } else {
    writer->WritesDone();
  }
  return writer->Finish();
}

std::vector<opd::v1::WeightChunk> ChunksOf(lm::CausalLM& model, int64_t version) {
  std::vector<opd::v1::WeightChunk> out;
  auto w = testing_util::WeightsOf(model);
  for (const auto& t : w.chunks) {
    opd::v1::WeightChunk c;
    c.set_version(version);
    opd::rpc::ToProto(t, &c);
    out.push_back(std::move(c));
  }
  return out;
}

TEST_F(RolloutService, InterruptedOrWrongUpdatesLeaveOldWeightsServing) {
  auto b = LoadLocal((*dir_ / "model_b").string());
  const auto greedy = Sampling(0, 0.0f, 1, 10);
  auto before = Client()->Generate(kPrompts, greedy);
  ASSERT_TRUE(before.ok());
  const int64_t v = ServingVersion();
  auto unchanged = [&](const std::string& what) {
    EXPECT_EQ(ServingVersion(), v) << what;
    auto now = Client()->Generate(kPrompts, greedy);
    ASSERT_TRUE(now.ok()) << what;
    for (size_t i = 0; i < now->size(); ++i) {
      EXPECT_EQ((*now)[i].tokens, (*before)[i].tokens) << what;
      EXPECT_EQ((*now)[i].weight_version, v) << what;
    }
  };
  auto chunks = ChunksOf(*b, v + 1);

  // Interrupted after half the tensors.
  std::vector<opd::v1::WeightChunk> half(chunks.begin(), chunks.begin() + chunks.size() / 2);
  EXPECT_EQ(RawUpdate(*rollout_, half, /*cancel=*/true).error_code(), grpc::StatusCode::CANCELLED);
  unchanged("interrupted");
  // Closed cleanly but incomplete.
  auto st = RawUpdate(*rollout_, half, false);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("missing"), std::string::npos) << st.error_message();
  unchanged("incomplete");
  // A wrong shape, a wrong name, a wrong dtype, mixed versions, and an empty stream.
  auto bad = chunks;
  bad[3].mutable_shape()->Set(0, bad[3].shape(0) + 1);
  EXPECT_EQ(RawUpdate(*rollout_, bad, false).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = chunks;
  bad[2].set_name("model.layers.0.mlp.no_such_weight");
  EXPECT_EQ(RawUpdate(*rollout_, bad, false).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = chunks;
  bad[1].set_wire_dtype(opd::v1::WIRE_DTYPE_BFLOAT16);
  EXPECT_EQ(RawUpdate(*rollout_, bad, false).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = chunks;
  bad[4].set_version(v + 7);
  EXPECT_EQ(RawUpdate(*rollout_, bad, false).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = chunks;
  for (auto& c : bad) c.set_version(v);  // not above the serving version
  EXPECT_EQ(RawUpdate(*rollout_, bad, false).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(RawUpdate(*rollout_, {}, false).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  unchanged("wrong tensors");
  // A NaN in one tensor: INVALID_ARGUMENT naming it (it was served).
  bad = chunks;
  {
    std::string data = bad[5].data();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(data.data() + 4 * 3, &nan, 4);
    bad[5].set_data(data);
  }
  st = RawUpdate(*rollout_, bad, false);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("'" + bad[5].name() + "'"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("not finite"), std::string::npos) << st.error_message();
  unchanged("a NaN weight");
  // Version INT64_MAX (it was accepted, and then every later push was stale).
  bad = chunks;
  for (auto& c : bad) c.set_version(std::numeric_limits<int64_t>::max());
  st = RawUpdate(*rollout_, bad, false);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("weight version 9223372036854775807"), std::string::npos)
      << st.error_message();
  unchanged("version INT64_MAX");
}

TEST(RolloutStartup, WithoutSecretUpdateWeightsIsDisabled) {
  auto rollout = ServerProcess::Start(Binary("rollout/opd-rollout"),
                                      {"--model=" + FixtureModel(), "--threads=1"});
  ASSERT_NE(rollout, nullptr);
  auto c = *opd::rpc::RolloutClient::Create(Options(*rollout, "anything"));
  EXPECT_TRUE(c->Generate({{1, 2}}, Sampling(0)).ok());  // open without a secret
  auto model = LoadLocal(FixtureModel());
  auto pushed =
      opd::rpc::StreamWeights(Options(*rollout, "anything"), 1,
                              opd::rpc::OutgoingTensorsOf(opd::rpc::NamedParameters(*model),
                                                          opd::rpc::WireDtype::kFloat32));
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*c->Info()).weight_version(), 0);
}

// ---------------------------------------------------------------------------------------------
// opd-ctl against services

TEST(OpdCtlClient, InfoGenerateAndConnectionFailure) {
  const fs::path dir = TempDir("ctl");
  const auto secret = WriteSecret(dir, kSecret);
  auto rollout =
      ServerProcess::Start(Binary("rollout/opd-rollout"),
                           {"--model=" + FixtureModel(), "--secret-file=" + secret.string()});
  ASSERT_NE(rollout, nullptr);
  const std::string ctl = Binary("ctl/opd-ctl");
  const std::string auth = " --addr " + rollout->address() + " --secret-file " + secret.string();
  ASSERT_EQ(Shell(ctl + " info" + auth + " > " + (dir / "info.json").string()), 0);
  auto info = nlohmann::json::parse(ReadFile(dir / "info.json"));
  EXPECT_EQ(info["service"], "opd.v1.Rollout");
  EXPECT_EQ(info["architecture"], "qwen3_moe");
  {
    std::ofstream in(dir / "prompts.jsonl");
    for (const auto& p : kPrompts) in << nlohmann::json{{"tokens", p}}.dump() << "\n";
  }
  ASSERT_EQ(Shell(ctl + " generate" + auth + " --input " + (dir / "prompts.jsonl").string() +
                  " --samples 2 --max-new-tokens 5 --seed 4 > " + (dir / "gen.jsonl").string()),
            0);
  std::ifstream gen(dir / "gen.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(gen, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["tokens"].size(), 5u);
    EXPECT_EQ(j["logprobs"].size(), 5u);
    EXPECT_EQ(j["finish_reason"], "length");
    ++lines;
  }
  EXPECT_EQ(lines, 6);
  // No server at the address: exit 1, and the message names the address and the gRPC status.
  EXPECT_EQ(Shell(ctl + " info --addr 127.0.0.1:1 --timeout 5 2> " + (dir / "err.txt").string()),
            1);
  const std::string err = ReadFile(dir / "err.txt");
  EXPECT_NE(err.find("127.0.0.1:1"), std::string::npos) << err;
  EXPECT_NE(err.find("UNAVAILABLE"), std::string::npos) << err;
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// The Scorer in-process

std::shared_ptr<lm::CausalLM> TeacherModel() {
  return LoadLocal(FixtureModel());
}

teacher::ScoreJob Job(const std::vector<std::vector<int64_t>>& seqs, int64_t top_k = 0) {
  teacher::ScoreJob j;
  for (const auto& s : seqs) j.sequences.push_back(ToScore(To32(s), 1));
  j.top_k = top_k;
  return j;
}

// A reply over the budget is refused before any work, naming its size and the flag; the bound is
// exact for the wire format (4 bytes per position, 8 per top-k pair) plus a fixed overhead.
TEST(Scorer, ReplyOverTheBudgetIsRefusedBeforeScoring) {
  teacher::ScoreLimits limits;
  limits.vocab_size = 320;
  limits.max_seq_len = 4096;
  auto job = Job({std::vector<int64_t>(1001, 7), std::vector<int64_t>(501, 9)}, 64);
  const int64_t positions = 1000 + 500;
  EXPECT_GE(teacher::ReplyBytes(job), positions * (4 + 64 * 8));
  EXPECT_LE(teacher::ReplyBytes(job), positions * (4 + 64 * 8) + 16 + 2 * 32);
  limits.max_reply_bytes = positions * (4 + 64 * 8);  // just under the reply
  auto st = teacher::Validate(job, limits);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_NE(std::string(st.message()).find("--max-reply-mb"), std::string::npos) << st;
  limits.max_reply_bytes = teacher::ReplyBytes(job);
  EXPECT_TRUE(teacher::Validate(job, limits).ok());
  // The default (1 GiB) refuses the 2,048 x 512, top-k 320 request that crossed protobuf's 2 GiB.
  auto big = Job(std::vector<std::vector<int64_t>>(2048, std::vector<int64_t>(512, 3)), 320);
  teacher::ScoreLimits defaults;
  defaults.vocab_size = 320;
  defaults.max_seq_len = 4096;
  EXPECT_TRUE(absl::IsResourceExhausted(teacher::Validate(big, defaults)));
}

TEST(Scorer, PackedBatchesEqualOneSequenceAtATime) {
  auto model = TeacherModel();
  const auto seqs = FixtureSequences();
  teacher::ScorerOptions o;
  o.max_batch_tokens = 25;  // forces jobs to be split across batches and batches to mix jobs
  teacher::Scorer scorer(model, o);
  std::vector<std::future<absl::StatusOr<std::vector<lm::SequenceScore>>>> futures;
  for (int rep = 0; rep < 3; ++rep) {
    futures.push_back(std::async(std::launch::async, [&] { return scorer.Score(Job(seqs, 4)); }));
  }
  for (auto& f : futures) {
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status();
    for (size_t i = 0; i < seqs.size(); ++i) {
      auto ref =
          lm::SequenceLogprobs(*model, lm::PackedBatch::FromSequences({seqs[i]})).contiguous();
      EXPECT_LE(
          MaxAbsDiff((*r)[i].logprobs, std::vector<float>(ref.data_ptr<float>(),
                                                          ref.data_ptr<float>() + ref.numel())),
          1e-5);
      EXPECT_EQ((*r)[i].topk_ids.size(), (seqs[i].size() - 1) * 4);
    }
  }
}

// Fair scheduling, on the scorer's batch counter: with one worker, a large job of 400 sequences
// (100 batches of 4 under the token budget) is queued, then a small job of 2 sequences once the
// large one's first batch is packed. The small job must finish in the next batch packed after it
// was queued: at most the batch in flight is ahead of it, whatever is queued. That holds on any
// machine; with first-in-first-out packing the small job waited for all the large one's batches
// (here: finished in batch 11 of a 40-sequence job, queued at 2), unless the large job was done
// before the small one arrived, which its size makes unlikely but never a false failure.
TEST(Scorer, SmallJobFinishesInTheNextBatchBehindALargeOne) {
  auto model = TeacherModel();
  teacher::ScorerOptions o;
  o.workers = 1;
  o.max_batch_tokens = 40;  // 4 sequences of 10 tokens per batch
  teacher::Scorer scorer(model, o);
  std::promise<int64_t> large_done, small_done;
  std::vector<std::vector<int64_t>> large_seqs(400, std::vector<int64_t>(10, 5));
  ASSERT_TRUE(scorer
                  .Submit(Job(large_seqs),
                          [&](absl::StatusOr<std::vector<lm::SequenceScore>> r) {
                            EXPECT_TRUE(r.ok()) << r.status();
                            large_done.set_value(scorer.batches());
                          })
                  .ok());
  // Wait (on the counter, not on time) until the large job's first batch is packed.
  for (int i = 0; i < 60000 && scorer.batches() == 0; ++i)  // a failure bound of a minute
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GE(scorer.batches(), 1);
  ASSERT_TRUE(scorer
                  .Submit(Job({std::vector<int64_t>(10, 6), std::vector<int64_t>(10, 7)}),
                          [&](absl::StatusOr<std::vector<lm::SequenceScore>> r) {
                            EXPECT_TRUE(r.ok()) << r.status();
                            small_done.set_value(scorer.batches());
                          })
                  .ok());
  const int64_t queued_at = scorer.batches();  // batches packed before the small job could be
  const int64_t small_in = small_done.get_future().get();
  EXPECT_LE(small_in, queued_at + 1);
  EXPECT_GE(large_done.get_future().get(), 100);
}

// Holds a scorer's only worker inside a job's completion until Release(), so that jobs submitted
// meanwhile queue up whole: the state of the queue is the test's, not the machine's speed.
class WorkerHold {
 public:
  void Start(teacher::Scorer& scorer) {
    auto entered = entered_;
    auto released = released_;
    ASSERT_TRUE(scorer
                    .Submit(Job({{1, 2, 3}}),
                            [entered, released](auto) {
                              entered->set_value();
                              released.wait();
                            })
                    .ok());
    entered_->get_future().wait();
  }
  void Release() {
    if (!done_) release_.set_value();
    done_ = true;
  }
  ~WorkerHold() { Release(); }

 private:
  std::shared_ptr<std::promise<void>> entered_ = std::make_shared<std::promise<void>>();
  std::promise<void> release_;
  std::shared_future<void> released_ = release_.get_future().share();
  bool done_ = false;
};

// The fill the scorer's previous packer reached on `jobs` (sequence lengths, queue order) with
// buckets of `budget` tokens: passes taking each job's next sequence in turn, the bucket closed at
// the first that did not fit. Over the buckets closed while work remained, as Scorer::Packing.
double NextSequencePackerFill(std::vector<std::vector<int64_t>> jobs, int64_t budget) {
  std::vector<size_t> next(jobs.size(), 0);
  auto left = [&] {
    for (size_t j = 0; j < jobs.size(); ++j)
      if (next[j] < jobs[j].size()) return true;
    return false;
  };
  int64_t closed = 0, closed_tokens = 0;
  while (left()) {
    int64_t tokens = 0, items = 0;
    for (bool full = false, took = true; !full && took;) {
      took = false;
      for (size_t j = 0; j < jobs.size() && !full; ++j) {
        if (next[j] == jobs[j].size()) continue;
        const int64_t len = jobs[j][next[j]];
        if (items > 0 && tokens + len > budget) {
          full = true;
        } else {
          tokens += len;
          ++items;
          ++next[j];
          took = true;
        }
      }
    }
    if (left()) {
      ++closed;
      closed_tokens += tokens;
    }
  }
  return static_cast<double>(closed_tokens) / (closed * budget);
}

// Bucket fill on a mixed-length queue: four jobs of 20-60 sequences, each 20-40 or 100-160 tokens
// (the paper's mix of 2k-token prompts with short and long responses, over 16k-token buckets,
// scaled by 1/64 to the fixture's 256 positions), queued whole behind a held worker, packed into
// 256-token buckets. The buckets closed while work remained must be >= 95% full; the previous
// packer, run on the same queue, is well below that. Every job's scores are still complete.
TEST(Scorer, BucketsAreFullOnAMixedLengthQueue) {
  auto model = TeacherModel();
  teacher::ScorerOptions o;
  o.workers = 1;
  o.max_batch_tokens = 256;
  teacher::Scorer scorer(model, o);
  WorkerHold hold;
  hold.Start(scorer);
  std::mt19937 rng(4);
  std::vector<std::future<absl::StatusOr<std::vector<lm::SequenceScore>>>> results;
  std::vector<std::vector<int64_t>> lengths(4);
  for (auto& job_lengths : lengths) {
    std::vector<std::vector<int64_t>> seqs(20 + rng() % 41);
    for (auto& s : seqs) {
      const int64_t len = rng() % 2 ? 20 + rng() % 21 : 100 + rng() % 61;
      s.assign(len, 1 + static_cast<int64_t>(rng() % 95));
      job_lengths.push_back(len);
    }
    auto done = std::make_shared<std::promise<absl::StatusOr<std::vector<lm::SequenceScore>>>>();
    results.push_back(done->get_future());
    ASSERT_TRUE(scorer.Submit(Job(seqs), [done](auto r) { done->set_value(std::move(r)); }).ok());
  }
  const teacher::Scorer::Packing before = scorer.packing();  // the holding job's bucket
  hold.Release();
  for (size_t j = 0; j < results.size(); ++j) {
    auto r = results[j].get();
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->size(), lengths[j].size());
    for (size_t i = 0; i < r->size(); ++i)
      EXPECT_EQ((*r)[i].logprobs.size(), static_cast<size_t>(lengths[j][i] - 1)) << j << " " << i;
  }
  const teacher::Scorer::Packing p = scorer.packing();
  const int64_t closed = p.closed_buckets - before.closed_buckets;
  ASSERT_GT(closed, 10);
  const double fill =
      static_cast<double>(p.closed_tokens - before.closed_tokens) / (closed * o.max_batch_tokens);
  const double previous = NextSequencePackerFill(lengths, o.max_batch_tokens);
  std::printf(
      "%lld buckets, %lld closed with work left, %.1f%% full (the previous packer: %.1f%%)\n",
      static_cast<long long>(p.buckets - before.buckets), static_cast<long long>(closed),
      100 * fill, 100 * previous);
  EXPECT_GE(fill, 0.95);
  EXPECT_LT(previous, 0.85) << "this queue does not tell the packers apart";
}

// Weights with a NaN or an infinity: the job fails with FAILED_PRECONDITION naming the sequence
// and the position (it returned NaN log-probs with OK), with and without top-k; the scorer goes
// on serving other models' jobs.
TEST(Scorer, NonFiniteScoresAreFailedPreconditionNamingThePosition) {
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    auto model = TeacherModel();
    model->named_parameters()["model.norm.weight"].detach()[3] = bad;
    teacher::Scorer scorer(model, {});
    for (int64_t k : {0, 4}) {
      SCOPED_TRACE(testing::Message() << "weight " << bad << " top_k " << k);
      auto job = Job({{1, 2, 3}, {4, 5, 6, 7}}, k);
      job.sequences[0].response_start = 2;
      job.sequences[1].response_start = 3;
      auto r = scorer.Score(job);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      EXPECT_NE(std::string(r.status().message()).find("sequence 0: "), std::string::npos)
          << r.status();
      EXPECT_NE(std::string(r.status().message()).find("at position 2"), std::string::npos)
          << r.status();
      EXPECT_NE(std::string(r.status().message()).find("non-finite"), std::string::npos)
          << r.status();
    }
  }
  teacher::Scorer healthy(TeacherModel(), {});
  auto r = healthy.Score(Job({{1, 2, 3}}, 4));
  ASSERT_TRUE(r.ok()) << r.status();
}

TEST(Scorer, QueueBoundCancellationAndDeadline) {
  auto model = TeacherModel();
  teacher::ScorerOptions o;
  o.max_queue = 2;
  teacher::Scorer scorer(model, o);
  // Hold the worker inside a job's completion so that the queue fills up.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> entered;
  ASSERT_TRUE(scorer
                  .Submit(Job({{1, 2, 3}}),
                          [&](auto) {
                            entered.set_value();
                            released.wait();
                          })
                  .ok());
  entered.get_future().wait();
  std::atomic<int> cancelled{0}, expired{0}, fine{0};
  auto job = Job({{1, 2, 3}});
  job.cancelled = [] { return true; };
  ASSERT_TRUE(
      scorer
          .Submit(job,
                  [&](auto r) { cancelled += r.status().code() == absl::StatusCode::kCancelled; })
          .ok());
  job = Job({{4, 5}});
  job.deadline = absl::Now() - absl::Seconds(1);
  ASSERT_TRUE(scorer
                  .Submit(job,
                          [&](auto r) {
                            expired += r.status().code() == absl::StatusCode::kDeadlineExceeded;
                          })
                  .ok());
  EXPECT_EQ(scorer.Submit(Job({{1}}), [](auto) {}).code(), absl::StatusCode::kResourceExhausted);
  release.set_value();
  while (scorer.queued() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto r = scorer.Score(Job({{1, 2}}));
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(cancelled, 1);
  EXPECT_EQ(expired, 1);
}

}  // namespace
