// Expert-parallel serving (lm/model/expert_parallel.h, rpc/ep_group.h): real opd-teacher and
// opd-rollout processes launched as N ranks with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
// over Gloo on loopback, driven over gRPC.
//
// Covered: a 2- and 4-rank teacher scores like one rank (<= 1e-5, Qwen3-MoE and Qwen3-Next);
// each rank holds the replicated parameters + its experts' share, and a loaded shard equals the
// slice of the whole model; a 2-rank rollout samples the same tokens as one rank for a seed;
// a follower killed mid-request gives the client UNAVAILABLE and the server refuses later calls;
// SIGTERM to rank 0 stops every rank; bad --world-size values exit 2 naming the flag.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "child_process.h"
#include "lm/io/sharded_load.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "nlohmann/json.hpp"
#include "rpc/client.h"
#include "rpc/ep_group.h"
#include "rpc/tensor_codec.h"
#include "rpc/weight_stream.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"

using testing_util::MaxAbsDiff;
using testing_util::TempDir;

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;

const std::string kBin = OPD_BINARY_DIR;
// 32 experts per layer, most of the bytes in them: the memory split is plain.
const std::string kMoe = std::string(OPD_FIXTURES_DIR) + "/moe_many_experts";
// Qwen3-Next: 16 experts, a shared expert, linear attention.
const std::string kNext = std::string(OPD_NEXT_FIXTURES_DIR) + "/next_interval2_tied";

std::vector<std::vector<int32_t>> Sequences(const std::string& fixture) {
  std::ifstream in(fixture + "/inputs.json");
  auto seqs = nlohmann::json::parse(in)["sequences"].get<std::vector<std::vector<int32_t>>>();
  return seqs;
}

// N ranks of one server, launched as torchrun would; rank 0 writes its port file.
class Group {
 public:
  Group(const std::string& binary, const std::string& model, int world,
        const std::vector<std::string>& extra = {}, const std::vector<std::string>& extra_env = {})
      : dir_(TempDir("group")) {
    const std::string master = std::to_string(testing_util::FreeLoopbackPort());
    auto rank_argv = [&](int r) {
      std::vector<std::string> argv = {binary, "--model=" + model, "--threads=1",
                                       "--world-size=" + std::to_string(world),
                                       "--ep-timeout-seconds=120"};
      if (r > 0) argv.push_back("--listen=127.0.0.1:0");  // rank 0's port is the group's
      argv.insert(argv.end(), extra.begin(), extra.end());
      return argv;
    };
    auto rank_env = [&](int r) {
      std::vector<std::string> env;
      if (world > 1)
        env = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
               "LOCAL_RANK=" + std::to_string(r), "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + master};
      env.insert(env.end(), extra_env.begin(), extra_env.end());
      return env;
    };
    // The followers first: rank 0 serves (writes its port) once the group has formed.
    for (int r = 1; r < world; ++r)
      followers_.push_back(std::make_unique<ChildProcess>(
          rank_argv(r), (dir_ / ("rank" + std::to_string(r) + ".log")).string(), rank_env(r)));
    leader_ = testing_util::StartServed(dir_, "rank0", rank_argv(0), std::chrono::seconds(120),
                                        rank_env(0));
    if (!leader_.address.empty()) {
      opd::rpc::ClientOptions o = Options();
      const absl::Status st = opd::rpc::WaitUntilServing(o, absl::Seconds(60));
      if (!st.ok()) leader_.address.clear();
    }
  }
  ~Group() {
    leader_.process->Stop();  // rank 0 first: it stops the followers
    for (auto& r : followers_) r->Stop();
    fs::remove_all(dir_);
  }

