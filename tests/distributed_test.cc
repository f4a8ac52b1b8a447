// The learner past one process: c10d process groups (Gloo on loopback), the ZeRO-1 optimizer,
// and `opd-trainer sft` as 1, 2 and 4 ranks launched with RANK / WORLD_SIZE / MASTER_ADDR /
// MASTER_PORT, as torchrun or srun would.
//
// Tolerance: N ranks sum the same gradients in another order, so weights agree with one rank to
// float rounding: 1e-6 relative (elementwise for the optimizer on its own, per tensor norm for
// whole training runs; see RelNormDiff).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "lm/dist/process_group.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "tests/child_process.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "trainer/common/optim.h"
#include "trainer/common/zero1.h"

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
// The ZeRO-1 optimizer against AdamW on one rank.

struct Problem {
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<std::vector<torch::Tensor>> grads;  // [step][param]: the global gradient
};

Problem MakeProblem(int steps) {
  torch::manual_seed(7);
  Problem p;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"embed.weight", {13, 6}},
      {"norm.weight", {6}},
      {"proj.weight", {5, 6}},
      {"proj.bias", {5}},
      {"head.weight", {7, 5}}};
  for (const auto& [name, shape] : shapes) p.params.emplace_back(name, torch::randn(shape));
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> g;
    for (const auto& [name, t] : p.params) g.push_back(torch::randn(t.sizes()) * 0.5);
    p.grads.push_back(g);
  }
  return p;
}

std::vector<std::pair<std::string, torch::Tensor>> Clone(
    const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [n, t] : params) out.emplace_back(n, t.clone());
  return out;
}

trainer::OptimConfig Optim() {
  trainer::OptimConfig c;
  c.weight_decay = 0.1;
  c.max_grad_norm = 2.0;  // clips some steps
  return c;
}

// Rank r's share of the global gradient: the shares over all ranks sum to it. (A generator of its
// own: the ranks are threads here, and the global one would be shared by them.)
torch::Tensor Share(const torch::Tensor& g, int rank, int world, int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  std::vector<torch::Tensor> parts;
  torch::Tensor rest = g.clone();
  for (int r = 0; r < world - 1; ++r) {
    parts.push_back(torch::randn(g.sizes(), gen) * 0.1);
    rest -= parts.back();
  }
  parts.push_back(rest);
  return parts[static_cast<size_t>(rank)];
}

// `steps` updates from step `first` on: one rank, or `world` ranks each with its share.
void Train(trainer::DistributedOptimizer& opt, const Problem& p, int first, int steps, int rank,
           int world) {
  for (int s = first; s < first + steps; ++s) {
    opt.ZeroGrad();
    for (size_t i = 0; i < p.params.size(); ++i) {
      torch::Tensor share = Share(p.grads[s][i], rank, world, s);
      torch::Tensor param = opt.params()[i];  // a handle: its gradient is the parameter's
      if (param.grad().defined())
        param.mutable_grad().add_(share);
      else
        param.mutable_grad() = share;
    }
    ASSERT_TRUE(opt.ReduceAndClip(2.0).ok());
    ASSERT_TRUE(opt.Step(1e-2).ok());
  }
}

double MaxRelDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(a[i].abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

std::vector<torch::Tensor> Values(const trainer::DistributedOptimizer& o) {
  std::vector<torch::Tensor> out;
  for (const auto& t : o.params()) out.push_back(t.detach().clone());
  return out;
}

// The weights after `steps` updates on one rank (AdamW), and its optimizer state's size.
std::vector<torch::Tensor> OneRank(const Problem& p, int steps, int64_t* state_bytes = nullptr) {
  ProcessGroup single;
  auto one = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &single);
  EXPECT_TRUE(one.ok());
  if (!one.ok()) return {};
  Train(**one, p, 0, steps, 0, 1);
  if (state_bytes) *state_bytes = (*one)->state_bytes();
  return Values(**one);
}

TEST(DistributedOptimizer, NRanksMakeTheUpdatesOfOneAndHoldAnNthOfTheState) {
  torch::set_num_threads(1);
  const Problem p = MakeProblem(3);
  int64_t full_state = 0;
  const std::vector<torch::Tensor> want = OneRank(p, 3, &full_state);

  for (int world : {2, 4}) {
    std::vector<double> diffs(world);
    std::vector<int64_t> state(world);
    RunRanks(world, [&](int rank, ProcessGroup& g) {
      // Small buckets: several collectives in flight at once.
      auto opt = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &g, 37);
      ASSERT_TRUE(opt.ok()) << opt.status();
      Train(**opt, p, 0, 3, rank, world);
      diffs[rank] = MaxRelDiff(want, Values(**opt));
      state[rank] = (*opt)->state_bytes();
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_LE(diffs[r], 1e-6) << world << " ranks, rank " << r;
      // 1/N of the moments, give or take the last chunk's rounding.
      EXPECT_LE(state[r], full_state / world + 2 * 4 * world) << world << " ranks, rank " << r;
    }
    int64_t sum = 0;
    for (int64_t s : state) sum += s;
    EXPECT_EQ(sum, full_state);
  }
}

