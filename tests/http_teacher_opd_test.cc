// External teachers in the OPD learner, on the demo's task (scripts/demo/make_task.py, a random
// tiny student and teacher, opd-ctl init-model): the connect-time tokenizer probe, and short CPU
// OPD runs whose teacher is the fake SGLang / vLLM server (tests/python/fake_inference_server.py)
// serving the teacher model with transformers, against the same run on opd-teacher.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>

#include <gtest/gtest.h>

#include "fake_inference_server.h"
#include "lm/io/safetensors.h"
#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "opd_task.h"
#include "tests/testing.h"
#include "trainer/opd/teacher_pool.h"

using testing_util::ReadJsonl;

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using testing_util::FakeInferenceServer;

const std::string kSecret = "http-teacher-opd-secret-7d3e";

class HttpTeacherOpd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing_util::FreshDir("http_teacher_opd");
    ASSERT_TRUE(testing_util::MakeOpdTask(
        dir_, "--teacher-examples 40 --student-examples 10 --prompts 16 --eval 4", kSecret));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static std::string Tokenizer() { return (dir_ / "task/tokenizer").string(); }
  static std::string Teacher() { return (dir_ / "teacher_small").string(); }

  trainer::TeacherRequirements Student() {
    auto tok = lm::Tokenizer::Load(Tokenizer());
    EXPECT_TRUE(tok.ok()) << tok.status();
    return trainer::StudentRequirements(**tok, 0);
  }

  // An opd-rollout serving the student (one per run: a rollout that has taken a run's weight
  // pushes would refuse the next run's first, older version).
  testing_util::Served StartRollout(const std::string& tag) {
    return testing_util::StartServed(
        dir_, tag + ".rollout",
        {std::string(OPD_BINARY_DIR) + "/rollout/opd-rollout",
         "--model=" + (dir_ / "student").string(), "--tokenizer=" + Tokenizer(),
         "--secret-file=" + (dir_ / "secret").string(), "--threads=1"},
        std::chrono::seconds(120));
  }

  // Two steps of OPD (one per stage, both stages on `teacher`); returns the run directory.
  fs::path RunOpd(const std::string& tag, const std::string& teacher) {
    const testing_util::Served ro = StartRollout(tag);
    const std::string& rollout = ro.address;
    const fs::path run = dir_ / ("run_" + tag);
    // Adam's eps = 1 makes the update lr * m / (sqrt(v) + 1), Lipschitz in the gradient (with the
    // default 1e-8 the first update is lr * sign(g), which a 1e-7 change of a tiny gradient flips).
    auto args = testing_util::OpdTrainerArgs(
        dir_, run.string(), rollout,
        {"stages.0.teachers=[\"" + teacher + "\"]", "stages.1.teachers=[\"" + teacher + "\"]",
         "stages.0.max_steps=1", "stages.0.plateau.enabled=false", "stages.1.max_steps=1",
         "train.prompts_per_step=4", "checkpoint.every=1", "logging.log_every=1", "optim.eps=1.0",
         "optim.warmup_steps=0"});
    ChildProcess trainer(args, (dir_ / (tag + ".trainer.log")).string());
    EXPECT_EQ(trainer.Wait(std::chrono::seconds(600)), 0) << trainer.Log();
    return run;
  }

  static inline fs::path dir_;
};