  bool ok() const { return !leader_.address.empty(); }
  opd::rpc::ClientOptions Options(const std::string& secret = "") const {
    opd::rpc::ClientOptions o;
    o.address = leader_.address;
    o.secret = secret;
    o.timeout = absl::Seconds(120);
    return o;
  }
  ChildProcess& rank(int r) { return r == 0 ? *leader_.process : *followers_[r - 1]; }
  int size() const { return static_cast<int>(followers_.size()) + 1; }
  std::string Logs() const {
    std::string all = "--- rank 0\n" + leader_.process->Log();
    for (size_t r = 0; r < followers_.size(); ++r)
      all += "--- rank " + std::to_string(r + 1) + "\n" + followers_[r]->Log();
    return all;
  }

 private:
  fs::path dir_;
  std::vector<std::unique_ptr<ChildProcess>> followers_;  // ranks 1..world-1
  testing_util::Served leader_;                           // rank 0
};

std::vector<lm::SequenceScore> Score(const Group& g, const std::string& fixture) {
  auto client = opd::rpc::TeacherClient::Create(g.Options());
  EXPECT_TRUE(client.ok()) << client.status();
  std::vector<lm::Sample> in;
  for (const auto& s : Sequences(fixture)) in.push_back(lm::Sample::ToScore(s, 1));
  opd::rpc::ScoreOptions so;
  so.top_k = 4;
  auto out = (*client)->Score(in, so);
  EXPECT_TRUE(out.ok()) << out.status() << "\n" << g.Logs();
  return out.ok() ? *out : std::vector<lm::SequenceScore>{};
}

// The parameter bytes a rank logged: {total, experts}.
std::pair<int64_t, int64_t> LoggedBytes(const std::string& log) {
  std::smatch m;
  static const std::regex re("parameter_bytes=([0-9]+) expert_bytes=([0-9]+)");
  if (!std::regex_search(log, m, re)) return {-1, -1};
  return {std::stoll(m[1]), std::stoll(m[2])};
}

class TeacherParity : public ::testing::TestWithParam<std::string> {};

// 1, 2 and 4 ranks give the same log-probs and top-k; every rank holds the replicated
// parameters and its share of the experts; SIGTERM to rank 0 ends every rank with 0.
TEST_P(TeacherParity, ScoresLikeOneRankWithAShareOfTheExpertsPerRank) {
  const std::string fixture = GetParam();
  const std::string model = fixture + "/model";
  const std::string bin = kBin + "/teacher_service/opd-teacher";
  std::vector<lm::SequenceScore> want;
  {
    Group one(bin, model, 1);
    ASSERT_TRUE(one.ok()) << one.Logs();
    want = Score(one, fixture);
    ASSERT_FALSE(want.empty());
  }
  auto full = lm::LoadModel(model);
  ASSERT_TRUE(full.ok()) << full.status();
  const lm::ParameterBytes whole = lm::CountParameterBytes(**full);
  const int64_t experts = (*full)->config().num_experts;

  for (int world : {2, 4}) {
    Group g(bin, model, world);
    ASSERT_TRUE(g.ok()) << g.Logs();
    const auto got = Score(g, fixture);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LE(MaxAbsDiff(got[i].logprobs, want[i].logprobs), 1e-5)
          << world << " ranks, seq " << i;
      EXPECT_LE(MaxAbsDiff(got[i].topk_logprobs, want[i].topk_logprobs), 1e-5);
      EXPECT_EQ(got[i].topk_ids, want[i].topk_ids);
    }
    int64_t expert_sum = 0;
    for (int r = 0; r < world; ++r) {
      const auto [total, mine] = LoggedBytes(g.rank(r).Log());
      ASSERT_GT(total, 0) << g.rank(r).Log();
      // Replicated part + this rank's experts: (E / N rounded up) of the expert bytes at most.
      EXPECT_EQ(total - mine, whole.total - whole.experts) << "rank " << r;
      const int64_t share = (experts + world - 1) / world;
      EXPECT_LE(mine, whole.experts / experts * share) << "rank " << r;
      expert_sum += mine;
    }
    EXPECT_EQ(expert_sum, whole.experts);
    std::cout << world << " ranks: " << LoggedBytes(g.rank(0).Log()).first
              << " parameter bytes per rank vs " << whole.total << " for one\n";
    // Rank 0 stops the followers.
    EXPECT_EQ(g.rank(0).Stop(), 0) << g.Logs();
    for (int r = 1; r < world; ++r)
      EXPECT_EQ(g.rank(r).Wait(std::chrono::seconds(60)), 0) << g.Logs();
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TeacherParity, ::testing::Values(kMoe, kNext),
                         [](const auto& info) {
                           return info.index == 0 ? "Qwen3Moe" : "Qwen3Next";
                         });

