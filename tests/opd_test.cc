// The OPD learner against real services: teacher failover within a step, tokenizer checks at
// connect time and at swap, the admin RPC's authentication, a full two-stage run, and resume
// after the learner is SIGKILLed. Models are tiny random Qwen3-MoE students/teachers with the
// demo's small tokenizer (scripts/demo/make_task.py); every process is on 127.0.0.1.
//
// The failure paths (bounded retries with backoff, cool-downs, cancellation on stop, replies that
// fail validation) use in-process fake services whose every reply the test scripts, and a fake
// clock where backoffs are checked, so nothing depends on the machine's speed.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/synchronization/mutex.h"
#include "child_process.h"
#include "lm/model/model.h"
#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "opd/v1/rollout.grpc.pb.h"
#include "opd/v1/teacher.grpc.pb.h"
#include "opd_task.h"
#include "rpc/codec.h"
#include "rpc/server.h"
#include "rpc/tensor_codec.h"
#include "rpc/weight_stream.h"
#include "tests/opd_fakes.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "trainer/common/signals.h"
#include "trainer/opd/learner_service.h"
#include "trainer/opd/rollout_pool.h"
#include "trainer/opd/teacher_pool.h"

using testing_util::ReadJsonl;
using testing_util::Shell;

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::FakeClock;
using testing_util::FakeRollout;
using testing_util::FakeTeacher;
using testing_util::FakeTeacherServer;
using testing_util::HangingReactor;
using testing_util::InProcessServer;
using testing_util::ProcessState;
using testing_util::WaitFor;

const std::string kBin = OPD_BINARY_DIR;
const std::string kSecret = "opd-test-secret-4f1c";

std::vector<lm::Sample> SomeInputs(int n) {
  std::vector<lm::Sample> out;
  for (int i = 0; i < n; ++i) out.push_back(lm::Sample::ToScore({1, 2, 3, 4 + i % 5}, 2));
  return out;
}

FakeTeacher::Action Fail(grpc::StatusCode code, const std::string& message) {
  FakeTeacher::Action a;
  a.status = grpc::Status(code, message);
  return a;
}