// The teacher's tokenizer must tokenize the probe as the student's does: the same tokenizer
// passes, one whose ids differ is refused naming the endpoint, the probe and the ids, and a server
// that cannot tokenize is let through (it cannot tell).
TEST_F(HttpTeacherOpd, ConnectChecksTheServersTokenizerOnAProbe) {
  const auto req = Student();
  ASSERT_FALSE(req.probe_ids.empty());
  FakeInferenceServer same("ok", {"--tokenizer", Tokenizer()});
  FakeInferenceServer wrong("wrongtok", {"--tokenizer", Tokenizer()});
  FakeInferenceServer none("ok");
  ASSERT_TRUE(same.ok() && wrong.ok() && none.ok());
  trainer::TeacherPoolOptions po;
  po.client.timeout = absl::Seconds(30);
  for (const char* scheme : {"sglang", "vllm"}) {
    EXPECT_TRUE(trainer::TeacherPool::Connect("s", {same.Endpoint(scheme)}, req, po).ok());
    EXPECT_TRUE(trainer::TeacherPool::Connect("s", {none.Endpoint(scheme)}, req, po).ok());
    const std::string ep = wrong.Endpoint(scheme);
    auto pool = trainer::TeacherPool::Connect("s", {ep}, req, po);
    ASSERT_EQ(pool.status().code(), absl::StatusCode::kFailedPrecondition) << pool.status();
    const std::string msg(pool.status().message());
    EXPECT_NE(msg.find(ep), std::string::npos) << msg;
    EXPECT_NE(msg.find("probe"), std::string::npos) << msg;
    // The wrong server changes the last id by one.
    const size_t last = req.probe_ids.size() - 1;
    EXPECT_NE(msg.find("first different at id " + std::to_string(last) + ": the teacher's " +
                       std::to_string(req.probe_ids[last] + 1) + ", the student's " +
                       std::to_string(req.probe_ids[last])),
              std::string::npos)
        << msg;
  }
  // Our own teacher is checked by its fingerprint, not asked to tokenize.
  testing_util::OpdTeacherProcess own(Teacher(), Tokenizer());
  ASSERT_TRUE(own.ok());
  po.client.secret = testing_util::OpdTeacherProcess::kSecret;
  EXPECT_TRUE(trainer::TeacherPool::Connect("s", {own.address()}, req, po).ok());
}

// Step -> opd/teacher_logprob (the mean teacher log-prob of the step's tokens).
std::map<int, double> TeacherLogprobs(const fs::path& run) {
  std::map<int, double> out;
  for (const auto& m : ReadJsonl(run / "metrics.jsonl"))
    if (m.contains("opd/teacher_logprob")) out[m["step"]] = m["opd/teacher_logprob"];
  return out;
}

// The largest |a - b| over the fp32 tensors of two weight files.
double MaxWeightDiff(const fs::path& a, const fs::path& b) {
  auto fa = lm::SafetensorsFile::Open(a.string());
  auto fb = lm::SafetensorsFile::Open(b.string());
  EXPECT_TRUE(fa.ok() && fb.ok());
  if (!fa.ok() || !fb.ok()) return std::numeric_limits<double>::infinity();
  EXPECT_EQ((*fa)->tensors().size(), (*fb)->tensors().size());
  double m = 0;
  for (const auto& [name, ta] : (*fa)->tensors()) {
    auto tb = (*fb)->Get(name);
    EXPECT_TRUE(tb.ok() && tb->nbytes == ta.nbytes && ta.dtype == lm::DType::kF32) << name;
    if (!tb.ok() || tb->nbytes != ta.nbytes || ta.dtype != lm::DType::kF32) continue;
    const float* x = reinterpret_cast<const float*>(ta.data);
    const float* y = reinterpret_cast<const float*>(tb->data);
    for (int64_t i = 0; i < ta.numel(); ++i)
      m = std::max(m, std::abs(static_cast<double>(x[i]) - y[i]));
  }
  return m;
}

// The per-token tolerance, derived as in http_teacher_test.cc's parity test: 2 * 64 * eps * M,
// with M the magnitude of what is rounded. This random teacher (std 0.02) has logits well below 1,
// so the log-sum-exp, about log V ~ 5.8, dominates: M = the largest |log-prob| seen.
double TokenTolerance(const std::vector<nlohmann::json>& records) {
  double m = 1;
  for (const auto& r : records)
    for (double lp : r["logprobs"].get<std::vector<double>>()) m = std::max(m, std::abs(lp));
  return 2.0 * 64.0 * std::numeric_limits<float>::epsilon() * m;
}

