// The SFT job (`opd-trainer sft`) and its pieces. The job tests run the real binaries as child
// processes (a SIGKILL or SIGTERM must hit a real process) on the tiny student of
// configs/sft/tiny_model.json, made with `opd-ctl init-model`, and the synthetic chat data and
// tokenizer of tests/python/make_sft_fixtures.py. Single-threaded, so that runs are bit-for-bit
// repeatable.
//
// Tolerances against the Python reference loop (transformers + torch.optim.AdamW, fp32): per-step
// loss within 1e-5, weights after 4 updates at lr 1e-3 within 2e-5 (measured: ~4e-7 and ~1.5e-6;
// the forwards differ in summation order only).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/strings/str_format.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/util/config.h"
#include "nlohmann/json.hpp"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "trainer/common/job_args.h"
#include "trainer/common/metrics.h"
#include "trainer/common/optim.h"
#include "trainer/common/progress.h"
#include "trainer/sft/fused_nll.h"
#include "trainer/sft/sft_config.h"

using testing_util::ReadJsonl;
using testing_util::TestDir;

namespace trainer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kFixtures = std::string(OPD_BINARY_DIR) + "/fixtures_sft";
const std::string kTrainer = std::string(OPD_BINARY_DIR) + "/trainer/opd-trainer";
const std::string kCtl = std::string(OPD_BINARY_DIR) + "/ctl/opd-ctl";
const std::string kTinyConfig = std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny.yaml";

// ---------------------------------------------------------------------------------------------
// Helpers: child processes, files.

// A child process whose stdout and stderr go to `log`.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::string& log) {
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  // Exit code, or 128 + signal when killed by one.
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  void Signal(int sig) { kill(pid_, sig); }

 private:
  pid_t pid_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Result {
  int code;
  std::string log;
};

Result RunTool(const std::vector<std::string>& argv, const std::string& log) {
  Child c(argv, log);
  const int code = c.Wait();
  return {code, ReadFile(log)};
}

// Runs a command line and returns its stdout (for the Python helpers).
std::string Capture(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  while (p && fgets(buf, sizeof(buf), p)) out += buf;
  if (p) pclose(p);
  return out;
}

// The complete JSON lines of a file (a line being written by a live process is skipped).
// The metrics lines of training steps (evaluations have lines of their own).
std::vector<json> TrainLines(const std::string& run_dir) {
  std::vector<json> out;
  for (json& m : ReadJsonl(run_dir + "/metrics.jsonl")) {
    if (m.contains("train/loss")) out.push_back(std::move(m));
  }
  return out;
}

int64_t LastTrainStep(const std::string& run_dir) {
  auto lines = TrainLines(run_dir);
  return lines.empty() ? 0 : lines.back()["step"].get<int64_t>();
}

// A fresh directory for one test.
// A random tiny student with the fixture tokenizer (opd-ctl init-model).
std::string MakeStudent(const std::string& dir, double std = 0.05, int seed = 1) {
  const std::string out = dir + "/student";
  auto r = RunTool(
      {kCtl, "init-model", "--config", std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json",
       "--out", out, "--tokenizer", kFixtures + "/tokenizer", "--std", std::to_string(std),
       "--seed", std::to_string(seed)},
      dir + "/init.log");
  EXPECT_EQ(r.code, 0) << r.log;
  return out;
}

// `opd-trainer sft` on configs/sft/tiny.yaml with the fixture data, `student` and `run_dir`,
// single-threaded, plus `sets` (key=value).
std::vector<std::string> SftArgs(const std::string& student, const std::string& run_dir,
                                 const std::vector<std::string>& sets) {
  std::vector<std::string> argv = {kTrainer, "sft", "--config", kTinyConfig};
  std::vector<std::string> all = {"model.path=" + student,
                                  "data.train.0.files=[" + kFixtures + "/data/train.jsonl]",
                                  "data.eval.0.files=[" + kFixtures + "/data/eval.jsonl]",
                                  "run.dir=" + run_dir,
                                  "train.threads=1",
                                  "logging.log_every=1000"};
  all.insert(all.end(), sets.begin(), sets.end());
  for (const auto& s : all) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  return argv;
}