// A shard holds the replicated tensors as they are and exactly its rows of every fused expert
// tensor.
// The combine in one process: two "ranks" holding experts [0, 4) and [4, 8), the all-reduce
// adding the other rank's partial sum. It must equal all eight experts run at once (fp32:
// the same products, summed in another grouping, so within a few ulps), hand the all-reduce
// fp32 partials whatever the activations' dtype, and give the same bits every time.
TEST(ExpertCombine, TwoShardsSumToAllExpertsInFp32) {
  torch::manual_seed(5);
  const int64_t T = 9, H = 16, I = 8, E = 8, k = 3;
  lm::ExpertsImpl all(E, H, I);
  for (auto& p : all.parameters()) p.data().normal_(0, 0.3);
  auto shard = [&](int64_t first) {
    auto e = std::make_shared<lm::ExpertsImpl>(E / 2, H, I);
    e->gate_up_proj.data().copy_(all.gate_up_proj.narrow(0, first, E / 2));
    e->down_proj.data().copy_(all.down_proj.narrow(0, first, E / 2));
    return e;
  };
  auto lo = shard(0), hi = shard(E / 2);
  lm::Routing r;
  r.ids = torch::empty({T, k}, torch::kInt64);
  for (int64_t t = 0; t < T; ++t) r.ids[t] = torch::randperm(E).narrow(0, 0, k);
  r.weights = torch::softmax(torch::randn({T, k}), -1);
  auto x = torch::randn({T, H});

  auto run = [&](const torch::Tensor& xs, const lm::Routing& rs, torch::Dtype* seen) {
    torch::Tensor hi_part;
    lm::ExpertParallel ep_hi{{E / 2, E / 2}, [&](torch::Tensor& y) {
                               *seen = y.scalar_type();
                               hi_part = y.clone();
                               return absl::OkStatus();
                             }};
    lm::ExpertParallelExperts(ep_hi, xs, rs, *hi);
    lm::ExpertParallel ep_lo{{0, E / 2}, [&](torch::Tensor& y) {
                               y.add_(hi_part);
                               return absl::OkStatus();
                             }};
    return lm::ExpertParallelExperts(ep_lo, xs, rs, *lo);
  };
  torch::Dtype seen = torch::kFloat64;
  auto got = run(x, r, &seen);
  auto want = lm::MoeExperts(x, r.ids, r.weights, all.gate_up_proj, all.down_proj);
  // Each output is a sum of k weighted expert rows; the shards add them in two groups instead of
  // one, which moves the result by at most a few fp32 ulps of the largest row.
  EXPECT_LE((got - want).abs().max().item<double>(),
            8 * k * std::numeric_limits<float>::epsilon() * want.abs().max().item<double>());
  EXPECT_EQ(seen, torch::kFloat32);
  EXPECT_TRUE(torch::equal(got, run(x, r, &seen)));  // the same bits on a second run

  lm::Routing rb = r;
  rb.weights = r.weights.to(torch::kBFloat16);
  auto got_bf16 = run(x.to(torch::kBFloat16), rb, &seen);
  EXPECT_EQ(seen, torch::kFloat32) << "a bf16 model's partial sums must travel in fp32";
  EXPECT_EQ(got_bf16.scalar_type(), torch::kBFloat16);
}

