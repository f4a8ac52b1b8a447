// The OPD learner against real services: teacher failover within a step, tokenizer checks at
// connect time and at swap, the admin RPC's authentication, a full two-stage run, and resume
// after the learner is SIGKILLed. Models are tiny random Qwen3-MoE students/teachers with the
// demo's small tokenizer (scripts/demo/make_task.py); every process is on 127.0.0.1.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "child_process.h"
#include "lm/model/model.h"
#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "trainer/learner_service.h"
#include "trainer/teacher_pool.h"

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::WaitForPort;

const std::string kBin = OPD_BINARY_DIR;
const std::string kSecret = "opd-test-secret-4f1c";

int Shell(const std::string& cmd) {
  return std::system(cmd.c_str());
}

class Opd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("opd_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    const std::string py = OPD_PYTHON, src = OPD_SOURCE_DIR, d = dir_.string();
    // Two task directories: the second's tokenizer is trained on other text (another fingerprint).
    ASSERT_EQ(Shell(py + " " + src + "/scripts/demo/make_task.py --out " + d +
                    "/task --teacher-examples 400 "
                    "--student-examples 50 --prompts 200 --eval 16 > /dev/null"),
              0);
    ASSERT_EQ(
        Shell(py + " " + src + "/scripts/demo/make_task.py --out " + d +
              "/other --seed 7 --tokenizer-vocab 270 "
              "--teacher-examples 400 --student-examples 10 --prompts 10 --eval 4 > /dev/null"),
        0);
    for (auto [name, seed] : {std::pair{"student", 1}, {"teacher_small", 2}}) {
      ASSERT_EQ(Shell(kBin + "/ctl/opd-ctl init-model --config " + d + "/task/models/" + name +
                      ".json --out " + d + "/" + name + " --tokenizer " + d +
                      "/task/tokenizer --seed " + std::to_string(seed) + " 2>/dev/null"),
                0);
    }
    std::ofstream(dir_ / "secret") << kSecret << "\n";
    chmod((dir_ / "secret").c_str(), 0600);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // An opd-teacher or opd-rollout on an ephemeral port; returns "127.0.0.1:PORT" or "".
  std::string StartService(const std::string& tag, const std::string& binary,
                           const std::string& model, const std::string& tokenizer) {
    const std::string port_file = (dir_ / (tag + ".port")).string();
    fs::remove(port_file);
    services_.push_back(std::make_unique<ChildProcess>(
        std::vector<std::string>{binary, "--model=" + model, "--tokenizer=" + tokenizer,
                                 "--listen=127.0.0.1:0", "--port-file=" + port_file,
                                 "--secret-file=" + (dir_ / "secret").string(), "--threads=1"},
        (dir_ / (tag + ".log")).string()));
    const int port = WaitForPort(*services_.back(), port_file, std::chrono::seconds(60));
    EXPECT_GT(port, 0) << services_.back()->Log();
    return port > 0 ? "127.0.0.1:" + std::to_string(port) : "";
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
  opd::TeacherRequirements Requirements() {
    auto tok = lm::Tokenizer::Load((dir_ / "task/tokenizer").string());
    EXPECT_TRUE(tok.ok());
    return {(*tok)->Fingerprint(), 320};
  }
  opd::TeacherPoolOptions PoolOptions() {
    opd::TeacherPoolOptions o;
    o.client.secret = kSecret;
    o.client.timeout = absl::Seconds(30);
    o.backoff_initial = absl::Milliseconds(100);
    return o;
  }

  // The opd-trainer command line of a small two-stage run.
  std::vector<std::string> TrainerArgs(const std::string& run, const std::string& rollout,
                                       const std::string& t1, const std::string& t2,
                                       int steps_per_stage) {
    const std::string d = dir_.string();
    return {kBin + "/trainer/opd-trainer",
            "opd",
            "--config",
            std::string(OPD_SOURCE_DIR) + "/configs/demo/opd.yaml",
            "--set",
            "run.dir=" + run,
            "--set",
            "model.path=" + d + "/student",
            "--set",
            "prompts.sources=[{files: [" + d + "/task/opd_prompts.jsonl]}]",
            "--set",
            "rollout.endpoints=[" + rollout + "]",
            "--set",
            "stages.0.teachers=[" + t1 + "]",
            "--set",
            "stages.1.teachers=[" + t2 + "]",
            "--set",
            "stages.0.max_steps=" + std::to_string(steps_per_stage),
            "--set",
            "stages.0.plateau.enabled=false",
            "--set",
            "stages.1.max_steps=" + std::to_string(steps_per_stage),
            "--set",
            "train.prompts_per_step=8",
            "--set",
            "checkpoint.every=1",
            "--set",
            "auth.secret_file=" + (dir_ / "secret").string()};
  }

  static inline fs::path dir_;
  std::vector<std::unique_ptr<ChildProcess>> services_;
};

std::vector<nlohmann::json> ReadJsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

// Kill one of two replicas while a step's scoring is in flight: the call still returns every
// sequence's scores, each equal to the in-process teacher's (so none was lost or mixed up).
TEST_F(Opd, TeacherReplicaKilledMidStepEverySequenceScoredOnce) {
  const std::string a = StartTeacher("teacher_a"), b = StartTeacher("teacher_b");
  ASSERT_FALSE(a.empty() || b.empty());
  auto opts = PoolOptions();
  opts.max_sequences_per_call = 2;
  auto pool = opd::TeacherPool::Connect("s", {a, b}, Requirements(), opts);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<opd::rpc::ScoreInput> inputs;
  std::mt19937 rng(3);
  for (int i = 0; i < 600; ++i) {
    std::vector<int32_t> t(20 + i % 17);
    for (auto& x : t) x = static_cast<int32_t>(rng() % 280);
    inputs.push_back({t, 5 + i % 7});
  }
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    services_[1]->Kill(SIGKILL);
  });
  auto scores = (*pool)->Score(inputs, {});
  killer.join();
  ASSERT_TRUE(scores.ok()) << scores.status();
  EXPECT_GE((*pool)->failovers(), 1)
      << "the replica died after the work was done: make the batch larger";
  EXPECT_EQ((*pool)->healthy_count(), 1);

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
  auto pool = opd::TeacherPool::Connect("s", {a}, Requirements(), PoolOptions());
  ASSERT_TRUE(pool.ok()) << pool.status();
  services_[0]->Kill(SIGKILL);
  services_[0]->Wait(std::chrono::seconds(5));
  // Stop asking after a while: the call must end Cancelled, not with partial scores.
  const auto start = std::chrono::steady_clock::now();
  auto r = (*pool)->Score({{{1, 2, 3, 4}, 2}}, {}, [&] {
    return std::chrono::steady_clock::now() - start > std::chrono::seconds(2);
  });
  EXPECT_TRUE(absl::IsCancelled(r.status())) << r.status();
}