Result RunSftJob(const std::string& student, const std::string& run_dir,
                 const std::vector<std::string>& sets) {
  return RunTool(SftArgs(student, run_dir, sets), run_dir + ".log");
}

// (step, train/loss or eval/loss) of every metrics line, for exact comparisons.
std::vector<std::tuple<int64_t, double, double>> LossCurve(const std::string& run_dir) {
  std::vector<std::tuple<int64_t, double, double>> out;
  for (const json& m : ReadJsonl(run_dir + "/metrics.jsonl")) {
    out.emplace_back(m["step"].get<int64_t>(), m.value("train/loss", -1.0),
                     m.value("eval/loss", -1.0));
  }
  return out;
}

std::map<std::string, torch::Tensor> Weights(const std::string& model_dir) {
  auto model = lm::LoadModel(model_dir);
  EXPECT_TRUE(model.ok()) << model.status();
  std::map<std::string, torch::Tensor> out;
  if (!model.ok()) return out;
  for (const auto& p : (*model)->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

double MaxWeightDiff(const std::string& a, const std::string& b) {
  auto wa = Weights(a), wb = Weights(b);
  EXPECT_EQ(wa.size(), wb.size());
  double worst = 0;
  for (const auto& [name, t] : wa)
    worst = std::max(worst, (t - wb.at(name)).abs().max().item<double>());
  return worst;
}

bool WaitFor(const std::function<bool()>& cond, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Config: strict keys, overrides, round trip.

absl::StatusOr<SftConfig> Decode(const std::string& yaml,
                                 const std::vector<std::string>& sets = {}) {
  auto root = lm::ParseYaml(yaml, "test.yaml");
  if (!root.ok()) return root.status();
  for (const auto& s : sets) {
    if (auto st = lm::ApplyOverride(*root, s); !st.ok()) return st;
  }
  SftConfig c;
  if (auto st = lm::DecodeConfig(*root, &c); !st.ok()) return st;
  return c;
}

TEST(Config, DefaultsAreThePaperRecipe) {
  auto c = Decode("model: {path: m}");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optim.lr, 1e-5);
  EXPECT_EQ(c->optim.min_lr, 1e-6);
  EXPECT_EQ(c->optim.weight_decay, 0.1);
  EXPECT_EQ(c->optim.beta1, 0.9);
  EXPECT_EQ(c->optim.beta2, 0.95);
  EXPECT_EQ(c->train.global_batch_size, 512);
  EXPECT_EQ(c->train.epochs, 1.0);
  EXPECT_EQ(c->data.max_seq_len, 8192);
  EXPECT_LT(c->train.aux_loss_coef, 0);  // the model's own coefficient
}

TEST(Config, UnknownKeysAreErrorsNamingTheirPath) {
  auto c = Decode("optim:\n  lr: 1e-4\n  lrr: 2\n");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("unknown key 'optim.lrr'"), std::string::npos) << c.status();
  c = Decode("data:\n  train:\n    - files: [a.jsonl]\n      wieght: 2\n");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("data.train[0].wieght"), std::string::npos) << c.status();
  c = Decode("trian: {max_steps: 3}");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'trian'"), std::string::npos) << c.status();
}

