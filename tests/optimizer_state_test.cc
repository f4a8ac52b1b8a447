// The sharded optimizer's checkpointed state (trainer/common/optimizer_state.h, the checks in
// zero1.h and checkpoint.h): resume across world sizes, ZeRO stages, bucket sizes and flat orders
// and from the older one-range shards; moments no AdamW could have made refused on load on every
// rank, naming the file, tensor and parameter; weights that are not finite never checkpointed.
// Tolerance as tests/zero_test.cc derives it: 1e-6 of the largest weight per tensor.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/io/safetensors.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "tests/testing.h"
#include "tests/zero_testing.h"
#include "trainer/common/checkpoint.h"
#include "trainer/common/optimizer_state.h"
#include "trainer/common/zero1.h"

using testing_util::TestDir;

namespace {

namespace fs = std::filesystem;
using lm::dist::LaunchEnv;
using lm::dist::ProcessGroup;
using trainer::ZeroStage;
using namespace zero_testing;

// Three steps on `from` ranks (stage, bucket, flat order), saved; the fourth on `to` ranks, loaded
// from that checkpoint: the one-rank trajectory whatever the world sizes, stages, buckets and flat
// orders on either side (a checkpoint's ranges are translated parameter by parameter).
TEST(OptimizerState, CheckpointsResumeOnAnyWorldSizeStageBucketAndOrder) {
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
TEST(OptimizerState, OlderContiguousShardsStillLoad) {
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

}  // namespace
