// TLS and authentication of the learner's links, with a CA made in the test (openssl CLI) and
// every process on 127.0.0.1: a learner configured with `auth.tls` runs OPD steps against TLS
// teacher (mutual TLS) and rollout services and serves its admin service over TLS; plaintext
// clients are refused by all of them; a plaintext learner cannot reach TLS services; a partial
// `auth.tls` set is a config error naming the keys; the admin service refuses a non-loopback
// listen without a secret; the shipped configs keep the admin service on loopback or behind
// TLS + a secret.
#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "child_process.h"
#include "lm/text/tokenizer.h"
#include "lm/util/config.h"
#include "opd/v1/learner.grpc.pb.h"
#include "opd_task.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "rpc/status.h"
#include "tests/testing.h"
#include "trainer/opd/learner_service.h"
#include "trainer/opd/opd_config.h"

using testing_util::Shell;

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::ReadFile;

const std::string kBin = OPD_BINARY_DIR;
const std::string kSecret = "security-test-secret-91d2";

class Security : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("opd_security_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    // A CA, one certificate it signs for 127.0.0.1/localhost, and a second CA that signs nothing
    // we serve.
    ASSERT_TRUE(testing_util::MakeTestCertificates(dir_, /*other_ca=*/true));
    ASSERT_TRUE(testing_util::MakeOpdTask(
        dir_, "--teacher-examples 100 --student-examples 10 --prompts 64 --eval 4", kSecret));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static std::string Path(const std::string& name) { return (dir_ / name).string(); }

  // The TLS options of a client that trusts the test CA (with the node's certificate as client
  // certificate when `client_cert`).
  static opd::rpc::TlsClientOptions Tls(bool client_cert = false) {
    opd::rpc::TlsClientOptions t;
    t.ca_file = Path("ca.pem");
    if (client_cert) {
      t.cert_file = Path("node.pem");
      t.key_file = Path("node.key");
    }
    return t;
  }

  // An opd-teacher / opd-rollout over TLS on an ephemeral loopback port; "127.0.0.1:PORT" or "".
  std::string StartService(const std::string& tag, const std::string& binary,
                           const std::string& model, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {binary,
                                     "--model=" + model,
                                     "--tokenizer=" + Path("task/tokenizer"),
                                     "--secret-file=" + Path("secret"),
                                     "--tls-cert=" + Path("node.pem"),
                                     "--tls-key=" + Path("node.key"),
                                     "--threads=1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    services_.push_back(testing_util::StartServed(dir_, tag, std::move(argv)));
    return services_.back().address;
  }
  // The teacher requires client certificates signed by the CA (mutual TLS).
  std::string StartTeacher() {
    return StartService("teacher", kBin + "/teacher_service/opd-teacher", Path("teacher_small"),
                        {"--tls-client-ca=" + Path("ca.pem")});
  }
  std::string StartRollout() {
    return StartService("rollout", kBin + "/rollout/opd-rollout", Path("student"));
  }

  // `opd-trainer opd` on the demo config: one long stage (stopped by the test), the given extra
  // overrides.
  std::vector<std::string> TrainerArgs(const std::string& run, const std::string& rollout,
                                       const std::string& teacher,
                                       const std::vector<std::string>& sets) {
    std::vector<std::string> all = {"rollout.timeout_s=60",
                                    "stages.0.teachers=[" + teacher + "]",
                                    "stages.1.teachers=[" + teacher + "]",
                                    "stages.0.max_steps=100000",
                                    "stages.0.plateau.enabled=false",
                                    "train.prompts_per_step=4",
                                    "train.teacher_timeout_s=60",
                                    "logging.log_every=1"};
    all.insert(all.end(), sets.begin(), sets.end());
    return testing_util::OpdTrainerArgs(dir_, run, rollout, all);
  }
  std::vector<std::string> TlsSets() {
    return {"auth.tls.ca=" + Path("ca.pem"), "auth.tls.cert=" + Path("node.pem"),
            "auth.tls.key=" + Path("node.key")};
  }

  static inline fs::path dir_;
  std::vector<testing_util::Served> services_;
};

// The learner's admin GetStatus with `opts`.
absl::StatusOr<opd::v1::LearnerStatus> AdminStatus(const opd::rpc::ClientOptions& opts) {
  auto channel = opd::rpc::MakeChannel(opts);
  if (!channel.ok()) return channel.status();
  auto stub = opd::v1::Learner::NewStub(*channel);
  grpc::ClientContext ctx;
  opd::rpc::PrepareContext(opts, &ctx);
  opd::v1::LearnerStatus status;
  absl::Status st = opd::rpc::FromGrpc(
      stub->GetStatus(&ctx, opd::v1::LearnerStatusRequest(), &status), opts.address);
  if (!st.ok()) return st;
  return status;
}

// Whether metrics.jsonl of `run` has a completed OPD step.
bool HasStep(const fs::path& run) {
  return ReadFile(run / "metrics.jsonl").find("opd/reverse_kl") != std::string::npos;
}

TEST_F(Security, TlsLearnerTalksToTlsServicesAndPlaintextClientsAreRefused) {
  const std::string teacher = StartTeacher(), rollout = StartRollout();
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  // Plaintext, and TLS without a client certificate, cannot reach the mutual-TLS teacher; the
  // rollout worker refuses plaintext too.
  opd::rpc::ClientOptions probe;
  probe.secret = kSecret;
  probe.timeout = absl::Seconds(10);
  probe.address = teacher;
  EXPECT_EQ((*opd::rpc::TeacherClient::Create(probe))->Info().status().code(),
            absl::StatusCode::kUnavailable);
  probe.tls = Tls();
  EXPECT_FALSE((*opd::rpc::TeacherClient::Create(probe))->Info().ok());
  probe.tls = Tls(true);
  EXPECT_TRUE((*opd::rpc::TeacherClient::Create(probe))->Info().ok());
  probe.address = rollout;
  probe.tls = {};
  EXPECT_EQ((*opd::rpc::RolloutClient::Create(probe))->Info().status().code(),
            absl::StatusCode::kUnavailable);

  const fs::path run = dir_ / "run_tls";
  std::vector<std::string> sets = TlsSets();
  const testing_util::Served served = testing_util::StartLearnerAdmin(
      dir_, "learner", TrainerArgs(run.string(), rollout, teacher, sets),
      std::chrono::seconds(120));
  ASSERT_FALSE(served.address.empty());
  ChildProcess& learner = *served.process;
  // A step done means the learner sampled from the rollout worker, was scored by the teacher
  // and pushed weights, all over TLS.
  for (int i = 0; i < 2400 && !HasStep(run); ++i) {
    ASSERT_TRUE(learner.Running()) << learner.Log();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(HasStep(run)) << learner.Log();
  EXPECT_NE(learner.Log().find("(TLS)"), std::string::npos) << learner.Log();

  opd::rpc::ClientOptions admin;
  admin.address = served.address;
  admin.secret = kSecret;
  admin.timeout = absl::Seconds(10);
  EXPECT_EQ(AdminStatus(admin).status().code(), absl::StatusCode::kUnavailable)
      << "the admin service answered a plaintext client";
  admin.tls = Tls();
  auto status = AdminStatus(admin);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_GE(status->step(), 1);
  admin.tls.ca_file = Path("other_ca.pem");
  EXPECT_EQ(AdminStatus(admin).status().code(), absl::StatusCode::kUnavailable);
  admin.tls = Tls();
  admin.secret.clear();
  EXPECT_EQ(AdminStatus(admin).status().code(), absl::StatusCode::kUnauthenticated);

  // opd-ctl reaches the admin service over TLS too (a wrong stage: refused by the learner, not
  // by the transport).
  const std::string out = Path("swap.txt");
  const std::string swap = kBin + "/ctl/opd-ctl swap-teacher --learner " + admin.address +
                           " --stage nope --endpoints " + teacher + " --secret-file " +
                           Path("secret");
  EXPECT_NE(Shell(swap + " --tls-ca " + Path("ca.pem") + " > " + out + " 2>&1"), 0);
  EXPECT_NE(ReadFile(out).find("no stage named 'nope'"), std::string::npos) << ReadFile(out);
  EXPECT_NE(Shell(swap + " > " + out + " 2>&1"), 0);
  EXPECT_EQ(ReadFile(out).find("no stage named"), std::string::npos) << ReadFile(out);
  // A real swap: the admin service connects to the (mutual-TLS) teacher with the learner's
  // certificate and checks it before accepting.
  const std::string good = kBin + "/ctl/opd-ctl swap-teacher --learner " + admin.address +
                           " --stage stage1_small_teacher --endpoints " + teacher +
                           " --secret-file " + Path("secret") + " --tls-ca " + Path("ca.pem");
  EXPECT_EQ(Shell(good + " > " + out + " 2>&1"), 0) << ReadFile(out) << learner.Log();

  learner.Kill(SIGTERM);
  EXPECT_EQ(learner.Wait(std::chrono::seconds(120)), 128 + SIGTERM) << learner.Log();
}

TEST_F(Security, PlaintextLearnerCannotReachTlsServices) {
  const std::string teacher = StartTeacher(), rollout = StartRollout();
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  ChildProcess learner(TrainerArgs(Path("run_plain"), rollout, teacher, {}),
                       Path("learner_plain.log"));
  EXPECT_EQ(learner.Wait(std::chrono::seconds(120)), 1) << learner.Log();
  EXPECT_NE(learner.Log().find(rollout), std::string::npos) << learner.Log();
  EXPECT_FALSE(HasStep(Path("run_plain")));
}

TEST_F(Security, PartialTlsConfigIsRefusedNamingTheKeys) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"auth.tls.cert=" + Path("node.pem")}, {"auth.tls.cert", "auth.tls.key"}},
      {{"auth.tls.key=" + Path("node.key")}, {"auth.tls.cert", "auth.tls.key"}},
      {{"auth.tls.cert=" + Path("node.pem"), "auth.tls.key=" + Path("node.key")}, {"auth.tls.ca"}},
      {{"auth.tls.server_name=localhost"}, {"auth.tls.server_name", "auth.tls.ca"}},
      {{"auth.tls.ca=" + Path("ca.pem"), "admin.listen=127.0.0.1:0"},
       {"admin.listen", "auth.tls.cert"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [sets, named] = cases[i];
    const std::string tag = std::to_string(i);
    ChildProcess p(TrainerArgs(Path("run_bad" + tag), "127.0.0.1:1", "127.0.0.1:1", sets),
                   Path("bad" + tag + ".log"));
    EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 2) << p.Log();
    for (const auto& key : named) EXPECT_NE(p.Log().find(key), std::string::npos) << p.Log();
  }
}