TEST(Config, OverridesAreTypeChecked) {
  auto c = Decode("optim: {lr: 1e-4}", {"optim.lr=3e-3", "train.max_steps=7",
                                        "data.train=[{files: [x.jsonl], weight: 2}]",
                                        "data.train.0.name=web", "debug.nan_steps=[2, 5]"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optim.lr, 3e-3);
  EXPECT_EQ(c->train.max_steps, 7);
  ASSERT_EQ(c->data.train.size(), 1u);
  EXPECT_EQ(c->data.train[0].files, std::vector<std::string>{"x.jsonl"});
  EXPECT_EQ(c->data.train[0].weight, 2.0);
  EXPECT_EQ(c->data.train[0].name, "web");
  EXPECT_EQ(c->debug.nan_steps, (std::vector<int64_t>{2, 5}));

  for (auto [set, expected] : std::vector<std::pair<std::string, std::string>>{
           {"optim.lr=fast", "optim.lr: expected a number"},
           {"train.max_steps=1.5", "train.max_steps: expected an integer"},
           {"train.max_steps=[1]", "train.max_steps: expected an integer"},
           {"logging.tensorboard=maybe", "logging.tensorboard: expected true or false"},
           {"data.overlong=cut", "data.overlong: 'cut' is not one of truncate, drop"},
           {"model.chat_format=chatml", "model.chat_format: 'chatml' is not one of qwen3, qwen2"},
           {"optim.lrr=1", "unknown key 'optim.lrr'"},
           {"optim.lr.x=1", "cannot set a key inside optim.lr"},
           {"noequals", "expected key.path=value"}}) {
    auto bad = Decode("optim: {lr: 1e-4}", {set});
    ASSERT_FALSE(bad.ok()) << set;
    EXPECT_NE(bad.status().message().find(expected), std::string::npos)
        << set << ": " << bad.status();
  }
}

TEST(Config, ResolvedConfigRoundTrips) {
  auto c = Decode("model: {path: /m}\ndata: {train: [{files: [a, b], weight: 0.25}]}",
                  {"optim.lr=1e-5", "optim.eps=1e-8", "debug.nan_steps=[3]", "run.dir=\"007\"",
                   "data.overlong=drop"});
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string text = lm::EncodeConfig(*c);
  auto again = Decode(text);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << text;
  EXPECT_EQ(lm::EncodeConfig(*again), text);
  EXPECT_EQ(again->optim.eps, 1e-8);
  EXPECT_EQ(again->run.dir, "007");  // a string that looks like a number stays a string
  EXPECT_EQ(again->data.overlong, lm::OverlongPolicy::kDrop);  // an enum is written as its word
  EXPECT_NE(text.find("overlong: \"drop\""), std::string::npos) << text;
  // Floats carry a point so that YAML 1.1 readers (PyYAML) see numbers.
  EXPECT_NE(text.find("eps: 1.0e-08"), std::string::npos) << text;
}

TEST(Config, ValidationNamesTheKey) {
  auto c = Decode(
      "model: {path: m}\ndata: {train: [{files: [a]}]}\nrun: {dir: r}\ntrain: {global_batch_size: "
      "10, micro_batch_size: 4}");
  ASSERT_TRUE(c.ok());
  auto s = ValidateSftConfig(*c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(
                "train.global_batch_size: 10 is not divisible by train.micro_batch_size (4)"),
            std::string::npos)
      << s;
  c->train.micro_batch_size = 5;
  EXPECT_TRUE(ValidateSftConfig(*c).ok());
  c->model.path = "";
  EXPECT_NE(ValidateSftConfig(*c).message().find("model.path"), std::string::npos);
}

TEST(Config, JobArgs) {
  auto a = ParseJobArgs({"--config", "x.yaml", "--set", "a.b=1", "--set=c=2", "--resume"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->config_path, "x.yaml");
  EXPECT_EQ(a->overrides, (std::vector<std::string>{"a.b=1", "c=2"}));
  EXPECT_TRUE(a->resume);
  EXPECT_FALSE(ParseJobArgs({"--set", "a=1"}).ok());  // no --config
  EXPECT_FALSE(ParseJobArgs({"--config", "x", "--bogus"}).ok());
}

// ---------------------------------------------------------------------------------------------
// Small pieces.

TEST(Metrics, Crc32cAndMasking) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);  // the standard CRC-32C check value
  EXPECT_EQ(Crc32c("", 0), 0u);
  const uint32_t crc = Crc32c("abc", 3);
  EXPECT_EQ(MaskedCrc32c("abc", 3), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST(Optim, CosineScheduleFormula) {
  CosineSchedule s{1e-3, 1e-4, 10, 110};
  EXPECT_DOUBLE_EQ(s.LrAt(0), 1e-4);  // warm-up: peak * (s + 1) / W
  EXPECT_DOUBLE_EQ(s.LrAt(9), 1e-3);
  EXPECT_DOUBLE_EQ(s.LrAt(10), 1e-3);                   // cosine starts at the peak
  EXPECT_NEAR(s.LrAt(60), 1e-4 + 0.9e-3 * 0.5, 1e-15);  // half-way: the mean
  EXPECT_DOUBLE_EQ(s.LrAt(110), 1e-4);                  // and ends at min_lr
  EXPECT_DOUBLE_EQ(s.LrAt(500), 1e-4);
  CosineSchedule no_warmup{1e-5, 1e-6, 0, 4000};
  EXPECT_DOUBLE_EQ(no_warmup.LrAt(0), 1e-5);
}

TEST(Optim, WeightDecayGroupsAndClipping) {
  EXPECT_TRUE(UsesWeightDecay("model.layers.0.self_attn.q_proj.weight", torch::zeros({4, 4})));
  EXPECT_TRUE(UsesWeightDecay("model.layers.0.mlp.experts.gate_up_proj", torch::zeros({2, 4, 4})));
  EXPECT_FALSE(UsesWeightDecay("model.norm.weight", torch::zeros({4})));
  EXPECT_FALSE(UsesWeightDecay("x.bias", torch::zeros({4, 4})));

  auto a = torch::ones({3}).requires_grad_(), b = torch::ones({4}).requires_grad_();
  a.mutable_grad() = torch::full({3}, 2.0);
  b.mutable_grad() = torch::full({4}, 2.0);
  const double norm = ClipGradNorm({a, b}, 1.0);
  EXPECT_NEAR(norm, std::sqrt(7 * 4.0), 1e-5);
  EXPECT_NEAR(torch::cat({a.grad(), b.grad()}).norm().item<double>(), 1.0, 1e-5);
  b.mutable_grad() = torch::full({4}, std::nan(""));
  EXPECT_TRUE(std::isnan(ClipGradNorm({a, b}, 1.0)));
  EXPECT_TRUE(std::isfinite(a.grad().sum().item<double>()));  // left alone: the step is skipped
}

// The fused training loss equals -sum(TokenLogprobs) in value and in both gradients, also with a
// chunk size that does not divide the rows and a non-unit upstream gradient.
TEST(FusedNll, MatchesTokenLogprobs) {
  torch::manual_seed(0);
  auto h1 = torch::randn({37, 16}).requires_grad_(), w1 = torch::randn({50, 16}).requires_grad_();
  auto h2 = h1.detach().clone().requires_grad_(), w2 = w1.detach().clone().requires_grad_();
  auto targets = torch::randint(0, 50, {37}, torch::kInt64);
  auto fused = FusedNllSum(h1, w1, targets, /*chunk_rows=*/8);
  auto reference = -lm::TokenLogprobs(h2, w2, targets).sum();
  EXPECT_NEAR(fused.item<double>(), reference.item<double>(), 1e-4);
  (fused * 0.25).backward();
  (reference * 0.25).backward();
  EXPECT_LE((h1.grad() - h2.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_LE((w1.grad() - w2.grad()).abs().max().item<double>(), 1e-5);
  torch::NoGradGuard no_grad;  // evaluation: no gradient work, same value
  EXPECT_NEAR(FusedNllSum(h1.detach(), w1.detach(), targets).item<double>(),
              reference.item<double>(), 1e-4);
}

TEST(Progress, LineAndEta) {
  Progress p(100, 10, /*tty=*/false);
  EXPECT_EQ(FormatDuration(3725), "1h02m");
  EXPECT_EQ(FormatDuration(65), "1m05s");
  EtaEstimator eta(2);
  eta.AddStep(10);
  eta.AddStep(1);
  eta.AddStep(1);  // the 10 s step left the window
  EXPECT_DOUBLE_EQ(eta.Eta(5), 5.0);
  const std::string line = p.Line({12, 1.5, 1e-5, 1234, 0.5, false});
  EXPECT_NE(line.find("step 12/100"), std::string::npos) << line;
  EXPECT_NE(line.find("loss 1.5000"), std::string::npos) << line;
  EXPECT_NE(line.find("1234 tok/s"), std::string::npos) << line;
  EXPECT_NE(line.find("ETA"), std::string::npos) << line;
}

// ---------------------------------------------------------------------------------------------
// The job.

// Our losses and updated weights equal a transformers + torch.optim.AdamW loop replaying the
// same micro-batches; and the loss normalisation makes the micro-batch split irrelevant.
TEST(Sft, MatchesPythonReference) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir, 0.15, 3);
  // 4 micro-batches of one packed sequence each: different token counts per micro-batch.
  const std::vector<std::string> sets = {"train.max_steps=4",    "train.global_batch_size=4",
                                         "optim.lr=1e-3",        "optim.min_lr=1e-4",
                                         "optim.warmup_steps=1", "optim.max_grad_norm=0.5",
                                         "eval.every=0",         "debug.dump_batches=true"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), sets.begin(), sets.end());
    return extra;
  };
  auto r = RunSftJob(student, dir + "/micro1", with({"train.micro_batch_size=1"}));
  ASSERT_EQ(r.code, 0) << r.log;

  // The micro-batches really differ in trained tokens (else the normalisation is not tested).
  std::set<int64_t> counts;
  for (const json& b : ReadJsonl(dir + "/micro1/debug/batches.jsonl")) {
    int64_t n = 0;
    for (const auto& d : b["docs"])
      for (size_t t = 1; t < d["labels"].size(); ++t) n += d["labels"][t].get<int>() != -100;
    counts.insert(n);
  }
  EXPECT_GT(counts.size(), 2u);

  // Token-level normalisation: the cross-entropy part of the step is the same whatever the split
  // (measured: losses within ~1e-6, weights ~6e-6, summation order). The load-balancing loss is
  // per micro-batch by design (as transformers computes it per forward), so it is off here.
  r = RunSftJob(student, dir + "/ce_micro1",
                with({"train.micro_batch_size=1", "train.aux_loss_coef=0"}));
  ASSERT_EQ(r.code, 0) << r.log;
  r = RunSftJob(student, dir + "/ce_micro4",
                with({"train.micro_batch_size=4", "train.aux_loss_coef=0"}));
  ASSERT_EQ(r.code, 0) << r.log;
  auto c1 = LossCurve(dir + "/ce_micro1"), c4 = LossCurve(dir + "/ce_micro4");
  ASSERT_EQ(c1.size(), c4.size());
  for (size_t i = 0; i < c1.size(); ++i)
    EXPECT_NEAR(std::get<1>(c1[i]), std::get<1>(c4[i]), 5e-6) << i;
  EXPECT_LE(MaxWeightDiff(dir + "/ce_micro1/checkpoints/step_000004/model",
                          dir + "/ce_micro4/checkpoints/step_000004/model"),
            2e-5);

  const std::string final1 = dir + "/micro1/checkpoints/step_000004/model";
  const std::string out = Capture(
      std::string(OPD_PYTHON) + " " + OPD_SOURCE_DIR + "/tests/python/sft_reference.py --run " +
      dir + "/micro1 --model " + student + " --ours " + final1 + " 2>" + dir + "/reference.log");
  auto j = json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out << ReadFile(dir + "/reference.log");
  std::printf(
      "reference: max |loss diff| %.3g, max |weight diff| %.3g (%s), grad-norm rel diff %.3g\n",
      j["max_loss_diff"].get<double>(), j["max_weight_diff"].get<double>(),
      j["worst_param"].get<std::string>().c_str(), j["max_grad_norm_rel_diff"].get<double>());
  EXPECT_EQ(j["steps"].get<int>(), 4);
  EXPECT_LE(j["max_loss_diff"].get<double>(), 1e-5);
  EXPECT_LE(j["max_grad_norm_rel_diff"].get<double>(), 1e-5);
  EXPECT_LE(j["max_weight_diff"].get<double>(), 2e-5);
  // Clipping was active (max_grad_norm 0.5): the reference agrees on the pre-clip norms above.
  EXPECT_GT(j["grad_norm_ref"][0].get<double>(), 0.5);
}