TEST(ShardedLoad, EachRankHoldsItsSliceOfTheExperts) {
  for (const std::string& fixture : {kMoe, kNext}) {
    auto full = lm::LoadModel(fixture + "/model");
    ASSERT_TRUE(full.ok()) << full.status();
    std::map<std::string, torch::Tensor> want;
    for (const auto& p : (*full)->named_parameters()) want[p.key()] = p.value();
    int64_t rows = 0;
    for (int rank = 0; rank < 3; ++rank) {
      auto shard = lm::LoadExpertShard(fixture + "/model", {}, rank, 3);
      ASSERT_TRUE(shard.ok()) << shard.status();
      const auto& c = (*shard)->config();
      const lm::ExpertRange r = lm::LocalExpertRange(c.num_experts, rank, 3);
      EXPECT_EQ(c.expert_first, r.first);
      EXPECT_EQ(c.local_experts, r.count);
      rows += r.count;
      for (const auto& p : (*shard)->named_parameters()) {
        const torch::Tensor& w = want.at(p.key());
        if (p.key().find(".experts.") != std::string::npos) {
          EXPECT_TRUE(torch::equal(p.value(), w.narrow(0, r.first, r.count))) << p.key();
        } else {
          EXPECT_TRUE(torch::equal(p.value(), w)) << p.key();
        }
      }
    }
    EXPECT_EQ(rows, (*full)->config().num_experts);
  }
}

// A follower that dies when a request reaches it: the client gets UNAVAILABLE (no hang), later
// calls too, and rank 0 exits non-zero when stopped.
TEST(TeacherFailure, FollowerKilledMidRequestGivesUnavailable) {
  Group g(kBin + "/teacher_service/opd-teacher", kMoe + "/model", 2, {"--debug-kill-rank=1"});
  ASSERT_TRUE(g.ok()) << g.Logs();
  auto client = opd::rpc::TeacherClient::Create(g.Options());
  ASSERT_TRUE(client.ok());
  auto first = (*client)->Score({lm::Sample::ToScore(Sequences(kMoe)[0], 1)});
  EXPECT_EQ(first.status().code(), absl::StatusCode::kUnavailable) << first.status();
  EXPECT_EQ(g.rank(1).Wait(std::chrono::seconds(60)), 128 + SIGKILL);
  auto later = (*client)->Score({lm::Sample::ToScore(Sequences(kMoe)[0], 1)});
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable) << later.status();
  EXPECT_NE(std::string(later.status().message()).find("expert-parallel group failed"),
            std::string::npos)
      << later.status();
  EXPECT_EQ(g.rank(0).Stop(), 1) << g.Logs();
}

// Batch-invariant scoring (the default) across an expert-parallel group: with three ranks the
// MoE layers' partial sums are gathered and added in rank order (rpc/ep_group.cc) where the
// backend's all-reduce adds an element's three terms in an order set by its place in the buffer,
// i.e. by the batch's size; the followers run the leader's mode. A sequence scored alone, and in
// one request (one batch) with 1, 8 and 40 others before or around it, gives the same bits.
TEST(TeacherBatchInvariance, ThreeRanksScoreASequenceTheSameAloneAndBatched) {
  Group g(kBin + "/teacher_service/opd-teacher", kMoe + "/model", 3,
          {"--max-batch-tokens=1000000"});
  ASSERT_TRUE(g.ok()) << g.Logs();
  auto client = opd::rpc::TeacherClient::Create(g.Options());
  ASSERT_TRUE(client.ok()) << client.status();
  std::mt19937 rng(3);
  auto random = [&rng](int len) {
    std::vector<int32_t> t(len);
    for (auto& x : t) x = static_cast<int32_t>(rng() % 96);
    return lm::Sample::ToScore(std::move(t), 1);
  };
  const lm::Sample target = random(37);
  std::vector<lm::Sample> others;
  for (int i = 0; i < 40; ++i) others.push_back(random(5 + static_cast<int>(rng() % 60)));
  opd::rpc::ScoreOptions so;
  so.top_k = 4;
  auto alone = (*client)->Score({target}, so);
  ASSERT_TRUE(alone.ok()) << alone.status() << "\n" << g.Logs();
  for (auto [n, at] : {std::pair{1, 1}, {8, 0}, {8, 5}, {40, 20}, {40, 40}}) {
    std::vector<lm::Sample> batch(others.begin(), others.begin() + n);
    batch.insert(batch.begin() + at, target);
    auto got = (*client)->Score(batch, so);
    ASSERT_TRUE(got.ok()) << got.status();
    const auto& a = (*alone)[0];
    const auto& b = (*got)[at];
    EXPECT_TRUE(a.logprobs.size() == b.logprobs.size() &&
                std::memcmp(a.logprobs.data(), b.logprobs.data(), 4 * a.logprobs.size()) == 0 &&
                std::memcmp(a.topk_logprobs.data(), b.topk_logprobs.data(),
                            4 * a.topk_logprobs.size()) == 0 &&
                a.topk_ids == b.topk_ids)
        << n << " others, at " << at;
  }
}

