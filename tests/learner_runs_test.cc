// Learner runs end to end. Resuming an SFT or OPD run after a skipped (non-finite) step continues
// it exactly: AdamW's bias correction must count the updates applied, not the steps run. A
// teacher swap restarts the stage's plateau window. A tiny random student and
// teacher with the demo's tokenizer and task (scripts/demo/make_task.py); OPD runs against real
// opd-teacher and opd-rollout processes on 127.0.0.1 with a shared secret, stopped by the test.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "child_process.h"
#include "nlohmann/json.hpp"
#include "opd_task.h"
#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::ReadFile;

const std::string kBin = OPD_BINARY_DIR;

// Both files of a checkpoint that an exact resume must reproduce: the fp32 master weights and the
// AdamW moments (equal bytes, equal state).
void ExpectSameWeightsAndMoments(const fs::path& a, const fs::path& b) {
  EXPECT_TRUE(ReadFile(a / "model/model.safetensors") == ReadFile(b / "model/model.safetensors"))
      << "the resumed run's weights differ from the uninterrupted run's";
  EXPECT_TRUE(ReadFile(a / "optimizer.safetensors") == ReadFile(b / "optimizer.safetensors"))
      << "the resumed run's AdamW state differs from the uninterrupted run's";
}

// The checkpoint of step 2, after the skipped step: one update applied.
void ExpectStepTwoWasSkipped(const fs::path& checkpoint) {
  auto state = nlohmann::json::parse(std::ifstream(checkpoint / "trainer_state.json"));
  ASSERT_EQ(state["step"], 2);
  EXPECT_EQ(state["optimizer_steps"], 1) << "step 2 was not skipped";
  EXPECT_EQ(state["nonfinite"]["total"], 1);
}

// A copy of `checkpoint` at `to` whose trainer state counts the steps run (2) as updates: what
// the OPD resume used to load. Resuming from it must not reproduce the run, or the comparison
// could not see the bug.
fs::path OvercountedCopy(const fs::path& checkpoint, const fs::path& to) {
  fs::copy(checkpoint, to, fs::copy_options::recursive);
  auto state = nlohmann::json::parse(std::ifstream(to / "trainer_state.json"));
  state["optimizer_steps"] = state["step"];
  std::ofstream(to / "trainer_state.json") << state.dump(2);
  return to;
}

// The learning-rate schedule counts updates, not steps: step 2 was skipped, so step 3 applies the
// rate step 2 would have (the second update's), and the cosine decays between updates (warm-up 0).
void ExpectScheduleCountsUpdates(const fs::path& metrics, const std::string& key) {
  std::map<int, double> lr;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto m = nlohmann::json::parse(line);
    if (m.contains(key)) lr[m["step"].get<int>()] = m[key].get<double>();
  }
  ASSERT_EQ(lr.size(), 4u);
  EXPECT_EQ(lr[3], lr[2]) << "the skipped step 2 moved the schedule";
  EXPECT_LT(lr[2], lr[1]);
  EXPECT_LT(lr[4], lr[3]);
}

int64_t OptimizerSteps(const fs::path& checkpoint) {
  return nlohmann::json::parse(std::ifstream(checkpoint / "trainer_state.json"))["optimizer_steps"]
      .get<int64_t>();
}

class LearnerRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("learner_runs_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    ASSERT_TRUE(testing_util::MakeOpdTask(
        dir_, "--teacher-examples 400 --student-examples 50 --prompts 200 --eval 16",
        "opd-resume-test-secret-91d2"));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void TearDown() override { services_.clear(); }

  static int Shell(const std::string& cmd) { return std::system(cmd.c_str()); }

  std::string StartService(const std::string& tag, const std::string& binary,
                           const std::string& model) {
    testing_util::Served s = testing_util::StartTaskService(dir_, tag, binary, model);
    services_.push_back(std::move(s.process));
    return s.address;
  }

  // Four SFT steps of the student on the task's chat data, step 2 poisoned with NaN.
  int RunSft(const fs::path& run, const std::vector<std::string>& extra = {}) {
    const std::string d = dir_.string();
    std::vector<std::string> args = {kBin + "/trainer/opd-trainer", "sft", "--config",
                                     std::string(OPD_SOURCE_DIR) + "/configs/demo/sft.yaml"};
    for (const std::string& set : std::vector<std::string>{
             "run.dir=" + run.string(), "model.path=" + d + "/student",
             "data.train=[{files: [" + d + "/task/sft_student.jsonl]}]", "data.eval=[]",
             "train.max_steps=4", "train.global_batch_size=4", "train.micro_batch_size=4",
             "optim.warmup_steps=0", "debug.nan_steps=[2]", "checkpoint.every=1",
             "checkpoint.keep_last=0", "eval.every=0"}) {
      args.push_back("--set");
      args.push_back(set);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    ChildProcess p(args, run.string() + ".log");
    const int code = p.Wait(std::chrono::seconds(300));
    EXPECT_EQ(code, 0) << p.Log();
    return code;
  }

  // A one-stage OPD run of `steps` steps with a checkpoint after every step; `extra` adds
  // arguments (--set k=v, --resume=DIR).
  std::vector<std::string> OpdArgs(const fs::path& run, int steps, const std::string& rollout,
                                   const std::string& teacher,
                                   const std::vector<std::string>& extra) {
    std::vector<std::string> args = testing_util::OpdTrainerArgs(
        dir_, run.string(), rollout,
        {"stages=[{name: only, teachers: [" + teacher + "], max_steps: " + std::to_string(steps) +
             "}]",
         "train.prompts_per_step=4",
         // one-step-off sampling would draw step 3 before step 2's update
         "train.async=false", "checkpoint.every=1", "checkpoint.keep_last=0"});
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  // OpdArgs with step 2 poisoned with NaN (and so skipped), run to its end.
  int RunOpd(const fs::path& run, int steps, const std::string& rollout, const std::string& teacher,
             const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"--set", "debug.nan_steps=[2]"};
    args.insert(args.end(), extra.begin(), extra.end());
    ChildProcess p(OpdArgs(run, steps, rollout, teacher, args), run.string() + ".log");
    const int code = p.Wait(std::chrono::seconds(300));
    EXPECT_EQ(code, 0) << p.Log();
    return code;
  }

  static inline fs::path dir_;
  std::vector<std::unique_ptr<ChildProcess>> services_;
};

// For each job: run A does four steps straight through, step 2 skipped. Run B resumes from A's
// checkpoint of step 2 (after the skip: 1 update applied) and runs steps 3 and 4. B's final
// weights and AdamW moments must be A's, bit for bit. With the step count taken as 2 instead of
// 1 (as OPD's resume did), step 3's bias correction differs and so do the weights.
TEST_F(LearnerRuns, SftResumeAfterASkippedStepIsExact) {
  const fs::path a = dir_ / "sft_a", b = dir_ / "sft_b";
  ASSERT_EQ(RunSft(a), 0);
  ExpectStepTwoWasSkipped(a / "checkpoints/step_000002");
  ExpectScheduleCountsUpdates(a / "metrics.jsonl", "train/lr");
  ASSERT_EQ(RunSft(b, {"--resume=" + (a / "checkpoints/step_000002").string()}), 0);
  ASSERT_FALSE(fs::exists(b / "checkpoints/step_000002")) << "run B did not resume";
  EXPECT_EQ(OptimizerSteps(a / "checkpoints/step_000004"), 3);
  EXPECT_EQ(OptimizerSteps(b / "checkpoints/step_000004"), 3);
  ExpectSameWeightsAndMoments(a / "checkpoints/step_000004", b / "checkpoints/step_000004");

  const fs::path c = dir_ / "sft_c";
  const fs::path bad = OvercountedCopy(a / "checkpoints/step_000002", dir_ / "sft_bad_step2");
  ASSERT_EQ(RunSft(c, {"--resume=" + bad.string()}), 0);
  EXPECT_FALSE(ReadFile(a / "checkpoints/step_000004/model/model.safetensors") ==
               ReadFile(c / "checkpoints/step_000004/model/model.safetensors"))
      << "the step count does not reach the weights: this test cannot see the bug";
}

