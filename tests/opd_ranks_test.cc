// The OPD learner's step as a pipeline and its ranks' agreements, end to end: opd-trainer
// processes (one rank, or two over Gloo on loopback) against real opd-teacher and opd-rollout
// processes or in-process fakes (tests/opd_fakes.h), on the small task of tests/opd_task.h.
//   - a pipelined step trains bitwise the weights of the same step run phase by phase;
//   - ranks wait for a sampling longer than the collectives' timeout;
//   - a rank 0 that stops (SIGSTOP) ends every other rank with the stall error, checkpoint kept;
//   - a rank that throws mid-step, or cannot start a stage, ends every rank with its error, and
//     the last checkpoint is the last completed step;
//   - a failed push owes the held-out evaluation of its step: the resumed run logs what the
//     uninterrupted run logged and ends with its weights.
// Waits are on files and events; time bounds only keep a broken build from hanging.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "lm/generate/sampling.h"
#include "lm/io/safetensors.h"
#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/child_process.h"
#include "tests/opd_fakes.h"
#include "tests/opd_task.h"
#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::FakeRollout;
using testing_util::InProcessServer;
using testing_util::ReadFile;
using testing_util::ReadJsonl;

const std::string kBin = OPD_BINARY_DIR;
const std::string kSecret = "opd-ranks-test-secret-77a0";

class OpdRanks : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("opd_ranks_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    ASSERT_TRUE(testing_util::MakeOpdTask(
        dir_, "--teacher-examples 200 --student-examples 20 --prompts 64 --eval 8", kSecret));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void TearDown() override { services_.clear(); }

  std::string Start(const std::string& tag, const std::string& binary, const std::string& model) {
    testing_util::Served s = testing_util::StartTaskService(dir_, tag, binary, model);
    services_.push_back(std::move(s.process));
    return s.address;
  }
  std::string Teacher(const std::string& tag) {
    return Start(tag, kBin + "/teacher_service/opd-teacher", (dir_ / "teacher_small").string());
  }
  std::string Rollout(const std::string& tag) {
    return Start(tag, kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  }

  std::vector<std::string> Args(const fs::path& run, const std::string& rollout,
                                const std::string& teacher, int steps,
                                const std::vector<std::string>& sets) {
    std::vector<std::string> all = {"stages=[{name: only, teachers: [" + teacher +
                                        "], max_steps: " + std::to_string(steps) + "}]",
                                    "train.prompts_per_step=8", "checkpoint.every=1",
                                    "checkpoint.keep_last=0"};
    all.insert(all.end(), sets.begin(), sets.end());
    return testing_util::OpdTrainerArgs(dir_, run.string(), rollout, all);
  }

  // The learner as `n` ranks launched as torchrun would; each rank's log is RUN.rankR.log.
  std::vector<std::unique_ptr<ChildProcess>> Ranks(int n, const std::vector<std::string>& args,
                                                   const fs::path& run) {
    const std::string port = std::to_string(testing_util::FreeLoopbackPort());
    std::vector<std::unique_ptr<ChildProcess>> ranks;
    for (int r = 0; r < n; ++r) {
      ranks.push_back(std::make_unique<ChildProcess>(
          args, run.string() + ".rank" + std::to_string(r) + ".log",
          std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(n),
                                   "LOCAL_RANK=" + std::to_string(r), "MASTER_ADDR=127.0.0.1",
                                   "MASTER_PORT=" + port}));
    }
    return ranks;
  }

  static inline fs::path dir_;
  std::vector<std::unique_ptr<ChildProcess>> services_;
};

void ExpectSameCheckpoint(const fs::path& a, const fs::path& b) {
  EXPECT_TRUE(ReadFile(a / "model/model.safetensors") == ReadFile(b / "model/model.safetensors"))
      << a << " and " << b << " hold different weights";
  EXPECT_TRUE(ReadFile(a / "optimizer.safetensors") == ReadFile(b / "optimizer.safetensors"))
      << a << " and " << b << " hold different AdamW states";
}