std::vector<lm::Sample> Generate(const Group& g, uint64_t seed, const std::string& secret = "") {
  auto client = opd::rpc::RolloutClient::Create(g.Options(secret));
  EXPECT_TRUE(client.ok()) << client.status();
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& s : Sequences(kMoe))
    prompts.emplace_back(s.begin(), s.begin() + std::min<size_t>(4, s.size()));
  lm::SamplingParams go;
  go.samples_per_prompt = 2;
  go.max_new_tokens = 12;
  go.seed = seed;
  auto out = (*client)->Generate(prompts, go);
  EXPECT_TRUE(out.ok()) << out.status() << "\n" << g.Logs();
  return out.ok() ? *out : std::vector<lm::Sample>{};
}

// A 2-rank rollout (static sampler on both ranks) samples the tokens one rank samples, with the
// same log-probs, for each seed (Qwen3-MoE, and Qwen3-Next with its recurrent decode state);
// SIGTERM to rank 0 ends both ranks with 0.
class RolloutParity : public ::testing::TestWithParam<std::string> {};

TEST_P(RolloutParity, TwoRanksSampleTheSameTokensAsOne) {
  const std::string bin = kBin + "/rollout/opd-rollout";
  const std::string model = GetParam() + "/model";
  std::vector<std::vector<lm::Sample>> want;
  {
    Group one(bin, model, 1, {"--engine=static"});
    ASSERT_TRUE(one.ok()) << one.Logs();
    for (uint64_t seed : {1, 2}) want.push_back(Generate(one, seed));
  }
  Group two(bin, model, 2);
  ASSERT_TRUE(two.ok()) << two.Logs();
  for (size_t i = 0; i < want.size(); ++i) {
    const auto got = Generate(two, i + 1);
    ASSERT_EQ(got.size(), want[i].size());
    ASSERT_FALSE(got.empty());
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_EQ(got[s].tokens, want[i][s].tokens) << "seed " << i + 1 << " sample " << s;
      EXPECT_LE(MaxAbsDiff(got[s].logprobs, want[i][s].logprobs), 1e-5);
    }
  }
  // Different seeds drew different tokens (the comparison is not of constant output).
  EXPECT_NE(want[0][0].tokens, want[1][0].tokens);
  EXPECT_EQ(two.rank(0).Stop(), 0) << two.Logs();
  EXPECT_EQ(two.rank(1).Wait(std::chrono::seconds(60)), 0) << two.Logs();
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RolloutParity, ::testing::Values(kMoe, kNext),
                         [](const auto& info) {
                           return info.index == 0 ? "Qwen3Moe" : "Qwen3Next";
                         });