// Run 2N steps; separately run, SIGKILL after the checkpoint at N, resume to 2N: identical curve
// and bit-identical weights and optimizer state. Leftovers of a crashed checkpoint write (a .tmp-
// directory, a step directory without trainer_state.json) are never resumed from.
TEST(Sft, ResumeAfterSigkillIsExact) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::vector<std::string> sets = {"train.max_steps=12", "eval.every=4", "checkpoint.every=5",
                                         "checkpoint.keep_last=2"};
  auto r = RunSftJob(student, dir + "/straight", sets);
  ASSERT_EQ(r.code, 0) << r.log;

  const std::string run = dir + "/killed";
  auto slow = sets;
  slow.push_back("debug.step_sleep_ms=150");
  Child child(SftArgs(student, run, slow), run + ".log");
  ASSERT_TRUE(
      WaitFor([&] { return fs::exists(run + "/checkpoints/step_000005/trainer_state.json"); }, 60));
  // Let it get into step 6 or 7 (metrics beyond the checkpoint must be rewritten).
  ASSERT_TRUE(WaitFor([&] { return LastTrainStep(run) >= 6; }, 30));
  child.Signal(SIGKILL);
  EXPECT_EQ(child.Wait(), 128 + SIGKILL);
  ASSERT_FALSE(fs::exists(run + "/checkpoints/step_000010"));
  // A crash during a later checkpoint write: neither of these may be taken for a checkpoint.
  fs::create_directories(run + "/checkpoints/.tmp-step_000010-1234/model");
  std::ofstream(run + "/checkpoints/.tmp-step_000010-1234/trainer_state.json")
      << "{\"version\": 1, \"step\": 10}";
  fs::create_directories(run + "/checkpoints/step_000011/model");

  r = RunSftJob(student, run, sets);  // automatic resume from the run directory
  ASSERT_EQ(r.code, 0) << r.log;
  EXPECT_NE(r.log.find("resumed from " + run + "/checkpoints/step_000005 at step 5"),
            std::string::npos)
      << r.log;
  EXPECT_FALSE(fs::exists(run + "/checkpoints/.tmp-step_000010-1234"));

  EXPECT_EQ(LossCurve(dir + "/straight"), LossCurve(run));
  for (const char* file : {"/model/model.safetensors", "/optimizer.safetensors"}) {
    EXPECT_EQ(ReadFile(dir + "/straight/checkpoints/step_000012" + file),
              ReadFile(run + "/checkpoints/step_000012" + file))
        << file << " differs";
  }
  // keep_last 2: steps 10 and 12 remain.
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(dir + "/straight/checkpoints"))
    kept.push_back(e.path().filename());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"step_000010", "step_000012"}));
}

