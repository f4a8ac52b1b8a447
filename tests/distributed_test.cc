// The learner past one process: c10d process groups (Gloo on loopback) and `opd-trainer sft` as
// 1, 2, 3 and 4 ranks launched with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as torchrun or
// srun would, in both ZeRO stages (the optimizer on its own: tests/zero_test.cc).
//
// Tolerance: N ranks sum the same gradients in another order (zero_test.cc derives the bound), so
// weights agree with one rank to float rounding: 1e-6 relative per tensor norm (see RelNormDiff).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "lm/dist/process_group.h"
#include "lm/io/safetensors.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "tests/child_process.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "trainer/common/checkpoint.h"

using testing_util::TestDir;

namespace {

namespace fs = std::filesystem;
using lm::dist::LaunchEnv;
using lm::dist::ProcessGroup;
using testing_util::ChildProcess;

const std::string kBin = OPD_BINARY_DIR;
const std::string kFixtures = kBin + "/fixtures_sft";

// Runs fn(rank, group) on `world` threads, each with its own Gloo group on loopback.
void RunRanks(int world, const std::function<void(int, ProcessGroup&)>& fn,
              absl::Duration timeout = absl::Seconds(60)) {
  const int port = testing_util::FreeLoopbackPort();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      LaunchEnv env{r, world, r, "127.0.0.1", port};
      lm::dist::GroupOptions o;
      o.timeout = timeout;
      auto group = ProcessGroup::Create(env, torch::kCPU, o);
      ASSERT_TRUE(group.ok()) << group.status();
      fn(r, **group);
    });
  }
  for (auto& t : threads) t.join();
}

class ScopedEnv {
 public:
  explicit ScopedEnv(std::map<std::string, std::string> vars) {
    for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"})
      unsetenv(k);
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"})
      unsetenv(k);
  }
};

TEST(LaunchEnv, ReadsTheLauncherVariablesAndNamesBadOnes) {
  {
    ScopedEnv e({});
    auto env = LaunchEnv::FromEnvironment();
    ASSERT_TRUE(env.ok());
    EXPECT_EQ(env->world_size, 1);
    EXPECT_FALSE(env->distributed());
  }
  {
    ScopedEnv e({{"RANK", "3"},
                 {"WORLD_SIZE", "4"},
                 {"LOCAL_RANK", "1"},
                 {"MASTER_ADDR", "10.0.0.1"},
                 {"MASTER_PORT", "29500"}});
    auto env = LaunchEnv::FromEnvironment();
    ASSERT_TRUE(env.ok()) << env.status();
    EXPECT_EQ(env->rank, 3);
    EXPECT_EQ(env->local_rank, 1);
    EXPECT_EQ(env->master_port, 29500);
  }
  struct Bad {
    std::map<std::string, std::string> vars;
    std::string names;
  };
  for (const Bad& b : std::vector<Bad>{
           {{{"WORLD_SIZE", "two"}}, "WORLD_SIZE='two'"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}},
            "RANK=2"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_PORT", "29500"}}, "MASTER_ADDR"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "h"}}, "MASTER_PORT"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}},
            "MASTER_PORT=70000"},
           {{{"WORLD_SIZE", "0"}}, "WORLD_SIZE=0"},
       }) {
    ScopedEnv e(b.vars);
    auto env = LaunchEnv::FromEnvironment();
    ASSERT_FALSE(env.ok()) << b.names;
    EXPECT_NE(std::string(env.status().message()).find(b.names), std::string::npos) << env.status();
  }
}

TEST(ProcessGroup, OneProcessIsTheTrivialGroup) {
  auto group = ProcessGroup::Create(LaunchEnv{}, torch::kCPU);
  ASSERT_TRUE(group.ok());
  std::vector<torch::Tensor> t{torch::full({3}, 2.0)};
  ASSERT_TRUE((*group)->AllReduce(t).ok());
  EXPECT_TRUE(torch::equal(t[0], torch::full({3}, 2.0)));
  std::string bytes = "abc";
  ASSERT_TRUE((*group)->BroadcastBytes(&bytes).ok());
  EXPECT_EQ(bytes, "abc");
}

