// The rollout worker's memory: one copy of the weights, updates staged in host memory or written
// in place (rollout/weights.h), and the KV pool sized from the device (rollout/kv_pool.h).
//
// Covered: --kv-cache-gb auto gives the pool what a given device has left after the weights, a
// weight update's receive bucket, the prefill workspace and the reserve (hand arithmetic; the
// engine then holds the plan's blocks; opd-rollout logs them; a device too small is refused
// naming the term); a push that arrives while a request decodes is staged in host memory and
// waits, the request ends with the old weights bit for bit, the next request waits for the commit
// and samples with the new weights bit for bit; a second push while one waits is UNAVAILABLE;
// an in-place update (when nothing holds the weights) writes into the serving model, and one that
// fails half-way leaves the store damaged (refusing requests, naming the version) until an update
// of every tensor repairs it. Synchronised on events (the engine's per-iteration poll, the
// store's pending state), never on time.
#include <algorithm>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "child_process.h"
#include "lm/generate/sampler.h"
#include "lm/model/model.h"
#include "lm/plan/plan.h"
#include "rollout/engine.h"
#include "rollout/kv_pool.h"
#include "rollout/weights.h"
#include "tests/gpu.h"
#include "tests/testing.h"
#include "tests/wire_testing.h"

namespace rollout {
namespace {

namespace fs = std::filesystem;
using lm::Sample;
using lm::SamplingParams;

constexpr const char* kModel = "moe_tied_topk8";  // vocab 96, 256 positions
constexpr int64_t kGiB = lm::plan::kGiB;

std::string FixtureDir() {
  return std::string(OPD_FIXTURES_DIR) + "/" + kModel + "/model";
}

std::shared_ptr<lm::CausalLM> Load() {
  torch::set_num_threads(1);
  auto m = lm::LoadModel(FixtureDir());
  EXPECT_TRUE(m.ok()) << m.status();
  (*m)->eval();
  for (auto& p : (*m)->parameters()) p.set_requires_grad(false);
  return *m;
}

std::shared_ptr<lm::CausalLM> LoadB() {
  auto b = Load();
  b->InitWeights(0.1, 42);
  return b;
}

// Every parameter of `store`'s model equals `want`'s, bit for bit.
void ExpectHolds(const WeightStore& store, lm::CausalLM& want) {
  auto served = store.Current().model->named_parameters();
  for (const auto& p : want.named_parameters())
    EXPECT_TRUE(torch::equal(served[p.key()], p.value())) << p.key();
}

// ---------------------------------------------------------------------------------------------
// The KV pool from the device's size.

lm::plan::RolloutSettings FixtureSettings() {
  const EngineOptions eo;  // the engine's defaults, as opd-rollout passes them
  lm::plan::RolloutSettings s;
  s.weight_bytes = 4;  // fp32 on the CPU
  s.block_size = eo.block_size;
  s.max_running = eo.max_running;
  s.max_prefill_tokens = eo.max_prefill_tokens;
  return s;
}

// The terms before the pool, by hand: the fp32 weights (every parameter the model registers),
// one 64 MiB receive bucket of a collective push (no second model), the 2 GiB reserve, and the
// prefill workspace (plan arithmetic of its own, checked in plan_test).
int64_t TermsBeforeThePool(lm::CausalLM& model) {
  int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  const lm::ModelConfig& c = model.config();
  EXPECT_EQ(lm::plan::CountParameters(c).total, params);
  const int64_t workspace =
      8192 * lm::plan::InferenceActivationBytesPerToken(c, 4) + 256 * c.vocab_size * 4 * 2;
  return 4 * params + (int64_t{64} << 20) + 2 * kGiB + workspace;
}

TEST(KvPool, AutoTakesWhatAGivenDeviceHasLeft) {
  auto model = Load();
  const lm::ModelConfig& c = model->config();
  const int64_t device = 3 * kGiB;
  auto choice = ChooseKvPool(c, FixtureSettings(), std::nullopt, device);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->bytes, device - TermsBeforeThePool(*model));
  EXPECT_NE(choice->why.find("weight update: one receive bucket (64 MiB)"), std::string::npos)
      << choice->why;