TEST(Sft, LearnsSyntheticChat) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  auto r = RunSftJob(student, dir + "/run",
                     {"train.max_steps=150", "eval.every=50", "checkpoint.every=0"});
  ASSERT_EQ(r.code, 0) << r.log;
  const json summary = json::parse(ReadFile(dir + "/run/summary.json"));
  const double first = summary["first_eval_loss"], last = summary["final_eval_loss"];
  std::printf("held-out loss %.4f -> %.4f after 150 steps\n", first, last);
  EXPECT_GT(first, 5.0);  // ~ln(320) for a random model
  EXPECT_LT(last, 0.25 * first);
}

// train.activation_checkpointing: each decoder layer is recomputed in the backward; the run ends
// with the same weights (the same operations in the same order, so to float rounding at most).
TEST(Sft, ActivationCheckpointingTrainsTheSameWeights) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::vector<std::string> sets = {"train.max_steps=3", "eval.every=0"};
  auto plain = RunSftJob(student, dir + "/plain", sets);
  ASSERT_EQ(plain.code, 0) << plain.log;
  auto with = sets;
  with.push_back("train.activation_checkpointing=true");
  auto ckpt = RunSftJob(student, dir + "/recomputed", with);
  ASSERT_EQ(ckpt.code, 0) << ckpt.log;
  // Recomputation is the same computation: the checkpointed forward runs the kernels its
  // recomputation runs (lm/model/recompute.cc), and the backward sums each gradient's terms in the
  // same order, so the weights are bitwise equal on any machine (a bound would be one machine's
  // rounding: an AVX2 machine measured 1.1e-6 when the forward took the inference kernels).
  EXPECT_EQ(MaxWeightDiff(dir + "/plain/checkpoints/step_000003/model",
                          dir + "/recomputed/checkpoints/step_000003/model"),
            0.0);
}

