// The learner's sharded optimizer (trainer/common/zero1.h, gradient_reducer.h) on Gloo ranks that
// are threads of this process, against AdamW on one rank, in both ZeRO stages: the updates, the
// overlap of the reduce-scatters with the backward, uneven micro-batches and ranks with none, the
// late loss normaliser (grad_scale), the memory each rank holds; bf16-mixed; NCCL where two GPUs
// are. The checkpointed state: tests/optimizer_state_test.cc.
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
#include <thread>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "lm/dist/process_group.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/plan/plan.h"
#include "nlohmann/json.hpp"
#include "tests/child_process.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "tests/zero_testing.h"
#include "trainer/common/optimizer_state.h"
#include "trainer/common/zero1.h"

using testing_util::TestDir;

namespace {

namespace fs = std::filesystem;
using lm::dist::LaunchEnv;
using lm::dist::ProcessGroup;
using trainer::ZeroStage;
using namespace zero_testing;

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
    if (!legacy) {
      EXPECT_TRUE((*opt)->ExpectBackwards(mine).ok());
    }
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