  // The engine holds the plan's blocks: the pool over (KV bytes per token x block), less the null
  // block (qwen3_moe has no recurrent state).
  EngineOptions eo;
  eo.kv_cache_bytes = static_cast<double>(choice->bytes);
  auto engine = Engine::Create(*model, eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const int64_t blocks = choice->bytes / (lm::plan::KvBytesPerToken(c, 4) * eo.block_size) - 1;
  EXPECT_EQ((*engine)->stats().usable_blocks, blocks);
  auto settings = FixtureSettings();
  settings.kv_cache_bytes = choice->bytes;
  lm::plan::DeviceSpec d;
  d.memory_bytes = device;
  const auto plan = lm::plan::PlanRollout(c, settings, d);
  EXPECT_EQ(plan.memory.peak(), device);
  bool named = false;
  for (const auto& t : plan.memory.terms)
    named |= t.name.find(absl::StrCat("KV pool: ", blocks, " blocks")) == 0;
  EXPECT_TRUE(named) << lm::plan::FormatPlan(plan, d);

  // A device the other terms fill is refused naming a term; a number is taken as it is; without
  // a device size the CPU default.
  auto small = ChooseKvPool(c, FixtureSettings(), std::nullopt, TermsBeforeThePool(*model));
  EXPECT_EQ(small.status().code(), absl::StatusCode::kResourceExhausted) << small.status();
  EXPECT_NE(small.status().message().find("opd-rollout"), std::string::npos) << small.status();
  auto given = ChooseKvPool(c, FixtureSettings(), 0.25, device);
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->bytes, kGiB / 4);
  auto too_big = ChooseKvPool(c, FixtureSettings(), 1.0, device);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("--kv-cache-gb"), std::string::npos)
      << too_big.status();
  auto unknown = ChooseKvPool(c, FixtureSettings(), std::nullopt, 0);
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ(unknown->bytes, kCpuDefaultKvBytes);
  EXPECT_EQ(ParseKvCacheGb("auto", 64).value(), std::nullopt);
  EXPECT_EQ(ParseKvCacheGb("1.5", 64).value(), 1.5);
  for (const char* bad : {"0", "-1", "nan", "65", "lots"})
    EXPECT_EQ(ParseKvCacheGb(bad, 64).status().code(), absl::StatusCode::kInvalidArgument) << bad;
}

// opd-rollout sizes its pool the same way from --device-memory-gb, and refuses a device the
// other terms fill before it serves.
TEST(KvPool, OpdRolloutSizesItsPoolFromTheDevice) {
  const fs::path dir = testing_util::TempDir("kv_pool_auto");
  auto model = Load();
  const lm::ModelConfig& c = model->config();
  const int64_t blocks =
      (3 * kGiB - TermsBeforeThePool(*model)) / (lm::plan::KvBytesPerToken(c, 4) * 16) - 1;
  const std::string bin = std::string(OPD_BINARY_DIR) + "/rollout/opd-rollout";
  {
    testing_util::Served s =
        testing_util::StartServed(dir, "auto",
                                  {bin, "--model=" + FixtureDir(), "--threads=1",
                                   "--kv-cache-gb=auto", "--device-memory-gb=3"});
    ASSERT_FALSE(s.address.empty());
    EXPECT_NE(s.process->Log().find(absl::StrCat("paged engine: ", blocks, " KV blocks of 16")),
              std::string::npos)
        << s.process->Log();
    s.process->Stop();
  }
  const double tight = static_cast<double>(TermsBeforeThePool(*model)) / kGiB;
  testing_util::ChildProcess refused(
      {bin, "--model=" + FixtureDir(), "--threads=1", "--listen=127.0.0.1:0",
       absl::StrCat("--device-memory-gb=", tight)},
      (dir / "refused.log").string());
  EXPECT_NE(refused.Wait(std::chrono::seconds(120)), 0);
  EXPECT_NE(refused.Log().find("the memory plan needs"), std::string::npos) << refused.Log();
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Pushes and requests.

const std::vector<std::vector<int32_t>> kPrompts = {{1, 5, 9, 13, 2}, {7, 3}};

SamplingParams Params() {
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 24;
  p.temperature = 1.0;
  p.seed = 11;
  return p;
}

std::vector<Sample> Sorted(std::vector<Sample> out) {
  std::sort(out.begin(), out.end(), [](const Sample& a, const Sample& b) {
    return std::tie(a.prompt_index, a.sample_index) < std::tie(b.prompt_index, b.sample_index);
  });
  return out;
}

// The request sampled alone by an engine over `model` (the reference).
std::vector<Sample> Reference(std::shared_ptr<lm::CausalLM> model) {
  WeightStore store(std::move(model));
  auto engine = Engine::Create(*store.Current().model, EngineOptions{});
  EXPECT_TRUE(engine.ok()) << engine.status();
  std::vector<Sample> out;
  auto snapshot = store.Acquire(absl::InfiniteFuture());
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_TRUE((*engine)
                  ->Generate(
                      *snapshot, kPrompts, Params(), [&](Sample s) { out.push_back(s); }, nullptr)
                  .ok());
  return Sorted(std::move(out));
}

void ExpectSameSamples(const std::vector<Sample>& got, const std::vector<Sample>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
    EXPECT_EQ(got[i].logprobs, want[i].logprobs) << i;  // bitwise: the same fp32 weights
  }
}