// NCCL's own default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) lets its watchdog kill the process on a
// collective timeout; the group is made with blocking waits that throw and a watchdog that only
// aborts the communicators, so a timeout reaches Run() as on Gloo (an NCCL group needs two GPUs,
// so this checks what the backend is told; a user's other value is replaced).
TEST(ProcessGroup, NcclTimeoutsAreErrorsNotAborts) {
  setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", 1);
  unsetenv("TORCH_NCCL_BLOCKING_WAIT");
  lm::dist::PrepareNcclErrorHandling();
  EXPECT_STREQ(std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "2");
  EXPECT_STREQ(std::getenv("TORCH_NCCL_BLOCKING_WAIT"), "1");
}

TEST(ProcessGroup, GlooCollectivesOnLoopback) {
  for (int world : {2, 3}) {
    RunRanks(world, [&](int rank, ProcessGroup& g) {
      EXPECT_EQ(g.backend(), "gloo");
      std::vector<torch::Tensor> t{torch::full({5}, static_cast<float>(rank + 1))};
      ASSERT_TRUE(g.AllReduce(t).ok());
      EXPECT_TRUE(torch::equal(t[0], torch::full({5}, world * (world + 1) / 2.0f)));
      auto mx =
          g.AllReduceDoubles({static_cast<double>(rank), -rank * 1.0}, lm::dist::ReduceOp::kMax);
      ASSERT_TRUE(mx.ok());
      EXPECT_EQ((*mx)[0], world - 1);
      EXPECT_EQ((*mx)[1], 0);

      std::string bytes = rank == 1 ? std::string("from rank 1\0!", 13) : "";
      ASSERT_TRUE(g.BroadcastBytes(&bytes, 1).ok());
      EXPECT_EQ(bytes, std::string("from rank 1\0!", 13));

      torch::Tensor mine = torch::arange(4, torch::kFloat32) + 10 * rank;
      torch::Tensor all = torch::empty({4 * world});
      ASSERT_TRUE(g.AllGather(all, mine).ok());
      for (int r = 0; r < world; ++r)
        EXPECT_TRUE(
            torch::equal(all.narrow(0, 4 * r, 4), torch::arange(4, torch::kFloat32) + 10 * r));

      torch::Tensor in = torch::arange(3 * world, torch::kFloat32) * (rank + 1);
      torch::Tensor out = torch::empty({3});
      ASSERT_TRUE(g.ReduceScatterSum(out, in).ok());
      const float factor = world * (world + 1) / 2.0f;
      EXPECT_TRUE(
          torch::equal(out, torch::arange(3 * rank, 3 * rank + 3, torch::kFloat32) * factor));

      auto any = g.AnyRank(rank == world - 1);
      ASSERT_TRUE(any.ok());
      EXPECT_TRUE(*any);
      EXPECT_TRUE(g.Barrier().ok());
    });
  }
}

// A rank that leaves the job makes the others' next collective fail with the operation named,
// long before the group's timeout (set here to far more than the test would ever wait).
TEST(ProcessGroup, APeerThatLeavesIsAnErrorNotAHang) {
  const int port = testing_util::FreeLoopbackPort();
  std::thread quitter([&] {
    auto g = ProcessGroup::Create(LaunchEnv{1, 2, 1, "127.0.0.1", port}, torch::kCPU);
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE((*g)->Barrier().ok());
    // Leaves: the group (and its connections) goes away with this scope.
  });
  auto g = ProcessGroup::Create(LaunchEnv{0, 2, 0, "127.0.0.1", port}, torch::kCPU);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE((*g)->Barrier().ok());
  quitter.join();  // the peer has gone
  std::vector<torch::Tensor> t{torch::ones({1000})};
  absl::Status s = (*g)->AllReduce(t);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(std::string(s.message()).find("all_reduce"), std::string::npos) << s;
  // The group stays failed, and says so, instead of trying again.
  absl::Status again = (*g)->Barrier();
  EXPECT_FALSE(again.ok());
}