// A request larger than one batch's cache (--kv-cache-gb=0.00003, 32 KiB: two of these prompts
// with their samples) runs as consecutive batches on both ranks alike, with the samples one rank
// draws running it whole; the seed indices travel to the follower. One prompt whose samples alone
// exceed the batch is RESOURCE_EXHAUSTED naming it.
TEST(RolloutBatches, TwoRanksRunALargeRequestInBatches) {
  const std::string bin = kBin + "/rollout/opd-rollout";
  const std::string model = kMoe + "/model";
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t i = 0; i < 12; ++i) prompts.push_back({i + 1, (5 * i) % 96, (7 * i + 3) % 96});
  lm::SamplingParams go;
  go.samples_per_prompt = 2;
  go.max_new_tokens = 12;
  go.seed = 4;
  for (int64_t i = 0; i < 12; ++i) go.seed_indices.push_back(10 + i);
  auto run = [&](const Group& g, const std::vector<std::vector<int32_t>>& ps) {
    auto client = opd::rpc::RolloutClient::Create(g.Options());
    EXPECT_TRUE(client.ok()) << client.status();
    return (*client)->Generate(ps, go);
  };
  absl::StatusOr<std::vector<lm::Sample>> want;
  {
    Group one(bin, model, 1, {"--engine=static"});
    ASSERT_TRUE(one.ok()) << one.Logs();
    want = run(one, prompts);
    ASSERT_TRUE(want.ok()) << want.status();
  }
  Group two(bin, model, 2, {"--kv-cache-gb=0.00003"});
  ASSERT_TRUE(two.ok()) << two.Logs();
  const auto got = run(two, prompts);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << two.Logs();
  ASSERT_EQ(got->size(), want->size());
  for (size_t s = 0; s < got->size(); ++s) {
    EXPECT_EQ((*got)[s].tokens, (*want)[s].tokens) << "sample " << s;
    EXPECT_LE(MaxAbsDiff((*got)[s].logprobs, (*want)[s].logprobs), 1e-5);
  }
  go.seed_indices = {0};
  const auto big = run(two, {std::vector<int32_t>(40, 5)});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_NE(std::string(big.status().message()).find("prompt 0: 40 tokens"), std::string::npos)
      << big.status();
  EXPECT_EQ(two.rank(0).Stop(), 0) << two.Logs();
  EXPECT_EQ(two.rank(1).Wait(std::chrono::seconds(60)), 0) << two.Logs();
}

constexpr const char* kSecret = "ep-test-secret";

void ExpectSameSamples(const std::vector<lm::Sample>& got, const std::vector<lm::Sample>& want,
                       int64_t version) {
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(got.empty());
  for (size_t s = 0; s < got.size(); ++s) {
    EXPECT_EQ(got[s].tokens, want[s].tokens) << "sample " << s;
    EXPECT_LE(MaxAbsDiff(got[s].logprobs, want[s].logprobs), 1e-5);
    EXPECT_EQ(got[s].weight_version, version);
  }
}