// Reads the complete lines of a JSON-lines file that is still being written.
std::vector<nlohmann::json> ReadCompleteJsonl(const std::filesystem::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

int LastLoggedStep(const std::filesystem::path& metrics) {
  int last = 0;
  for (const auto& m : ReadCompleteJsonl(metrics)) {
    if (m.contains("opd/reverse_kl")) last = std::max(last, m["step"].get<int>());
  }
  return last;
}

class Opd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("opd_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    const std::string py = OPD_PYTHON, src = OPD_SOURCE_DIR, d = dir_.string();
    // Two task directories: the second's tokenizer is trained on other text (another fingerprint).
    ASSERT_TRUE(testing_util::MakeOpdTask(
        dir_, "--teacher-examples 400 --student-examples 50 --prompts 200 --eval 16", kSecret));
    ASSERT_EQ(
        Shell(py + " " + src + "/scripts/demo/make_task.py --out " + d +
              "/other --seed 7 --tokenizer-vocab 270 "
              "--teacher-examples 400 --student-examples 10 --prompts 10 --eval 4 > /dev/null"),
        0);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // An opd-teacher or opd-rollout on an ephemeral port (testing_util::StartTaskService); returns
  // "127.0.0.1:PORT" or "".
  std::string StartService(const std::string& tag, const std::string& binary,
                           const std::string& model, const std::string& tokenizer) {
    testing_util::Served s = testing_util::StartTaskService(dir_, tag, binary, model, tokenizer);
    services_.push_back(std::move(s.process));
    return s.address;
  }
  std::string StartTeacher(const std::string& tag, const std::string& tokenizer = "") {
    return StartService(tag, kBin + "/teacher_service/opd-teacher",
                        (dir_ / "teacher_small").string(),
                        tokenizer.empty() ? (dir_ / "task/tokenizer").string() : tokenizer);
  }
  std::string StartRollout() {
    return StartService("rollout", kBin + "/rollout/opd-rollout", (dir_ / "student").string(),
                        (dir_ / "task/tokenizer").string());
  }
  trainer::TeacherRequirements Requirements() {
    auto tok = lm::Tokenizer::Load((dir_ / "task/tokenizer").string());
    EXPECT_TRUE(tok.ok());
    return {(*tok)->Fingerprint(), 320};
  }
  trainer::TeacherPoolOptions PoolOptions() {
    trainer::TeacherPoolOptions o;
    o.client.secret = kSecret;
    o.client.timeout = absl::Seconds(30);
    o.backoff_initial = absl::Milliseconds(100);
    return o;
  }

  // The opd-trainer command line of a small two-stage run.
  std::vector<std::string> TrainerArgs(const std::string& run, const std::string& rollout,
                                       const std::string& t1, const std::string& t2,
                                       int steps_per_stage,
                                       const std::vector<std::string>& extra_sets = {}) {
    std::vector<std::string> sets = {"stages.0.teachers=[" + t1 + "]",
                                     "stages.1.teachers=[" + t2 + "]",
                                     "stages.0.max_steps=" + std::to_string(steps_per_stage),
                                     "stages.0.plateau.enabled=false",
                                     "stages.1.max_steps=" + std::to_string(steps_per_stage),
                                     "train.prompts_per_step=8",
                                     "checkpoint.every=1"};
    sets.insert(sets.end(), extra_sets.begin(), extra_sets.end());
    return testing_util::OpdTrainerArgs(dir_, run, rollout, sets);
  }
  std::string Fingerprint() { return Requirements().tokenizer_fingerprint; }

  static inline fs::path dir_;
  std::vector<std::unique_ptr<ChildProcess>> services_;

 public:
  std::vector<std::string> Args(const std::string& run, const std::string& rollout,
                                const std::string& t1, const std::string& t2, int steps_per_stage,
                                const std::vector<std::string>& extra_sets) {
    return TrainerArgs(run, rollout, t1, t2, steps_per_stage, extra_sets);
  }
};

// Kill one of two replicas while a step's scoring is in flight: the call still returns every
// sequence's scores, each equal to the in-process teacher's (so none was lost or mixed up).
// Replica b is frozen (SIGSTOP) before the step, so it holds its first shares unanswered; it is
// killed once replica a has delivered scores, i.e. mid-step, whatever the machine's speed.
TEST_F(Opd, TeacherReplicaKilledMidStepEverySequenceScoredOnce) {
  const std::string a = StartTeacher("teacher_a"), b = StartTeacher("teacher_b");
  ASSERT_FALSE(a.empty() || b.empty());
  auto opts = PoolOptions();
  opts.max_sequences_per_call = 2;
  opts.client.timeout =
      absl::Seconds(600);               // b's frozen calls must end by the kill, not a deadline
  opts.readmit_after = absl::Hours(1);  // the killed replica does not come back
  auto pool = trainer::TeacherPool::Connect("s", {a, b}, Requirements(), opts);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<lm::Sample> inputs;
  std::mt19937 rng(3);
  for (int i = 0; i < 600; ++i) {
    std::vector<int32_t> t(20 + i % 17);
    for (auto& x : t) x = static_cast<int32_t>(rng() % 280);
    inputs.push_back(lm::Sample::ToScore(t, 5 + i % 7));
  }
  ChildProcess& replica_b = *services_[1];
  replica_b.Kill(SIGSTOP);
  ASSERT_TRUE(
      WaitFor([&] { return ProcessState(replica_b.pid()) == 'T'; }, std::chrono::seconds(30)));
  std::atomic<bool> finished{false};
  absl::StatusOr<std::vector<lm::SequenceScore>> scores;
  std::thread scorer([&] {
    scores = (*pool)->Score(inputs, {});
    finished = true;
  });
  // a has answered part of the step; b cannot have answered anything.
  EXPECT_TRUE(WaitFor([&] { return (*pool)->sequences_scored() > 0; }, std::chrono::seconds(120)));
  EXPECT_FALSE(finished.load()) << "the step cannot end while b holds a share";
  replica_b.Kill(SIGKILL);
  scorer.join();
  ASSERT_TRUE(scores.ok()) << scores.status();
  EXPECT_GE((*pool)->failovers(), 1);
  EXPECT_EQ((*pool)->healthy_count(), 1);
  EXPECT_EQ((*pool)->sequences_scored(), static_cast<int64_t>(inputs.size()));

  torch::NoGradGuard no_grad;
  auto teacher = lm::LoadModel((dir_ / "teacher_small").string());
  ASSERT_TRUE(teacher.ok());
  double worst = 0;
  for (size_t i = 0; i < inputs.size(); i += 7) {
    std::vector<int64_t> seq(inputs[i].tokens.begin(), inputs[i].tokens.end());
    auto lp = lm::SequenceLogprobs(**teacher, lm::PackedBatch::FromSequences({seq}));
    auto ref = lp.narrow(0, inputs[i].response_start - 1, seq.size() - inputs[i].response_start);
    ASSERT_EQ((*scores)[i].logprobs.size(), static_cast<size_t>(ref.numel())) << i;
    worst =
        std::max(worst, (torch::tensor((*scores)[i].logprobs) - ref).abs().max().item<double>());
  }
  EXPECT_LE(worst, 1e-4);
}

// With every replica down the pool waits (with backoff) and resumes when one comes back.
TEST_F(Opd, NoHealthyReplicaWaitsUntilOneReturns) {
  const std::string a = StartTeacher("teacher_w");
  ASSERT_FALSE(a.empty());
  auto pool = trainer::TeacherPool::Connect("s", {a}, Requirements(), PoolOptions());
  ASSERT_TRUE(pool.ok()) << pool.status();
  services_[0]->Kill(SIGKILL);
  services_[0]->Wait(std::chrono::seconds(5));
  // Stop asking after a while: the call must end Cancelled, not with partial scores.
  const auto start = std::chrono::steady_clock::now();
  auto r = (*pool)->Score(testing_util::ToScore({{{1, 2, 3, 4}, 2}}), {}, [&] {
    return std::chrono::steady_clock::now() - start > std::chrono::seconds(2);
  });
  EXPECT_TRUE(absl::IsCancelled(r.status())) << r.status();
}

// Every replica down for good: Score ends DEADLINE_EXCEEDED at train.score_deadline_s, naming the
// stage and its replicas, instead of waiting for one to return. Time is the pool's own (a clock
// the waits advance), so the test does not depend on how fast this machine is.
TEST_F(Opd, ScoringEndsAtItsDeadlineWhenNoReplicaReturns) {
  const std::string a = StartTeacher("teacher_deadline");
  ASSERT_FALSE(a.empty());
  auto opts = PoolOptions();
  absl::Time now = absl::UnixEpoch();
  absl::Duration waited;
  opts.clock = [&] { return now; };
  opts.wait = [&](absl::Duration d, const std::function<bool()>&) {
    now += d;
    waited += d;
    return true;
  };
  opts.score_deadline = absl::Seconds(90);
  auto pool = trainer::TeacherPool::Connect("stage_one", {a}, Requirements(), opts);
  ASSERT_TRUE(pool.ok()) << pool.status();
  services_[0]->Kill(SIGKILL);
  services_[0]->Wait(std::chrono::seconds(5));
  auto r = (*pool)->Score(testing_util::ToScore({{{1, 2, 3, 4}, 2}}), {}, nullptr);
  ASSERT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  const std::string m(r.status().message());
  EXPECT_NE(m.find("stage 'stage_one'"), std::string::npos) << m;
  EXPECT_NE(m.find(a), std::string::npos) << m;
  EXPECT_NE(m.find("train.score_deadline_s"), std::string::npos) << m;
  // The waits end at the deadline, not a backoff past it.
  EXPECT_GE(waited, absl::Seconds(90));
  EXPECT_LE(waited, absl::Seconds(90) + absl::Milliseconds(10));
}

// The learner's admin service for `stages`, on a loopback port with the test's secret (the tests
// below play its training loop).
std::unique_ptr<trainer::LearnerServer> StartAdmin(const std::vector<std::string>& stages) {
  trainer::LearnerServerOptions lo;
  lo.listen = "127.0.0.1:0";
  lo.secret = kSecret;
  lo.stages = stages;
  auto learner = trainer::LearnerServer::Start(lo);
  EXPECT_TRUE(learner.ok()) << learner.status();
  return learner.ok() ? std::move(*learner) : nullptr;
}

TEST_F(Opd, TeacherWithAnotherTokenizerIsRefusedAtConnectAndAtSwap) {
  const std::string good = StartTeacher("teacher_good");
  const std::string bad = StartTeacher("teacher_bad", (dir_ / "other/tokenizer").string());
  ASSERT_FALSE(good.empty() || bad.empty());
  auto other = lm::Tokenizer::Load((dir_ / "other/tokenizer").string());
  ASSERT_TRUE(other.ok());
  ASSERT_NE((*other)->Fingerprint(), Requirements().tokenizer_fingerprint)
      << "the test needs two tokenizers";
  auto pool = trainer::TeacherPool::Connect("stage2", {bad}, Requirements(), PoolOptions());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(pool.status().message().find("fingerprint"), std::string::npos) << pool.status();
  EXPECT_NE(pool.status().message().find(bad), std::string::npos) << pool.status();

  const std::unique_ptr<trainer::LearnerServer> learner = StartAdmin({"stage1", "stage2"});
  ASSERT_NE(learner, nullptr);
  const std::string addr = "127.0.0.1:" + std::to_string(learner->port());
  const std::string ctl = kBin + "/ctl/opd-ctl swap-teacher --learner " + addr + " --stage stage2 ";
  const std::string secret = " --secret-file " + (dir_ / "secret").string();
  const std::string out = (dir_ / "swap.txt").string();
  auto read_out = [&] {
    std::ifstream in(out);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  // A swap call stays open until the training loop's step boundary answers it: opd-ctl runs as
  // a child while the test plays the training loop (ServePendingSwap connects and checks).
  auto swap_call = [&](const std::string& endpoints, const std::string& tag) {
    return std::make_unique<ChildProcess>(
        std::vector<std::string>{kBin + "/ctl/opd-ctl", "swap-teacher", "--learner", addr,
                                 "--stage", "stage2", "--endpoints", endpoints, "--secret-file",
                                 (dir_ / "secret").string()},
        (dir_ / (tag + ".log")).string());
  };
  std::vector<std::string> applied;
  auto step_boundary = [&] {
    return learner->ServePendingSwap([&](const trainer::SwapRequest& r) -> absl::Status {
      auto p = trainer::TeacherPool::Connect(r.stage, r.endpoints, Requirements(), PoolOptions());
      if (!p.ok()) return p.status();
      applied = r.endpoints;
      return absl::OkStatus();
    });
  };
  auto queued = [&] {
    return WaitFor([&] { return learner->swap_pending(); }, std::chrono::seconds(60));
  };
  // Wrong tokenizer: refused at the boundary, the caller is told why, nothing applied.
  {
    auto call = swap_call(bad, "swap_bad");
    ASSERT_TRUE(queued()) << call->Log();
    EXPECT_TRUE(step_boundary());
    EXPECT_EQ(call->Wait(std::chrono::seconds(60)), 1) << call->Log();
    EXPECT_NE(call->Log().find("fingerprint"), std::string::npos) << call->Log();
    EXPECT_TRUE(applied.empty());
  }
  // No secret: UNAUTHENTICATED at once, nothing queued.
  EXPECT_NE(Shell("env -u OPD_SECRET " + ctl + "--endpoints " + good + " > " + out + " 2>&1"), 0);
  EXPECT_NE(read_out().find("16"), std::string::npos) << read_out();  // grpc::UNAUTHENTICATED
  EXPECT_FALSE(learner->swap_pending());
  // Unknown stage.
  EXPECT_NE(Shell(kBin + "/ctl/opd-ctl swap-teacher --learner " + addr +
                  " --stage nope --endpoints " + good + secret + " > " + out + " 2>&1"),
            0);
  EXPECT_FALSE(learner->swap_pending());
  // A compatible teacher: applied at the boundary, the caller gets OK.
  {
    auto call = swap_call(good, "swap_good");
    ASSERT_TRUE(queued()) << call->Log();
    EXPECT_TRUE(step_boundary());
    EXPECT_EQ(call->Wait(std::chrono::seconds(60)), 0) << call->Log();
    EXPECT_EQ(applied, std::vector<std::string>{good});
  }
  EXPECT_FALSE(step_boundary()) << "nothing is queued any more";
}

// One swap per step boundary: a second one while the first is queued is FAILED_PRECONDITION
// (instead of silently replacing it), the swap is applied on the thread that serves the step
// boundary, and a caller that gives up withdraws its swap.
TEST_F(Opd, SecondSwapBeforeTheStepBoundaryIsRefused) {
  FakeTeacherServer t1("opd.v1.Teacher", Fingerprint(), [](int) { return FakeTeacher::Action(); });
  FakeTeacherServer t2("opd.v1.Teacher", Fingerprint(), [](int) { return FakeTeacher::Action(); });
  const std::unique_ptr<trainer::LearnerServer> learner = StartAdmin({"stage1"});
  ASSERT_NE(learner, nullptr);
  const std::string addr = "127.0.0.1:" + std::to_string(learner->port());
  auto swap_args = [&](const std::string& endpoints) {
    return std::vector<std::string>{kBin + "/ctl/opd-ctl",
                                    "swap-teacher",
                                    "--learner",
                                    addr,
                                    "--stage",
                                    "stage1",
                                    "--endpoints",
                                    endpoints,
                                    "--secret-file",
                                    (dir_ / "secret").string()};
  };
  ChildProcess first(swap_args(t1.address), (dir_ / "swap_first.log").string());
  ASSERT_TRUE(WaitFor([&] { return learner->swap_pending(); }, std::chrono::seconds(60)))
      << first.Log();
  ChildProcess second(swap_args(t2.address), (dir_ / "swap_second.log").string());
  EXPECT_EQ(second.Wait(std::chrono::seconds(60)), 1) << second.Log();
  EXPECT_NE(second.Log().find(" 9 "), std::string::npos) << second.Log();  // FAILED_PRECONDITION
  EXPECT_NE(second.Log().find("already queued"), std::string::npos) << second.Log();

  std::vector<std::string> applied;
  std::thread::id applied_on;
  EXPECT_TRUE(learner->ServePendingSwap([&](const trainer::SwapRequest& r) {
    applied = r.endpoints;
    applied_on = std::this_thread::get_id();
    return absl::OkStatus();
  }));
  EXPECT_EQ(first.Wait(std::chrono::seconds(60)), 0) << first.Log();
  EXPECT_EQ(applied, std::vector<std::string>{t1.address}) << "the first swap stands";
  EXPECT_EQ(applied_on, std::this_thread::get_id());

  // A caller that goes away before the boundary withdraws its swap.
  ChildProcess gone(swap_args(t2.address), (dir_ / "swap_gone.log").string());
  ASSERT_TRUE(WaitFor([&] { return learner->swap_pending(); }, std::chrono::seconds(60)));
  gone.Kill(SIGKILL);
  EXPECT_TRUE(WaitFor([&] { return !learner->swap_pending(); }, std::chrono::seconds(60)));
  EXPECT_FALSE(learner->ServePendingSwap([](const trainer::SwapRequest&) {
    ADD_FAILURE() << "a withdrawn swap was applied";
    return absl::OkStatus();
  }));
}

// The swap's moves at a step boundary: take (the call leaves the queue), then answer. A taken swap
// dropped unanswered (the job ends between the moves) answers its caller ABORTED, once.
TEST_F(Opd, TakenSwapIsAnsweredOnceAndAbortedWhenDropped) {
  FakeTeacherServer t1("opd.v1.Teacher", Fingerprint(), [](int) { return FakeTeacher::Action(); });
  const std::unique_ptr<trainer::LearnerServer> learner = StartAdmin({"stage1"});
  ASSERT_NE(learner, nullptr);
  auto call = [&](const std::string& tag) {
    return std::make_unique<ChildProcess>(
        std::vector<std::string>{kBin + "/ctl/opd-ctl", "swap-teacher", "--learner",
                                 "127.0.0.1:" + std::to_string(learner->port()), "--stage",
                                 "stage1", "--endpoints", t1.address, "--secret-file",
                                 (dir_ / "secret").string()},
        (dir_ / (tag + ".log")).string());
  };
  EXPECT_EQ(learner->TakeSwap(), nullptr) << "nothing is queued";
  {
    auto answered = call("swap_answered");
    ASSERT_TRUE(WaitFor([&] { return learner->swap_pending(); }, std::chrono::seconds(60)))
        << answered->Log();
    auto taken = learner->TakeSwap();
    ASSERT_NE(taken, nullptr);
    EXPECT_FALSE(learner->swap_pending()) << "taken off the queue";
    EXPECT_EQ(taken->request().endpoints, std::vector<std::string>{t1.address});
    taken->Answer(absl::UnavailableError("rank 1 cannot connect"));
    taken.reset();  // answered already: the destructor adds nothing
    EXPECT_EQ(answered->Wait(std::chrono::seconds(60)), 1) << answered->Log();
    EXPECT_NE(answered->Log().find("rank 1 cannot connect"), std::string::npos) << answered->Log();
    EXPECT_NE(answered->Log().find(": 14 "), std::string::npos) << answered->Log();  // UNAVAILABLE
  }
  {
    auto dropped = call("swap_dropped");
    ASSERT_TRUE(WaitFor([&] { return learner->swap_pending(); }, std::chrono::seconds(60)))
        << dropped->Log();
    learner->TakeSwap().reset();
    EXPECT_EQ(dropped->Wait(std::chrono::seconds(60)), 1) << dropped->Log();
    EXPECT_NE(dropped->Log().find(": 10 "), std::string::npos) << dropped->Log();  // ABORTED
    EXPECT_NE(dropped->Log().find("nothing changed"), std::string::npos) << dropped->Log();
  }
}

// A two-stage run: the stage switch happens by the rule, metrics are complete, and a SIGKILLed
// learner resumes from its last checkpoint and finishes the cascade with every step logged once.
TEST_F(Opd, TwoStageRunSurvivesSigkillOfTheLearner) {
  const std::string t1 = StartTeacher("teacher_1"), t2 = StartTeacher("teacher_2"),
                    ro = StartRollout();
  ASSERT_FALSE(t1.empty() || t2.empty() || ro.empty());
  const fs::path run = dir_ / "run";
  {
    ChildProcess first(TrainerArgs(run.string(), ro, t1, t2, 3), (dir_ / "opd1.log").string());
    // Kill it once step 2's checkpoint exists (mid-run: 6 steps in all).
    for (int i = 0; i < 1200 && !fs::exists(run / "checkpoints/step_000002"); ++i) {
      ASSERT_TRUE(first.Running()) << first.Log();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    first.Kill(SIGKILL);
    EXPECT_EQ(first.Wait(std::chrono::seconds(10)), 128 + SIGKILL);
  }
  ChildProcess second(TrainerArgs(run.string(), ro, t1, t2, 3), (dir_ / "opd2.log").string());
  ASSERT_EQ(second.Wait(std::chrono::seconds(300)), 0) << second.Log();
  EXPECT_NE(second.Log().find("resumed from"), std::string::npos) << second.Log();

  auto summary = nlohmann::json::parse(std::ifstream(run / "summary.json"));
  EXPECT_EQ(summary["steps"], 6);
  ASSERT_EQ(summary["stages"].size(), 2u);
  EXPECT_EQ(summary["stages"][0]["end_step"], 3);
  EXPECT_EQ(summary["stages"][0]["reason"], "max_steps");
  EXPECT_EQ(summary["stages"][1]["end_step"], 6);
  std::vector<int> steps;
  for (const auto& m : ReadJsonl(run / "metrics.jsonl")) {
    if (m.contains("opd/reverse_kl")) {
      steps.push_back(m["step"].get<int>());
      EXPECT_EQ(m["opd/stage"].get<double>(), m["step"].get<int>() <= 3 ? 0.0 : 1.0) << m.dump();
      EXPECT_TRUE(m["opd/reverse_kl"].is_number());
    }
  }
  EXPECT_EQ(steps, (std::vector<int>{1, 2, 3, 4, 5, 6}));
}

// A stage whose teacher has another tokenizer stops the run at the switch, before any of its
// steps: the last logged step is the previous stage's last.
TEST_F(Opd, MismatchedNextStageTeacherStopsTheRunBeforeItsFirstStep) {
  const std::string t1 = StartTeacher("teacher_s1"),
                    bad = StartTeacher("teacher_s2", (dir_ / "other/tokenizer").string());
  const std::string ro = StartRollout();
  ASSERT_FALSE(t1.empty() || bad.empty() || ro.empty());
  const fs::path run = dir_ / "run_bad";
  ChildProcess p(TrainerArgs(run.string(), ro, t1, bad, 2), (dir_ / "opd_bad.log").string());
  EXPECT_EQ(p.Wait(std::chrono::seconds(300)), 1) << p.Log();
  EXPECT_NE(p.Log().find("fingerprint"), std::string::npos) << p.Log();
  int last = 0;
  for (const auto& m : ReadJsonl(run / "metrics.jsonl"))
    last = std::max(last, m["step"].get<int>());
  EXPECT_EQ(last, 2);
}

// --- retries, cool-downs, stop (fake teachers, fake time) ---

trainer::TeacherPoolOptions FakePoolOptions(FakeClock* clock) {
  trainer::TeacherPoolOptions o;
  o.client.secret = kSecret;
  o.client.timeout = absl::Seconds(60);
  o.backoff_initial = absl::Milliseconds(100);
  o.backoff_max = absl::Seconds(10);
  o.readmit_after = absl::Seconds(1);
  o.max_attempts = 4;
  clock->Drive(&o);
  return o;
}

// A share that keeps failing transiently is retried a bounded number of times, with a doubling
// backoff, and the step then fails naming the last error. Before, it was retried without end
// (the fake teachers here give in after 50 calls, so an unbounded pool would succeed).
TEST_F(Opd, TransientTeacherErrorsAreRetriedWithBackoffAFixedNumberOfTimes) {
  FakeClock clock;
  std::vector<absl::Time> at;
  FakeTeacherServer busy("opd.v1.Teacher", Fingerprint(), [&](int call) {
    at.push_back(clock.Now());  // calls of one share come one after another
    return call < 50 ? Fail(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full")
                     : FakeTeacher::Action();
  });
  auto pool =
      trainer::TeacherPool::Connect("s", {busy.address}, Requirements(), FakePoolOptions(&clock));
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto r = (*pool)->Score(SomeInputs(1), {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("failed 4 times"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("queue full"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find(busy.address), std::string::npos) << r.status();
  EXPECT_EQ(busy.service.calls(), 4);
  ASSERT_EQ(at.size(), 4u);
  EXPECT_EQ(at[1] - at[0], absl::Milliseconds(100));
  EXPECT_EQ(at[2] - at[1], absl::Milliseconds(200));
  EXPECT_EQ(at[3] - at[2], absl::Milliseconds(400));

  // INTERNAL (a replica that crashes on this input, say) is bounded the same way; the replica
  // is out of rotation between tries and comes back through its health check.
  FakeTeacherServer broken("opd.v1.Teacher", Fingerprint(), [](int call) {
    return call < 50 ? Fail(grpc::StatusCode::INTERNAL, "boom") : FakeTeacher::Action();
  });
  auto pool2 =
      trainer::TeacherPool::Connect("s", {broken.address}, Requirements(), FakePoolOptions(&clock));
  ASSERT_TRUE(pool2.ok()) << pool2.status();
  auto r2 = (*pool2)->Score(SomeInputs(1), {});
  EXPECT_EQ(r2.status().code(), absl::StatusCode::kInternal) << r2.status();
  EXPECT_NE(r2.status().message().find("boom"), std::string::npos) << r2.status();
  EXPECT_EQ(broken.service.calls(), 4);
}

// A replica that failed stays out of rotation for its cool-down even though its health check
// passes at once (before, the next round re-admitted it), and comes back after it.
TEST_F(Opd, FailedTeacherReplicaIsReadmittedOnlyAfterItsCoolDown) {
  FakeClock clock;
  const absl::Time back = clock.Now() + absl::Hours(1);
  FakeTeacherServer flaky("opd.v1.Teacher", Fingerprint(), [&](int) {
    // Scoring fails until the cool-down is over (its health check passes all along).
    return clock.Now() < back ? Fail(grpc::StatusCode::UNAVAILABLE, "flaky")
                              : FakeTeacher::Action();
  });
  FakeTeacherServer steady("opd.v1.Teacher", Fingerprint(),
                           [](int) { return FakeTeacher::Action(); });
  auto o = FakePoolOptions(&clock);
  o.max_sequences_per_call = 1;
  o.readmit_after = absl::Hours(1);
  auto pool =
      trainer::TeacherPool::Connect("s", {flaky.address, steady.address}, Requirements(), o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto r = (*pool)->Score(SomeInputs(20), {});
  ASSERT_TRUE(r.ok()) << r.status();
  // At most the first round's two calls (two shares per replica per round) reach it.
  EXPECT_LE(flaky.service.calls(), 2) << "re-admitted during its cool-down";
  const int before = flaky.service.calls();
  EXPECT_EQ(steady.service.calls(), 20);
  EXPECT_EQ((*pool)->healthy_count(), 1);

  clock.Advance(back - clock.Now() + absl::Seconds(1));
  auto r2 = (*pool)->Score(SomeInputs(20), {});
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_GT(flaky.service.calls(), before) << "not re-admitted after its cool-down";
  EXPECT_EQ((*pool)->healthy_count(), 2);
}

// A deterministic failure is not retried: the step ends with the teacher's error, named.
TEST_F(Opd, DeterministicTeacherErrorEndsTheStepNamingTheTeacher) {
  FakeClock clock;
  FakeTeacherServer refusing("opd.v1.Teacher", Fingerprint(), [](int) {
    return Fail(grpc::StatusCode::INVALID_ARGUMENT, "sequence 0: id 999 is outside [0, 320)");
  });
  auto pool = trainer::TeacherPool::Connect("stage_x", {refusing.address}, Requirements(),
                                            FakePoolOptions(&clock));
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto r = (*pool)->Score(SomeInputs(3), {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("stage 'stage_x'"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find(refusing.address), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("id 999"), std::string::npos) << r.status();
  EXPECT_EQ(refusing.service.calls(), 1);
}

// `stop` is checked between retries too (before, only while no replica was healthy).
TEST_F(Opd, StopEndsScoringBetweenRetries) {
  FakeClock clock;
  FakeTeacherServer busy("opd.v1.Teacher", Fingerprint(), [](int call) {
    return call < 50 ? Fail(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full")
                     : FakeTeacher::Action();
  });
  auto o = FakePoolOptions(&clock);
  o.max_attempts = 1000;
  auto pool = trainer::TeacherPool::Connect("s", {busy.address}, Requirements(), o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto r = (*pool)->Score(SomeInputs(1), {}, [&] { return busy.service.calls() >= 3; });
  EXPECT_TRUE(absl::IsCancelled(r.status())) << r.status();
  EXPECT_EQ(busy.service.calls(), 3);
}

// A stop signal cancels a Score in flight at once (its deadline here is an hour): the signal's
// helper thread runs the StopCallback, which cancels every registered call.
TEST_F(Opd, StopSignalCancelsAScoreInFlight) {
  FakeTeacherServer stuck("opd.v1.Teacher", Fingerprint(), [](int) {
    FakeTeacher::Action a;
    a.hang = true;
    return a;
  });
  auto canceller = std::make_shared<opd::rpc::CallCanceller>();
  auto o = PoolOptions();
  o.client.timeout = absl::Hours(1);
  o.client.canceller = canceller;
  auto pool = trainer::TeacherPool::Connect("s", {stuck.address}, Requirements(), o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  trainer::ResetStopForTest();
  trainer::StopCallback cancel_on_stop([canceller] { canceller->Cancel(); });
  auto scoring = std::async(std::launch::async, [&] {
    return (*pool)->Score(SomeInputs(2), {}, [] { return trainer::StopRequested(); });
  });
  ASSERT_TRUE(stuck.service.AwaitHang(absl::Seconds(60)));
  trainer::RaiseStopForTest(SIGTERM);
  if (scoring.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    stuck.Shutdown();  // so that the failing test ends too
    FAIL() << "the stop signal did not end the Score in flight";
  }
  auto r = scoring.get();
  EXPECT_TRUE(absl::IsCancelled(r.status())) << r.status();
  EXPECT_EQ(stuck.service.calls(), 1);
  trainer::ResetStopForTest();
  std::signal(SIGINT, SIG_DFL);  // the rest of this process is not a training job
  std::signal(SIGTERM, SIG_DFL);
}

// --- what crosses the wire is checked ---

std::vector<float> Floats(const std::string& bytes) {
  return *opd::rpc::UnpackArray<float>(bytes, static_cast<int64_t>(bytes.size() / 4), "x");
}
std::vector<int32_t> Ints(const std::string& bytes) {
  return *opd::rpc::UnpackArray<int32_t>(bytes, static_cast<int64_t>(bytes.size() / 4), "x");
}

TEST_F(Opd, TeacherRepliesThatFailValidationAreRefusedNamingTheField) {
  struct Case {
    std::function<void(opd::v1::ScoreResponse*)> corrupt;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](opd::v1::ScoreResponse* r) {
         auto ids = Ints(r->sequences(0).topk_ids());
         ids[3] = 400;
         *r->mutable_sequences(0)->mutable_topk_ids() = opd::rpc::PackArray(ids);
       },
       "topk_ids[3] = 400 is outside the vocabulary [0, 320)"},
      {[](opd::v1::ScoreResponse* r) {
         auto ids = Ints(r->sequences(0).topk_ids());
         ids[0] = -1;
         *r->mutable_sequences(0)->mutable_topk_ids() = opd::rpc::PackArray(ids);
       },
       "topk_ids[0] = -1"},
      {[](opd::v1::ScoreResponse* r) {
         auto lp = Floats(r->sequences(0).logprobs());
         lp[1] = std::nanf("");
         *r->mutable_sequences(0)->mutable_logprobs() = opd::rpc::PackArray(lp);
       },
       "logprobs[1] = nan is not a log-probability"},
      {[](opd::v1::ScoreResponse* r) {
         auto lp = Floats(r->sequences(0).topk_logprobs());
         lp[2] = 3.0f;
         *r->mutable_sequences(0)->mutable_topk_logprobs() = opd::rpc::PackArray(lp);
       },
       "topk_logprobs[2] = 3 is not a log-probability"},
  };
  for (const auto& c : cases) {
    FakeTeacherServer t("opd.v1.Teacher", Fingerprint(), [&](int) {
      FakeTeacher::Action a;
      a.corrupt = c.corrupt;
      return a;
    });
    FakeClock clock;
    auto pool =
        trainer::TeacherPool::Connect("s", {t.address}, Requirements(), FakePoolOptions(&clock));
    ASSERT_TRUE(pool.ok()) << pool.status();
    auto r = (*pool)->Score(SomeInputs(1), {1.0f, 2});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_NE(r.status().message().find(c.expected), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(t.address), std::string::npos) << r.status();
  }
}

TEST_F(Opd, RolloutRepliesThatFailValidationAreRefusedNamingTheField) {
  struct Case {
    std::function<void(std::vector<opd::v1::Sample>*)> corrupt;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {nullptr, ""},
      {[](auto* v) { (*v)[0].set_prompt_index(9); }, "prompt_index 9 is outside [0, 2)"},
      {[](auto* v) { (*v)[1] = (*v)[0]; }, "sent (prompt_index 0, sample_index 0) twice"},
      {[](auto* v) { (*v)[2].set_sample_index(5); }, "sample_index 5 is outside [0, 2)"},
      {[](auto* v) { (*v)[0].set_tokens(1, 320); },
       "tokens[1] = 320 is outside the vocabulary [0, 320)"},
      {[](auto* v) { (*v)[3].set_weight_version(1); }, "weight_version 1 is not in [3, 3]"},
      {[](auto* v) { v->pop_back(); }, "ended without 1 of prompt 1's samples"},
  };
  torch::nn::Linear weights(2, 2);
  for (const auto& c : cases) {
    InProcessServer<FakeRollout> worker("opd.v1.Rollout", Fingerprint());
    worker.service.corrupt = c.corrupt;
    opd::rpc::ClientOptions base;
    base.secret = kSecret;
    auto pool = trainer::RolloutPool::Connect({worker.address}, base, Fingerprint(), 320);
    ASSERT_TRUE(pool.ok()) << pool.status();
    // Version 3 goes out through the one weight streamer, and the pool is told, as a
    // WeightPublisher tells it: the samples' versions are checked against it from now on.
    opd::rpc::ClientOptions to = base;
    to.address = worker.address;
    auto pushed =
        opd::rpc::StreamWeights(to, 3,
                                opd::rpc::OutgoingTensorsOf(opd::rpc::NamedParameters(*weights),
                                                            opd::rpc::WireDtype::kFloat32));
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    (*pool)->RecordPush(3, /*acknowledged=*/true);
    lm::SamplingParams g;
    g.samples_per_prompt = 2;
    g.max_new_tokens = 256;
    const std::vector<int32_t> a = {1, 2}, b = {3, 4};
    auto r = (*pool)->Generate({{0, a}, {1, b}}, g);
    if (c.expected.empty()) {
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->size(), 4u);
      continue;
    }
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_NE(r.status().message().find(c.expected), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(worker.address), std::string::npos) << r.status();
  }
}

TEST(SampleStats, StalenessAndTruncation) {
  std::vector<lm::Sample> samples(4);
  const int64_t versions[] = {3, 2, 2, 3};
  for (size_t i = 0; i < samples.size(); ++i) {
    samples[i].weight_version = versions[i];
    samples[i].finish = i == 0 ? lm::FinishReason::kLength : lm::FinishReason::kStop;
  }
  const trainer::SampleStats st = trainer::SummarizeSamples(samples, 3);
  EXPECT_DOUBLE_EQ(st.staleness_mean, 0.5);
  EXPECT_DOUBLE_EQ(st.staleness_max, 1.0);
  EXPECT_DOUBLE_EQ(st.truncated_frac, 0.25);
}

// --- the trainer's stop and failure paths (real processes) ---

// SIGTERM while a Score is in flight (deadline an hour): the call is cancelled, the last
// completed step is checkpointed and the trainer exits 128 + SIGTERM within seconds.
TEST_F(Opd, SigtermWhileAScoreHangsCheckpointsAndExits) {
  FakeTeacherServer teacher("opd.v1.Teacher", Fingerprint(), [](int call) {
    FakeTeacher::Action a;
    a.hang = call >= 1;  // step 1 is scored, step 2's Score never answers
    return a;
  });
  const std::string ro = StartRollout();
  ASSERT_FALSE(ro.empty());
  const fs::path run = dir_ / "run_sigterm";
  ChildProcess p(
      TrainerArgs(run.string(), ro, teacher.address, teacher.address, 50,
                  {"checkpoint.every=0", "train.teacher_timeout_s=3600", "rollout.timeout_s=3600",
                   // one Score call a step (all samples, then one call under the token cap), so
                   // call 1 is step 2's whatever the order the samples arrive in
                   "train.pipeline=false", "train.score_call_tokens=1048576"}),
      (dir_ / "opd_sigterm.log").string());
  ASSERT_TRUE(teacher.service.AwaitHang(absl::Seconds(300))) << p.Log();
  p.Kill(SIGTERM);
  EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 128 + SIGTERM) << p.Log();
  EXPECT_NE(p.Log().find("stopped by SIGTERM"), std::string::npos) << p.Log();
  EXPECT_TRUE(fs::exists(run / "checkpoints/step_000001/trainer_state.json")) << p.Log();
}

// The rollout worker dies mid-run: the trainer checkpoints its last completed step before it
// exits (checkpoint.every is 0, so no other checkpoint exists). A resume from a checkpoint whose
// state lacks a field is then an error naming it, not an abort.
TEST_F(Opd, RolloutFailureCheckpointsTheLastCompletedStep) {
  const std::string t1 = StartTeacher("teacher_r1"), ro = StartRollout();
  ASSERT_FALSE(t1.empty() || ro.empty());
  const fs::path run = dir_ / "run_rollout_dies";
  const auto args = TrainerArgs(run.string(), ro, t1, t1, 50, {"checkpoint.every=0"});
  {
    ChildProcess p(args, (dir_ / "opd_rollout_dies.log").string());
    ASSERT_TRUE(WaitFor([&] { return LastLoggedStep(run / "metrics.jsonl") >= 1 || !p.Running(); },
                        std::chrono::seconds(300)))
        << p.Log();
    services_.back()->Kill(SIGKILL);  // the rollout worker
    EXPECT_EQ(p.Wait(std::chrono::seconds(120)), 1) << p.Log();
    EXPECT_NE(p.Log().find("is checkpointed"), std::string::npos) << p.Log();
  }
  const int logged = LastLoggedStep(run / "metrics.jsonl");
  int latest = -1;
  for (const auto& e : fs::directory_iterator(run / "checkpoints")) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0) latest = std::max(latest, std::stoi(name.substr(5)));
  }
  EXPECT_GE(latest, std::max(logged, 1)) << "a completed step was lost";

  char name[32];
  std::snprintf(name, sizeof(name), "step_%06d", latest);
  const fs::path state_file = run / "checkpoints" / name / "trainer_state.json";
  auto state = nlohmann::json::parse(std::ifstream(state_file));
  EXPECT_EQ(state["step"].get<int>(), latest);
  state.erase("nonfinite");
  std::ofstream(state_file) << state.dump();
  ChildProcess q(args, (dir_ / "opd_bad_state.log").string());
  EXPECT_EQ(q.Wait(std::chrono::seconds(120)), 1) << q.Log();
  EXPECT_NE(q.Log().find("nonfinite"), std::string::npos) << q.Log();
}

// swap-teacher on a running job: applied at a step boundary, and the new pool keeps the
// stage's teacher_timeout_s (the fake teacher sees each call's deadline).
TEST_F(Opd, SwappedTeachersKeepTheStageTimeout) {
  const std::string t1 = StartTeacher("teacher_sw"), ro = StartRollout();
  ASSERT_FALSE(t1.empty() || ro.empty());
  FakeTeacherServer fake("opd.v1.Teacher", Fingerprint(),
                         [](int) { return FakeTeacher::Action(); });
  const fs::path run = dir_ / "run_swap";
  const testing_util::Served admin = testing_util::StartLearnerAdmin(
      dir_, "opd_swap",
      TrainerArgs(run.string(), ro, t1, t1, 1000,
                  {"train.teacher_timeout_s=900", "checkpoint.every=0"}));
  ASSERT_FALSE(admin.address.empty());
  ChildProcess& p = *admin.process;
  ChildProcess ctl({kBin + "/ctl/opd-ctl", "swap-teacher", "--learner", admin.address, "--stage",
                    "stage1_small_teacher", "--endpoints", fake.address, "--secret-file",
                    (dir_ / "secret").string(), "--timeout", "600"},
                   (dir_ / "ctl_swap.log").string());
  EXPECT_EQ(ctl.Wait(std::chrono::seconds(600)), 0) << ctl.Log() << p.Log();
  ASSERT_TRUE(WaitFor([&] { return fake.service.calls() > 0; }, std::chrono::seconds(300)))
      << p.Log();
  const double deadline = fake.service.deadlines_s().at(0);
  EXPECT_GT(deadline, 800) << "the swapped pool's deadline is not train.teacher_timeout_s";
  EXPECT_LE(deadline, 902);  // the wire rounds a deadline up to whole seconds
  p.Kill(SIGTERM);
  EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 128 + SIGTERM) << p.Log();
}

// Teachers by data domain. The prompts come from two sources: "add" (lines without a "domain":
// the source's name is theirs) and "m" (lines saying "domain": "mul"). Stage "only" maps each
// domain to its own fake teacher and has a default pool no sample should reach. Run 1 swaps the
// mul pool after step 2 and is stopped; run 2 resumes from its last checkpoint in another run
// directory, so that its steps' sequences can be matched exactly against the teachers' counts:
// every add sample reaches the add teacher, every mul sample the swapped-in one, none the old mul
// teacher or the default, and each step logs both domains' KL.
TEST_F(Opd, TeachersByDomainScoreOnlyTheirDomainAcrossASwapAndAResume) {
  const std::string ro = StartRollout();
  ASSERT_FALSE(ro.empty());
  auto ok = [](int) { return FakeTeacher::Action(); };
  FakeTeacherServer add("opd.v1.Teacher", Fingerprint(), ok),
      mul("opd.v1.Teacher", Fingerprint(), ok), mul2("opd.v1.Teacher", Fingerprint(), ok),
      fallback("opd.v1.Teacher", Fingerprint(), ok);
  const fs::path add_file = dir_ / "prompts_add.jsonl", mul_file = dir_ / "prompts_mul.jsonl";
  testing_util::SplitPromptsByDomain(dir_, add_file, "", mul_file, "mul");
  auto args = [&](const fs::path& run, int max_steps, const std::vector<std::string>& extra) {
    std::vector<std::string> sets = {
        "prompts.sources=[{name: add, files: [" + add_file.string() + "]}, {name: m, files: [" +
            mul_file.string() + "]}]",
        "stages=[{name: only, teachers: [" + fallback.address + "], max_steps: " +
            std::to_string(max_steps) + ", domains: " + "[{domain: add, teachers: [" + add.address +
            "]}, {domain: mul, teachers: [" + mul.address + "]}]}]",
        "train.prompts_per_step=8",
        "train.async=false",
        "checkpoint.every=1",
        "checkpoint.keep_last=3"};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return testing_util::OpdTrainerArgs(dir_, run.string(), ro, sets);
  };
  const fs::path run1 = dir_ / "run_domains", run2 = dir_ / "run_domains_resumed";
  int swap_step = -1;
  {
    // Steps take milliseconds here: run 1 is stopped by the test, long before its budget.
    const testing_util::Served admin =
        testing_util::StartLearnerAdmin(dir_, "run_domains", args(run1, 100000, {}));
    ASSERT_FALSE(admin.address.empty());
    ChildProcess& p = *admin.process;
    ASSERT_TRUE(WaitFor([&] { return LastLoggedStep(run1 / "metrics.jsonl") >= 2; },
                        std::chrono::seconds(300)))
        << p.Log();
    auto swap = [&](const std::string& domain) {
      ChildProcess ctl({kBin + "/ctl/opd-ctl", "swap-teacher", "--learner", admin.address,
                        "--stage", "only", "--domain", domain, "--endpoints", mul2.address,
                        "--secret-file", (dir_ / "secret").string()},
                       (dir_ / ("ctl_domain_" + domain + ".log")).string());
      const int rc = ctl.Wait(std::chrono::seconds(300));
      return std::make_pair(rc, ctl.Log());
    };
    const auto [bad_rc, bad_log] = swap("div");  // the stage has no pool for it
    EXPECT_EQ(bad_rc, 1) << bad_log;
    EXPECT_NE(bad_log.find("no pool for domain 'div'"), std::string::npos) << bad_log;
    const auto [rc, log] = swap("mul");
    ASSERT_EQ(rc, 0) << log << p.Log();
    const std::string marker = "teacher swap applied at step ";
    const size_t at = p.Log().find(marker);
    ASSERT_NE(at, std::string::npos) << p.Log();
    swap_step = std::stoi(p.Log().substr(at + marker.size()));
    // A step on the new pool is done; SIGTERM then checkpoints the last completed step.
    ASSERT_TRUE(WaitFor([&] { return LastLoggedStep(run1 / "metrics.jsonl") > swap_step; },
                        std::chrono::seconds(300)))
        << p.Log();
    p.Kill(SIGTERM);
    p.Wait(std::chrono::seconds(120));
  }
  int latest = 0;
  for (const auto& e : fs::directory_iterator(run1 / "checkpoints")) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step_", 0) == 0) latest = std::max(latest, std::stoi(n.substr(5)));
  }
  char latest_name[32];
  std::snprintf(latest_name, sizeof(latest_name), "step_%06d", latest);
  const fs::path resume_from = run1 / "checkpoints" / latest_name;
  const auto state = nlohmann::json::parse(std::ifstream(resume_from / "trainer_state.json"));
  EXPECT_EQ(state["swapped_domain_teachers"]["only"]["mul"], nlohmann::json::array({mul2.address}));

  const int64_t add_before = add.service.sequences(), mul_before = mul.service.sequences(),
                mul2_before = mul2.service.sequences();
  EXPECT_GT(add_before, 0);
  EXPECT_GT(mul_before, 0);
  {
    // The command line still names the old mul teacher: the checkpoint's swap must win.
    auto resume = args(run2, latest + 3, {});  // three more steps
    resume.push_back("--resume=" + resume_from.string());
    ChildProcess q(resume, run2.string() + ".log");
    ASSERT_EQ(q.Wait(std::chrono::seconds(300)), 0) << q.Log();
  }
  double add_seqs = 0, mul_seqs = 0;
  int steps = 0;
  for (const auto& m : ReadJsonl(run2 / "metrics.jsonl")) {
    if (!m.contains("sequences/add")) continue;
    ++steps;
    add_seqs += m["sequences/add"].get<double>();
    mul_seqs += m["sequences/mul"].get<double>();
    EXPECT_EQ(m["sequences/other"].get<double>(), 0.0);
    for (const std::string domain : {"add", "mul"}) {
      if (m["sequences/" + domain].get<double>() > 0)
        EXPECT_TRUE(m["teacher_kl/" + domain].is_number()) << m.dump();
    }
  }
  EXPECT_EQ(steps, 3);
  EXPECT_GT(add_seqs, 0);
  EXPECT_GT(mul_seqs, 0);
  EXPECT_EQ(add.service.sequences() - add_before, static_cast<int64_t>(add_seqs));
  EXPECT_EQ(mul2.service.sequences() - mul2_before, static_cast<int64_t>(mul_seqs));
  EXPECT_EQ(mul.service.sequences(), mul_before) << "the swapped-out mul teacher was used";
  EXPECT_EQ(fallback.service.sequences(), 0) << "a sample reached the default pool";
}

// SIGTERM while a server is still loading its model (here: blocked reading a config.json that
// is a FIFO nobody writes) ends it at once; before, the signal waited for the load to finish.
TEST_F(Opd, SigtermWhileAServerLoadsItsModelEndsItPromptly) {
  for (const std::string& binary :
       {kBin + "/teacher_service/opd-teacher", kBin + "/rollout/opd-rollout"}) {
    const fs::path model = dir_ / "fifo_model";
    fs::remove_all(model);
    fs::create_directories(model);
    const std::string fifo = (model / "config.json").string();
    ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
    ChildProcess server({binary, "--model=" + model.string(), "--listen=127.0.0.1:0",
                         "--secret-file=" + (dir_ / "secret").string(), "--threads=1"},
                        (dir_ / "loading.log").string());
    // Opening the FIFO's write end succeeds once the server has opened it to read: it is loading.
    int fd = -1;
    ASSERT_TRUE(WaitFor(
        [&] {
          fd = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
          return fd >= 0 || !server.Running();
        },
        std::chrono::seconds(60)));
    ASSERT_GE(fd, 0) << server.Log();
    server.Kill(SIGTERM);
    EXPECT_EQ(server.Wait(std::chrono::seconds(30)), 128 + SIGTERM) << binary << server.Log();
    EXPECT_NE(server.Log().find("while loading the model"), std::string::npos) << server.Log();
    close(fd);
  }
}

// The learner as two ranks (Gloo on loopback, launched as torchrun would): rank 0 samples and
// pushes, both ranks score and learn their share of every step's micro-batches, and the two-stage
// run (2 steps per stage) ends with the weights of the one-rank run (same samples: the rollout
// worker gets the same weights each step, up to float rounding; tolerance as distributed_test's).
void ExpectTwoRanksTrainAsOne(Opd& t, const fs::path& dir, const std::string& tag,
                              const std::string& ro, const std::string& t1, const std::string& t2,
                              const std::vector<std::string>& sets, double tolerance) {
  auto weights = [](const fs::path& model) {
    std::vector<torch::Tensor> out;
    auto m = lm::LoadModel(model.string());
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok())
      for (const auto& p : (*m)->named_parameters()) out.push_back(p.value().detach().clone());
    return out;
  };
  const fs::path one = dir / (tag + "_one");
  {
    ChildProcess p(t.Args(one.string(), ro, t1, t2, 2, sets), one.string() + ".log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  }
  const fs::path two = dir / (tag + "_two");
  const std::string port = std::to_string(testing_util::FreeLoopbackPort());
  std::vector<std::unique_ptr<ChildProcess>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<ChildProcess>(
        t.Args(two.string(), ro, t1, t2, 2, sets),
        two.string() + ".rank" + std::to_string(r) + ".log",
        std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=2",
                                 "LOCAL_RANK=" + std::to_string(r), "MASTER_ADDR=127.0.0.1",
                                 "MASTER_PORT=" + port}));
  }
  for (auto& r : ranks) ASSERT_EQ(r->Wait(std::chrono::seconds(300)), 0) << r->Log();

  const auto want = weights(one / "checkpoints/step_000004/model");
  const auto got = weights(two / "checkpoints/step_000004/model");
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_LE((want[i] - got[i]).norm().item<double>() / want[i].norm().item<double>(), tolerance)
        << i;
  auto summary = nlohmann::json::parse(std::ifstream(two / "summary.json"));
  EXPECT_EQ(summary["world_size"], 2);
  const auto stages_one = nlohmann::json::parse(std::ifstream(one / "summary.json"))["stages"];
  ASSERT_EQ(summary["stages"].size(), stages_one.size());
  for (size_t i = 0; i < stages_one.size(); ++i) {
    EXPECT_EQ(summary["stages"][i]["end_step"], stages_one[i]["end_step"]);
    EXPECT_EQ(summary["stages"][i]["reason"], stages_one[i]["reason"]);
    EXPECT_NEAR(summary["stages"][i]["smoothed_reverse_kl"].get<double>(),
                stages_one[i]["smoothed_reverse_kl"].get<double>(), 10 * tolerance);
  }
  // Both ranks took part in scoring and learning: the per-step numbers agree with one rank's.
  std::vector<double> kl_one, kl_two;
  for (const auto& m : ReadJsonl(one / "metrics.jsonl"))
    if (m.contains("opd/reverse_kl")) kl_one.push_back(m["opd/reverse_kl"].get<double>());
  for (const auto& m : ReadJsonl(two / "metrics.jsonl"))
    if (m.contains("opd/reverse_kl")) kl_two.push_back(m["opd/reverse_kl"].get<double>());
  ASSERT_EQ(kl_one.size(), kl_two.size());
  for (size_t i = 0; i < kl_one.size(); ++i) EXPECT_NEAR(kl_one[i], kl_two[i], 10 * tolerance) << i;
}

// Small micro-batches, so that each rank gets several.
TEST_F(Opd, TwoLearnerRanksTrainAsOne) {
  const std::string t1 = StartTeacher("dp_teacher_1"), t2 = StartTeacher("dp_teacher_2"),
                    ro = StartRollout();
  ASSERT_FALSE(t1.empty() || t2.empty() || ro.empty());
  ExpectTwoRanksTrainAsOne(*this, dir_, "dp", ro, t1, t2,
                           {"train.micro_batch_tokens=96", "dist.timeout_s=120"}, 1e-6);
}

// One prompt, one sample and room for it in one micro-batch: every step packs into a single
// micro-batch, so rank 1 learns nothing and must still issue its collectives in rank 0's order
// (buckets, then statistics). Before, it sent the statistics first: a Gloo size error. With
// clipping off the two runs are the same arithmetic: rank 0 computes the one micro-batch as the
// single rank does, the gradient all-reduce adds rank 1's zeros (x + 0 is exact), AdamW is
// elementwise whatever the slicing and the fp32 all-gather copies bits. So the weights are equal
// bit for bit (with clipping, the norm's per-rank partial sums round differently).
TEST_F(Opd, ARankWithNoMicroBatchTrainsAsOne) {
  const std::string t1 = StartTeacher("dp1_teacher_1"), t2 = StartTeacher("dp1_teacher_2"),
                    ro = StartRollout();
  ASSERT_FALSE(t1.empty() || t2.empty() || ro.empty());
  ExpectTwoRanksTrainAsOne(
      *this, dir_, "dp_single", ro, t1, t2,
      {"train.prompts_per_step=1", "rollout.samples_per_prompt=1", "train.micro_batch_tokens=4096",
       "optim.max_grad_norm=0", "dist.timeout_s=120"},
      0.0);
}

// dist.zero_stage 2 (each rank keeps only its slice of the fp32 gradients) through the OPD Learn
// loop as it drives the optimizer (ExpectLastBackward before a rank's last backward): the weights
// and per-step KL of one rank, within the same bound; and with one micro-batch (rank 1 has none
// and reduces zeros: x + 0 is exact, so without clipping the weights are equal bit for bit).
TEST_F(Opd, TwoLearnerRanksWithShardedGradientsTrainAsOne) {
  const std::string t1 = StartTeacher("z2_teacher_1"), t2 = StartTeacher("z2_teacher_2"),
                    ro = StartRollout();
  ASSERT_FALSE(t1.empty() || t2.empty() || ro.empty());
  ExpectTwoRanksTrainAsOne(
      *this, dir_, "zero2", ro, t1, t2,
      {"train.micro_batch_tokens=96", "dist.timeout_s=120", "dist.zero_stage=2"}, 1e-6);
  ExpectTwoRanksTrainAsOne(
      *this, dir_, "zero2_single", ro, t1, t2,
      {"train.prompts_per_step=1", "rollout.samples_per_prompt=1", "train.micro_batch_tokens=4096",
       "optim.max_grad_norm=0", "dist.timeout_s=120", "dist.zero_stage=2"},
      0.0);
}

}  // namespace