// ---------------------------------------------------------------------------------------------
// `opd-trainer sft` as several processes.

std::string MakeStudent(const std::string& dir) {
  const std::string out = dir + "/student";
  ChildProcess init({kBin + "/ctl/opd-ctl", "init-model", "--config",
                     std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json", "--out", out,
                     "--tokenizer", kFixtures + "/tokenizer", "--std", "0.05", "--seed", "1"},
                    dir + "/init.log");
  EXPECT_EQ(init.Wait(std::chrono::seconds(120)), 0) << init.Log();
  return out;
}

struct RunResult {
  std::vector<int> codes;
  std::vector<std::string> logs;
};

// One SFT job of `world` ranks (each single-threaded), 4 steps of 8 sequences in micro-batches of
// 2 at a constant learning rate, plus `sets`.
RunResult RunSft(int world, const std::string& student, const std::string& run,
                 const std::vector<std::string>& sets) {
  std::vector<std::string> argv = {kBin + "/trainer/opd-trainer", "sft", "--config",
                                   std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny.yaml"};
  std::vector<std::string> all = {"model.path=" + student,
                                  "data.train.0.files=[" + kFixtures + "/data/train.jsonl]",
                                  "data.eval.0.files=[" + kFixtures + "/data/eval.jsonl]",
                                  "eval.max_sequences=6",
                                  "eval.every=0",
                                  "run.dir=" + run,
                                  "train.threads=1",
                                  "train.max_steps=4",
                                  "train.global_batch_size=8",
                                  "train.micro_batch_size=2",
                                  "optim.warmup_steps=0",
                                  "optim.lr=3e-3",
                                  "optim.min_lr=3e-3",
                                  "checkpoint.every=3",
                                  "checkpoint.keep_last=0",
                                  "logging.log_every=1000",
                                  "dist.timeout_s=120"};
  all.insert(all.end(), sets.begin(), sets.end());
  for (const auto& s : all) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  const std::string port = std::to_string(testing_util::FreeLoopbackPort());
  std::vector<std::unique_ptr<ChildProcess>> ranks;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env;
    if (world > 1)
      env = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
             "LOCAL_RANK=" + std::to_string(r), "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port};
    ranks.push_back(
        std::make_unique<ChildProcess>(argv, run + ".rank" + std::to_string(r) + ".log", env));
  }
  RunResult out;
  for (auto& p : ranks) {
    out.codes.push_back(p->Wait(std::chrono::seconds(600)));
    out.logs.push_back(p->Log());
  }
  return out;
}

void ExpectSucceeded(const RunResult& r) {
  for (size_t i = 0; i < r.codes.size(); ++i) EXPECT_EQ(r.codes[i], 0) << r.logs[i];
}

// max over tensors of ||a - b|| / ||a||: the relative difference of each weight tensor. (A
// single entry can move by more: Adam divides by sqrt(v), so an entry whose gradient is a near
// cancellation of larger terms amplifies the summation-order rounding; measured ~5e-6 of the
// largest weight for one entry, with the tensor norms within ~1e-7.)
double RelNormDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double scale = std::max(a[i].norm().item<double>(), 1e-12);
    worst = std::max(worst, (a[i] - b[i]).norm().item<double>() / scale);
  }
  return worst;
}

std::vector<torch::Tensor> ModelWeights(const std::string& dir) {
  auto model = lm::LoadModel(dir);
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<torch::Tensor> out;
  if (!model.ok()) return out;
  for (const auto& p : (*model)->named_parameters()) out.push_back(p.value().detach().clone());
  return out;
}

nlohmann::json Summary(const std::string& run) {
  std::ifstream in(run + "/summary.json");
  return nlohmann::json::parse(in, nullptr, false);
}