// The weights' all-gather in bf16: the other ranks' slices arrive rounded to bf16 (half the
// bytes), this rank's stays the fp32 master, and SyncMasters() restores the exact fp32 weights,
// which follow the same trajectory as one rank's (the gradients here do not depend on them).
TEST(DistributedOptimizer, Bf16AllGatherKeepsTheFp32MastersSharded) {
  torch::set_num_threads(1);
  const Problem p = MakeProblem(3);
  const std::vector<torch::Tensor> want = OneRank(p, 3);
  std::vector<double> before(2), after(2);
  RunRanks(2, [&](int rank, ProcessGroup& g) {
    auto opt =
        trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &g, 37, torch::kBFloat16);
    ASSERT_TRUE(opt.ok()) << opt.status();
    Train(**opt, p, 0, 3, rank, 2);
    before[rank] = MaxRelDiff(want, Values(**opt));
    ASSERT_TRUE((*opt)->SyncMasters().ok());
    after[rank] = MaxRelDiff(want, Values(**opt));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_GT(before[r], 1e-6) << "rank " << r << ": nothing was rounded to bf16";
    EXPECT_LE(before[r], 1.0 / 128) << "rank " << r;  // bf16 keeps 8 significant bits
    EXPECT_LE(after[r], 1e-6) << "rank " << r;
  }
}

// Through autograd: a chain of layers, two micro-batches per rank. The buckets of the last layers
// go out while the backward is still in the first ones, and the result is one rank's.
TEST(DistributedOptimizer, BucketsGoOutDuringTheLastBackward) {
  torch::set_num_threads(1);
  torch::manual_seed(3);
  std::vector<std::pair<std::string, torch::Tensor>> init;
  for (int l = 0; l < 6; ++l)
    init.emplace_back("layer" + std::to_string(l) + ".weight", torch::randn({8, 8}) * 0.3);
  const torch::Tensor inputs = torch::randn({4, 3, 8});  // 4 micro-batches of 3 rows
  auto run = [&](ProcessGroup& g, int64_t bucket, int64_t* overlapped, int64_t* buckets) {
    auto params = Clone(init);
    for (auto& [n, t] : params) t.set_requires_grad(true);
    auto opt = trainer::DistributedOptimizer::Create(params, Optim(), &g, bucket);
    EXPECT_TRUE(opt.ok());
    for (int step = 0; step < 2; ++step) {
      (*opt)->ZeroGrad();
      for (int i = g.rank(); i < 4; i += g.size()) {
        torch::Tensor x = inputs[i];
        for (const auto& t : (*opt)->params()) x = torch::tanh(x.matmul(t));
        if (i + g.size() >= 4) (*opt)->ExpectLastBackward();
        (x.pow(2).sum() / 12.0).backward();
      }
      EXPECT_TRUE((*opt)->ReduceAndClip(1.0).ok());
      EXPECT_TRUE((*opt)->Step(1e-2).ok());
    }
    if (overlapped) *overlapped = (*opt)->overlapped_buckets();
    if (buckets) *buckets = (*opt)->num_buckets();
    return Values(**opt);
  };
  ProcessGroup single;
  const auto want = run(single, 64, nullptr, nullptr);
  std::vector<double> diffs(2);
  std::vector<int64_t> overlapped(2), buckets(2);
  RunRanks(2, [&](int rank, ProcessGroup& g) {
    diffs[rank] = MaxRelDiff(want, run(g, 64, &overlapped[rank], &buckets[rank]));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(diffs[r], 1e-6) << "rank " << r;
    EXPECT_EQ(buckets[r], 6) << "one 64-element parameter per bucket";
    // The first layer's gradient comes last; every bucket before it went out during the backward.
    EXPECT_GE(overlapped[r], 5) << "rank " << r;
  }
}

TEST(DistributedOptimizer, CheckpointsResumeOnAnyWorldSize) {
  torch::set_num_threads(1);
  const Problem p = MakeProblem(4);
  const std::vector<torch::Tensor> want = OneRank(p, 4);
  ProcessGroup single;

  const std::string root = kBin + "/distributed_test_runs/optimizer";
  fs::remove_all(root);
  // Three steps on `from` ranks, saved; the fourth on `to` ranks, loaded from that checkpoint.
  for (auto [from, to] : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}, {2, 3}, {4, 2}}) {
    const std::string dir = root + "/" + std::to_string(from) + "to" + std::to_string(to);
    fs::create_directories(dir);
    std::vector<torch::Tensor> after3;
    RunRanks(from, [&](int rank, ProcessGroup& g) {
      auto opt = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &g);
      ASSERT_TRUE(opt.ok());
      Train(**opt, p, 0, 3, rank, from);
      ASSERT_TRUE((*opt)->SaveState(dir).ok());
      if (rank == 0) after3 = Values(**opt);
    });
    std::vector<double> diffs(to);
    RunRanks(to, [&](int rank, ProcessGroup& g) {
      auto params = Clone(p.params);
      for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(after3[i]);
      auto opt = trainer::DistributedOptimizer::Create(params, Optim(), &g);
      ASSERT_TRUE(opt.ok());
      absl::Status s = (*opt)->LoadState(dir, 3);
      ASSERT_TRUE(s.ok()) << s;
      Train(**opt, p, 3, 1, rank, to);
      diffs[rank] = MaxRelDiff(want, Values(**opt));
    });
    for (int r = 0; r < to; ++r) EXPECT_LE(diffs[r], 1e-6) << from << " -> " << to << " rank " << r;
  }

  // State written for other parameters is refused with the file named.
  const std::string dir = root + "/2to1";
  auto params = Clone(p.params);
  params.pop_back();
  auto other = trainer::DistributedOptimizer::Create(params, Optim(), &single);
  ASSERT_TRUE(other.ok());
  absl::Status s = (*other)->LoadState(dir, 3);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("optimizer-00000-of-00002"), std::string::npos) << s;
  // A missing shard is named too.
  fs::remove(dir + "/optimizer-00001-of-00002.safetensors");
  auto again = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &single);
  s = (*again)->LoadState(dir, 3);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("optimizer-00001-of-00002"), std::string::npos) << s;
}

