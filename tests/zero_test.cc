// The learner's sharded optimizer (trainer/common/zero1.h, gradient_reducer.h) on Gloo ranks that
// are threads of this process, against AdamW on one rank, in both ZeRO stages: the updates, the
// overlap of the reduce-scatters with the backward, uneven micro-batches and ranks with none, the
// late loss normaliser (grad_scale), the memory each rank holds, and resume across world sizes,
// stages and bucket sizes.
//
// Tolerance. N ranks sum the same M micro-batch gradients g_1..g_M of an element as one rank does,
// in another order: one rank accumulates them in backward order, stage 1 sums each rank's local
// sum in the reduce-scatter, stage 2 sums each round over the ranks and then the rounds. Every
// order is a sum of the same M terms in fp32, so each differs from the exact sum by at most
// (M - 1) u sum_i |g_i| (u = 2^-24) and from each other by twice that: with M <= 5 and terms of
// one magnitude, ~5e-7 of the gradient. AdamW's update m / (sqrt(v) + eps) is homogeneous of
// degree 0 in the gradient, so it moves by at most ~2x that relative amount, and a weight by
// lr x that: we allow 1e-6 of the largest weight per tensor after 3-4 steps (elementwise), as the
// one-rank comparison has always been held to.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "lm/dist/process_group.h"
#include "lm/io/safetensors.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/plan/plan.h"
#include "nlohmann/json.hpp"
#include "tests/child_process.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "trainer/common/checkpoint.h"
#include "trainer/common/optim.h"
#include "trainer/common/optimizer_state.h"
#include "trainer/common/zero1.h"

using testing_util::TestDir;

namespace {

namespace fs = std::filesystem;
using lm::dist::LaunchEnv;
using lm::dist::ProcessGroup;
using trainer::ZeroStage;

// Runs fn(rank, group) on `world` threads, each with its own Gloo group on loopback.
void RunRanks(int world, const std::function<void(int, ProcessGroup&)>& fn) {
  const int port = testing_util::FreeLoopbackPort();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      LaunchEnv env{r, world, r, "127.0.0.1", port};
      lm::dist::GroupOptions o;
      o.timeout = absl::Seconds(60);
      auto group = ProcessGroup::Create(env, torch::kCPU, o);
      ASSERT_TRUE(group.ok()) << group.status();
      fn(r, **group);
    });
  }
  for (auto& t : threads) t.join();
}

const char* StageName(ZeroStage s) {
  return s == ZeroStage::kTwo ? "stage 2" : "stage 1";
}

// ---------------------------------------------------------------------------------------------
// Gradients given by hand: a problem of five tensors and each rank's share of every gradient.

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

// `steps` updates from step `first` on: one rank, or `world` ranks each with its share, put into
// the parameters' .grad by hand (no backward: the reduction takes them at ReduceAndClip).
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
  for (const auto& t : o.params()) out.push_back(t.detach().to(torch::kFloat32).clone());
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

TEST(ShardedOptimizer, NRanksMakeTheUpdatesOfOneAndHoldAnNthOfTheState) {
  torch::set_num_threads(1);
  const Problem p = MakeProblem(3);
  int64_t full_state = 0;
  const std::vector<torch::Tensor> want = OneRank(p, 3, &full_state);
  int64_t total = 0;
  for (const auto& [n, t] : p.params) total += t.numel();

  for (ZeroStage stage : {ZeroStage::kOne, ZeroStage::kTwo}) {
    for (int world : {2, 4}) {
      std::vector<double> diffs(world);
      std::vector<int64_t> state(world);
      std::vector<trainer::LearnerMemory> mem(world);
      std::vector<trainer::BucketSharding> sharding(world);
      RunRanks(world, [&](int rank, ProcessGroup& g) {
        // Small buckets (37 elements, cutting parameters): several collectives in flight.
        auto opt = trainer::DistributedOptimizer::Create(
            Clone(p.params), Optim(), &g, 37, torch::kFloat32, trainer::Precision::kFp32, stage);
        ASSERT_TRUE(opt.ok()) << opt.status();
        Train(**opt, p, 0, 3, rank, world);
        diffs[rank] = MaxRelDiff(want, Values(**opt));
        state[rank] = (*opt)->state_bytes();
        mem[rank] = (*opt)->memory();
        sharding[rank] = (*opt)->sharding();
      });
      int64_t sum = 0;
      for (int r = 0; r < world; ++r) {
        const std::string what = absl::StrCat(StageName(stage), ", ", world, " ranks, rank ", r);
        EXPECT_LE(diffs[r], 1e-6) << what;
        // 1/N of the moments, give or take the padding of each bucket.
        EXPECT_LE(state[r], full_state / world + 2 * 4 * world * sharding[r].buckets.size())
            << what;
        sum += state[r];
        // The gradients: stage 1 the full buffer and the slice, stage 2 the slice alone.
        const int64_t slice = 4 * sharding[r].slice, full = 4 * sharding[r].padded_total;
        EXPECT_EQ(mem[r].gradients, stage == ZeroStage::kTwo ? slice : full + slice) << what;
        EXPECT_LE(slice, 4 * (total / world + static_cast<int64_t>(sharding[r].buckets.size())));
      }
      EXPECT_EQ(sum, full_state) << StageName(stage) << ", " << world << " ranks";
    }
  }
}