// A step of one micro-batch on two ranks: rank 1 has no micro-batch, so it sends its gradient
// buckets in ReduceAndClip while rank 0 sent them in its backward; the step statistics must come
// after the buckets on both, or the collectives pair wrongly (a Gloo size error or a hang, here
// ended by the short timeout). Same bound as below: only the summation order differs.
TEST(DistributedSft, ARankWithNoMicroBatchTrainsAsOne) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::vector<std::string> one_micro = {"train.global_batch_size=2",
                                              "train.micro_batch_size=2", "train.max_steps=2",
                                              "checkpoint.every=2", "dist.timeout_s=30"};
  ExpectSucceeded(RunSft(1, student, dir + "/one", one_micro));
  RunResult r = RunSft(2, student, dir + "/two", one_micro);
  ExpectSucceeded(r);
  const auto want = ModelWeights(dir + "/one/checkpoints/step_000002/model");
  ASSERT_FALSE(want.empty());
  EXPECT_LE(RelNormDiff(want, ModelWeights(dir + "/two/checkpoints/step_000002/model")), 1e-6);
}

TEST(DistributedSft, TwoAndFourRanksTrainAsOne) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  ExpectSucceeded(RunSft(1, student, dir + "/one", {}));
  const auto want = ModelWeights(dir + "/one/checkpoints/step_000004/model");
  ASSERT_FALSE(want.empty());
  const int64_t one_state = Summary(dir + "/one")["optimizer_state_bytes_per_rank"];
  for (int world : {2, 4}) {
    const std::string run = dir + "/ranks" + std::to_string(world);
    RunResult r = RunSft(world, student, run, {});
    ExpectSucceeded(r);
    EXPECT_LE(RelNormDiff(want, ModelWeights(run + "/checkpoints/step_000004/model")), 1e-6)
        << world << " ranks";
    // One optimizer shard per rank, and an Nth of the moments on each.
    for (int rank = 0; rank < world; ++rank) {
      char name[64];
      std::snprintf(name, sizeof(name), "/optimizer-%05d-of-%05d.safetensors", rank, world);
      EXPECT_TRUE(fs::exists(run + "/checkpoints/step_000004" + name)) << name;
    }
    const nlohmann::json s = Summary(run);
    EXPECT_EQ(s["world_size"], world);
    EXPECT_LE(s["optimizer_state_bytes_per_rank"].get<int64_t>(), one_state / world + 64);
    // The same held-out loss (computed as shares and summed).
    EXPECT_NEAR(s["final_eval_loss"].get<double>(),
                Summary(dir + "/one")["final_eval_loss"].get<double>(), 1e-5);
  }
  // With the weights all-gathered in bf16 (the default on GPUs) the forward reads the other
  // ranks' slices rounded to bf16, so the run only stays close; the checkpoint holds the fp32
  // masters.
  const std::string bf16 = dir + "/ranks2_bf16";
  ExpectSucceeded(RunSft(2, student, bf16, {"dist.allgather_dtype=bfloat16"}));
  const double d = RelNormDiff(want, ModelWeights(bf16 + "/checkpoints/step_000004/model"));
  EXPECT_GT(d, 1e-7) << "the bf16 all-gather changed nothing";
  EXPECT_LE(d, 1e-2);
}