// A checkpoint whose trainer_state.json lacks a field or has one of the wrong type: the resume
// fails with the file and the problem named (exit 1), not with an uncaught exception (SIGABRT).
TEST(Sft, MalformedTrainerStateIsANamedError) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::string run = dir + "/run";
  auto r = RunSftJob(student, run, {"train.max_steps=1"});
  ASSERT_EQ(r.code, 0) << r.log;
  const std::string state = run + "/checkpoints/step_000001/trainer_state.json";
  const json good = json::parse(ReadFile(state));
  for (const auto& [key, bad] : std::vector<std::pair<std::string, json>>{
           {"step", "one"}, {"data_cursor", nullptr}, {"nonfinite", json::array()}}) {
    json j = good;
    j[key] = bad;
    std::ofstream(state) << j.dump();
    r = RunSftJob(student, run, {"train.max_steps=2"});
    EXPECT_EQ(r.code, 1) << key << ": " << r.log;
    EXPECT_NE(r.log.find("trainer_state.json"), std::string::npos) << key << ": " << r.log;
  }
}

TEST(Sft, BadConfigsFailBeforeTraining) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  fs::create_directories(dir + "/broken_model");
  std::ofstream(dir + "/broken_model/config.json") << ReadFile(student + "/config.json");
  std::ofstream(dir + "/broken_model/model.safetensors") << "not a safetensors file";
  struct Case {
    std::vector<std::string> sets;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"data.train.0.files=[" + dir + "/missing.jsonl]"}, "missing.jsonl"},
      {{"optim.lrr=1"}, "unknown key 'optim.lrr'"},
      {{"train.micro_batch_size=3"},
       "train.global_batch_size: 8 is not divisible by train.micro_batch_size (3)"},
      {{"model.path=" + dir}, "model.path: " + dir + "/config.json"},
      {{"model.path=" + dir + "/broken_model", "model.tokenizer=" + kFixtures + "/tokenizer"},
       "model.safetensors"},
      {{"model.tokenizer=" + dir}, "model.tokenizer: " + dir},
      {{"train.max_steps=many"}, "train.max_steps: expected an integer"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string run = dir + "/run" + std::to_string(i);
    auto r = RunSftJob(student, run, cases[i].sets);
    EXPECT_NE(r.code, 0) << cases[i].message;
    EXPECT_NE(r.log.find(cases[i].message), std::string::npos)
        << "expected '" << cases[i].message << "' in:\n"
        << r.log;
    EXPECT_FALSE(fs::exists(run + "/metrics.jsonl")) << "training started: " << cases[i].message;
  }
  auto r = RunTool({kTrainer, "sft", "--config", dir + "/nope.yaml"}, dir + "/nope.log");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.log.find("nope.yaml: cannot open"), std::string::npos) << r.log;
}

