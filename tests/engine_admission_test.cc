// The generators at the paper's size (issue 37 items 1 and 6), on the tiny fixtures:
//   - admission, not refusal: a request whose summed KV cache is 20 pools completes through the
//     paged engine, with the samples the same sequences get in small requests; the static sampler
//     runs a large request in batches that fit its cache; only a sequence that could never fit is
//     RESOURCE_EXHAUSTED, naming its prompt;
//   - seed indices: a prompt sent alone with seed index 7 draws what it draws at position 7;
//   - chunked prefill: prompts prefilled in chunks of the step's token budget give the static
//     sampler's samples on every engine fixture, a long prompt's chunks run between the decode
//     steps of the sequences already running, and the recompute of a 10k-token sequence stays
//     within a peak of tensor memory linear in the chunk and the context (no mask, no
//     quadratic score matrix), measured by LibTorch's allocation reports.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <random>

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/synchronization/mutex.h"
#include "lm/generate/sampler.h"
#include "lm/model/model.h"
#include "rollout/engine.h"
#include "tests/engine_testing.h"
#include "tests/fixture_names.h"
#include "tests/testing.h"

namespace rollout {
namespace {

using engine_testing::ExpectSameSamples;
using engine_testing::kPrompts;
using engine_testing::Load;
using engine_testing::MakeEngine;
using engine_testing::RunEngine;
using engine_testing::SortSamples;
using engine_testing::Static;
using lm::Sample;
using lm::SamplingParams;

std::vector<std::vector<int32_t>> RandomPrompts(int n, int64_t min_len, int64_t max_len,
                                                uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prompts(n);
  for (auto& p : prompts) {
    p.resize(min_len + rng() % (max_len - min_len + 1));
    for (auto& t : p) t = rng() % 96;
  }
  return prompts;
}

// --- admission ---

// 40 prompts x 2 samples of up to 12 + 60 tokens in a pool of 16 blocks of 16 tokens: the
// request's sequences need 20x the pool at once (each fits it alone), so the engine queues,
// preempts and recomputes them; every sample equals that of its prompt sent alone (one prompt a
// request, which never preempts) with its seed index. Tokens and finish reasons are the same
// bits. Log-probs are not: a recomputed sequence's keys and values come from a prefill instead of
// the decode steps that first made them (another fp32 summation order), so they agree to
// rounding, 1e-4 at most (fp32 logits of a few units, relative error ~1e-6 after two layers).
TEST(Admission, RequestOfTwentyPoolsCompletesWithTheSamplesOfSmallRequests) {
  auto model = Load();
  const int64_t usable = 16, block = 16;
  const auto prompts = RandomPrompts(40, 5, 12, 3);
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 60;
  p.temperature = 1.0;
  p.seed = 5;
  int64_t kv_tokens = 0;
  for (const auto& pr : prompts)
    kv_tokens += p.samples_per_prompt * (static_cast<int64_t>(pr.size()) + p.max_new_tokens);
  ASSERT_GE(kv_tokens, 20 * usable * block);

  auto big = MakeEngine(*model, usable + 1);
  const auto got = RunEngine(*big, model, prompts, p);
  ASSERT_EQ(got.size(), prompts.size() * 2);
  const EngineStats st = big->stats();
  EXPECT_GT(st.preemptions, 0);
  EXPECT_LE(st.peak_used_blocks, usable);

  auto small = MakeEngine(*model, usable + 1);
  std::vector<Sample> want;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SamplingParams one = p;
    one.seed_indices = {static_cast<int64_t>(i)};
    for (Sample s : RunEngine(*small, model, {prompts[i]}, one)) {
      EXPECT_EQ(s.prompt_index, 0);  // the position in its own request
      s.prompt_index = static_cast<int64_t>(i);
      want.push_back(std::move(s));
    }
  }
  EXPECT_EQ(small->stats().preemptions, 0);
  SortSamples(want);
  ExpectSameSamples(got, want, 1e-4);
  int64_t same_bits = 0, logprobs = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    for (size_t t = 0; t < std::min(got[i].logprobs.size(), want[i].logprobs.size()); ++t)
      same_bits += got[i].logprobs[t] == want[i].logprobs[t];
    logprobs += static_cast<int64_t>(got[i].logprobs.size());
  }
  std::printf("20 pools: %lld sequences, %lld preemptions, %lld of %lld log-probs bit-equal\n",
              static_cast<long long>(got.size()), static_cast<long long>(st.preemptions),
              static_cast<long long>(same_bits), static_cast<long long>(logprobs));
}

