// Resuming an SFT or OPD run after a skipped (non-finite) step continues it exactly: AdamW's bias
// correction must count the updates applied, not the steps run. A tiny random student and
// teacher with the demo's tokenizer and task (scripts/demo/make_task.py); OPD runs against real
// opd-teacher and opd-rollout processes on 127.0.0.1 with a shared secret, stopped by the test.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "child_process.h"
#include "nlohmann/json.hpp"

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::WaitForPort;

const std::string kBin = OPD_BINARY_DIR;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

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

int64_t OptimizerSteps(const fs::path& checkpoint) {
  return nlohmann::json::parse(std::ifstream(checkpoint / "trainer_state.json"))["optimizer_steps"]
      .get<int64_t>();
}

class SkippedStepResume : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("skipped_step_resume_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    const std::string py = OPD_PYTHON, src = OPD_SOURCE_DIR, d = dir_.string();
    ASSERT_EQ(Shell(py + " " + src + "/scripts/demo/make_task.py --out " + d +
                    "/task --teacher-examples 400 --student-examples 50 --prompts 200 --eval 16"
                    " > /dev/null"),
              0);
    for (auto [name, seed] : {std::pair{"student", 1}, {"teacher_small", 2}}) {
      ASSERT_EQ(Shell(kBin + "/ctl/opd-ctl init-model --config " + d + "/task/models/" + name +
                      ".json --out " + d + "/" + name + " --tokenizer " + d +
                      "/task/tokenizer --seed " + std::to_string(seed) + " 2>/dev/null"),
                0);
    }
    std::ofstream(dir_ / "secret") << "opd-resume-test-secret-91d2\n";
    chmod((dir_ / "secret").c_str(), 0600);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void TearDown() override { services_.clear(); }

  static int Shell(const std::string& cmd) { return std::system(cmd.c_str()); }

  std::string StartService(const std::string& tag, const std::string& binary,
                           const std::string& model) {
    const std::string port_file = (dir_ / (tag + ".port")).string();
    services_.push_back(std::make_unique<ChildProcess>(
        std::vector<std::string>{binary, "--model=" + model,
                                 "--tokenizer=" + (dir_ / "task/tokenizer").string(),
                                 "--listen=127.0.0.1:0", "--port-file=" + port_file,
                                 "--secret-file=" + (dir_ / "secret").string(), "--threads=1"},
        (dir_ / (tag + ".log")).string()));
    const int port = WaitForPort(*services_.back(), port_file, std::chrono::seconds(60));
    EXPECT_GT(port, 0) << services_.back()->Log();
    return port > 0 ? "127.0.0.1:" + std::to_string(port) : "";
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

  // A one-stage run of `steps` steps whose step 2 is poisoned with NaN (and so skipped), with a
  // checkpoint after every step; `extra` adds arguments (--resume=DIR).
  int RunOpd(const fs::path& run, int steps, const std::string& rollout, const std::string& teacher,
             const std::vector<std::string>& extra = {}) {
    const std::string d = dir_.string();
    std::vector<std::string> args = {
        kBin + "/trainer/opd-trainer",
        "opd",
        "--config",
        std::string(OPD_SOURCE_DIR) + "/configs/demo/opd.yaml",
        "--set",
        "run.dir=" + run.string(),
        "--set",
        "model.path=" + d + "/student",
        "--set",
        "prompts.sources=[{files: [" + d + "/task/opd_prompts.jsonl]}]",
        "--set",
        "rollout.endpoints=[" + rollout + "]",
        "--set",
        "stages=[{name: only, teachers: [" + teacher + "], max_steps: " + std::to_string(steps) +
            "}]",
        "--set",
        "train.prompts_per_step=4",
        "--set",
        "train.async=false",  // one-step-off sampling would draw step 3 before step 2's update
        "--set",
        "debug.nan_steps=[2]",
        "--set",
        "checkpoint.every=1",
        "--set",
        "checkpoint.keep_last=0",
        "--set",
        "auth.secret_file=" + (dir_ / "secret").string()};
    args.insert(args.end(), extra.begin(), extra.end());
    ChildProcess p(args, run.string() + ".log");
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
TEST_F(SkippedStepResume, Sft) {
  const fs::path a = dir_ / "sft_a", b = dir_ / "sft_b";
  ASSERT_EQ(RunSft(a), 0);
  ExpectStepTwoWasSkipped(a / "checkpoints/step_000002");
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

TEST_F(SkippedStepResume, Opd) {
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

}  // namespace