// Metrics in the run directory: the resolved config, the JSONL and TensorBoard event files
// that tensorboard's own reader accepts, with the same numbers.
TEST(Sft, MetricsJsonlAndTensorBoard) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::string run = dir + "/run";
  auto r = RunSftJob(student, run, {"train.max_steps=6", "eval.every=3", "checkpoint.every=0"});
  ASSERT_EQ(r.code, 0) << r.log;
  EXPECT_NE(ReadFile(run + "/config.yaml").find("max_steps: 6"), std::string::npos);
  EXPECT_NE(ReadFile(run + "/train.log").find("done: 6 steps"), std::string::npos);

  std::map<int64_t, double> train_loss, eval_loss;
  for (const json& m : ReadJsonl(run + "/metrics.jsonl")) {
    if (m.contains("train/loss")) train_loss[m["step"]] = m["train/loss"];
    if (m.contains("eval/loss")) eval_loss[m["step"]] = m["eval/loss"];
    if (m.contains("train/loss")) {
      for (const char* key :
           {"train/lr", "train/tokens_per_s", "train/grad_norm", "train/aux_loss"})
        EXPECT_TRUE(m.contains(key)) << key;
    }
  }
  EXPECT_EQ(train_loss.size(), 6u);
  EXPECT_EQ(eval_loss.size(), 3u);  // steps 0, 3, 6

  const std::string out =
      Capture(std::string(OPD_PYTHON) + " " + OPD_SOURCE_DIR +
              "/tests/python/read_tensorboard.py " + run + "/tensorboard 2>" + dir + "/tb.log");
  auto tb = json::parse(out, nullptr, false);
  ASSERT_FALSE(tb.is_discarded()) << out << ReadFile(dir + "/tb.log");
  ASSERT_TRUE(tb.contains("train/loss"));
  ASSERT_EQ(tb["train/loss"].size(), 6u);
  for (const auto& e : tb["train/loss"]) {
    EXPECT_NEAR(e[1].get<double>(), train_loss.at(e[0].get<int64_t>()),
                1e-6 * std::abs(e[1].get<double>()));
  }
  ASSERT_EQ(tb["eval/loss"].size(), 3u);
  EXPECT_TRUE(tb.contains("train/lr"));
  EXPECT_TRUE(tb.contains("train/tokens_per_s"));
}