// A prompt's samples are keyed by its seed index, not its position: sent alone with seed index 7
// it draws what it draws at position 7 of a request without seed indices, on the engine and on
// the static sampler; its samples still name position 0 of their own request.
TEST(Admission, SeedIndexKeysAPromptWhateverItsPosition) {
  auto model = Load();
  auto engine = MakeEngine(*model, 64);
  const auto prompts = RandomPrompts(8, 3, 9, 11);
  SamplingParams p;
  p.samples_per_prompt = 3;
  p.max_new_tokens = 20;
  p.seed = 77;
  SamplingParams alone = p;
  alone.seed_indices = {7};
  for (bool paged : {true, false}) {
    SCOPED_TRACE(paged ? "engine" : "static sampler");
    auto run = [&](const std::vector<std::vector<int32_t>>& ps, const SamplingParams& sp) {
      return paged ? RunEngine(*engine, model, ps, sp) : Static(*model, ps, sp);
    };
    const auto all = run(prompts, p);
    auto one = run({prompts[7]}, alone);
    ASSERT_EQ(one.size(), 3u);
    for (Sample& s : one) {
      EXPECT_EQ(s.prompt_index, 0);
      s.prompt_index = 7;
    }
    const std::vector<Sample> at7(all.begin() + 7 * 3, all.begin() + 8 * 3);
    ExpectSameSamples(one, at7);
    // Without its seed index the prompt draws as position 0: other tokens.
    const auto unkeyed = run({prompts[7]}, p);
    EXPECT_NE(unkeyed[0].tokens, at7[0].tokens);
  }
}

// The static sampler (and so the expert-parallel rollout, which runs it on every rank) bounds
// one batch's contiguous cache instead of refusing a large request: 12 prompts in batches whose
// cache fits (3 prompts of 10 tokens, hand arithmetic) give the samples of one batch; one prompt
// whose samples alone need more than the bound is RESOURCE_EXHAUSTED naming it, before anything is
// sampled.
TEST(Admission, StaticSamplerRunsALargeRequestInBatchesThatFitItsCache) {
  auto model = Load();
  const auto prompts = RandomPrompts(12, 2, 10, 4);
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 16;
  p.seed = 3;
  const lm::StaticCacheCost cost = lm::StaticCacheCostOf(*model);
  // Keys and values of 2 layers x 2 KV heads x 16 dims in fp32, no recurrent state.
  EXPECT_EQ(cost.bytes_per_token, 2 * 2 * 2 * 16 * 4);
  EXPECT_EQ(cost.bytes_per_slot, 0);
  // 3 prompts of up to 10 tokens: (1 + 2) x 3 slots of 10 + 16 tokens.
  const int64_t budget = cost.BatchBytes(3, 10, p);
  EXPECT_EQ(budget, 9 * 26 * 512);
  auto batches = lm::PlanStaticBatches(prompts, p, cost, budget);
  ASSERT_TRUE(batches.ok()) << batches.status();
  EXPECT_GE(batches->size(), 3u);  // 12 prompts of 2 to 10 tokens: at most 4 fit a batch
  int64_t next = 0;
  for (auto [b, e] : *batches) {
    EXPECT_EQ(b, next);
    int64_t longest = 0;
    for (int64_t i = b; i < e; ++i)
      longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts[i].size()));
    EXPECT_LE(cost.BatchBytes(e - b, longest, p), budget);
    next = e;
  }
  EXPECT_EQ(next, 12);
  ExpectSameSamples(Static(*model, prompts, p, budget), Static(*model, prompts, p));

  int samples = 0;
  auto st = lm::SampleResponses(
      *model, {{1, 2}, std::vector<int32_t>(30, 5)}, p, [&](Sample) { ++samples; }, nullptr,
      nullptr, cost.BatchBytes(1, 20, p));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kResourceExhausted) << st.status();
  EXPECT_NE(std::string(st.status().message()).find("prompt 1: 30 tokens"), std::string::npos)
      << st.status();
  EXPECT_EQ(samples, 0);
}