// `opd-trainer sft` in bf16-mixed on 2 ranks against 1 rank in bf16-mixed, and the 2-rank
// checkpoint of step 2 resumed on 1 rank. Tolerances: after step 1 the two runs differ only by
// how the ranks' fp32 gradient sums round (relative 1e-7 of each gradient); AdamW's first update
// is lr * g / (|g| + eps), which moves by at most that relative amount, so the masters agree to
// 1e-6 of their norm. Later steps compute with bf16 copies of the masters: a master that lands
// on the other side of a bf16 rounding boundary moves its copy by a whole bf16 ulp (2^-8), the
// flips feed back into the gradients, and AdamW turns a changed near-zero gradient into a
// full-size update, a divergence that grows with the steps and differs between machines
// (measured 3e-4 and 5.9e-3 after 4 steps on two): step 4 is only held to a few bf16 ulps
// (2^-6), the scale past which it would be another trajectory rather than rounding. The resumed
// run repeats the 2-rank run's arithmetic from the same state and agrees to 1e-6.
TEST(DistributedSft, Bf16MixedOnTwoRanksTrainsAsOne) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::vector<std::string> mixed = {"train.precision=bf16-mixed", "checkpoint.every=1",
                                          "checkpoint.keep_last=0"};
  ExpectSucceeded(RunSft(1, student, dir + "/one", mixed));
  ExpectSucceeded(RunSft(2, student, dir + "/two", mixed));
  const double d_first = RelNormDiff(ModelWeights(dir + "/one/checkpoints/step_000001/model"),
                                     ModelWeights(dir + "/two/checkpoints/step_000001/model"));
  EXPECT_LE(d_first, 1e-6);
  const auto one = ModelWeights(dir + "/one/checkpoints/step_000004/model");
  const auto two = ModelWeights(dir + "/two/checkpoints/step_000004/model");
  ASSERT_FALSE(one.empty());
  const double d_two = RelNormDiff(one, two);
  EXPECT_LE(d_two, 1.0 / 64);
  fs::create_directories(dir + "/resumed/checkpoints");
  fs::copy(dir + "/two/checkpoints/step_000002", dir + "/resumed/checkpoints/step_000002",
           fs::copy_options::recursive);
  ExpectSucceeded(RunSft(1, student, dir + "/resumed", mixed));
  const double d_resumed =
      RelNormDiff(two, ModelWeights(dir + "/resumed/checkpoints/step_000004/model"));
  EXPECT_LE(d_resumed, 1e-6);
  std::printf(
      "bf16-mixed SFT: 2 ranks vs 1 %.2e after step 1, %.2e after step 4; 2 ranks resumed on 1 "
      "at step 2 vs 2 ranks %.2e\n",
      d_first, d_two, d_resumed);
}

// dist.zero_stage 2 (each rank keeps only its 1/N slice of the fp32 gradients, every backward's
// gradients reduce-scattered into it) against one rank, for shares of every shape: 2 micro-batches
// per rank on 2 ranks, 2/1/1 on 3 ranks, 1 each on 4, and one micro-batch on 2 ranks (rank 1 has
// none and reduces rounds of zeros). Same bound as above (only the summation order differs); in
// bf16-mixed after step 1 (Bf16MixedOnTwoRanksTrainsAsOne says why later steps drift by bf16
// ulps), and a few bf16 ulps after step 4.
TEST(DistributedSft, ShardedGradientsTrainAsOne) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::vector<std::string> two = {"dist.zero_stage=2"};
  ExpectSucceeded(RunSft(1, student, dir + "/one", {}));
  const auto want = ModelWeights(dir + "/one/checkpoints/step_000004/model");
  ASSERT_FALSE(want.empty());
  for (int world : {2, 3, 4}) {
    const std::string run = dir + "/ranks" + std::to_string(world);
    RunResult r = RunSft(world, student, run, two);
    ExpectSucceeded(r);
    EXPECT_NE(r.logs[0].find("dist.zero_stage 2"), std::string::npos) << r.logs[0];
    EXPECT_LE(RelNormDiff(want, ModelWeights(run + "/checkpoints/step_000004/model")), 1e-6)
        << world << " ranks";
  }
  const std::vector<std::string> one_micro = {"train.global_batch_size=2",
                                              "train.micro_batch_size=2", "train.max_steps=2",
                                              "checkpoint.every=2", "dist.zero_stage=2"};
  ExpectSucceeded(RunSft(1, student, dir + "/one_micro", one_micro));
  ExpectSucceeded(RunSft(2, student, dir + "/two_micro", one_micro));
  EXPECT_LE(RelNormDiff(ModelWeights(dir + "/one_micro/checkpoints/step_000002/model"),
                        ModelWeights(dir + "/two_micro/checkpoints/step_000002/model")),
            1e-6);
  const std::vector<std::string> mixed = {"train.precision=bf16-mixed", "checkpoint.every=1",
                                          "dist.zero_stage=2"};
  ExpectSucceeded(RunSft(1, student, dir + "/mixed_one", mixed));
  ExpectSucceeded(RunSft(2, student, dir + "/mixed_two", mixed));
  EXPECT_LE(RelNormDiff(ModelWeights(dir + "/mixed_one/checkpoints/step_000001/model"),
                        ModelWeights(dir + "/mixed_two/checkpoints/step_000001/model")),
            1e-6);
  EXPECT_LE(RelNormDiff(ModelWeights(dir + "/mixed_one/checkpoints/step_000004/model"),
                        ModelWeights(dir + "/mixed_two/checkpoints/step_000004/model")),
            1.0 / 64);
}