TEST_F(Opd, TeacherWithAnotherTokenizerIsRefusedAtConnectAndAtSwap) {
  const std::string good = StartTeacher("teacher_good");
  const std::string bad = StartTeacher("teacher_bad", (dir_ / "other/tokenizer").string());
  ASSERT_FALSE(good.empty() || bad.empty());
  auto other = lm::Tokenizer::Load((dir_ / "other/tokenizer").string());
  ASSERT_TRUE(other.ok());
  ASSERT_NE((*other)->Fingerprint(), Requirements().tokenizer_fingerprint)
      << "the test needs two tokenizers";
  auto pool = opd::TeacherPool::Connect("stage2", {bad}, Requirements(), PoolOptions());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(pool.status().message().find("fingerprint"), std::string::npos) << pool.status();
  EXPECT_NE(pool.status().message().find(bad), std::string::npos) << pool.status();

  trainer::LearnerServerOptions lo;
  lo.listen = "127.0.0.1:0";
  lo.secret = kSecret;
  lo.client.secret = kSecret;
  lo.requirements = Requirements();
  lo.stages = {"stage1", "stage2"};
  auto learner = trainer::LearnerServer::Start(lo);
  ASSERT_TRUE(learner.ok()) << learner.status();
  const std::string addr = "127.0.0.1:" + std::to_string((*learner)->port());
  const std::string ctl = kBin + "/ctl/opd-ctl swap-teacher --learner " + addr + " --stage stage2 ";
  const std::string secret = " --secret-file " + (dir_ / "secret").string();
  const std::string out = (dir_ / "swap.txt").string();
  auto read_out = [&] {
    std::ifstream in(out);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  // Wrong tokenizer: refused, nothing queued.
  EXPECT_NE(Shell(ctl + "--endpoints " + bad + secret + " > " + out + " 2>&1"), 0);
  EXPECT_NE(read_out().find("fingerprint"), std::string::npos) << read_out();
  EXPECT_FALSE((*learner)->TakePendingSwap().has_value());
  // No secret: UNAUTHENTICATED, nothing queued.
  EXPECT_NE(Shell("env -u OPD_SECRET " + ctl + "--endpoints " + good + " > " + out + " 2>&1"), 0);
  EXPECT_NE(read_out().find("16"), std::string::npos) << read_out();  // grpc::UNAUTHENTICATED
  EXPECT_FALSE((*learner)->TakePendingSwap().has_value());
  // Unknown stage.
  EXPECT_NE(Shell(kBin + "/ctl/opd-ctl swap-teacher --learner " + addr +
                  " --stage nope --endpoints " + good + secret + " > " + out + " 2>&1"),
            0);
  // A compatible teacher: accepted and queued for the next step boundary.
  EXPECT_EQ(Shell(ctl + "--endpoints " + good + secret + " > " + out + " 2>&1"), 0) << read_out();
  auto swap = (*learner)->TakePendingSwap();
  ASSERT_TRUE(swap.has_value());
  EXPECT_EQ(swap->stage, "stage2");
  EXPECT_EQ(swap->endpoints, std::vector<std::string>{good});
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

}  // namespace