TEST_F(Security, AdminServiceRefusesNonLoopbackListenWithoutSecret) {
  trainer::LearnerServerOptions o;
  o.listen = "0.0.0.0:0";
  o.stages = {"s"};
  auto server = trainer::LearnerServer::Start(o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(server.status().message().find("admin.insecure"), std::string::npos) << server.status();
  EXPECT_NE(server.status().message().find("auth.secret_file"), std::string::npos)
      << server.status();
  // A partial TLS set is refused rather than served in plaintext.
  o.listen = "127.0.0.1:0";
  o.secret = kSecret;
  o.tls.key_file = Path("node.key");
  server = trainer::LearnerServer::Start(o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  // On loopback without a secret it starts (and refuses every call).
  o.tls = {};
  o.secret.clear();
  server = trainer::LearnerServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  opd::rpc::ClientOptions c;
  c.address = "127.0.0.1:" + std::to_string((*server)->port());
  EXPECT_EQ(AdminStatus(c).status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(ListenAddress, LoopbackOrNot) {
  for (const char* a :
       {"127.0.0.1:0", "127.1.2.3:7001", "localhost:7001", "[::1]:7001", "unix:/tmp/opd.sock"})
    EXPECT_TRUE(opd::rpc::IsLoopbackListen(a)) << a;
  for (const char* a : {"0.0.0.0:7001", "[::]:7001", ":7001", "10.0.0.5:7001", "host:7001",
                        "[fe80::1]:7001", "127example.com:1"})
    EXPECT_FALSE(opd::rpc::IsLoopbackListen(a)) << a;
}

// Every shipped OPD config keeps its admin service on loopback, or behind TLS and a secret.
TEST(ShippedConfigs, AdminServiceIsLoopbackOrTlsWithSecret) {
  int checked = 0;
  for (const auto& entry :
       fs::recursive_directory_iterator(std::string(OPD_SOURCE_DIR) + "/configs")) {
    if (entry.path().extension() != ".yaml") continue;
    auto config = lm::LoadConfig<trainer::OpdConfig>(entry.path().string(), {});
    if (!config.ok()) continue;  // an SFT config
    ++checked;
    const auto& c = *config;
    EXPECT_TRUE(trainer::ValidateAuthConfig(c.auth, c.admin.listen).ok()) << entry.path();
    EXPECT_FALSE(c.admin.insecure) << entry.path();
    if (c.admin.listen.empty() || opd::rpc::IsLoopbackListen(c.admin.listen)) continue;
    EXPECT_FALSE(c.auth.tls.cert.empty() || c.auth.secret_file.empty())
        << entry.path() << ": admin.listen " << c.admin.listen
        << " is reachable from other hosts without TLS and a secret";
  }
  EXPECT_GE(checked, 2);
}

}  // namespace