// A stage-2 checkpoint of 2 ranks (step 3) resumed on 1 and on 3 ranks: step 4 ends with the
// uninterrupted one-rank run's weights.
TEST(DistributedSft, ShardedCheckpointResumesOnOneAndThreeRanks) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::vector<std::string> two = {"dist.zero_stage=2"};
  ExpectSucceeded(RunSft(1, student, dir + "/one", {}));
  const auto want = ModelWeights(dir + "/one/checkpoints/step_000004/model");
  ASSERT_FALSE(want.empty());
  ExpectSucceeded(RunSft(2, student, dir + "/two", two));
  ASSERT_TRUE(
      fs::exists(dir + "/two/checkpoints/step_000003/optimizer-00001-of-00002.safetensors"));
  for (int world : {1, 3}) {
    const std::string run = dir + "/resumed" + std::to_string(world);
    fs::create_directories(run + "/checkpoints");
    fs::copy(dir + "/two/checkpoints/step_000003", run + "/checkpoints/step_000003",
             fs::copy_options::recursive);
    RunResult r = RunSft(world, student, run, two);
    ExpectSucceeded(r);
    EXPECT_NE(r.logs[0].find("resumed from " + run + "/checkpoints/step_000003"), std::string::npos)
        << r.logs[0];
    EXPECT_LE(RelNormDiff(want, ModelWeights(run + "/checkpoints/step_000004/model")), 1e-6)
        << "2 -> " << world << " ranks";
  }
}

// Rewrites `path` with element `index` of tensor `name` set to NaN.
void PoisonTensor(const std::string& path, const std::string& name, int64_t index) {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> meta;
  {
    auto file = lm::SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    meta = (*file)->metadata();
    for (const auto& [n, t] : (*file)->tensors())
      tensors[n] = torch::from_blob(const_cast<std::byte*>(t.data), {t.numel()}, torch::kFloat32)
                       .clone()
                       .view(t.shape);
  }
  ASSERT_TRUE(tensors.count(name)) << path << " has no " << name;
  tensors[name].view(-1)[index] = std::nanf("");
  std::vector<lm::TensorToWrite> out;
  for (const auto& [n, t] : tensors)
    out.push_back(
        {n, lm::DType::kF32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.numel()) * 4});
  ASSERT_TRUE(lm::WriteSafetensors(path, out, meta).ok());
}

// A NaN in the newest checkpoint's second moments (what made a run unresumable: the update turned
// the weights NaN and the NaN model was checkpointed): the resume refuses it, naming the file,
// the tensor and the checkpoint, says that it does not fall back and which checkpoint is next,
// and writes nothing. Moved aside, the previous checkpoint resumes.
TEST(DistributedSft, UnusableNewestCheckpointIsNamedNotSkipped) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::string run = dir + "/run";
  ExpectSucceeded(RunSft(1, student, run, {"train.max_steps=2", "checkpoint.every=1"}));
  const std::string newest = run + "/checkpoints/step_000002";
  PoisonTensor(newest + "/optimizer.safetensors", "exp_avg_sq.model.norm.weight", 3);
  RunResult r = RunSft(1, student, run, {"train.max_steps=3", "checkpoint.every=1"});
  EXPECT_NE(r.codes[0], 0) << r.logs[0];
  for (const std::string& part :
       {"cannot resume from " + newest, newest + "/optimizer.safetensors",
        std::string("exp_avg_sq.model.norm.weight"), std::string("not replaced by an older one"),
        run + "/checkpoints/step_000001"})
    EXPECT_NE(r.logs[0].find(part), std::string::npos) << part << "\n" << r.logs[0];
  EXPECT_FALSE(fs::exists(run + "/checkpoints/step_000003"));
  fs::rename(newest, dir + "/bad_step_000002");
  r = RunSft(1, student, run, {"train.max_steps=3", "checkpoint.every=1"});
  ExpectSucceeded(r);
  EXPECT_NE(r.logs[0].find("resumed from " + run + "/checkpoints/step_000001"), std::string::npos)
      << r.logs[0];
}