// A full weight push to a 2-rank rollout: each rank keeps its shard, both swap to the new
// version, and sampling equals one rank serving the new weights from disk. Chunks of 1000 bytes
// straddle the experts' row boundaries. An incomplete push and a stale version change nothing.
TEST(RolloutWeights, PushToTwoRanksSwapsEveryRanksShard) {
  const fs::path dir = TempDir("weights");
  std::shared_ptr<lm::CausalLM> fresh;
  {
    auto base = lm::LoadModel(kMoe + "/model");
    ASSERT_TRUE(base.ok()) << base.status();
    auto created = lm::CreateModel((*base)->config());
    ASSERT_TRUE(created.ok());
    fresh = *created;
    fresh->InitWeights(0.05, 7);
    ASSERT_TRUE(lm::SaveModel(*fresh, (dir / "new").string()).ok());
  }
  const std::string bin = kBin + "/rollout/opd-rollout";
  const std::vector<std::string> env = {std::string("OPD_SECRET=") + kSecret};
  std::vector<lm::Sample> want;
  {
    Group one(bin, (dir / "new").string(), 1, {"--engine=static"}, env);
    ASSERT_TRUE(one.ok()) << one.Logs();
    want = Generate(one, 3, kSecret);
  }
  Group two(bin, kMoe + "/model", 2, {}, env);
  ASSERT_TRUE(two.ok()) << two.Logs();
  const auto before = Generate(two, 3, kSecret);
  auto client = opd::rpc::RolloutClient::Create(two.Options(kSecret));
  ASSERT_TRUE(client.ok());
  const auto w =
      opd::rpc::OutgoingTensorsOf(opd::rpc::NamedParameters(*fresh), opd::rpc::WireDtype::kFloat32);
  opd::rpc::StreamOptions small;
  small.chunk_bytes = 1000;
  auto pushed = opd::rpc::StreamWeights(two.Options(kSecret), 1, w, small);
  ASSERT_TRUE(pushed.ok()) << pushed.status() << "\n" << two.Logs();
  EXPECT_EQ(pushed->applied.version(), 1);
  EXPECT_EQ(pushed->applied.tensors(), static_cast<int64_t>(w.size()));
  ExpectSameSamples(Generate(two, 3, kSecret), want, 1);

  // Incomplete (the last tensor left out): refused, every rank keeps version 1.
  const std::vector<opd::rpc::OutgoingTensor> partial(w.begin(), w.end() - 1);
  auto refused = opd::rpc::StreamWeights(two.Options(kSecret), 2, partial, small);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  auto stale = opd::rpc::StreamWeights(two.Options(kSecret), 1, w);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  ExpectSameSamples(Generate(two, 3, kSecret), want, 1);
  // The push changed what is sampled (the comparison is not of unchanged weights).
  EXPECT_NE(before[0].tokens, want[0].tokens);
  EXPECT_EQ(two.rank(0).Stop(), 0) << two.Logs();
  EXPECT_EQ(two.rank(1).Wait(std::chrono::seconds(60)), 0) << two.Logs();
  fs::remove_all(dir);
}

// The same on the rollout: the Generate in flight is UNAVAILABLE, and so is a later weight push.
TEST(RolloutFailure, FollowerKilledMidGenerateGivesUnavailable) {
  Group g(kBin + "/rollout/opd-rollout", kMoe + "/model", 2, {"--debug-kill-rank=1"},
          {std::string("OPD_SECRET=") + kSecret});
  ASSERT_TRUE(g.ok()) << g.Logs();
  auto client = opd::rpc::RolloutClient::Create(g.Options(kSecret));
  ASSERT_TRUE(client.ok());
  lm::SamplingParams go;
  go.max_new_tokens = 4;
  auto first = (*client)->Generate({{1, 2, 3}}, go);
  EXPECT_EQ(first.status().code(), absl::StatusCode::kUnavailable) << first.status();
  EXPECT_EQ(g.rank(1).Wait(std::chrono::seconds(60)), 128 + SIGKILL);
  auto model = lm::LoadModel(kMoe + "/model");
  ASSERT_TRUE(model.ok());
  auto push =
      opd::rpc::StreamWeights(g.Options(kSecret), 1,
                              opd::rpc::OutgoingTensorsOf(opd::rpc::NamedParameters(**model),
                                                          opd::rpc::WireDtype::kFloat32));
  EXPECT_EQ(push.status().code(), absl::StatusCode::kUnavailable) << push.status();
  EXPECT_EQ(g.rank(0).Stop(), 1) << g.Logs();
}