TEST_F(LearnerRuns, OpdResumeAfterASkippedStepIsExact) {
  const std::string teacher = StartService("teacher", kBin + "/teacher_service/opd-teacher",
                                           (dir_ / "teacher_small").string());
  const std::string rollout =
      StartService("rollout", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(teacher.empty() || rollout.empty());

  const fs::path a = dir_ / "run_a", b = dir_ / "run_b";
  ASSERT_EQ(RunOpd(a, 4, rollout, teacher), 0);
  const fs::path a2 = a / "checkpoints/step_000002", a4 = a / "checkpoints/step_000004";
  ExpectStepTwoWasSkipped(a2);

  ASSERT_EQ(RunOpd(b, 4, rollout, teacher, {"--resume=" + a2.string()}), 0);
  const fs::path b4 = b / "checkpoints/step_000004";
  ASSERT_TRUE(fs::exists(b4 / "trainer_state.json"));
  ASSERT_FALSE(fs::exists(b / "checkpoints/step_000002")) << "run B did not resume";
  EXPECT_EQ(OptimizerSteps(a4), 3);
  EXPECT_EQ(OptimizerSteps(b4), 3);  // was 4: the skipped step counted as an update
  ExpectSameWeightsAndMoments(a4, b4);

  const fs::path c = dir_ / "run_c";
  const fs::path bad = OvercountedCopy(a2, dir_ / "opd_bad_step2");
  ASSERT_EQ(RunOpd(c, 4, rollout, teacher, {"--resume=" + bad.string()}), 0);
  EXPECT_FALSE(ReadFile(a4 / "model/model.safetensors") ==
               ReadFile(c / "checkpoints/step_000004/model/model.safetensors"))
      << "the step count does not reach the weights: this test cannot see the bug";
}

// One-step-off sampling (train.async) resumes exactly too: step 3's samples were drawn during
// step 2 with step 1's weights, so the checkpoint of step 2 holds them and run B, resumed from it,
// learns from the same samples and ends with run A's weights and moments at step 4. Run C resumes
// from a copy without them (what a checkpoint held before): it samples step 3 anew on step 2's
// weights, and must differ, or the comparison could not see the bug. Run D resumes from samples
// of another format: C's path, with a warning.
TEST_F(LearnerRuns, OpdOneStepOffResumeIsExact) {
  const std::string teacher = StartService("teacher_async", kBin + "/teacher_service/opd-teacher",
                                           (dir_ / "teacher_small").string());
  const std::string rollout =
      StartService("rollout_async", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  auto run = [&](const fs::path& dir, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--set", "train.async=true"};
    args.insert(args.end(), extra.begin(), extra.end());
    ChildProcess p(OpdArgs(dir, 4, rollout, teacher, args), dir.string() + ".log");
    const int code = p.Wait(std::chrono::seconds(300));
    EXPECT_EQ(code, 0) << p.Log();
    return code;
  };
  const fs::path a = dir_ / "async_a", b = dir_ / "async_b", c = dir_ / "async_c";
  ASSERT_EQ(run(a, {}), 0);
  const fs::path a2 = a / "checkpoints/step_000002", a4 = a / "checkpoints/step_000004";
  ASSERT_TRUE(fs::exists(a2 / "prefetched_samples.rank0.bin"));
  ASSERT_EQ(run(b, {"--resume=" + a2.string()}), 0);
  ExpectSameWeightsAndMoments(a4, b / "checkpoints/step_000004");

  const fs::path stripped = dir_ / "async_a2_without_samples";
  fs::copy(a2, stripped, fs::copy_options::recursive);
  auto state = nlohmann::json::parse(std::ifstream(stripped / "trainer_state.json"));
  state.erase("prefetched");
  std::ofstream(stripped / "trainer_state.json") << state.dump(2);
  ASSERT_EQ(run(c, {"--resume=" + stripped.string()}), 0);
  EXPECT_FALSE(ReadFile(a4 / "model/model.safetensors") ==
               ReadFile(c / "checkpoints/step_000004/model/model.safetensors"))
      << "re-sampling step 3 does not reach the weights: this test cannot see the bug";

  // Run D resumes from a copy whose samples another build wrote (no format tag): it says so and
  // samples step 3 anew, as C did, ending where C ended.
  const fs::path foreign = dir_ / "async_a2_foreign_samples", d = dir_ / "async_d";
  fs::copy(a2, foreign, fs::copy_options::recursive);
  std::ofstream(foreign / "prefetched_samples.rank0.bin", std::ios::binary | std::ios::trunc)
      << std::string(64, '\0');
  ASSERT_EQ(run(d, {"--resume=" + foreign.string()}), 0);
  EXPECT_NE(ReadFile(d.string() + ".log").find("the next step samples anew"), std::string::npos);
  ExpectSameWeightsAndMoments(c / "checkpoints/step_000004", d / "checkpoints/step_000004");
}

// The held-out convergence set end to end: 4 fixed prompts of task/eval_prompts.jsonl, sampled
// and scored every 2 steps of a 5-step stage whose plateau watches them. Each evaluation is logged
// (finite mean and standard error over 4 responses) and lands in the checkpoint's tracker state,
// with the logged mean, one step after the weights it evaluated were pushed (it runs beside that
// step); the rule's decisions are tested in convergence_test.
TEST_F(LearnerRuns, HeldoutEvaluationsFeedTheStagesRule) {
  const std::string teacher = StartService("teacher_heldout", kBin + "/teacher_service/opd-teacher",
                                           (dir_ / "teacher_small").string());
  const std::string rollout =
      StartService("rollout_heldout", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  const fs::path run = dir_ / "run_heldout";
  ChildProcess p(
      OpdArgs(run, 5, rollout, teacher,
              {"--set",
               "heldout={sources: [{files: [" + (dir_ / "task/eval_prompts.jsonl").string() +
                   "]}], num_prompts: 4, every: 2, seed: 5}",
               "--set",
               "stages.0.plateau={enabled: true, metric: heldout, window: 2, "
               "min_rel_improvement: 0.01}"}),
      run.string() + ".log");
  ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  // Evaluated after the pushes of steps 2 and 4, applied (and logged) at steps 3 and 5.
  std::map<int, double> logged;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto m = nlohmann::json::parse(line);
    if (!m.contains("opd/heldout_reverse_kl")) continue;
    const int evaluated = static_cast<int>(m["opd/heldout_step"].get<double>());
    EXPECT_EQ(m["step"].get<int>(), evaluated + 1) << line;
    logged[evaluated] = m["opd/heldout_reverse_kl"].get<double>();
    EXPECT_EQ(m["opd/heldout_samples"].get<double>(), 4.0) << line;
    EXPECT_TRUE(std::isfinite(m["opd/heldout_reverse_kl_se"].get<double>())) << line;
  }
  ASSERT_EQ(logged.size(), 2u) << p.Log();
  ASSERT_TRUE(logged.count(2) && logged.count(4));
  // Step 4's checkpoint: step 2's evaluation is in the rule, step 4's is pending (its values, or
  // its step alone for a resume to evaluate again).
  const auto four =
      nlohmann::json::parse(std::ifstream(run / "checkpoints/step_000004/trainer_state.json"));
  const auto conv = four["convergence"];
  ASSERT_EQ(conv["heldout"].size(), 1u) << conv.dump();
  EXPECT_EQ(conv["heldout"][0][0], 4);
  EXPECT_DOUBLE_EQ(conv["heldout"][0][1].get<double>(), logged[2]);
  EXPECT_EQ(conv["reason"], "");  // one evaluation cannot fill two windows of two
  ASSERT_TRUE(four.contains("heldout_pending")) << four.dump();
  EXPECT_EQ(four["heldout_pending"]["step"], 4);
  if (!four["heldout_pending"]["values"].is_null()) {
    const auto v = four["heldout_pending"]["values"].get<std::vector<double>>();
    double mean = 0;
    for (double x : v) mean += x / static_cast<double>(v.size());
    EXPECT_NEAR(mean, logged[4], 1e-12);
  }
  // Step 5 ended the stage by its budget: step 4's evaluation was logged, not fed to the rule.
  const auto last = nlohmann::json::parse(
      std::ifstream(run / "checkpoints/step_000005/trainer_state.json"))["convergence"];
  EXPECT_EQ(last["heldout"].size(), 1u) << last.dump();
  EXPECT_EQ(last["reason"], "max_steps");
}

// Teachers by domain with real teachers: the task's prompts split into two domains, each scored
// by its own opd-teacher, student and teachers all at temperature 0.1. Domain "add" is scored by
// a random teacher (another random model: its KL to the random student is far from 0); domain "mul"
// by an opd-teacher serving the student itself, so at step 1 (weights not yet updated) its KL is
// the sampler-vs-scorer rounding gap alone: fp32 logits agree to ~1e-6 relative, |logit| < 10 on
// these models, so after dividing by T the log-probs agree to ~1e-4 per token and the mean is
// far below 1e-2. "mul"'s KL below 1e-2 and "add"'s ten times that bound and more (the random
// teacher disagrees with the student by tenths of a nat per token at T=0.1): each domain had its
// own teacher.
// (Whether the KL then falls is the optimiser's business and depends on the draws: the losses
// themselves are tested in opd_loss_test and LossFormsAndOptionsTrainEndToEnd.)
TEST_F(LearnerRuns, EachDomainIsScoredByItsOwnTeacher) {
  const std::string t_add = StartService("teacher_add", kBin + "/teacher_service/opd-teacher",
                                         (dir_ / "teacher_small").string());
  const std::string t_mul = StartService("teacher_mul", kBin + "/teacher_service/opd-teacher",
                                         (dir_ / "student").string());
  const std::string rollout =
      StartService("rollout_domains", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(t_add.empty() || t_mul.empty() || rollout.empty());
  const fs::path add_file = dir_ / "domain_add.jsonl", mul_file = dir_ / "domain_mul.jsonl";
  testing_util::SplitPromptsByDomain(dir_, add_file, "add", mul_file, "mul");
  const fs::path run = dir_ / "run_domain_kl";
  ChildProcess p(testing_util::OpdTrainerArgs(
                     dir_, run.string(), rollout,
                     {"prompts.sources=[{files: [" + add_file.string() + "]}, {files: [" +
                          mul_file.string() + "]}]",
                      "stages=[{name: only, teachers: [" + t_add +
                          "], max_steps: 2, domains: [{domain: add, "
                          "teachers: [" +
                          t_add + "]}, {domain: mul, teachers: [" + t_mul + "]}]}]",
                      "train.prompts_per_step=16", "loss.teacher_temperature=0.1",
                      "rollout.temperature=0.1", "optim.warmup_steps=0", "checkpoint.every=0"}),
                 run.string() + ".log");
  ASSERT_EQ(p.Wait(std::chrono::seconds(600)), 0) << p.Log();
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto m = nlohmann::json::parse(line);
    if (m["step"] != 1 || !m.contains("teacher_kl/add")) continue;
    ASSERT_TRUE(m["teacher_kl/add"].is_number() && m["teacher_kl/mul"].is_number()) << line;
    EXPECT_GT(m["teacher_kl/add"].get<double>(), 0.1) << line;
    EXPECT_LT(std::abs(m["teacher_kl/mul"].get<double>()), 1e-2) << line;
    return;
  }
  ADD_FAILURE() << "no step-1 domain metrics in " << run / "metrics.jsonl";
}

// A failed weight push comes after the update: the step is complete and so is its bookkeeping.
// Step 3 is the stage's last (max_steps), skipped (NaN) and its push fails. Its checkpoint must
// count the step in the tracker (3 steps, the stage finished by max_steps), in the non-finite
// count and in the stage's end; the resume then finds the run done and trains nothing more. Before,
// the tracker held 2 steps and no reason, so the resume ran a fourth step.
TEST_F(LearnerRuns, FailedPushCheckpointsTheStepWithItsBookkeeping) {
  const std::string teacher = StartService("teacher_push", kBin + "/teacher_service/opd-teacher",
                                           (dir_ / "teacher_small").string());
  const std::string rollout =
      StartService("rollout_push", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  const fs::path run = dir_ / "run_push_fails";
  const std::vector<std::string> hooks = {"--set", "debug.fail_push_steps=[3]", "--set",
                                          "debug.nan_steps=[3]"};
  {
    ChildProcess p(OpdArgs(run, 3, rollout, teacher, hooks), run.string() + ".log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 1) << p.Log();
    EXPECT_NE(p.Log().find("the weight push failed"), std::string::npos) << p.Log();
  }
  const auto state =
      nlohmann::json::parse(std::ifstream(run / "checkpoints/step_000003/trainer_state.json"));
  EXPECT_EQ(state["step"], 3);
  EXPECT_EQ(state["convergence"]["steps"], 3) << state["convergence"].dump();
  EXPECT_EQ(state["convergence"]["reason"], "max_steps");
  EXPECT_EQ(state["stage_done"], true);
  EXPECT_EQ(state["nonfinite"]["total"], 1);
  EXPECT_EQ(state["optimizer_steps"], 2);

  ChildProcess q(OpdArgs(run, 3, rollout, teacher, {"--resume"}), run.string() + "_resume.log");
  ASSERT_EQ(q.Wait(std::chrono::seconds(300)), 0) << q.Log();
  EXPECT_FALSE(fs::exists(run / "checkpoints/step_000004")) << q.Log();
}

// An exception after a step's update (a torch error in the push or the logging) is checkpointed
// as that step: run X throws after step 2's update and must leave a checkpoint of step 2 equal to
// the uninterrupted run Y's; X resumed from it then equals Y at step 3. Before, step_ still said 1,
// the step-1 checkpoint already existed, so the updated weights were lost (or, without it, saved
// as step 1 and the batch applied twice on resume).
TEST_F(LearnerRuns, ExceptionAfterTheUpdateCheckpointsTheNewStep) {
  const std::string teacher = StartService("teacher_throw", kBin + "/teacher_service/opd-teacher",
                                           (dir_ / "teacher_small").string());
  const std::string rollout =
      StartService("rollout_throw", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  const fs::path x = dir_ / "run_throws", y = dir_ / "run_straight";
  {
    ChildProcess p(OpdArgs(y, 3, rollout, teacher, {}), y.string() + ".log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  }
  {
    ChildProcess p(OpdArgs(x, 3, rollout, teacher, {"--set", "debug.throw_after_update_steps=[2]"}),
                   x.string() + ".log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 1) << p.Log();
    EXPECT_NE(p.Log().find("debug.throw_after_update_steps: step 2"), std::string::npos) << p.Log();
  }
  ASSERT_TRUE(fs::exists(x / "checkpoints/step_000002/trainer_state.json"));
  ExpectSameWeightsAndMoments(x / "checkpoints/step_000002", y / "checkpoints/step_000002");
  {
    ChildProcess p(OpdArgs(x, 3, rollout, teacher, {"--resume"}), x.string() + "_resume.log");
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  }
  ExpectSameWeightsAndMoments(x / "checkpoints/step_000003", y / "checkpoints/step_000003");
}

// The plateau window restarts when the running stage's teachers are swapped: the checkpoint of
// the step after the swap holds one smoothed value (KL to the new teachers), the average starts
// at that step's KL, and the checkpoint before it still has the whole history. The window (50)
// is longer than the run gets, so only the restart can shorten the history.
TEST_F(LearnerRuns, TeacherSwapRestartsThePlateauWindow) {
  const std::string t1 = StartService("teacher_1", kBin + "/teacher_service/opd-teacher",
                                      (dir_ / "teacher_small").string());
  const std::string t2 = StartService("teacher_2", kBin + "/teacher_service/opd-teacher",
                                      (dir_ / "teacher_small").string());
  const std::string rollout =
      StartService("rollout", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(t1.empty() || t2.empty() || rollout.empty());
  const fs::path run = dir_ / "run_swap";
  const testing_util::Served admin = testing_util::StartLearnerAdmin(
      dir_, "run_swap",
      OpdArgs(run, 1000, rollout, t1,
              {"--set", "stages.0.plateau={enabled: true, window: 50, min_rel_improvement: 0.5}"}),
      std::chrono::seconds(120));
  ASSERT_FALSE(admin.address.empty());
  ChildProcess& learner = *admin.process;
  auto wait_for = [&](const fs::path& p) {
    for (int i = 0; i < 6000 && !fs::exists(p) && learner.Running(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return fs::exists(p);
  };
  auto checkpoint = [&](int step) {
    char name[32];
    std::snprintf(name, sizeof(name), "step_%06d", step);
    return run / "checkpoints" / name / "trainer_state.json";
  };
  ASSERT_TRUE(wait_for(checkpoint(2))) << learner.Log();
  // Answered once the learner has applied the swap at a step boundary.
  ChildProcess ctl({kBin + "/ctl/opd-ctl", "swap-teacher", "--learner", admin.address, "--stage",
                    "only", "--endpoints", t2, "--secret-file", (dir_ / "secret").string()},
                   (dir_ / "ctl_swap.log").string());
  ASSERT_EQ(ctl.Wait(std::chrono::seconds(300)), 0) << ctl.Log() << learner.Log();
  const std::string marker = "teacher swap applied at step ";
  int swap_step = -1;
  for (int i = 0; i < 600 && swap_step < 0; ++i) {
    const std::string log = learner.Log();
    if (const size_t at = log.find(marker); at != std::string::npos)
      swap_step = std::stoi(log.substr(at + marker.size()));
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(swap_step, 2) << learner.Log();
  ASSERT_TRUE(wait_for(checkpoint(swap_step + 1))) << learner.Log();
  learner.Kill(SIGTERM);
  learner.Wait(std::chrono::seconds(60));

  const auto before = nlohmann::json::parse(std::ifstream(checkpoint(swap_step)))["convergence"];
  const auto after = nlohmann::json::parse(std::ifstream(checkpoint(swap_step + 1)))["convergence"];
  EXPECT_EQ(before["history"].size(), static_cast<size_t>(swap_step));
  ASSERT_EQ(after["history"].size(), 1u) << after.dump();
  EXPECT_EQ(after["steps"], swap_step + 1);  // the stage's step count carries on
  // The restarted average is the first step's KL to the new teacher itself.
  double kl = -1;
  std::ifstream metrics(run / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    auto m = nlohmann::json::parse(line);
    if (m["step"] == swap_step + 1 && m.contains("opd/reverse_kl"))
      kl = m["opd/reverse_kl"].get<double>();
  }
  EXPECT_DOUBLE_EQ(after["ema"].get<double>(), kl);
}

// The top-k loss end to end: the teacher sends its top-4 per position, the learner scores them
// with the student's full-vocabulary log-probs (StudentTopKLogprobs) and the tail bucket. Three
// steps must run with a finite, positive loss and move the weights. Then two steps of the sampled
// form with per-sequence normalisation and a KL discount.
TEST_F(LearnerRuns, LossFormsAndOptionsTrainEndToEnd) {
  const std::string teacher = StartService("teacher_topk", kBin + "/teacher_service/opd-teacher",
                                           (dir_ / "teacher_small").string());
  const std::string rollout =
      StartService("rollout_topk", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(teacher.empty() || rollout.empty());
  const fs::path run = dir_ / "run_topk";
  ChildProcess p(
      OpdArgs(run, 3, rollout, teacher, {"--set", "loss.form=topk", "--set", "loss.top_k=4"}),
      run.string() + ".log");
  ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
  int steps = 0;
  std::ifstream metrics(run / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    auto m = nlohmann::json::parse(line);
    if (!m.contains("opd/loss")) continue;
    ++steps;
    EXPECT_TRUE(std::isfinite(m["opd/loss"].get<double>())) << line;
    EXPECT_GT(m["opd/loss"].get<double>(), 0.0) << line;
    EXPECT_EQ(m["optim/skipped"].get<double>(), 0.0) << line;
  }
  EXPECT_EQ(steps, 3);
  EXPECT_FALSE(ReadFile(run / "checkpoints/step_000003/model/model.safetensors") ==
               ReadFile(dir_ / "student/model.safetensors"));

  // The sampled form with the peers' options: per-sequence normalisation and a KL discount.
  const fs::path opts = dir_ / "run_loss_options";
  ChildProcess q(OpdArgs(opts, 2, rollout, teacher,
                         {"--set", "loss.normalization=sequence", "--set", "loss.kl_discount=0.9"}),
                 opts.string() + ".log");
  ASSERT_EQ(q.Wait(std::chrono::seconds(300)), 0) << q.Log();
  std::ifstream m2(opts / "metrics.jsonl");
  int finite = 0;
  for (std::string line; std::getline(m2, line);) {
    auto m = nlohmann::json::parse(line);
    if (m.contains("opd/loss") && std::isfinite(m["opd/loss"].get<double>()) &&
        m["optim/skipped"].get<double>() == 0.0)
      ++finite;
  }
  EXPECT_EQ(finite, 2);
}

}  // namespace