// bf16-mixed (trainer/common/mixed_precision.h) on 2 and 3 ranks against one rank in bf16-mixed,
// with a real model's forward and backward (the gradients depend on the bf16 compute copies). The
// ranks sum the fp32 gradients in another order (1e-7 relative); a master that then lands on the
// other side of a bf16 rounding boundary gives a compute copy one bf16 ulp apart, which the next
// steps' gradients feel: we allow 1e-5 per tensor on the masters after 3 steps (measured
// 1e-8: no copy flipped here). The fp32
// parameters (norms, router) are summed exactly from their owners' slices, and every rank's
// compute copies are its masters rounded to bf16.
TEST(DistributedOptimizer, Bf16MixedOnNRanksEqualsOneRank) {
  torch::set_num_threads(1);
  std::ifstream in(std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json");
  auto config = lm::ParseModelConfig(nlohmann::json::parse(in));
  ASSERT_TRUE(config.ok());
  const std::vector<lm::PackedBatch> micro = {
      lm::PackedBatch::FromSequences({{5, 9, 33, 2, 71, 8, 100}, {3, 17, 250, 4}}),
      lm::PackedBatch::FromSequences({{7, 7, 40, 41, 42, 43}}),
      lm::PackedBatch::FromSequences({{11, 12, 13}, {200, 201, 202, 203, 204}}),
      lm::PackedBatch::FromSequences({{1, 2, 3, 4, 5, 6, 7, 8}})};
  auto train = [&](int world) {
    std::map<std::string, torch::Tensor> masters;
    RunRanks(world, [&](int rank, ProcessGroup& g) {
      auto model = lm::CreateModel(*config);
      ASSERT_TRUE(model.ok());
      (*model)->InitWeights(0.05, 3);
      std::vector<std::pair<std::string, torch::Tensor>> params;
      for (const auto& p : (*model)->named_parameters()) params.emplace_back(p.key(), p.value());
      auto opt = trainer::DistributedOptimizer::Create(params, Optim(), &g, 5000, torch::kFloat32,
                                                       trainer::Precision::kBf16Mixed);
      ASSERT_TRUE(opt.ok()) << opt.status();
      for (int step = 0; step < 3; ++step) {
        (*opt)->ZeroGrad();
        for (size_t i = static_cast<size_t>(rank); i < micro.size(); i += world) {
          if (i + world >= micro.size()) (*opt)->ExpectLastBackward();
          torch::Tensor loss;
          {
            trainer::ForwardPrecision autocast(trainer::Precision::kBf16Mixed, torch::kCPU);
            auto [rows, targets] = lm::NextTokenRows(micro[i]);
            auto h = (*model)->Forward(micro[i]).index_select(0, rows);
            loss = -lm::TokenLogprobs(h, (*model)->LmHeadWeight(), targets).sum() / 30.0;
          }
          loss.backward();
        }
        ASSERT_TRUE((*opt)->ReduceAndClip(1.0).ok());
        ASSERT_TRUE((*opt)->Step(1e-3).ok());
      }
      auto flat = (*opt)->GatherMasters();
      ASSERT_TRUE(flat.ok()) << flat.status();
      // Every rank: rank 0's masters (broadcast) rounded are this rank's compute copies.
      torch::Tensor all = rank == 0 ? *flat : torch::empty({trainer::FlatLayout::Of(params).total});
      std::vector<torch::Tensor> b{all};
      ASSERT_TRUE(g.Broadcast(b).ok());
      for (const auto& e : trainer::FlatLayout::Of(params).entries) {
        torch::Tensor p;
        for (const auto& [n, t] : params)
          if (n == e.name) p = t;
        torch::Tensor m = all.narrow(0, e.offset, e.numel).view(p.sizes());
        const bool bf16 = p.scalar_type() == torch::kBFloat16;
        EXPECT_TRUE(torch::equal(p.to(torch::kFloat32),
                                 bf16 ? m.to(torch::kBFloat16).to(torch::kFloat32) : m))
            << e.name << " on rank " << rank << " of " << world;
        if (rank == 0) masters[e.name] = m.clone();
      }
    });
    return masters;
  };
  const auto one = train(1);
  ASSERT_FALSE(one.empty());
  for (int world : {2, 3}) {
    const auto n = train(world);
    double worst = 0;
    for (const auto& [name, m] : one) {
      const double d = ((n.at(name) - m).norm() / m.norm()).item<double>();
      EXPECT_LE(d, 1e-5) << name << ", " << world << " ranks";
      worst = std::max(worst, d);
    }
    std::printf("bf16-mixed masters after 3 steps, %d ranks vs 1: worst per-tensor %.2e\n", world,
                worst);
  }
}

// NCCL needs a device per rank: two ranks on two GPUs, as the learner runs on a GPU node. Skips
// without two CUDA devices (a one-GPU machine too: NCCL refuses two ranks on one device).
TEST(NcclGroup, CollectivesAndZeroOneOnTwoGpus) {
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2)
    GTEST_SKIP() << "needs two CUDA devices (found "
                 << (torch::cuda::is_available() ? torch::cuda::device_count() : 0) << ")";
  const Problem p = MakeProblem(3);
  const std::vector<torch::Tensor> want = OneRank(p, 3);
  const int port = testing_util::FreeLoopbackPort();
  std::vector<double> diffs(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      const torch::Device gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(r));
      auto g = ProcessGroup::Create(LaunchEnv{r, 2, r, "127.0.0.1", port}, gpu);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ((*g)->backend(), "nccl");
      std::vector<torch::Tensor> t{torch::full({7}, r + 1.0f, torch::TensorOptions(gpu))};
      ASSERT_TRUE((*g)->AllReduce(t).ok());
      EXPECT_TRUE(torch::equal(t[0].cpu(), torch::full({7}, 3.0f)));
      std::string bytes = r == 0 ? "from rank 0" : "";
      ASSERT_TRUE((*g)->BroadcastBytes(&bytes).ok());
      EXPECT_EQ(bytes, "from rank 0");
      std::vector<std::pair<std::string, torch::Tensor>> params;
      for (const auto& [n, v] : p.params) params.emplace_back(n, v.to(gpu));
      auto opt = trainer::DistributedOptimizer::Create(params, Optim(), g->get());
      ASSERT_TRUE(opt.ok()) << opt.status();
      for (int s = 0; s < 3; ++s) {
        (*opt)->ZeroGrad();
        for (size_t i = 0; i < params.size(); ++i) {
          torch::Tensor param = (*opt)->params()[i];
          param.mutable_grad().add_(Share(p.grads[s][i], r, 2, s).to(gpu));
        }
        ASSERT_TRUE((*opt)->ReduceAndClip(2.0).ok());
        ASSERT_TRUE((*opt)->Step(1e-2).ok());
      }
      std::vector<torch::Tensor> got;
      for (const auto& t : (*opt)->params()) got.push_back(t.detach().cpu());
      diffs[r] = MaxRelDiff(want, got);
    });
  }
  for (auto& t : ranks) t.join();
  // fp32 on the GPU (TF32 plays no part: AdamW is elementwise); reductions in another order.
  for (int r = 0; r < 2; ++r) EXPECT_LE(diffs[r], 1e-5) << "rank " << r;
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