// The largest difference between two checkpoints' fp32 weights, tensor by tensor.
double MaxWeightDifference(const fs::path& a, const fs::path& b) {
  auto fa = lm::SafetensorsFile::Open((a / "model/model.safetensors").string());
  auto fb = lm::SafetensorsFile::Open((b / "model/model.safetensors").string());
  EXPECT_TRUE(fa.ok() && fb.ok()) << a << " or " << b << " has no readable weights";
  if (!fa.ok() || !fb.ok()) return INFINITY;
  EXPECT_EQ((*fa)->tensors().size(), (*fb)->tensors().size());
  double worst = 0;
  for (const auto& [name, va] : (*fa)->tensors()) {
    absl::StatusOr<lm::TensorView> vb = (*fb)->Get(name);
    EXPECT_TRUE(vb.ok() && va.dtype == lm::DType::kF32 && vb->nbytes == va.nbytes) << name;
    if (!vb.ok() || vb->nbytes != va.nbytes) return INFINITY;
    const float* x = reinterpret_cast<const float*>(va.data);
    const float* y = reinterpret_cast<const float*>(vb->data);
    for (int64_t i = 0; i < va.numel(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(x[i] - y[i])));
  }
  return worst;
}

// The same two steps as a pipeline (scoring while sampling, learning while scoring) and phase by
// phase: the micro-batches are the same in the same order, and opd-teacher scores each sequence
// the same whatever shares its call (its batch-invariant mode), so the weights are the same bits.
TEST_F(OpdRanks, APipelinedStepTrainsTheWeightsOfThePhaseByPhaseStep) {
  const std::string teacher = Teacher("teacher_pipe"), rollout = Rollout("rollout_pipe");
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  for (const bool pipeline : {true, false}) {
    const fs::path run = dir_ / (pipeline ? "run_pipelined" : "run_phases");
    ChildProcess p(Args(run, rollout, teacher, 2,
                        {"train.pipeline=" + std::string(pipeline ? "true" : "false"),
                         "train.micro_batch_tokens=96", "train.score_call_tokens=64"}),
                   run.string() + ".log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  }
  ExpectSameCheckpoint(dir_ / "run_pipelined/checkpoints/step_000002",
                       dir_ / "run_phases/checkpoints/step_000002");
  // Both logged each phase's busy time and their overlap.
  for (const auto& m : ReadJsonl(dir_ / "run_pipelined/metrics.jsonl")) {
    if (!m.contains("time/step_s")) continue;
    EXPECT_TRUE(m.contains("time/score_s") && m.contains("time/overlap")) << m.dump();
    EXPECT_GT(m["time/overlap"].get<double>(), 0) << m.dump();
  }
}

// Two ranks, one prompt a step: rank 1 has nothing to sample and waits while rank 0's only
// sample is held back by the fake rollout worker for 3 times the collectives' timeout
// (dist.timeout_s = 2). The ranks meet outside the collectives while their heartbeats advance,
// so the run completes; before, rank 1 waited inside a collective and failed after 2 s.
TEST_F(OpdRanks, RanksWaitForASamplingLongerThanTheCollectivesTimeout) {
  const std::string teacher = Teacher("teacher_slow");
  ASSERT_FALSE(teacher.empty());
  auto tok = lm::Tokenizer::Load((dir_ / "task/tokenizer").string());
  ASSERT_TRUE(tok.ok());
  InProcessServer<FakeRollout> worker("opd.v1.Rollout", (*tok)->Fingerprint());
  worker.service.before_write = [](int, int) { absl::SleepFor(absl::Seconds(6)); };
  const fs::path run = dir_ / "run_slow_sampling";
  auto ranks = Ranks(2,
                     Args(run, worker.address, teacher, 2,
                          {"train.prompts_per_step=1", "rollout.samples_per_prompt=1",
                           "dist.timeout_s=2", "dist.stall_timeout_s=60"}),
                     run);
  for (auto& r : ranks) ASSERT_EQ(r->Wait(std::chrono::seconds(300)), 0) << r->Log();
  EXPECT_TRUE(fs::exists(run / "checkpoints/step_000002/trainer_state.json"));
}

// Rank 0 is stopped (SIGSTOP) while it samples step 2: the fake rollout worker notes the call of
// rank 0's prompt in step 2 and the test stops rank 0 there. Rank 1 finishes its share, waits for
// rank 0, sees its heartbeat stand still (and the store it hosts stop answering), and ends with
// the stall error naming rank 0 within the stall timeout. Nothing is checkpointed after the stall;
// step 1's checkpoint stays whole.
TEST_F(OpdRanks, ARankThatStopsEndsEveryOtherRankWithTheStallError) {
  const std::string teacher = Teacher("teacher_stall");
  ASSERT_FALSE(teacher.empty());
  auto tok = lm::Tokenizer::Load((dir_ / "task/tokenizer").string());
  ASSERT_TRUE(tok.ok());
  InProcessServer<FakeRollout> worker("opd.v1.Rollout", (*tok)->Fingerprint());
  absl::Mutex mu;
  int rank0_calls = 0;
  absl::Notification rank0_in_step2, stopped;
  worker.service.on_call = [&](const opd::v1::GenerateRequest& req) {
    if (req.prompts_size() == 0 || req.prompts(0).seed_index() != 0) return;  // rank 1's prompt
    {
      absl::MutexLock lock(&mu);
      if (++rank0_calls != 2) return;
    }
    rank0_in_step2.Notify();
    stopped.WaitForNotificationWithTimeout(absl::Seconds(120));
  };
  const fs::path run = dir_ / "run_stall";
  auto ranks = Ranks(
      2,
      Args(run, worker.address, teacher, 3,
           {"train.prompts_per_step=2", "rollout.samples_per_prompt=1", "dist.stall_timeout_s=5"}),
      run);
  ASSERT_TRUE(rank0_in_step2.WaitForNotificationWithTimeout(absl::Seconds(300))) << ranks[0]->Log();
  ASSERT_EQ(::kill(ranks[0]->pid(), SIGSTOP), 0);
  stopped.Notify();
  EXPECT_EQ(ranks[1]->Wait(std::chrono::seconds(120)), 1) << ranks[1]->Log();
  EXPECT_NE(ranks[1]->Log().find("learner rank 0 made no progress"), std::string::npos)
      << ranks[1]->Log();
  EXPECT_NE(ranks[1]->Log().find("nothing is checkpointed"), std::string::npos) << ranks[1]->Log();
  ::kill(ranks[0]->pid(), SIGKILL);
  (void)ranks[0]->Wait(std::chrono::seconds(60));
  EXPECT_FALSE(fs::exists(run / "checkpoints/step_000002"));
  const auto state =
      nlohmann::json::parse(std::ifstream(run / "checkpoints/step_000001/trainer_state.json"));
  EXPECT_EQ(state["step"], 1);
}

// Rank 1 throws while learning step 2 (as a CUDA out-of-memory error would): both ranks agree on
// its error at the step's meeting point, end with it, and checkpoint step 1 together.
TEST_F(OpdRanks, ARankThatThrowsMidStepEndsEveryRankWithItsError) {
  const std::string teacher = Teacher("teacher_throw"), rollout = Rollout("rollout_throw");
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  const fs::path run = dir_ / "run_rank_throws";
  auto ranks = Ranks(
      2,
      Args(run, rollout, teacher, 3,
           {"debug.throw_while_learning_steps=[2]", "debug.fail_rank=1", "checkpoint.every=0"}),
      run);
  for (auto& r : ranks) {
    EXPECT_EQ(r->Wait(std::chrono::seconds(300)), 1) << r->Log();
    EXPECT_NE(r->Log().find("debug.throw_while_learning_steps: step 2 on rank 1"),
              std::string::npos)
        << r->Log();
    EXPECT_NE(r->Log().find("step 1 is checkpointed"), std::string::npos) << r->Log();
  }
  const auto state =
      nlohmann::json::parse(std::ifstream(run / "checkpoints/step_000001/trainer_state.json"));
  EXPECT_EQ(state["step"], 1);
  EXPECT_FALSE(fs::exists(run / "checkpoints/step_000002"));
}

// ZeRO-2 over two ranks learns the step's micro-batches in lockstep once every rank's are scored
// (each backward reduce-scatters), and trains the weights ZeRO-1 trains: for shares of unequal
// size (3 prompts) and with a rank that has no work (1 prompt). The stages add the same gradient
// terms in another order, so the weights differ by rounding only: fp32 sums of a few terms differ
// by a few ulp of the gradient, which moves AdamW's normalised update by about 1e-6 of lr (1e-3)
// per step, plus one ulp of a weight below 2 (2.4e-7) per step: under 1e-6 after two steps. The
// bound is 1e-5; a missing rank's gradient moves weights by about lr.
TEST_F(OpdRanks, ZeroTwoLearnsInLockstepTheWeightsOfZeroOne) {
  const std::string teacher = Teacher("teacher_zero"), rollout = Rollout("rollout_zero");
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  for (const int prompts : {3, 1}) {
    std::map<int, fs::path> out;
    for (const int stage : {1, 2}) {
      const fs::path run =
          dir_ / ("run_zero" + std::to_string(stage) + "_p" + std::to_string(prompts));
      auto ranks = Ranks(
          2,
          Args(run, rollout, teacher, 2,
               {"train.prompts_per_step=" + std::to_string(prompts), "train.micro_batch_tokens=96",
                "checkpoint.every=2", "dist.zero_stage=" + std::to_string(stage)}),
          run);
      for (auto& r : ranks) ASSERT_EQ(r->Wait(std::chrono::seconds(300)), 0) << r->Log();
      // Rank 0 logs the stage in use.
      EXPECT_NE(ranks[0]->Log().find("dist.zero_stage " + std::to_string(stage)), std::string::npos)
          << ranks[0]->Log();
      for (auto& r : ranks) {
        // Stage 2 knew every rank's backwards before the first (not the full-size fallback).
        EXPECT_EQ(r->Log().find("driven by ExpectLastBackward"), std::string::npos) << r->Log();
      }
      out[stage] = run / "checkpoints/step_000002";
    }
    EXPECT_LT(MaxWeightDifference(out[1], out[2]), 1e-5) << prompts << " prompts a step";
  }
}

// One-step-off over two ranks: the checkpoint of step 2 holds step 3's samples as one file per
// rank, each with that rank's share only (no sample crossed ranks to be saved), together every
// prompt of the step once; a resume on one rank reads both files and learns step 3 from them.
TEST_F(OpdRanks, EachRankCheckpointsItsOwnPrefetchedSamples) {
  const std::string teacher = Teacher("teacher_prefetch"), rollout = Rollout("rollout_prefetch");
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  const fs::path run = dir_ / "run_prefetch_two";
  auto ranks =
      Ranks(2, Args(run, rollout, teacher, 3, {"train.async=true", "checkpoint.every=2"}), run);
  for (auto& r : ranks) ASSERT_EQ(r->Wait(std::chrono::seconds(300)), 0) << r->Log();
  const fs::path ckpt = run / "checkpoints/step_000002";
  const auto state = nlohmann::json::parse(std::ifstream(ckpt / "trainer_state.json"));
  ASSERT_TRUE(state.contains("prefetched")) << state.dump();
  EXPECT_EQ(state["prefetched"]["files"], 2);
  std::map<int, std::set<int64_t>> prompts;  // rank -> prompt indices of its file
  for (int r = 0; r < 2; ++r) {
    auto samples = lm::DecodeSamples(
        ReadFile(ckpt / ("prefetched_samples.rank" + std::to_string(r) + ".bin")));
    ASSERT_TRUE(samples.ok()) << samples.status();
    ASSERT_FALSE(samples->empty()) << "rank " << r;
    for (const lm::Sample& s : *samples) prompts[r].insert(s.prompt_index);
  }
  std::set<int64_t> all;
  for (const auto& [r, p] : prompts) {
    for (int64_t i : p) EXPECT_TRUE(all.insert(i).second) << "prompt " << i << " in two files";
  }
  EXPECT_EQ(all.size(), 8u);  // train.prompts_per_step
  EXPECT_FALSE(fs::exists(ckpt / "prefetched_samples.bin"));

  const fs::path one = dir_ / "run_prefetch_one";
  std::vector<std::string> args = Args(one, rollout, teacher, 3, {"train.async=true"});
  args.push_back("--resume=" + ckpt.string());
  ChildProcess p(args, one.string() + ".log");
  ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  EXPECT_EQ(p.Log().find("samples anew"), std::string::npos) << p.Log();
  EXPECT_TRUE(fs::exists(one / "checkpoints/step_000003/trainer_state.json")) << p.Log();
}

// Stage 2 cannot start on rank 1: both ranks end with that error after stage 1's checkpoint,
// before any step of stage 2.
TEST_F(OpdRanks, AStageThatCannotStartOnOneRankEndsEveryRank) {
  const std::string teacher = Teacher("teacher_stage"), rollout = Rollout("rollout_stage");
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  const fs::path run = dir_ / "run_stage_fails";
  std::vector<std::string> args =
      Args(run, rollout, teacher, 1, {"debug.fail_stage_starts=[2]", "debug.fail_rank=1"});
  args.insert(args.end(), {"--set", "stages=[{name: one, teachers: [" + teacher +
                                        "], max_steps: 1}, {name: two, teachers: [" + teacher +
                                        "], max_steps: 1}]"});
  auto ranks = Ranks(2, args, run);
  for (auto& r : ranks) {
    EXPECT_EQ(r->Wait(std::chrono::seconds(300)), 1) << r->Log();
    EXPECT_NE(r->Log().find("debug.fail_stage_starts: stage 2 on rank 1"), std::string::npos)
        << r->Log();
  }
  const auto state =
      nlohmann::json::parse(std::ifstream(run / "checkpoints/step_000001/trainer_state.json"));
  EXPECT_EQ(state["stage_name"], "one");
  EXPECT_FALSE(fs::exists(run / "checkpoints/step_000002"));
}

// Held-out evaluations every 2 steps of 4. Run X's push of step 2 fails: its checkpoint owes step
// 2's evaluation, which the resumed run evaluates on the same weights after its first push. X
// then logs the evaluations Y (uninterrupted) logged, at the same steps, and ends with Y's
// weights: an evaluation is neither lost nor repeated, so the stage's rule decides alike.
TEST_F(OpdRanks, AFailedPushNeverLosesTheHeldOutEvaluationOfItsStep) {
  const std::string teacher = Teacher("teacher_heldout"), rollout = Rollout("rollout_heldout");
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  const std::vector<std::string> heldout = {"heldout={sources: [{files: [" +
                                            (dir_ / "task/eval_prompts.jsonl").string() +
                                            "]}], num_prompts: 4, every: 2, seed: 3}"};
  auto evaluations = [](const fs::path& run) {
    std::map<int, double> out;  // evaluated step -> mean
    for (const auto& m : ReadJsonl(run / "metrics.jsonl"))
      if (m.contains("opd/heldout_reverse_kl"))
        out[static_cast<int>(m["opd/heldout_step"].get<double>())] =
            m["opd/heldout_reverse_kl"].get<double>();
    return out;
  };
  const fs::path y = dir_ / "run_heldout_straight", x = dir_ / "run_heldout_push_fails";
  {
    ChildProcess p(Args(y, rollout, teacher, 4, heldout), y.string() + ".log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  }
  std::vector<std::string> failing = heldout;
  failing.push_back("debug.fail_push_steps=[2]");
  {
    ChildProcess p(Args(x, rollout, teacher, 4, failing), x.string() + ".log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 1) << p.Log();
  }
  const auto owed =
      nlohmann::json::parse(std::ifstream(x / "checkpoints/step_000002/trainer_state.json"));
  ASSERT_TRUE(owed.contains("heldout_pending")) << owed.dump();
  EXPECT_EQ(owed["heldout_pending"]["step"], 2);
  EXPECT_TRUE(owed["heldout_pending"]["values"].is_null());
  {
    std::vector<std::string> resume = Args(x, rollout, teacher, 4, heldout);
    resume.push_back("--resume");
    ChildProcess p(resume, x.string() + ".resume.log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  }
  const auto want = evaluations(y), got = evaluations(x);
  ASSERT_EQ(want.size(), 2u);
  ASSERT_EQ(got.size(), want.size());
  // The same steps, on the same weights and draws; the values within rounding: the evaluation
  // samples beside another step's sequences in each run, and the rollout engine's fp32 log-probs
  // of a sequence move by ~1e-6 relative with its batch (|log-prob| < 10 here: 1e-5 per token, so
  // at most 1e-5 for the mean KL).
  for (const auto& [step, kl] : want) {
    ASSERT_TRUE(got.count(step)) << "step " << step << " was not evaluated after the resume";
    EXPECT_NEAR(got.at(step), kl, 1e-5) << "step " << step;
  }
  ExpectSameCheckpoint(y / "checkpoints/step_000004", x / "checkpoints/step_000004");
}

}  // namespace