// --- chunked prefill ---

// Prompts of 2 to 40 tokens prefilled 7 tokens a step (so most in several chunks, some sharing a
// step): on every Qwen3-MoE engine fixture, greedy and sampled, the static sampler's samples.
TEST(ChunkedPrefill, SamplesEqualTheStaticSamplerOnEveryFixture) {
  for (const std::string& fixture : testing_util::MoeFixtureNames()) {
    auto model = Load(fixture);
    if (!model->SupportsPagedKV()) continue;
    SCOPED_TRACE(fixture);
    auto prompts = RandomPrompts(6, 2, 40, 8);
    prompts.insert(prompts.end(), kPrompts.begin(), kPrompts.end());
    for (auto& pr : prompts)
      for (auto& t : pr) t %= model->config().vocab_size;
    auto engine = MakeEngine(*model, 128, 256, 64, /*max_prefill_tokens=*/7);
    for (double temperature : {0.0, 1.0}) {
      SamplingParams p;
      p.samples_per_prompt = 2;
      p.max_new_tokens = 12;
      p.temperature = temperature;
      p.seed = 17;
      ExpectSameSamples(RunEngine(*engine, model, prompts, p), Static(*model, prompts, p));
    }
    const EngineStats st = engine->stats();
    EXPECT_LE(st.largest_prefill_step, 7);
    EXPECT_GT(st.partial_prefills, 0);
  }
}

// A long prompt arrives while a short request decodes: its 600 tokens are prefilled 64 a step,
// and the short request's sequence decodes between the chunks, finishing before the long
// prompt's prefill has (the counters it sees when it finishes are the previous iteration's).
TEST(ChunkedPrefill, LongPromptIsPrefilledBetweenDecodeSteps) {
  auto model = Load();
  auto engine = MakeEngine(*model, 64, 256, 64, /*max_prefill_tokens=*/64);
  SamplingParams shortp;
  shortp.max_new_tokens = 4;
  SamplingParams longp;
  longp.max_new_tokens = 2;
  const std::vector<int32_t> long_prompt(600, 9);
  std::atomic<int64_t> prefilled_when_short_finished{-1};
  engine->Pause();
  auto a = engine->Submit(Snapshot{model, 0, nullptr}, {{4, 5, 6}}, shortp, [&](Sample) {
    prefilled_when_short_finished = engine->stats().prefill_tokens;
  });
  auto b = engine->Submit(Snapshot{model, 0, nullptr}, {long_prompt}, longp, [](Sample) {});
  ASSERT_TRUE(a.ok() && b.ok());
  engine->Resume();
  ASSERT_TRUE(Engine::Wait(**a).ok());
  ASSERT_TRUE(Engine::Wait(**b).ok());
  EXPECT_GE(prefilled_when_short_finished.load(), 0);
  EXPECT_LT(prefilled_when_short_finished.load(), 3 + 600);
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.prefill_tokens, 3 + 600);
  EXPECT_EQ(st.largest_prefill_step, 64);
  EXPECT_EQ(st.prefill_steps, (3 + 600 + 63) / 64);
  EXPECT_EQ(st.partial_prefills, st.prefill_steps - 1);
  // A step that could feed nothing would never finish a prefill: refused.
  EngineOptions o;
  o.max_prefill_tokens = 0;
  EXPECT_EQ(Engine::Create(*model, o).status().code(), absl::StatusCode::kInvalidArgument);
}

// The live total and its peak of the CPU tensor memory LibTorch allocates on the threads that
// carry this reporter (the creating thread's debug info, which the engine thread inherits).
class AllocationProbe final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device device) override {
    if (!device.is_cpu()) return;
    absl::MutexLock lock(&mu_);
    live_ += alloc_size;
    peak_ = std::max(peak_, live_);
  }
  bool memoryProfilingEnabled() const override { return true; }
  // Restarts the peak from what is live now; returns that.
  int64_t Mark() {
    absl::MutexLock lock(&mu_);
    peak_ = live_;
    return live_;
  }
  int64_t peak() {
    absl::MutexLock lock(&mu_);
    return peak_;
  }

 private:
  absl::Mutex mu_;
  int64_t live_ = 0, peak_ = 0;
};