// The same two-step OPD run with the teacher on opd-teacher, on the fake SGLang server and on the
// fake vLLM server (both computing the teacher's log-probs with transformers): every sequence the
// fake scored gets the same log-probs from opd-teacher, each step's mean teacher log-prob is the
// same, and so are the trained weights.
TEST_F(HttpTeacherOpd, RunsOnSglangAndVllmEqualTheRunOnOpdTeacher) {
  const fs::path record = dir_ / "scored.jsonl";
  testing_util::OpdTeacherProcess own(Teacher(), Tokenizer(), kSecret);
  FakeInferenceServer fake(
      "ok", {"--model", Teacher(), "--tokenizer", Tokenizer(), "--record", record.string()});
  ASSERT_TRUE(own.ok() && fake.ok()) << fake.Log();
  const fs::path base = RunOpd("opd_teacher", own.address());
  const fs::path sglang = RunOpd("sglang", fake.Endpoint("sglang"));
  const fs::path vllm = RunOpd("vllm", fake.Endpoint("vllm"));

  // Every sequence the fake scored, rescored by opd-teacher.
  const auto records = ReadJsonl(record);
  ASSERT_FALSE(records.empty());
  std::vector<lm::Sample> inputs;
  std::map<std::string, std::vector<std::vector<int32_t>>> seen;  // api -> sequences, in order
  for (const auto& r : records) {
    const auto tokens = r["tokens"].get<std::vector<int32_t>>();
    const auto n = static_cast<int32_t>(r["logprobs"].size());
    inputs.push_back(lm::Sample::ToScore(tokens, static_cast<int64_t>(tokens.size()) - n));
    seen[r["api"]].push_back(tokens);
  }
  // The two fake runs drew the same samples (so the comparisons below compare like with like);
  // the pipelined step scores them as they arrive, so in any order.
  for (auto& [api, sequences] : seen) std::sort(sequences.begin(), sequences.end());
  EXPECT_EQ(seen["sglang"], seen["vllm"]);
  auto client = opd::rpc::CreateTeacherEndpoint(own.Options());
  ASSERT_TRUE(client.ok());
  auto ref = (*client)->Score(inputs, {});
  ASSERT_TRUE(ref.ok()) << ref.status();
  const double tol = TokenTolerance(records);
  double max_d = 0;
  size_t tokens = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const auto lps = records[i]["logprobs"].get<std::vector<float>>();
    max_d = std::max(max_d, testing_util::MaxAbsDiff((*ref)[i].logprobs, lps));
    tokens += lps.size();
  }
  EXPECT_LE(max_d, tol);

  // Per step, the mean teacher log-prob the learner saw.
  const auto t0 = TeacherLogprobs(base), t1 = TeacherLogprobs(sglang), t2 = TeacherLogprobs(vllm);
  ASSERT_EQ(t0.size(), 2u);
  ASSERT_EQ(t1.size(), 2u);
  ASSERT_EQ(t2.size(), 2u);
  double max_step = 0;
  for (const auto& [step, v] : t0)
    max_step = std::max({max_step, std::abs(v - t1.at(step)), std::abs(v - t2.at(step))});
  EXPECT_LE(max_step, tol);

  // Weights. With the update Lipschitz in the gradient (constant lr / eps, eps = 1) and the
  // gradient linear in the teacher's log-probs (the sampled loss weighs each token's student
  // log-prob gradient by student - teacher log-prob), |dw| <= sum over steps of lr * tol * G,
  // with G the largest mean |d log p_student / d w| of one weight, O(1) for this tiny model: we
  // allow G = 10. lr = 1e-3 at both steps (the demo's, without warm-up), so sum lr = 2e-3.
  const double w_tol = 2e-3 * tol * 10;
  const fs::path weights = "checkpoints/step_000002/model/model.safetensors";
  const double dw_sglang = MaxWeightDiff(base / weights, sglang / weights);
  const double dw_vllm = MaxWeightDiff(base / weights, vllm / weights);
  // ... while training moved them by far more (else the comparison would prove nothing).
  const double moved = MaxWeightDiff(dir_ / "student/model.safetensors", base / weights);
  EXPECT_GT(moved, 1000 * std::max(dw_sglang, dw_vllm));
  EXPECT_LE(dw_sglang, w_tol);
  EXPECT_LE(dw_vllm, w_tol);
  std::cout << "[opd parity] " << records.size() << " sequences, " << tokens
            << " tokens scored by the fake: max |d logprob| vs opd-teacher " << max_d
            << " (tolerance " << tol << "); max |d step mean teacher logprob| " << max_step
            << "; max |d weight| sglang " << dw_sglang << ", vllm " << dw_vllm << " (tolerance "
            << w_tol << "); training moved a weight by up to " << moved << "\n";
}

}  // namespace