// A model file cut short in the newest checkpoint (a crash or a full disk while it was saved): the
// checkpoint holds no step, so the resume sets it aside as DIR.unreadable, says so, and resumes
// the one before it. When it is the run's only checkpoint, nothing is set aside: DATA_LOSS naming
// the file, and no fresh start over it.
TEST(DistributedSft, UnreadableNewestCheckpointFallsBackToThePreviousOne) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::string run = dir + "/run";
  ExpectSucceeded(RunSft(1, student, run, {"train.max_steps=2", "checkpoint.every=1"}));
  const std::string newest = run + "/checkpoints/step_000002";
  const std::string model = newest + "/model/model.safetensors";
  fs::resize_file(model, fs::file_size(model) / 2);
  RunResult r = RunSft(1, student, run, {"train.max_steps=3", "checkpoint.every=1"});
  ExpectSucceeded(r);
  for (const std::string& part :
       {std::string("the newest checkpoint is unreadable"), model,
        "moved to " + newest + ".unreadable", "resumed from " + run + "/checkpoints/step_000001"})
    EXPECT_NE(r.logs[0].find(part), std::string::npos) << part << "\n" << r.logs[0];
  EXPECT_TRUE(fs::exists(newest + ".unreadable/model/model.safetensors"));
  // Step 2 trained again (the schedule keeps the checkpoint's 2 steps) and saved whole.
  EXPECT_TRUE(fs::exists(newest + "/trainer_state.json"));
  EXPECT_TRUE(trainer::CheckCheckpointFiles(newest).ok());

  const std::string alone = dir + "/alone";
  ExpectSucceeded(RunSft(1, student, alone, {"train.max_steps=1", "checkpoint.every=1"}));
  const std::string only = alone + "/checkpoints/step_000001/model/model.safetensors";
  fs::resize_file(only, fs::file_size(only) / 2);
  r = RunSft(1, student, alone, {"train.max_steps=2", "checkpoint.every=1"});
  EXPECT_NE(r.codes[0], 0) << r.logs[0];
  EXPECT_NE(r.logs[0].find("the only checkpoint of this run"), std::string::npos) << r.logs[0];
  EXPECT_NE(r.logs[0].find(only), std::string::npos) << r.logs[0];
  EXPECT_TRUE(fs::exists(alone + "/checkpoints/step_000001/trainer_state.json"));
  EXPECT_FALSE(fs::exists(alone + "/checkpoints/step_000002"));
}

