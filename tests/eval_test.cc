// Evaluation as a library (trainer/common/eval.h) on the small OPD task's random student and
// teacher: `opd-ctl eval` prints exactly what RunEvaluation returns; the reverse KL of a model to
// itself is zero and to a teacher equals the mean over tokens of a sequence-by-sequence rescoring;
// accuracy counts trimmed matches over the prompts that have an answer; errors name the stage.
#include "trainer/common/eval.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "tests/opd_task.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

class EvalTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("opd_eval_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    ASSERT_TRUE(testing_util::MakeOpdTask(
        dir_, "--teacher-examples 100 --student-examples 10 --prompts 16 --eval 6", "secret"));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static EvalOptions Options() {
    EvalOptions o;
    o.model = (dir_ / "student").string();
    o.tokenizer = (dir_ / "task/tokenizer").string();
    o.prompts = (dir_ / "task/eval_prompts.jsonl").string();
    o.sampling.samples_per_prompt = 2;
    o.sampling.max_new_tokens = 8;
    o.sampling.seed = 3;
    return o;
  }

  static fs::path dir_;
};

fs::path EvalTest::dir_;

// stdout of `command`.
std::string Output(const std::string& command) {
  std::string out;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
  ::pclose(pipe);
  return out;
}

TEST_F(EvalTest, CommandPrintsTheLibraryResult) {
  EvalOptions o = Options();
  o.teachers = {(dir_ / "teacher_small").string(), o.model};
  auto result = RunEvaluation(o);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->prompts, 6u);
  EXPECT_EQ(result->samples, 12u);
  EXPECT_EQ(result->responses.size(), 12u);
  const std::string printed = Output(
      std::string(OPD_BINARY_DIR) + "/ctl/opd-ctl eval --model " + o.model + " --tokenizer " +
      o.tokenizer + " --prompts " + o.prompts + " --teachers " + o.teachers[0] + "," +
      o.teachers[1] + " --samples 2 --max-new-tokens 8 --seed 3 2>/dev/null");
  ASSERT_FALSE(printed.empty());
  EXPECT_EQ(json::parse(printed), EvalResultJson(o.model, *result));
}

TEST_F(EvalTest, ReverseKlMatchesRescoringEachSequence) {
  const EvalOptions o = Options();
  auto student = lm::LoadModel(o.model);
  auto teacher = lm::LoadModel((dir_ / "teacher_small").string());
  auto tokenizer = lm::Tokenizer::Load(o.tokenizer);
  ASSERT_TRUE(student.ok() && teacher.ok() && tokenizer.ok());
  (*student)->eval();
  (*teacher)->eval();
  lm::PromptDatasetOptions po;
  po.sources.push_back({"eval", {o.prompts}, 1.0});
  po.shuffle = false;
  po.drop_final_assistant = true;
  auto data = lm::PromptDataset::Load(**tokenizer, po);
  ASSERT_TRUE(data.ok()) << data.status();
  const auto prompts = (*data)->NextBatch((*data)->source_size(0));
  auto result = Evaluate(**student, **tokenizer, prompts, o.sampling,
                         {{"teacher", teacher->get()}, {"self", student->get()}});
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->reverse_kl.size(), 2u);

  // The same quantity one sequence at a time: sum over response tokens of the sampler's log-prob
  // minus the teacher's, over the number of response tokens.
  torch::NoGradGuard no_grad;
  double sum = 0;
  int64_t n = 0;
  for (const EvalResponse& r : result->responses) {
    std::vector<int64_t> seq(prompts[r.sample.prompt_index].prompt_ids.begin(),
                             prompts[r.sample.prompt_index].prompt_ids.end());
    const auto response = r.sample.response();
    seq.insert(seq.end(), response.begin(), response.end());
    const torch::Tensor lp = lm::SequenceLogprobs(**teacher, lm::PackedBatch::FromSequences({seq}));
    const int64_t first = static_cast<int64_t>(seq.size() - 1 - response.size());
    for (size_t j = 0; j < response.size(); ++j)
      sum += r.sample.logprobs[j] - lp[first + static_cast<int64_t>(j)].item<float>();
    n += static_cast<int64_t>(response.size());
  }
  ASSERT_GT(n, 0);
  EXPECT_EQ(result->reverse_kl[0].first, "teacher");
  EXPECT_NEAR(result->reverse_kl[0].second, sum / static_cast<double>(n), 1e-5);
  EXPECT_GT(std::abs(result->reverse_kl[0].second), 1e-4);  // two different random models
  // The model against itself: its sampled log-probs are its own scores of those tokens.
  EXPECT_EQ(result->reverse_kl[1].first, "self");
  EXPECT_NEAR(result->reverse_kl[1].second, 0.0, 1e-5);
}

TEST_F(EvalTest, AccuracyCountsTrimmedMatchesOfPromptsWithAnAnswer) {
  EvalOptions o = Options();
  o.sampling.samples_per_prompt = 1;
  auto first = RunEvaluation(o);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->responses.size(), 6u);
  std::vector<std::string> text(6);
  for (const EvalResponse& r : first->responses) text[r.sample.prompt_index] = r.text;

  // The same prompts with answers the same seed reproduces: prompts 0-2 get their own response
  // padded with whitespace (a match), 3 and 4 another text (no match), 5 none (not counted).
  std::ifstream in(o.prompts);
  const fs::path answered = dir_ / "answered.jsonl";
  std::ofstream out(answered);
  std::string line;
  for (int i = 0; std::getline(in, line); ++i) {
    json j = json::parse(line);
    j.erase("answer");
    if (i < 3) j["answer"] = " \n" + text[i] + "\t ";
    if (i == 3 || i == 4) j["answer"] = "x" + text[i] + "x";
    out << j.dump() << "\n";
  }
  out.close();
  o.prompts = answered.string();
  auto second = RunEvaluation(o);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->responses.size(), 6u);
  for (const EvalResponse& r : second->responses) {
    EXPECT_EQ(r.text, text[r.sample.prompt_index]);
    EXPECT_EQ(r.correct, r.sample.prompt_index < 3) << r.sample.prompt_index;
  }
  EXPECT_DOUBLE_EQ(second->accuracy, 3.0 / 5.0);
}

TEST_F(EvalTest, ErrorsNameTheStage) {
  const auto message = [](const EvalOptions& o) {
    auto r = RunEvaluation(o);
    return r.ok() ? std::string("ok") : std::string(r.status().message());
  };
  EvalOptions o = Options();
  o.model = (dir_ / "no_model").string();
  EXPECT_EQ(message(o).rfind("model: ", 0), 0u) << message(o);
  o = Options();
  o.tokenizer = (dir_ / "no_tokenizer").string();
  EXPECT_EQ(message(o).rfind("tokenizer: ", 0), 0u) << message(o);
  o = Options();
  o.prompts = (dir_ / "no_prompts.jsonl").string();
  EXPECT_EQ(message(o).rfind("prompts: ", 0), 0u) << message(o);
  o = Options();
  o.teachers = {(dir_ / "no_teacher").string()};
  EXPECT_EQ(message(o).rfind("teacher: ", 0), 0u) << message(o);
}

}  // namespace
}  // namespace trainer