// The weights' all-gather in bf16: the other ranks' slices arrive rounded to bf16 (half the
// bytes), this rank's stays the fp32 master, and SyncMasters() restores the exact fp32 weights,
// which follow the same trajectory as one rank's (the gradients here do not depend on them).
TEST(ShardedOptimizer, Bf16AllGatherKeepsTheFp32MastersSharded) {
  torch::set_num_threads(1);
  const Problem p = MakeProblem(3);
  const std::vector<torch::Tensor> want = OneRank(p, 3);
  std::vector<double> before(2), after(2);
  RunRanks(2, [&](int rank, ProcessGroup& g) {
    auto opt =
        trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &g, 37, torch::kBFloat16,
                                              trainer::Precision::kFp32, ZeroStage::kTwo);
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

// ---------------------------------------------------------------------------------------------
// Gradients from autograd: a chain of six 8x8 layers, micro-batches of 3 rows.

struct Chain {
  std::vector<std::pair<std::string, torch::Tensor>> init;
  torch::Tensor inputs;  // [micro-batches, 3, 8]
};

Chain MakeChain(int micro_batches) {
  torch::manual_seed(3);
  Chain c;
  for (int l = 0; l < 6; ++l)
    c.init.emplace_back("layer" + std::to_string(l) + ".weight", torch::randn({8, 8}) * 0.3);
  c.inputs = torch::randn({micro_batches, 3, 8});
  return c;
}

struct ChainRun {
  std::vector<torch::Tensor> weights;
  int64_t overlapped = 0, buckets = 0;
  trainer::LearnerMemory memory;
};

// Two steps of the chain on `g`'s ranks: rank r runs micro-batches r, r + N, ...; `legacy` drives
// the older protocol (ExpectLastBackward, then the rank's own loss.backward()).
ChainRun RunChain(const Chain& c, ProcessGroup& g, ZeroStage stage, int64_t bucket,
                  bool legacy = false, const std::vector<std::string>& order = {}) {
  auto params = Clone(c.init);
  for (auto& [n, t] : params) t.set_requires_grad(true);
  auto opt = trainer::DistributedOptimizer::Create(params, Optim(), &g, bucket, torch::kFloat32,
                                                   trainer::Precision::kFp32, stage, order);
  EXPECT_TRUE(opt.ok()) << opt.status();
  if (!opt.ok()) return {};
  const int64_t micro = c.inputs.size(0), world = g.size();
  ChainRun out;
  for (int step = 0; step < 2; ++step) {
    (*opt)->ZeroGrad();
    const int64_t mine = micro > g.rank() ? (micro - g.rank() + world - 1) / world : 0;
    if (!legacy) EXPECT_TRUE((*opt)->ExpectBackwards(mine).ok());
    for (int64_t i = g.rank(); i < micro; i += world) {
      torch::Tensor x = c.inputs[i];
      for (const auto& t : (*opt)->params()) x = torch::tanh(x.matmul(t));
      torch::Tensor loss = x.pow(2).sum() / (3.0 * static_cast<double>(micro));
      if (legacy) {
        if (i + world >= micro) (*opt)->ExpectLastBackward();
        loss.backward();
      } else {
        EXPECT_TRUE((*opt)->Backward(loss).ok());
      }
    }
    absl::StatusOr<double> norm = (*opt)->ReduceAndClip(1.0);
    EXPECT_TRUE(norm.ok()) << norm.status();
    EXPECT_TRUE((*opt)->Step(1e-2).ok());
    out.overlapped += (*opt)->overlapped_buckets();
  }
  out.buckets = (*opt)->num_buckets();
  out.weights = Values(**opt);
  out.memory = (*opt)->memory();
  return out;
}

std::vector<torch::Tensor> OneRankChain(const Chain& c) {
  ProcessGroup single;
  return RunChain(c, single, ZeroStage::kOne, 64).weights;
}

// One 64-element parameter per bucket, 4 micro-batches on 2 ranks (two backwards each): stage 1
// sends every bucket but the first layer's during the last backward, stage 2 during each.
TEST(ShardedOptimizer, BucketsGoOutDuringTheBackward) {
  torch::set_num_threads(1);
  const Chain c = MakeChain(4);
  const auto want = OneRankChain(c);
  for (ZeroStage stage : {ZeroStage::kOne, ZeroStage::kTwo}) {
    std::vector<ChainRun> runs(2);
    RunRanks(2, [&](int rank, ProcessGroup& g) { runs[rank] = RunChain(c, g, stage, 64); });
    for (int r = 0; r < 2; ++r) {
      EXPECT_LE(MaxRelDiff(want, runs[r].weights), 1e-6) << StageName(stage) << ", rank " << r;
      EXPECT_EQ(runs[r].buckets, 6) << "one 64-element parameter per bucket";
      // The first layer's gradient comes last: every bucket before it went out inside a backward
      // (per step: 5 in the last backward, or 5 in each of the 2).
      EXPECT_GE(runs[r].overlapped, stage == ZeroStage::kTwo ? 2 * 2 * 5 : 2 * 5)
          << StageName(stage) << ", rank " << r;
    }
  }
}

// Uneven shares: 4 micro-batches on 3 ranks (2, 1, 1), 1 on 2 ranks (rank 1 has none), 2 on 4
// ranks (two without), 5 on 2 (3 and 2); buckets cutting parameters (50 elements). The ranks with
// fewer backwards reduce rounds of zeros so that every collective pairs; the older protocol gives
// the same weights.
TEST(ShardedOptimizer, UnevenMicroBatchesAndRanksWithNoneTrainAsOne) {
  torch::set_num_threads(1);
  struct Case {
    int micro, world;
  };
  for (Case k : {Case{4, 3}, Case{1, 2}, Case{2, 4}, Case{5, 2}}) {
    const Chain c = MakeChain(k.micro);
    const auto want = OneRankChain(c);
    for (ZeroStage stage : {ZeroStage::kOne, ZeroStage::kTwo}) {
      for (bool legacy : {false, true}) {
        std::vector<ChainRun> runs(k.world);
        RunRanks(k.world, [&](int rank, ProcessGroup& g) {
          runs[rank] = RunChain(c, g, stage, 50, legacy);
        });
        for (int r = 0; r < k.world; ++r)
          EXPECT_LE(MaxRelDiff(want, runs[r].weights), 1e-6)
              << k.micro << " micro-batches on " << k.world << " ranks, " << StageName(stage)
              << (legacy ? ", ExpectLastBackward" : "") << ", rank " << r;
      }
    }
  }
}

// A flat space laid out against the backward (the layers first to last, their gradients arriving
// last to first): every gradient waits, as autograd made it, for its buckets' turn, the staging
// buckets stay at most 2 in flight + 1 filling, and the sums are the same.
TEST(ShardedOptimizer, GradientsArrivingOutOfOrderWaitForTheirBuckets) {
  torch::set_num_threads(1);
  const Chain c = MakeChain(4);
  const auto want = OneRankChain(c);
  std::vector<std::string> forward;
  for (const auto& [n, t] : c.init) forward.push_back(n);
  std::vector<ChainRun> runs(2);
  RunRanks(2, [&](int rank, ProcessGroup& g) {
    runs[rank] = RunChain(c, g, ZeroStage::kTwo, 16, false, forward);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(MaxRelDiff(want, runs[r].weights), 1e-6) << "rank " << r;
    EXPECT_EQ(runs[r].buckets, 24);
    EXPECT_GT(runs[r].memory.gradient_buckets, 0);
    EXPECT_LE(runs[r].memory.gradient_buckets,
              static_cast<int64_t>(trainer::GradientReducer::kMaxInFlight + 1) * 16 * 4)
        << "rank " << r;
  }
}

// The plan's largest parameter (its "gradient awaiting its buckets" term) is the model's.
TEST(ShardedOptimizer, ThePlansLargestParameterIsTheModels) {
  std::ifstream in(std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json");
  auto config = lm::ParseModelConfig(nlohmann::json::parse(in));
  ASSERT_TRUE(config.ok());
  auto model = lm::CreateModel(*config);
  ASSERT_TRUE(model.ok());
  int64_t largest = 0;
  for (const auto& p : (*model)->parameters()) largest = std::max(largest, p.numel());
  EXPECT_EQ(lm::plan::CountParameters(*config).largest, largest);
}

// A rank that runs more backwards than it announced would need a round the others do not run:
// refused before any collective.
TEST(ShardedOptimizer, MoreBackwardsThanAnnouncedIsRefused) {
  ProcessGroup single;
  const Chain c = MakeChain(2);
  auto params = Clone(c.init);
  for (auto& [n, t] : params) t.set_requires_grad(true);
  auto opt = trainer::DistributedOptimizer::Create(params, Optim(), &single, 64, torch::kFloat32,
                                                   trainer::Precision::kBf16Mixed, ZeroStage::kTwo);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE((*opt)->ExpectBackwards(1).ok());
  auto loss = [&] {
    torch::Tensor x = c.inputs[0];
    for (const auto& t : (*opt)->params()) x = x.matmul(t.to(torch::kFloat32));
    return x.sum();
  };
  ASSERT_TRUE((*opt)->Backward(loss()).ok());
  absl::Status s = (*opt)->Backward(loss());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(std::string(s.message()).find("announced"), std::string::npos) << s;
  EXPECT_EQ((*opt)->ExpectBackwards(-1).code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// ReduceAndClip's grad_scale: the loss normaliser applied after the sum.
//
// Each rank's loss is s * sum_b c_b . (W x_b) over 3 rows b, so dL/dW[i][j] = s sum_b c_bi x_bj.
// Scaling the loss, autograd rounds s c_bi once, then the matmul forms and sums the 3 products;
// with grad_scale the sum of c_bi x_bj is formed, summed over the ranks, then multiplied by s
// once. Both are the same sum of 3 x ranks terms up to roundings: at most (2 x 3 + 4) u of
// s sum |c_bi x_bj| per element (u = 2^-24: the products, the additions, s c, the final
// multiply and the ranks' sum). With s a power of two every rounding commutes with the scaling, so
// the two are equal bit for bit, and so are the norms.
TEST(ShardedOptimizer, GradScaleIsTheLossNormaliserAppliedAfterTheSum) {
  torch::set_num_threads(1);
  torch::manual_seed(11);
  const torch::Tensor w0 = torch::randn({5, 6}), x = torch::randn({2, 3, 6}),
                      cs = torch::randn({2, 3, 5});
  // This rank's reduced gradient (its slice) and the norm, the scale in the loss or after the sum.
  auto run = [&](ProcessGroup& g, double s, bool in_loss, ZeroStage stage) {
    std::vector<std::pair<std::string, torch::Tensor>> params = {{"w.weight", w0.clone()}};
    params[0].second.set_requires_grad(true);
    auto opt = trainer::DistributedOptimizer::Create(params, Optim(), &g, 7, torch::kFloat32,
                                                     trainer::Precision::kFp32, stage);
    EXPECT_TRUE(opt.ok());
    (*opt)->ZeroGrad();
    EXPECT_TRUE((*opt)->ExpectBackwards(1).ok());
    const int r = g.rank();
    torch::Tensor loss = (cs[r] * x[r].matmul((*opt)->params()[0].t())).sum();
    EXPECT_TRUE((*opt)->Backward(in_loss ? loss * s : loss).ok());
    auto norm = (*opt)->ReduceAndClip(0, in_loss ? 1.0 : s);
    EXPECT_TRUE(norm.ok());
    torch::Tensor grads = g.size() == 1 ? (*opt)->params()[0].grad().reshape(-1).clone()
                                        : (*opt)->grad_slice().clone();
    return std::make_pair(grads, *norm);
  };
  for (ZeroStage stage : {ZeroStage::kOne, ZeroStage::kTwo}) {
    for (int world : {1, 2}) {
      for (double s : {0.25, 1.0 / 3.0}) {
        std::vector<std::pair<torch::Tensor, double>> scaled(world), late(world);
        std::vector<trainer::BucketSharding> sh(world);
        RunRanks(world, [&](int rank, ProcessGroup& g) {
          scaled[rank] = run(g, s, true, stage);
          late[rank] = run(g, s, false, stage);
        });
        // sum over the ranks and rows of |s c_bi x_bj|, in the flat order of this one parameter.
        const torch::Tensor terms =
            (torch::einsum("rbi,rbj->ij", {cs.narrow(0, 0, world).abs().to(torch::kFloat64),
                                           x.narrow(0, 0, world).abs().to(torch::kFloat64)}) *
             s)
                .reshape(-1);
        for (int r = 0; r < world; ++r) {
          const std::string what =
              absl::StrCat(StageName(stage), ", ", world, " rank(s), rank ", r, ", s = ", s);
          const torch::Tensor& a = scaled[r].first;
          const torch::Tensor& b = late[r].first;
          if (s == 0.25) {
            EXPECT_TRUE(torch::equal(a, b)) << what;
            EXPECT_EQ(scaled[r].second, late[r].second) << what;
            continue;
          }
          // The slice's elements in flat order: with one parameter of 30 elements and buckets of
          // 7 (8 on 2 ranks), rank r owns piece r of every bucket.
          ProcessGroup single;
          const trainer::BucketSharding layout = trainer::BucketSharding::Of(30, 7, world, r);
          torch::Tensor bound = torch::zeros({a.numel()}, torch::kFloat64);
          if (world == 1) {
            bound = terms;
          } else {
            for (size_t k = 0; k < layout.buckets.size(); ++k) {
              const auto& bk = layout.buckets[k];
              if (bk.own_begin < bk.own_end)
                bound.narrow(0, bk.slice_begin, bk.own_end - bk.own_begin)
                    .copy_(terms.narrow(0, bk.own_begin, bk.own_end - bk.own_begin));
            }
          }
          const torch::Tensor diff = (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs();
          EXPECT_TRUE((diff <= bound * 10 * std::ldexp(1.0, -24)).all().item<bool>())
              << what << ": " << (diff - bound * 10 * std::ldexp(1.0, -24)).max().item<double>();
          EXPECT_NEAR(scaled[r].second, late[r].second, 1e-6 * late[r].second) << what;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpointed state.

// Three steps on `from` ranks (stage, bucket, flat order), saved; the fourth on `to` ranks, loaded
// from that checkpoint: the one-rank trajectory whatever the world sizes, stages, buckets and flat
// orders on either side (a checkpoint's ranges are translated parameter by parameter).
TEST(ShardedOptimizer, CheckpointsResumeOnAnyWorldSizeStageAndBucket) {
  torch::set_num_threads(1);
  const Problem p = MakeProblem(4);
  const std::vector<torch::Tensor> want = OneRank(p, 4);
  struct Side {
    int world;
    ZeroStage stage;
    int64_t bucket;
    std::vector<std::string> order = {};
  };
  const std::vector<std::string> shuffled = {"proj.bias", "embed.weight", "head.weight",
                                             "norm.weight", "proj.weight"};
  const std::string root = TestDir();
  int n = 0;
  for (auto [from, to] : std::vector<std::pair<Side, Side>>{
           {{2, ZeroStage::kTwo, 37}, {1, ZeroStage::kOne, 64}},
           {{1, ZeroStage::kOne, 64}, {2, ZeroStage::kTwo, 53}},
           {{2, ZeroStage::kOne, 37}, {3, ZeroStage::kTwo, 29}},
           {{4, ZeroStage::kTwo, 64}, {2, ZeroStage::kOne, 11}},
           {{3, ZeroStage::kTwo, 1 << 20}, {4, ZeroStage::kTwo, 16}},
           {{2, ZeroStage::kTwo, 37}, {3, ZeroStage::kTwo, 29, shuffled}},
           {{3, ZeroStage::kOne, 23, shuffled}, {2, ZeroStage::kTwo, 41}}}) {
    const std::string dir = root + "/case" + std::to_string(n++);
    fs::create_directories(dir);
    std::vector<torch::Tensor> after3;
    RunRanks(from.world, [&](int rank, ProcessGroup& g) {
      auto opt = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &g, from.bucket,
                                                       torch::kFloat32, trainer::Precision::kFp32,
                                                       from.stage, from.order);
      ASSERT_TRUE(opt.ok());
      Train(**opt, p, 0, 3, rank, from.world);
      ASSERT_TRUE((*opt)->SaveState(dir).ok());
      if (rank == 0) after3 = Values(**opt);
    });
    std::vector<double> diffs(to.world);
    RunRanks(to.world, [&](int rank, ProcessGroup& g) {
      auto params = Clone(p.params);
      for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(after3[i]);
      auto opt =
          trainer::DistributedOptimizer::Create(params, Optim(), &g, to.bucket, torch::kFloat32,
                                                trainer::Precision::kFp32, to.stage, to.order);
      ASSERT_TRUE(opt.ok());
      absl::Status s = (*opt)->LoadState(dir, 3);
      ASSERT_TRUE(s.ok()) << s;
      Train(**opt, p, 3, 1, rank, to.world);
      diffs[rank] = MaxRelDiff(want, Values(**opt));
    });
    for (int r = 0; r < to.world; ++r)
      EXPECT_LE(diffs[r], 1e-6) << from.world << " -> " << to.world << " ranks, rank " << r;
  }

  // State written for other parameters is refused with the file named.
  ProcessGroup single;
  const std::string dir = root + "/case0";
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

// The one-rank AdamW state after `steps` updates as flat [exp_avg, exp_avg_sq] in layout order.
std::pair<torch::Tensor, torch::Tensor> FlatMoments(const Problem& p, int steps) {
  ProcessGroup single;
  auto one = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &single);
  EXPECT_TRUE(one.ok());
  Train(**one, p, 0, steps, 0, 1);
  const std::string dir = TestDir().string() + "/one";
  fs::create_directories(dir);
  EXPECT_TRUE((*one)->SaveState(dir).ok());
  auto file = lm::SafetensorsFile::Open(dir + "/optimizer.safetensors");
  EXPECT_TRUE(file.ok());
  std::vector<torch::Tensor> m, v;
  for (const auto& e : trainer::FlatLayout::Of(p.params).entries) {
    for (auto [name, out] : {std::pair{"exp_avg.", &m}, std::pair{"exp_avg_sq.", &v}}) {
      auto t = (*file)->Get(name + e.name);
      EXPECT_TRUE(t.ok());
      out->push_back(
          torch::from_blob(const_cast<std::byte*>(t->data), {e.numel}, torch::kFloat32).clone());
    }
  }
  return {torch::cat(m), torch::cat(v)};
}

// Checkpoints written before the shards held lists of ranges (one contiguous chunk per rank, the
// format "opd-adamw-zero1") still resume, on any world size and stage.
TEST(ShardedOptimizer, OlderContiguousShardsStillLoad) {
  torch::set_num_threads(1);
  const Problem p = MakeProblem(4);
  const std::vector<torch::Tensor> want = OneRank(p, 4);
  const std::vector<torch::Tensor> after3 = OneRank(p, 3);
  const auto [m, v] = FlatMoments(p, 3);
  const trainer::FlatLayout layout = trainer::FlatLayout::Of(p.params);
  const std::string dir = TestDir().string() + "/old";
  fs::create_directories(dir);
  for (int rank = 0; rank < 2; ++rank) {
    const trainer::Shard s = trainer::Shard::Of(layout.total, 2, rank);
    torch::Tensor mr = m.narrow(0, s.begin, s.end - s.begin).contiguous();
    torch::Tensor vr = v.narrow(0, s.begin, s.end - s.begin).contiguous();
    const size_t bytes = static_cast<size_t>(mr.numel()) * 4;
    ASSERT_TRUE(
        lm::WriteSafetensors(dir + "/" + trainer::OptimizerShardFileName(rank, 2),
                             {{"exp_avg", lm::DType::kF32, {mr.numel()}, mr.data_ptr(), bytes},
                              {"exp_avg_sq", lm::DType::kF32, {vr.numel()}, vr.data_ptr(), bytes}},
                             {{"format", "opd-adamw-zero1"},
                              {"begin", std::to_string(s.begin)},
                              {"end", std::to_string(s.end)},
                              {"total", std::to_string(layout.total)},
                              {"world_size", "2"},
                              {"steps", "3"},
                              {"layout", layout.ToJson().dump()}})
            .ok());
  }
  for (int world : {1, 3}) {
    std::vector<double> diffs(world);
    RunRanks(world, [&](int rank, ProcessGroup& g) {
      auto params = Clone(p.params);
      for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(after3[i]);
      auto opt = trainer::DistributedOptimizer::Create(params, Optim(), &g, 17, torch::kFloat32,
                                                       trainer::Precision::kFp32, ZeroStage::kTwo);
      ASSERT_TRUE(opt.ok());
      absl::Status s = (*opt)->LoadState(dir, 3);
      ASSERT_TRUE(s.ok()) << s;
      Train(**opt, p, 3, 1, rank, world);
      diffs[rank] = MaxRelDiff(want, Values(**opt));
    });
    for (int r = 0; r < world; ++r) EXPECT_LE(diffs[r], 1e-6) << world << " ranks, rank " << r;
  }
}

// Rewrites `path` with element `index` of tensor `name` set to `value` (the rest, and the
// metadata, as they were).
void Corrupt(const std::string& path, const std::string& name, int64_t index, float value) {
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
  tensors[name].view(-1)[index] = value;
  std::vector<lm::TensorToWrite> out;
  for (const auto& [n, t] : tensors)
    out.push_back(
        {n, lm::DType::kF32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.numel()) * 4});
  ASSERT_TRUE(lm::WriteSafetensors(path, out, meta).ok());
}

// Moments no AdamW could have produced (a NaN or infinite moment, a negative second moment)
// would make the next update NaN: refused on load as DATA_LOSS naming the file, the stored tensor
// and the parameter, on every rank, whichever rank's range holds them.
TEST(OptimizerState, MomentsNoAdamwCouldMakeAreRefusedOnLoad) {
  torch::set_num_threads(1);
  const Problem p = MakeProblem(2);
  const std::string root = TestDir();
  struct Bad {
    const char* moment;
    float value;
  };
  int n = 0;
  for (const Bad& bad :
       {Bad{"exp_avg_sq", std::nanf("")}, Bad{"exp_avg_sq", -1e-3f}, Bad{"exp_avg", INFINITY}}) {
    // One rank: optimizer.safetensors, tensors by parameter name.
    const std::string one = root + "/one" + std::to_string(n);
    fs::create_directories(one);
    {
      ProcessGroup single;
      auto opt = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &single);
      Train(**opt, p, 0, 2, 0, 1);
      ASSERT_TRUE((*opt)->SaveState(one).ok());
    }
    Corrupt(one + "/optimizer.safetensors", std::string(bad.moment) + ".proj.weight", 7, bad.value);
    {
      ProcessGroup single;
      auto opt = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &single);
      absl::Status s = (*opt)->LoadState(one, 2);
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      for (const std::string& part :
           {std::string("optimizer.safetensors"), std::string(bad.moment) + ".proj.weight",
            std::string("parameter proj.weight element 7")})
        EXPECT_NE(std::string(s.message()).find(part), std::string::npos) << part << ": " << s;
    }
    // Two ranks, stage 2: the bad element in rank 1's range only; both ranks refuse with rank 1's
    // error, and so does one rank reading every shard.
    const std::string two = root + "/two" + std::to_string(n++);
    fs::create_directories(two);
    RunRanks(2, [&](int rank, ProcessGroup& g) {
      auto opt =
          trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &g, 37, torch::kFloat32,
                                                trainer::Precision::kFp32, ZeroStage::kTwo);
      Train(**opt, p, 0, 2, rank, 2);
      ASSERT_TRUE((*opt)->SaveState(two).ok());
    });
    Corrupt(two + "/optimizer-00001-of-00002.safetensors", bad.moment, 3, bad.value);
    std::vector<absl::Status> got(2);
    RunRanks(2, [&](int rank, ProcessGroup& g) {
      auto opt =
          trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &g, 37, torch::kFloat32,
                                                trainer::Precision::kFp32, ZeroStage::kTwo);
      got[rank] = (*opt)->LoadState(two, 2);
    });
    ProcessGroup single;
    auto opt = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &single);
    got.push_back((*opt)->LoadState(two, 2));
    for (size_t r = 0; r < got.size(); ++r) {
      EXPECT_EQ(got[r].code(), absl::StatusCode::kDataLoss) << r << ": " << got[r];
      for (const std::string& part :
           {std::string("optimizer-00001-of-00002.safetensors"),
            absl::StrCat("tensor ", bad.moment, " "), std::string("parameter ")})
        EXPECT_NE(std::string(got[r].message()).find(part), std::string::npos)
            << r << ": " << part << ": " << got[r];
    }
    EXPECT_NE(std::string(got[0].message()).find("rank 1: "), std::string::npos) << got[0];
  }
}

lm::ModelConfig TinyConfig() {
  std::ifstream in(std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json");
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = lm::ParseModelConfig(nlohmann::json::parse(ss.str()));
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// A step whose weights are not finite is never checkpointed: Save refuses before writing, naming
// a parameter that is not finite and the checkpoint that stays the one to resume from (not pruned
// by keep_last). Two ranks in bf16-mixed, stage 2: the NaN is in one master only, on the rank
// that owns it, and both ranks refuse.
TEST(OptimizerState, NonFiniteWeightsAreNeverCheckpointed) {
  torch::set_num_threads(1);
  const std::string dir = TestDir();
  std::vector<absl::Status> refused(2);
  RunRanks(2, [&](int rank, ProcessGroup& g) {
    auto model = lm::CreateModel(TinyConfig());
    ASSERT_TRUE(model.ok());
    (*model)->InitWeights(0.05, 1);
    std::vector<std::pair<std::string, torch::Tensor>> params;
    for (const auto& p : (*model)->named_parameters()) params.emplace_back(p.key(), p.value());
    auto opt =
        trainer::DistributedOptimizer::Create(params, Optim(), &g, 4096, torch::kFloat32,
                                              trainer::Precision::kBf16Mixed, ZeroStage::kTwo);
    ASSERT_TRUE(opt.ok()) << opt.status();
    trainer::CheckpointManager checkpoints(dir + "/checkpoints", /*keep_last=*/1);
    const nlohmann::json state = {{"job", "sft"}};
    ASSERT_TRUE(checkpoints.Save(1, **model, **opt, state, {}, g).ok());
    // A NaN gradient in one element of rank 1's slice: only its master goes NaN.
    (*opt)->ZeroGrad();
    ASSERT_TRUE((*opt)->ExpectBackwards(0).ok());
    ASSERT_TRUE((*opt)->ReduceAndClip(0).ok());
    if (rank == 1) (*opt)->grad_slice()[0] = std::nanf("");
    ASSERT_TRUE((*opt)->Step(1e-3).ok());
    refused[rank] = checkpoints.Save(2, **model, **opt, state, {}, g);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(refused[r].code(), absl::StatusCode::kFailedPrecondition) << refused[r];
    for (const std::string& part :
         {std::string("step 2 is not checkpointed"), std::string("not finite: parameter "),
          std::string("on rank 1"), std::string("step_000001")})
      EXPECT_NE(std::string(refused[r].message()).find(part), std::string::npos)
          << part << ": " << refused[r];
  }
  EXPECT_TRUE(fs::exists(dir + "/checkpoints/step_000001/trainer_state.json"));
  EXPECT_FALSE(fs::exists(dir + "/checkpoints/step_000002"));
  EXPECT_EQ(trainer::CheckpointManager(dir + "/checkpoints", 1).List().size(), 1u);
}

// bf16-mixed (trainer/common/mixed_precision.h) on 2 and 3 ranks in both stages against one rank
// in bf16-mixed, with a real model's forward and backward (the gradients depend on the bf16
// compute copies). The ranks sum the fp32 gradients in another order (1e-7 relative); a master
// that then lands on the other side of a bf16 rounding boundary gives a compute copy one bf16 ulp
// apart, which the next steps' gradients feel: we allow 1e-5 per tensor on the masters after 3
// steps (measured 1e-8: no copy flipped here). The fp32 parameters (norms, router) are summed
// exactly from their owners' slices, and every rank's compute copies are its masters rounded to
// bf16.
TEST(ShardedOptimizer, Bf16MixedOnNRanksEqualsOneRank) {
  torch::set_num_threads(1);
  std::ifstream in(std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json");
  auto config = lm::ParseModelConfig(nlohmann::json::parse(in));
  ASSERT_TRUE(config.ok());
  const std::vector<lm::PackedBatch> micro = {
      lm::PackedBatch::FromSequences({{5, 9, 33, 2, 71, 8, 100}, {3, 17, 250, 4}}),
      lm::PackedBatch::FromSequences({{7, 7, 40, 41, 42, 43}}),
      lm::PackedBatch::FromSequences({{11, 12, 13}, {200, 201, 202, 203, 204}}),
      lm::PackedBatch::FromSequences({{1, 2, 3, 4, 5, 6, 7, 8}})};
  auto train = [&](int world, ZeroStage stage) {
    std::map<std::string, torch::Tensor> masters;
    RunRanks(world, [&](int rank, ProcessGroup& g) {
      auto model = lm::CreateModel(*config);
      ASSERT_TRUE(model.ok());
      (*model)->InitWeights(0.05, 3);
      std::vector<std::pair<std::string, torch::Tensor>> params;
      for (const auto& p : (*model)->named_parameters()) params.emplace_back(p.key(), p.value());
      auto opt = trainer::DistributedOptimizer::Create(params, Optim(), &g, 5000, torch::kFloat32,
                                                       trainer::Precision::kBf16Mixed, stage);
      ASSERT_TRUE(opt.ok()) << opt.status();
      for (int step = 0; step < 3; ++step) {
        (*opt)->ZeroGrad();
        const size_t mine = (micro.size() - rank + world - 1) / world;
        ASSERT_TRUE((*opt)->ExpectBackwards(static_cast<int64_t>(mine)).ok());
        for (size_t i = static_cast<size_t>(rank); i < micro.size(); i += world) {
          torch::Tensor loss;
          {
            trainer::ForwardPrecision autocast(trainer::Precision::kBf16Mixed, torch::kCPU);
            auto [rows, targets] = lm::NextTokenRows(micro[i]);
            auto h = (*model)->Forward(micro[i]).index_select(0, rows);
            loss = -lm::TokenLogprobs(h, (*model)->LmHeadWeight(), targets).sum() / 30.0;
          }
          ASSERT_TRUE((*opt)->Backward(loss).ok());
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
  const auto one = train(1, ZeroStage::kOne);
  ASSERT_FALSE(one.empty());
  for (ZeroStage stage : {ZeroStage::kOne, ZeroStage::kTwo}) {
    for (int world : {2, 3}) {
      const auto n = train(world, stage);
      double worst = 0;
      for (const auto& [name, m] : one) {
        const double d = ((n.at(name) - m).norm() / m.norm()).item<double>();
        EXPECT_LE(d, 1e-5) << name << ", " << world << " ranks, " << StageName(stage);
        worst = std::max(worst, d);
      }
      std::printf("bf16-mixed masters after 3 steps, %d ranks (%s) vs 1: worst per-tensor %.2e\n",
                  world, StageName(stage), worst);
    }
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
      for (ZeroStage stage : {ZeroStage::kOne, ZeroStage::kTwo}) {
        std::vector<std::pair<std::string, torch::Tensor>> params;
        for (const auto& [n, v] : p.params) params.emplace_back(n, v.to(gpu));
        auto opt = trainer::DistributedOptimizer::Create(
            params, Optim(), g->get(), 37, torch::kFloat32, trainer::Precision::kFp32, stage);
        ASSERT_TRUE(opt.ok()) << opt.status();
        for (int s = 0; s < 3; ++s) {
          (*opt)->ZeroGrad();
          for (size_t i = 0; i < params.size(); ++i) {
            torch::Tensor param = (*opt)->params()[i];
            torch::Tensor share = Share(p.grads[s][i], r, 2, s).to(gpu);
            if (param.grad().defined())
              param.mutable_grad().add_(share);
            else
              param.mutable_grad() = share;
          }
          ASSERT_TRUE((*opt)->ReduceAndClip(2.0).ok());
          ASSERT_TRUE((*opt)->Step(1e-2).ok());
        }
        std::vector<torch::Tensor> got;
        for (const auto& t : (*opt)->params()) got.push_back(t.detach().cpu());
        diffs[r] = std::max(diffs[r], MaxRelDiff(want, got));
      }
    });
  }
  for (auto& t : ranks) t.join();
  // fp32 on the GPU (TF32 plays no part: AdamW is elementwise); reductions in another order.
  for (int r = 0; r < 2; ++r) EXPECT_LE(diffs[r], 1e-5) << "rank " << r;
}

}  // namespace