// Ranks launched with different configs would exchange tensors that do not belong together:
// every rank refuses to start, naming the rank that differs.
TEST(DistributedSft, RanksWithDifferentConfigsRefuseToStart) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::string port = std::to_string(testing_util::FreeLoopbackPort());
  std::vector<std::unique_ptr<ChildProcess>> ranks;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> argv = {kBin + "/trainer/opd-trainer", "sft", "--config",
                                     std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny.yaml"};
    for (const std::string& set : std::vector<std::string>{
             "model.path=" + student, "data.train.0.files=[" + kFixtures + "/data/train.jsonl]",
             "data.eval=[]", "run.dir=" + dir + "/run", "train.threads=1",
             "train.max_steps=" + std::to_string(2 + r), "dist.timeout_s=120"}) {
      argv.push_back("--set");
      argv.push_back(set);
    }
    ranks.push_back(std::make_unique<ChildProcess>(
        argv, dir + "/rank" + std::to_string(r) + ".log",
        std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=2",
                                 "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port}));
  }
  for (auto& p : ranks) {
    EXPECT_EQ(p->Wait(std::chrono::seconds(300)), 1) << p->Log();
    EXPECT_NE(p->Log().find("resolved config of rank(s) 1 differs from rank 0's"),
              std::string::npos)
        << p->Log();
  }
}

// A rank killed in step 4 (after step 3's checkpoint): every rank exits with an error naming the
// failed collective, and the last checkpoint resumes on another world size to the same step 4.
TEST(DistributedSft, RankKilledMidStepThenResumeOnAnotherWorldSize) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  ExpectSucceeded(RunSft(1, student, dir + "/one", {}));
  const auto want = ModelWeights(dir + "/one/checkpoints/step_000004/model");

  struct Case {
    int from, to;
  };
  for (Case c : {Case{2, 1}, Case{1, 2}}) {
    const std::string run = dir + "/from" + std::to_string(c.from) + "to" + std::to_string(c.to);
    const int victim = c.from - 1;
    RunResult killed =
        RunSft(c.from, student, run,
               {"debug.kill_rank=" + std::to_string(victim), "debug.kill_at_step=4"});
    EXPECT_EQ(killed.codes[victim], 128 + SIGKILL) << killed.logs[victim];
    for (int r = 0; r < c.from; ++r) {
      if (r == victim) continue;
      EXPECT_NE(killed.codes[r], 0) << killed.logs[r];
      EXPECT_NE(killed.logs[r].find("collective"), std::string::npos) << killed.logs[r];
    }
    ASSERT_TRUE(fs::exists(run + "/checkpoints/step_000003/trainer_state.json"));
    ASSERT_FALSE(fs::exists(run + "/checkpoints/step_000004"));

    RunResult resumed = RunSft(c.to, student, run, {});
    ExpectSucceeded(resumed);
    EXPECT_NE(resumed.logs[0].find("resumed from " + run + "/checkpoints/step_000003"),
              std::string::npos)
        << resumed.logs[0];
    EXPECT_LE(RelNormDiff(want, ModelWeights(run + "/checkpoints/step_000004/model")), 1e-6)
        << c.from << " -> " << c.to;
  }
}

// scripts/launch/local.sh: N ranks on this host as torchrun --standalone would start them; one
// rank's failure ends the job with its exit code instead of leaving the others waiting.
TEST(LaunchScript, LocalRunsTheRanksAndEndsOnAFailure) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  auto launch = [&](const std::string& run, const std::vector<std::string>& sets) {
    std::vector<std::string> argv = {"/bin/bash",
                                     std::string(OPD_SOURCE_DIR) + "/scripts/launch/local.sh",
                                     "--ranks",
                                     "2",
                                     "--log-dir",
                                     run + ".logs",
                                     "--",
                                     kBin + "/trainer/opd-trainer",
                                     "sft",
                                     "--config",
                                     std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny.yaml"};
    for (const std::string& s : std::vector<std::string>{
             "model.path=" + student, "data.train.0.files=[" + kFixtures + "/data/train.jsonl]",
             "data.eval=[]", "run.dir=" + run, "train.threads=1", "train.max_steps=2",
             "dist.timeout_s=120"}) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    for (const std::string& s : sets) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    ChildProcess p(argv, run + ".log");
    return std::make_pair(p.Wait(std::chrono::seconds(300)), p.Log());
  };
  auto [ok, ok_log] = launch(dir + "/ok", {});
  EXPECT_EQ(ok, 0) << ok_log;
  EXPECT_TRUE(fs::exists(dir + "/ok/checkpoints/step_000002/optimizer-00001-of-00002.safetensors"));
  auto [failed, failed_log] =
      launch(dir + "/killed", {"debug.kill_rank=1", "debug.kill_at_step=2"});
  EXPECT_NE(failed, 0) << failed_log;
  EXPECT_TRUE(fs::exists(dir + "/killed.logs/rank1.log"));
}

}  // namespace