TEST(Sft, SigtermWritesCheckpointAndExitsNonZero) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::string run = dir + "/run";
  const std::vector<std::string> sets = {"train.max_steps=30", "checkpoint.every=0",
                                         "eval.every=0"};
  auto slow = sets;
  slow.push_back("debug.step_sleep_ms=100");
  Child child(SftArgs(student, run, slow), run + ".log");
  ASSERT_TRUE(WaitFor([&] { return LastTrainStep(run) >= 3; }, 60));
  child.Signal(SIGTERM);
  EXPECT_EQ(child.Wait(), 128 + SIGTERM);
  const std::string log = ReadFile(run + ".log");
  EXPECT_NE(log.find("stopped by SIGTERM at step"), std::string::npos) << log;
  const int64_t last = LastTrainStep(run);
  EXPECT_LT(last, 30);
  const json state = json::parse(
      ReadFile(run + "/checkpoints/" + absl::StrFormat("step_%06d", last) + "/trainer_state.json"));
  EXPECT_EQ(state["step"].get<int64_t>(), last);
  for (const char* key : {"data_cursor", "rng", "schedule", "config", "nonfinite"})
    EXPECT_TRUE(state.contains(key)) << key;

  // --resume continues from there to the end.
  auto argv = SftArgs(student, run, sets);
  argv.push_back("--resume");
  auto r = RunTool(argv, run + ".resumed.log");
  ASSERT_EQ(r.code, 0) << r.log;
  EXPECT_NE(r.log.find(absl::StrFormat("at step %d", last)), std::string::npos) << r.log;
  EXPECT_EQ(LastTrainStep(run), 30);
  EXPECT_EQ(TrainLines(run).size(), 30u);
  // --resume where there is nothing to resume is an error.
  argv = SftArgs(student, dir + "/empty", sets);
  argv.push_back("--resume");
  r = RunTool(argv, dir + "/empty.log");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.log.find("no complete checkpoint"), std::string::npos) << r.log;
}

TEST(Sft, NonFiniteStepsAreSkippedThenStop) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  auto r = RunSftJob(student, dir + "/skip",
                     {"train.max_steps=6", "eval.every=0", "debug.nan_steps=[2, 3]",
                      "train.max_consecutive_nonfinite=3"});
  ASSERT_EQ(r.code, 0) << r.log;
  auto metrics = TrainLines(dir + "/skip");
  ASSERT_EQ(metrics.size(), 6u);
  for (const json& m : metrics) {
    const int64_t step = m["step"];
    EXPECT_EQ(m["train/skipped"].get<double>(), (step == 2 || step == 3) ? 1.0 : 0.0) << step;
  }
  EXPECT_EQ(metrics.back()["train/nonfinite_total"].get<double>(), 2.0);
  EXPECT_TRUE(std::isfinite(metrics.back()["train/loss"].get<double>()));  // training went on
  EXPECT_NE(r.log.find("update skipped (2 in a row, 2 in total)"), std::string::npos) << r.log;

  r = RunSftJob(student, dir + "/stop",
                {"train.max_steps=6", "eval.every=0", "debug.nan_steps=[2, 3, 4]",
                 "train.max_consecutive_nonfinite=3"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.log.find("3 consecutive steps with a non-finite loss or gradient"), std::string::npos)
      << r.log;
  EXPECT_EQ(TrainLines(dir + "/stop").size(), 4u);
}

}  // namespace
}  // namespace trainer