// An idle group outlives its collective timeout: rank 0's heartbeats (every timeout / 4) keep the
// follower's wait for the next command alive. Two ranks in this process; the test waits for the
// follower to count 12 heartbeats (3 timeouts of idling), then runs a command on both.
TEST(EpGroup, HeartbeatsKeepAnIdleFollowerAlive) {
  auto model = lm::LoadModel(kMoe + "/model");
  ASSERT_TRUE(model.ok());
  const int port = testing_util::FreeLoopbackPort();
  std::unique_ptr<opd::rpc::EpGroup> groups[2];
  std::shared_ptr<lm::CausalLM> shards[2];
  std::thread joins[2];
  for (int r = 0; r < 2; ++r) {
    auto shard = lm::LoadExpertShard(kMoe + "/model", {}, r, 2);
    ASSERT_TRUE(shard.ok());
    shards[r] = *shard;
  }
  for (int r = 0; r < 2; ++r) {
    joins[r] = std::thread([&, r] {
      lm::dist::LaunchEnv env;
      env.rank = r;
      env.world_size = 2;
      env.master_port = port;
      auto g = opd::rpc::EpGroup::Join(env, torch::kCPU, absl::Seconds(1), *shards[r], "same");
      EXPECT_TRUE(g.ok()) << g.status();
      if (g.ok()) groups[r] = std::move(*g);
    });
  }
  for (auto& t : joins) t.join();
  ASSERT_TRUE(groups[0] && groups[1]);
  int commands = 0;
  absl::Status followed;
  std::atomic<bool> done{false};
  std::thread follower([&] {
    followed = groups[1]->Follow([&](const std::string& c) {
      EXPECT_EQ(c, "work");
      ++commands;
      return absl::OkStatus();
    });
    done = true;
  });
  // Events, not time: the follower's count of heartbeats (or its end, when one was missed).
  while (groups[1]->heartbeats() < 12 && !done)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(groups[0]
                  ->Run("work",
                        [](const std::string& c) {
                          EXPECT_EQ(c, "work");
                          return absl::OkStatus();
                        })
                  .ok());
  EXPECT_TRUE(groups[0]->Stop().ok());
  follower.join();
  EXPECT_TRUE(followed.ok()) << followed;
  EXPECT_EQ(commands, 1);
}

// Runs a server that must refuse its flags; returns {exit code, output}.
std::pair<int, std::string> RunRefused(const std::string& binary,
                                       const std::vector<std::string>& args,
                                       const std::vector<std::string>& env) {
  const fs::path dir = TempDir("flags");
  std::vector<std::string> argv = {binary, "--model=" + kMoe + "/model", "--threads=1"};
  argv.insert(argv.end(), args.begin(), args.end());
  ChildProcess p(argv, (dir / "log").string(), env);
  const int code = p.Wait(std::chrono::seconds(60));
  const std::string log = p.Log();
  fs::remove_all(dir);
  return {code, log};
}

TEST(ExpertParallelFlags, BadWorldSizesExitTwoNamingTheFlag) {
  const std::vector<std::string> master = {
      "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(testing_util::FreeLoopbackPort())};
  for (const std::string bin :
       {kBin + "/teacher_service/opd-teacher", kBin + "/rollout/opd-rollout"}) {
    // --world-size without the environment, and disagreeing with it.
    auto [code, log] = RunRefused(bin, {"--world-size=2"}, {});
    EXPECT_EQ(code, 2) << log;
    EXPECT_NE(log.find("--world-size=2 disagrees with the environment's WORLD_SIZE"),
              std::string::npos)
        << log;
    std::vector<std::string> env = master;
    env.insert(env.end(), {"RANK=0", "WORLD_SIZE=4"});
    std::tie(code, log) = RunRefused(bin, {"--world-size=2"}, env);
    EXPECT_EQ(code, 2) << log;
    EXPECT_NE(log.find("WORLD_SIZE=4"), std::string::npos) << log;
    // More ranks than the model's 32 experts.
    env = master;
    env.insert(env.end(), {"RANK=0", "WORLD_SIZE=64"});
    std::tie(code, log) = RunRefused(bin, {"--world-size=64"}, env);
    EXPECT_EQ(code, 2) << log;
    EXPECT_NE(log.find("--world-size=64 is more ranks than the model's 32 experts"),
              std::string::npos)
        << log;
  }
}

}  // namespace
