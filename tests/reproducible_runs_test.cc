// OPD runs whose steps need several teacher calls are reproducible, and a killed run resumes
// exactly (issue #41 item 20). 128 prompts a step with 2 samples each is 256 sequences, which the
// learner's teacher pool sends in calls of 64 (TeacherPool's max_sequences_per_call), two at a
// time: four calls a step, which the teacher packs into buckets of 1,024 tokens as they happen to
// arrive, so which sequences share a forward differs from run to run. Before the teacher scored
// batch-invariantly, a sequence's log-probs moved with its bucket (60 of 66 sequences, by up to
// 9.5e-7) and so did the learner's weights. Here three runs of two steps end with the same
// weights and AdamW moments, bit for bit, and so does a run killed (SIGKILL) once its first step
// was checkpointed and then resumed. Real opd-teacher, opd-rollout and opd-trainer processes on
// 127.0.0.1 with the demo's task and tiny random models (tests/opd_task.h).
#include <csignal>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "child_process.h"
#include "opd_task.h"
#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::ReadFile;

const std::string kBin = OPD_BINARY_DIR;

class ReproducibleRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("reproducible_runs_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    ASSERT_TRUE(testing_util::MakeOpdTask(
        dir_, "--teacher-examples 400 --student-examples 50 --prompts 300 --eval 16",
        "opd-reproducible-test-secret-5c1e"));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // Two steps of one stage at 128 prompts a step, a checkpoint after each; `extra` adds arguments.
  std::vector<std::string> Args(const fs::path& run, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = testing_util::OpdTrainerArgs(
        dir_, run.string(), rollout_,
        {"stages=[{name: only, teachers: [" + teacher_ + "], max_steps: 2}]",
         "train.prompts_per_step=128", "train.async=false", "checkpoint.every=1",
         "checkpoint.keep_last=0"});
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  int Run(const fs::path& run, const std::vector<std::string>& extra = {}) {
    ChildProcess p(Args(run, extra), run.string() + ".log");
    const int code = p.Wait(std::chrono::seconds(900));
    EXPECT_EQ(code, 0) << p.Log();
    return code;
  }

  static inline fs::path dir_;
  std::string teacher_, rollout_;
  std::vector<std::unique_ptr<ChildProcess>> services_;
};

void ExpectSameWeightsAndMoments(const fs::path& a, const fs::path& b) {
  ASSERT_TRUE(fs::exists(a / "trainer_state.json")) << a;
  ASSERT_TRUE(fs::exists(b / "trainer_state.json")) << b;
  EXPECT_TRUE(ReadFile(a / "model/model.safetensors") == ReadFile(b / "model/model.safetensors"))
      << b << ": the weights differ from " << a;
  EXPECT_TRUE(ReadFile(a / "optimizer.safetensors") == ReadFile(b / "optimizer.safetensors"))
      << b << ": the AdamW state differs from " << a;
}

TEST_F(ReproducibleRuns, ThreeRunsAndAKilledRunResumedEndBitwiseEqual) {
  // The teacher as tests/opd_task.h starts it (one thread), with buckets of 1,024 tokens: a call's
  // 64 sequences of ~70 tokens span several, and the buckets mix the calls in flight.
  testing_util::Served teacher = testing_util::StartServed(
      dir_, "teacher",
      {kBin + "/teacher_service/opd-teacher", "--model=" + (dir_ / "teacher_small").string(),
       "--tokenizer=" + (dir_ / "task/tokenizer").string(),
       "--secret-file=" + (dir_ / "secret").string(), "--threads=1", "--max-batch-tokens=1024"});
  testing_util::Served rollout = testing_util::StartTaskService(
      dir_, "rollout", kBin + "/rollout/opd-rollout", (dir_ / "student").string());
  ASSERT_FALSE(teacher.address.empty() || rollout.address.empty());
  teacher_ = teacher.address;
  rollout_ = rollout.address;

  const fs::path a = dir_ / "run_a", b = dir_ / "run_b", c = dir_ / "run_c";
  for (const fs::path& run : {a, b, c}) ASSERT_EQ(Run(run), 0);
  const fs::path last = "checkpoints/step_000002";
  ExpectSameWeightsAndMoments(a / last, b / last);
  ExpectSameWeightsAndMoments(a / last, c / last);
  EXPECT_FALSE(ReadFile(a / last / "model/model.safetensors") ==
               ReadFile(dir_ / "student/model.safetensors"))
      << "the runs did not train: equal weights would prove nothing";

  // Run D is killed once its first step's checkpoint is complete (its directory appears by a
  // rename, whole), wherever it then is in step 2, and resumed from its newest checkpoint.
  const fs::path d = dir_ / "run_d";
  {
    ChildProcess p(Args(d), d.string() + ".log");
    const fs::path first = d / "checkpoints/step_000001/trainer_state.json";
    for (int i = 0; i < 18000 && !fs::exists(first) && p.Running(); ++i)  // 15 minutes at most
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(fs::exists(first)) << p.Log();
    p.Kill(SIGKILL);
    p.Wait(std::chrono::seconds(60));
  }
  // Had step 2 finished before the kill landed, the resume would have nothing to do: remove it
  // (and a half-written one), so that the resumed run always trains step 2 from step 1.
  for (const auto& entry : fs::directory_iterator(d / "checkpoints"))
    if (entry.path().filename() != "step_000001") fs::remove_all(entry.path());
  ASSERT_EQ(Run(d, {"--resume"}), 0);
  ExpectSameWeightsAndMoments(a / last, d / last);
}

}  // namespace