// A 9,984-token prompt preempted after a few tokens by an older sequence's growth, then
// recomputed whole (10k tokens) once that one finishes, 2,048 tokens a step. The tensor memory of
// the whole run (the pool aside) stays within a bound linear in the chunk and the context.
//
// The bound, 4 bytes a value (fp32; the fixture: H = 48 hidden, Hq = 4 and Hkv = 2 heads of D = 16,
// E = 16 experts, top-8): a layer of a chunk of n tokens after c of context holds per token its
// hidden state and norm (2H), the rope tables (2D), q, its rotation and the attention outputs of
// both parts with their fp32 merge (8 Hq D), k and v (2 Hkv D), the router's logits (E) and
// top-k weights and ids (3k); per context token its gathered keys and values (2 Hkv D) and pool
// row (8 bytes); and one flash tile (256 x 512). For n = 2048, c = 10000 that is 9.2 MiB (7.3
// measured); the test allows 1.5x of it, as kernel choices vary with the CPU. Prefilled whole
// (n = 10k) the same run peaks at 23 MiB; with the [B, 1, Q, L] mask of before, the mask of the
// recompute alone was 95 MiB (and 4x that in the fp32 form SDPA takes).
TEST(ChunkedPrefill, RecomputeOfA10kTokenSequenceStaysWithinItsMemoryBound) {
  auto model = Load();
  const lm::ModelConfig& c = model->config();
  const int64_t n = 2048, ctx = 10000, H = c.hidden_size, Hq = c.num_attention_heads,
                Hkv = c.num_key_value_heads, D = c.head_dim, E = c.num_experts,
                k = c.num_experts_per_tok;
  const int64_t per_token = 4 * (2 * H + 2 * D + 8 * Hq * D + 2 * Hkv * D + E + 3 * k);
  const int64_t per_context = 4 * 2 * Hkv * D + 8;
  const int64_t bound = (n * per_token + ctx * per_context + 4 * 256 * 512) * 3 / 2;

  auto probe = std::make_shared<AllocationProbe>();
  c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, probe);
  // 627 blocks of 16: the long sequence (624 blocks of prompt, at most 625 in all) and the short
  // one's first block fit together, with one block to spare for the short one's growth.
  auto engine = MakeEngine(*model, 627, 256, 64, /*max_prefill_tokens=*/n);
  const int64_t baseline = probe->Mark();
  SamplingParams grow;  // the older sequence: 16 tokens of prompt, 200 new
  grow.max_new_tokens = 200;
  SamplingParams longp;
  longp.max_new_tokens = 16;
  std::vector<int32_t> long_prompt(9984);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = (i * 31) % 96;
  engine->Pause();
  auto a = engine->Submit(Snapshot{model, 0, nullptr}, {std::vector<int32_t>(16, 3)}, grow,
                          [](Sample) {});
  auto b = engine->Submit(Snapshot{model, 0, nullptr}, {long_prompt}, longp,
                          [](Sample s) { EXPECT_EQ(s.response_length(), 16); });
  ASSERT_TRUE(a.ok() && b.ok());
  engine->Resume();
  ASSERT_TRUE(Engine::Wait(**a).ok());
  ASSERT_TRUE(Engine::Wait(**b).ok());
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.preemptions, 1);
  // The prompt's first prefill, then the recompute of the prompt and what it had drawn.
  EXPECT_GT(st.prefill_tokens, 16 + 2 * 9984);
  EXPECT_LE(st.largest_prefill_step, n);
  const int64_t peak = probe->peak() - baseline;
  std::printf("10k-token recompute: peak %.1f MiB of tensors above the pool, bound %.1f MiB\n",
              peak / 1048576.0, bound / 1048576.0);
  EXPECT_GE(peak, ctx * 2 * Hkv * D * 4);  // the probe saw the engine thread's gathered context
  EXPECT_LE(peak, bound);
}

}  // namespace
}  // namespace rollout
