// A rehearsal of the shipped job: configs/opd/marco_nano.yaml as it is, on this machine, with only
// its paths, endpoints and sizes overridden: the tiny task's student and teachers, two rollout
// workers, a teacher for the stage's default pool and one for each domain pool (math, code), the
// held-out set, TLS with a CA made here, one-step-off and the pipelined step as shipped. One step
// of each stage: the cascade moves from the first stage's teachers to the second's.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "nlohmann/json.hpp"
#include "tests/child_process.h"
#include "tests/opd_task.h"
#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::ReadFile;
using testing_util::ReadJsonl;

const std::string kBin = OPD_BINARY_DIR;
const std::string kSecret = "rehearsal-test-secret-5c1e";
// The shipped prompt sources, in file order: a source's name is its prompts' domain.
const std::vector<std::string> kDomains = {"math", "code", "stem", "multilingual", "general"};

class Rehearsal : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("opd_rehearsal_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    ASSERT_TRUE(testing_util::MakeTestCertificates(dir_));
    ASSERT_TRUE(testing_util::MakeOpdTask(
        dir_, "--teacher-examples 100 --student-examples 10 --prompts 40 --eval 4", kSecret));
    // The task's prompts dealt round-robin into one file per shipped source.
    std::ifstream in(dir_ / "task/opd_prompts.jsonl");
    std::vector<std::ofstream> out;
    for (const std::string& name : kDomains) out.emplace_back(dir_ / (name + ".jsonl"));
    int n = 0;
    for (std::string line; std::getline(in, line); ++n) {
      auto j = nlohmann::json::parse(line);
      j.erase("domain");  // the source's name is the domain
      out[n % out.size()] << j.dump() << "\n";
    }
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void TearDown() override { services_.clear(); }

  static std::string Path(const std::string& name) { return (dir_ / name).string(); }

  std::string Serve(const std::string& tag, const std::string& binary, const std::string& model) {
    services_.push_back(testing_util::StartServed(
        dir_, tag,
        {binary, "--model=" + Path(model), "--tokenizer=" + Path("task/tokenizer"),
         "--secret-file=" + Path("secret"), "--tls-cert=" + Path("node.pem"),
         "--tls-key=" + Path("node.key"), "--threads=1"}));
    return services_.back().address;
  }

  static inline fs::path dir_;
  std::vector<testing_util::Served> services_;
};

TEST_F(Rehearsal, TheShippedOpdConfigRunsTwoStepsWithOnlyPathsEndpointsAndSizesChanged) {
  const std::string teacher = kBin + "/teacher_service/opd-teacher";
  const std::string rollout = kBin + "/rollout/opd-rollout";
  const std::string r0 = Serve("rollout0", rollout, "student");
  const std::string r1 = Serve("rollout1", rollout, "student");
  const std::string t_default = Serve("teacher_default", teacher, "teacher_small");
  const std::string t_math = Serve("teacher_math", teacher, "teacher_small");
  const std::string t_code = Serve("teacher_code", teacher, "teacher_small");
  ASSERT_FALSE(r0.empty() || r1.empty() || t_default.empty() || t_math.empty() || t_code.empty());

  const fs::path run = dir_ / "run";
  std::vector<std::string> sets = {
      // paths
      "run.dir=" + run.string(), "model.path=" + Path("student"),
      "heldout.sources.0.files=[" + Path("task/opd_prompts.jsonl") + "]",
      "auth.secret_file=" + Path("secret"), "auth.tls.ca=" + Path("ca.pem"),
      "auth.tls.cert=" + Path("node.pem"), "auth.tls.key=" + Path("node.key"),
      // endpoints
      "rollout.endpoints=[" + r0 + ", " + r1 + "]", "admin.listen=127.0.0.1:0"};
  for (size_t i = 0; i < kDomains.size(); ++i)
    sets.push_back("prompts.sources." + std::to_string(i) + ".files=[" +
                   Path(kDomains[i] + ".jsonl") + "]");
  for (const char* stage : {"stages.0", "stages.1"}) {
    sets.push_back(std::string(stage) + ".teachers=[" + t_default + "]");
    sets.push_back(std::string(stage) + ".domains.0.teachers=[" + t_math + "]");
    sets.push_back(std::string(stage) + ".domains.1.teachers=[" + t_code + "]");
  }
  // sizes: the tiny task's; one step of each stage (the cascade's swap between them), a held-out
  // evaluation after each
  for (const char* s :
       {"train.prompts_per_step=10", "prompts.max_prompt_len=64", "rollout.max_new_tokens=8",
        "heldout.num_prompts=4", "heldout.every=1", "stages.0.max_steps=1", "stages.1.max_steps=1"})
    sets.push_back(s);
  std::vector<std::string> argv = {kBin + "/trainer/opd-trainer", "opd", "--config",
                                   std::string(OPD_SOURCE_DIR) + "/configs/opd/marco_nano.yaml"};
  for (const std::string& s : sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  ChildProcess trainer(argv, Path("trainer.log"));
  ASSERT_EQ(trainer.Wait(std::chrono::seconds(600)), 0) << trainer.Log();

  std::map<int64_t, nlohmann::json> steps;
  bool heldout = false;
  for (const auto& m : ReadJsonl(run / "metrics.jsonl")) {  // a step's rows, merged
    heldout = heldout || m.contains("opd/heldout_reverse_kl");
    if (m.contains("opd/heldout_reverse_kl") || !m.contains("step")) continue;
    steps[m["step"].get<int64_t>()].update(m);
  }
  ASSERT_EQ(steps.size(), 2u) << ReadFile(run / "metrics.jsonl");
  for (const auto& [step, m] : steps) {
    EXPECT_TRUE(std::isfinite(m["opd/reverse_kl"].get<double>())) << m.dump();
    // Every domain pool scored its own domain's samples (the default pool the other three).
    for (const char* domain : {"math", "code"})
      EXPECT_GT(m.value(std::string("sequences/") + domain, 0.0), 0) << domain << m.dump();
    EXPECT_EQ(m.value("opd/domain_fallbacks", -1.0), 0) << m.dump();
    EXPECT_GT(m.value("time/overlap", 0.0), 0) << m.dump();
    EXPECT_EQ(m["opd/stage"].get<double>(), static_cast<double>(step - 1)) << m.dump();
  }
  EXPECT_TRUE(heldout) << "no held-out evaluation was logged";
  EXPECT_TRUE(fs::exists(run / "checkpoints/step_000002/trainer_state.json"));
  // One-step-off as shipped: a step learns samples at most one weight version old.
  for (const auto& [step, m] : steps)
    EXPECT_LE(m.value("rollout/staleness_max", 99.0), 1.0) << m.dump();
}

}  // namespace