absl::Status StageAll(StagedWeights& staged, const testing_util::ModuleWeights& source) {
  for (const auto& t : source.chunks) {
    if (absl::Status st = staged.Add(t); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// A push that arrives while a request decodes: staged in host memory, committed once the request
// ends; the request samples with the old weights to its end, the next one with the new.
TEST(WeightUpdate, PushWhileARequestDecodesWaitsForIt) {
  auto b = LoadB();
  const std::vector<Sample> want_a = Reference(Load()), want_b = Reference(LoadB());
  ASSERT_NE(want_a[0].tokens, want_b[0].tokens);  // the two versions sample differently

  WeightStore store(Load());
  auto engine = Engine::Create(*store.Current().model, EngineOptions{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  absl::Notification decoding, pushed;
  int polls = 0;
  std::vector<Sample> first;
  std::shared_ptr<Engine::Request> req;
  {
    auto snapshot = store.Acquire(absl::InfiniteFuture());
    ASSERT_TRUE(snapshot.ok()) << snapshot.status();
    auto submitted = (*engine)->Submit(
        *snapshot, kPrompts, Params(), [&](Sample s) { first.push_back(std::move(s)); },
        // Polled on the engine thread between iterations: after the prefill and a decode step
        // the engine parks here until the push is in (24 tokens are far from done).
        [&] {
          if (++polls == 3) {
            decoding.Notify();
            pushed.WaitForNotification();
          }
          return false;
        });
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    req = *submitted;
  }  // only the request holds version 0 now
  decoding.WaitForNotification();

  auto staged = store.Stage(1);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_FALSE((*staged)->in_place());
  const auto source = testing_util::WeightsOf(*b);
  ASSERT_TRUE(StageAll(**staged, source).ok());
  int64_t params_bytes = 0;
  for (const auto& p : b->parameters()) params_bytes += p.numel() * 4;
  EXPECT_EQ((*staged)->staged_host_bytes(), params_bytes);
  CommitState state = CommitState::kServing;
  ASSERT_TRUE(store.Commit(std::move(*staged), &state).ok());
  EXPECT_EQ(state, CommitState::kPending);
  EXPECT_EQ(store.accepted_version(), 1);
  EXPECT_EQ(store.Current().version, 0);
  // A new request waits for the commit: with a deadline already passed it is refused.
  auto late = store.Acquire(absl::Now());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable) << late.status();
  EXPECT_NE(late.status().message().find("weight version 1"), std::string::npos) << late.status();
  // A second push while one waits is refused, a stale one says so.
  EXPECT_EQ(store.Stage(2).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store.Stage(1).status().code(), absl::StatusCode::kFailedPrecondition);

  pushed.Notify();
  ASSERT_TRUE(Engine::Wait(*req).ok());
  req.reset();
  ExpectSameSamples(Sorted(first), want_a);

  auto next = store.Acquire(absl::InfiniteFuture());  // waits for the commit thread
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->version, 1);
  ExpectHolds(store, *b);
  std::vector<Sample> second;
  ASSERT_TRUE(
      (*engine)
          ->Generate(
              *next, kPrompts, Params(), [&](Sample s) { second.push_back(std::move(s)); }, nullptr)
          .ok());
  ExpectSameSamples(Sorted(second), want_b);
}

// Nothing holds the weights: an update goes straight into the serving model (no staging), and
// requests wait for it; a failed one damages the store until every tensor is sent again.
TEST(WeightUpdate, InPlaceWhenIdleAndDamageUntilAFullUpdate) {
  auto a = Load();
  auto b = LoadB();
  const auto source_b = testing_util::WeightsOf(*b);
  std::vector<WireTensor> all;
  for (WireTensor t : source_b.chunks) {
    t.checksum = opd::rpc::Xxh64::Of(t.data.data(), t.data.size());
    all.push_back(t);
  }
  WeightStore store(a);
  {
    std::optional<Snapshot> held = store.Current();
    auto busy = store.StageInPlace(1, testing_util::ManifestOf(all));
    EXPECT_EQ(busy.status().code(), absl::StatusCode::kFailedPrecondition) << busy.status();
    EXPECT_NE(busy.status().message().find("in use"), std::string::npos) << busy.status();
  }
  auto staged = store.StageInPlace(1, testing_util::ManifestOf(all));
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_TRUE((*staged)->in_place());
  EXPECT_EQ(store.Acquire(absl::Now()).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(StageAll(**staged, source_b).ok());
  EXPECT_EQ((*staged)->staged_host_bytes(), 0);
  ASSERT_TRUE(store.Commit(std::move(*staged)).ok());
  auto now = store.Acquire(absl::InfiniteFuture());
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->version, 1);
  EXPECT_EQ(now->model, a);
  ExpectHolds(store, *b);
  now = absl::UnavailableError("released");

  // Half an update written in place, then dropped: damaged, requests refused naming it; an update
  // of some tensors is refused; one of every tensor repairs it.
  auto c = Load();
  c->InitWeights(0.1, 7);
  const auto source_c = testing_util::WeightsOf(*c);
  std::vector<WireTensor> unchecked = all;
  for (auto& t : unchecked) t.checksum.reset();
  {
    auto half = store.StageInPlace(2, testing_util::ManifestOf(unchecked));
    ASSERT_TRUE(half.ok()) << half.status();
    for (size_t i = 0; i < source_c.chunks.size() / 2; ++i)
      ASSERT_TRUE((*half)->Add(source_c.chunks[i]).ok());
  }
  EXPECT_EQ(store.damage().code(), absl::StatusCode::kFailedPrecondition);
  auto refused = store.Acquire(absl::InfiniteFuture());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("weight version 2"), std::string::npos)
      << refused.status();
  EXPECT_EQ(store.StageAnnounced(2, testing_util::ManifestOf({all[0]})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto full = store.Stage(2);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_TRUE(StageAll(**full, source_c).ok());
  ASSERT_TRUE(store.Commit(std::move(*full)).ok());
  EXPECT_TRUE(store.damage().ok());
  auto repaired = store.Acquire(absl::InfiniteFuture());
  ASSERT_TRUE(repaired.ok()) << repaired.status();
  EXPECT_EQ(repaired->version, 2);
  ExpectHolds(store, *c);
}

// On a CUDA model: an in-place update from device bytes (copies on the current stream, one
// finiteness read for the whole update) and a host-staged one (page-locked, copied into place on
// a side stream when the last snapshot ends) both leave the weights bit for bit. Skips without
// CUDA; fails under OPD_REQUIRE_GPU=1.
TEST(WeightUpdateGpu, InPlaceAndHostStagedOnCuda) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  auto a = Load();
  a->to(cuda, torch::kBFloat16);
  auto b = LoadB();
  std::vector<WireTensor> all;
  for (const auto& p : b->named_parameters()) {
    WireTensor t;
    t.name = p.key();
    t.shape = p.value().sizes().vec();
    t.dtype = opd::rpc::WireDtype::kBFloat16;  // no checksum: device bytes carry none
    all.push_back(t);
  }
  WeightStore store(a);
  auto in_place = store.StageInPlace(1, testing_util::ManifestOf(all));
  ASSERT_TRUE(in_place.ok()) << in_place.status();
  for (const auto& p : b->named_parameters()) {
    torch::Tensor bytes =
        p.value().to(torch::kBFloat16).contiguous().reshape({-1}).view(torch::kUInt8).to(cuda);
    const int64_t half = bytes.numel() / 2;  // two pieces, as across buckets
    ASSERT_TRUE((*in_place)->AddDeviceBytes(p.key(), 0, bytes.narrow(0, 0, half)).ok());
    ASSERT_TRUE((*in_place)
                    ->AddDeviceBytes(p.key(), half, bytes.narrow(0, half, bytes.numel() - half))
                    .ok());
  }
  ASSERT_TRUE(store.Commit(std::move(*in_place)).ok());
  auto served = store.Current().model->named_parameters();
  for (const auto& p : b->named_parameters())
    EXPECT_TRUE(torch::equal(served[p.key()].cpu(), p.value().to(torch::kBFloat16))) << p.key();

  auto c = Load();
  c->InitWeights(0.1, 9);
  std::optional<Snapshot> held = store.Current();
  auto staged = store.Stage(2);
  ASSERT_TRUE(staged.ok()) << staged.status();
  const auto source = testing_util::WeightsOf(*c);  // fp32 on the wire, cast on the host
  ASSERT_TRUE(StageAll(**staged, source).ok());
  CommitState state = CommitState::kServing;
  ASSERT_TRUE(store.Commit(std::move(*staged), &state).ok());
  EXPECT_EQ(state, CommitState::kPending);
  held.reset();
  auto now = store.Acquire(absl::InfiniteFuture());
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->version, 2);
  served = now->model->named_parameters();
  for (const auto& p : c->named_parameters())
    EXPECT_TRUE(torch::equal(served[p.key()].cpu(), p.value().to(torch::kBFloat16))) << p.key();
}

}  // namespace
}  // namespace rollout
