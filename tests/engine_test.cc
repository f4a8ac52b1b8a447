// The rollout engine (rollout/engine.h) and the paged KV cache it runs on (lm/model/paged_kv.h):
// paged attention equals the contiguous cache's (prefills, decodes and chunks after a context in
// one step, fp32 and bf16, no mask built); a model's paged steps, chunked or not, equal its full
// forward; the engine's samples equal the static sampler's (greedy, sampled, filtered;
// in-process and through the gRPC service), with and without preemption; the pool stays within
// its budget; the batch stays full under a long tail; the samples of a prompt share its blocks; a
// full queue and a request that cannot fit are refused; cancellation. Admission of large
// requests, chunked prefill and seed indices: tests/engine_admission_test.cc. Models: the tiny
// random fixtures; GPU cases (bf16 and fp32 on CUDA) skip without one.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/generate/sampler.h"
#include "lm/model/model.h"
#include "lm/model/paged_kv.h"
#include "rollout/engine.h"
#include "rollout/service.h"
#include "rollout/weights.h"
#include "rpc/auth.h"
#include "rpc/codec.h"
#include "tests/engine_testing.h"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"

using testing_util::MaxAbsDiff;
using testing_util::ResponseIds;

namespace rollout {

// The generation types and the sampler (lm/generate) the rollout code here builds on.
using lm::FinishReason;
using lm::Sample;
using lm::SampleResponses;
using lm::SamplingParams;
namespace {

using engine_testing::ExpectSameSamples;
using engine_testing::kModel;
using engine_testing::kPrompts;
using engine_testing::Load;
using engine_testing::MakeEngine;
using engine_testing::RunEngine;
using engine_testing::SortSamples;
using engine_testing::Static;

// --- paged attention against the contiguous cache ---

// Sequences with random lengths in a pool whose blocks are handed out shuffled; `context` of each
// sequence's tokens cached before, the rest new. Returns the step and fills the pools.
struct PagedCase {
  lm::PagedStep step;
  torch::Tensor k_pool, v_pool;
  std::vector<torch::Tensor> k_full, v_full;  // per sequence [len, Hkv, D]
};

PagedCase MakeCase(const std::vector<std::pair<int64_t, int64_t>>& ctx_new, int64_t block_size,
                   int64_t hkv, int64_t d, torch::TensorOptions opts) {
  PagedCase c;
  int64_t blocks = 1;
  for (auto [ctx, n] : ctx_new) blocks += (ctx + n + block_size - 1) / block_size;
  std::vector<int32_t> ids(blocks - 1);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
  c.k_pool = torch::randn({blocks, block_size, hkv, d}, opts);  // garbage everywhere...
  c.v_pool = torch::randn({blocks, block_size, hkv, d}, opts);
  c.k_pool[0].zero_();  // ...but the null block
  c.v_pool[0].zero_();
  size_t next = 0;
  c.step.cu_seqlens.push_back(0);
  for (auto [ctx, n] : ctx_new) {
    const int64_t len = ctx + n;
    std::vector<int32_t> table;
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) table.push_back(ids[next++]);
    auto k = torch::randn({len, hkv, d}, opts), v = torch::randn({len, hkv, d}, opts);
    for (int64_t t = 0; t < ctx; ++t) {  // the context is in the pool already
      c.k_pool[table[t / block_size]][t % block_size].copy_(k[t]);
      c.v_pool[table[t / block_size]][t % block_size].copy_(v[t]);
    }
    c.k_full.push_back(k);
    c.v_full.push_back(v);
    c.step.block_tables.push_back(table);
    c.step.context_lens.push_back(ctx);
    c.step.cu_seqlens.push_back(c.step.cu_seqlens.back() + n);
  }
  return c;
}

// New tokens' k/v, concatenated [T, Hkv, D].
std::pair<torch::Tensor, torch::Tensor> NewKV(const PagedCase& c) {
  std::vector<torch::Tensor> k, v;
  for (size_t b = 0; b < c.k_full.size(); ++b) {
    const int64_t ctx = c.step.context_lens[b];
    k.push_back(c.k_full[b].narrow(0, ctx, c.k_full[b].size(0) - ctx));
    v.push_back(c.v_full[b].narrow(0, ctx, c.v_full[b].size(0) - ctx));
  }
  return {torch::cat(k), torch::cat(v)};
}

void CheckPagedAttention(torch::TensorOptions opts, double tol) {
  torch::manual_seed(0);
  const int64_t hq = 4, hkv = 2, d = 8, bs = 4;
  const double scale = 1.0 / std::sqrt(double(d));
  {
    // Prefill (context 0): equals VarlenCausalAttention over the packed batch.
    auto c = MakeCase({{0, 7}, {0, 1}, {0, 13}, {0, 4}}, bs, hkv, d, opts);
    auto [k, v] = NewKV(c);
    auto q = torch::randn({c.step.num_tokens(), hq, d}, opts);
    auto meta = lm::BuildPagedAttentionMeta(c.step, bs, q.device());
    lm::WritePagedKV(c.k_pool, c.v_pool, k, v, meta);
    auto got = lm::PagedAttention(q, k, v, c.k_pool, c.v_pool, meta, scale);
    auto want = lm::VarlenCausalAttention(q, k, v, c.step.cu_seqlens, scale);
    EXPECT_LE((got - want).abs().max().item<double>(), tol);
  }
  {
    // Decode (one token after a context): equals CachedAttention over a contiguous cache.
    const std::vector<std::pair<int64_t, int64_t>> shape = {{5, 1}, {12, 1}, {1, 1}, {16, 1}};
    auto c = MakeCase(shape, bs, hkv, d, opts);
    auto [k, v] = NewKV(c);
    auto q = torch::randn({4, hq, d}, opts);
    auto meta = lm::BuildPagedAttentionMeta(c.step, bs, q.device());
    lm::WritePagedKV(c.k_pool, c.v_pool, k, v, meta);
    auto got = lm::PagedAttention(q, k, v, c.k_pool, c.v_pool, meta, scale);
    auto kc = torch::zeros({4, 20, hkv, d}, opts), vc = torch::zeros({4, 20, hkv, d}, opts);
    std::vector<int64_t> visible;
    for (int b = 0; b < 4; ++b) {
      const int64_t len = c.k_full[b].size(0);
      kc[b].narrow(0, 0, len).copy_(c.k_full[b]);
      vc[b].narrow(0, 0, len).copy_(c.v_full[b]);
      visible.push_back(len);
    }
    auto want = lm::CachedAttention(q, kc, vc, visible, scale);
    EXPECT_LE((got - want).abs().max().item<double>(), tol);
  }
  {
    // Several new tokens after a context (a chunk of a long prompt or of a recompute), with
    // prefills and a decode row in the same step: each new token's row of the causal attention
    // over its whole sequence.
    auto c = MakeCase({{6, 3}, {0, 2}, {9, 1}, {45, 17}, {0, 30}, {3, 40}}, bs, hkv, d, opts);
    auto [k, v] = NewKV(c);
    auto q_full = std::vector<torch::Tensor>{};
    std::vector<torch::Tensor> q_new, want;
    for (size_t b = 0; b < c.k_full.size(); ++b) {
      const int64_t len = c.k_full[b].size(0), ctx = c.step.context_lens[b];
      auto qf = torch::randn({len, hq, d}, opts);
      q_new.push_back(qf.narrow(0, ctx, len - ctx));
      auto full = lm::VarlenCausalAttention(qf, c.k_full[b], c.v_full[b], {0, len}, scale);
      want.push_back(full.narrow(0, ctx, len - ctx));
    }
    auto q = torch::cat(q_new);
    auto meta = lm::BuildPagedAttentionMeta(c.step, bs, q.device());
    lm::WritePagedKV(c.k_pool, c.v_pool, k, v, meta);
    auto got = lm::PagedAttention(q, k, v, c.k_pool, c.v_pool, meta, scale);
    EXPECT_LE((got - torch::cat(want)).abs().max().item<double>(), tol);
  }
}

TEST(PagedKV, AttentionThroughBlockTablesEqualsContiguousCache) {
  CheckPagedAttention(torch::TensorOptions().dtype(torch::kFloat32), 1e-5);
}

// bf16 on the CPU: the flash kernel accumulates in fp32 and the continued rows merge in fp32, so
// the two paths differ by the bf16 rounding of their outputs (a few units of 2^-8).
TEST(PagedKV, AttentionInBf16OnCpu) {
  CheckPagedAttention(torch::TensorOptions().dtype(torch::kBFloat16), 3e-2);
}

// CUDA: FlashAttention-2 varlen for bf16, the memory-efficient varlen kernel for fp32, both
// causal from the bottom right over the gathered keys.
TEST(PagedKV, AttentionOnCudaInBf16) {
  SKIP_WITHOUT_CUDA();
  CheckPagedAttention(torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA), 3e-2);
}

TEST(PagedKV, AttentionOnCudaInFp32) {
  SKIP_WITHOUT_CUDA();
  CheckPagedAttention(torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA), 1e-4);
}

// A step other than decode builds the varlen indices of its device only: the CPU's context rows
// (none when no sequence has a context), never a mask: host memory O(tokens), not O(B Q L).
TEST(PagedKV, PrefillMetaHoldsRowsNotAMask) {
  lm::PagedStep step;
  step.cu_seqlens = {0, 5, 9};
  step.context_lens = {0, 7};
  step.block_tables = {{3, 1}, {2, 4, 5}};
  const auto meta = lm::BuildPagedAttentionMeta(step, 4, torch::kCPU);
  EXPECT_FALSE(meta.decode);
  EXPECT_FALSE(meta.all_fresh);
  ASSERT_TRUE(meta.context_rows.defined());
  // Sequence 1's context: positions 0..6, rows of blocks 2 (0..3) then 4 (4..6).
  EXPECT_EQ(meta.context_rows.numel(), 7);
  EXPECT_EQ(meta.context_rows[0].item<int64_t>(), 2 * 4);
  EXPECT_EQ(meta.context_rows[6].item<int64_t>(), 4 * 4 + 2);
  EXPECT_FALSE(meta.key_rows.defined());  // CUDA's
  step.context_lens = {0, 0};
  EXPECT_FALSE(lm::BuildPagedAttentionMeta(step, 4, torch::kCPU).context_rows.defined());
}

// A prompt's paged prefill and decode steps give the hidden states of a full forward.
TEST(PagedKV, ModelStepsEqualFullForward) {
  for (const char* fixture : {kModel, "moe_mlp_only_gqa4"}) {
    auto model = Load(fixture);
    torch::NoGradGuard no_grad;
    const std::vector<int64_t> seq = {3, 8, 1, 30, 22, 5, 9, 11, 2, 60, 7, 7, 19};
    auto full = model->Forward(lm::PackedBatch::FromSequences({seq}));
    auto cache = model->NewPagedKVCache(8, 4, 1);
    std::vector<int32_t> table = {5, 2, 7, 1};  // any blocks, in any order
    lm::PagedStep step;
    step.input_ids = torch::tensor(std::vector<int64_t>(seq.begin(), seq.begin() + 6));
    step.cu_seqlens = {0, 6};
    step.context_lens = {0};
    step.block_tables = {table};
    step.state_slots = {0};
    auto h = model->PagedForward(step, cache);
    EXPECT_LE((h[0] - full[5]).abs().max().item<double>(), 1e-5) << fixture;
    // The same prompt prefilled in chunks of 2, 3 and 1 tokens (into other blocks).
    auto chunked = model->NewPagedKVCache(8, 4, 1);
    lm::PagedStep part = step;
    part.block_tables = {{6, 3}};
    for (auto [from, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 3}, {5, 1}}) {
      part.input_ids =
          torch::tensor(std::vector<int64_t>(seq.begin() + from, seq.begin() + from + n));
      part.cu_seqlens = {0, n};
      part.context_lens = {from};
      auto hc = model->PagedForward(part, chunked);
      EXPECT_LE((hc[0] - full[from + n - 1]).abs().max().item<double>(), 1e-5)
          << fixture << " chunk at " << from;
    }
    for (int64_t t = 6; t < static_cast<int64_t>(seq.size()); ++t) {
      step.input_ids = torch::tensor({seq[t]});
      step.cu_seqlens = {0, 1};
      step.context_lens = {t};
      h = model->PagedForward(step, cache);
      EXPECT_LE((h[0] - full[t]).abs().max().item<double>(), 1e-5) << fixture << " token " << t;
    }
  }
}

// --- the engine against the static sampler ---

TEST(Engine, SameSamplesAsTheStaticSampler) {
  auto model = Load();
  auto engine = MakeEngine(*model, 64);
  struct Case {
    double temperature;
    int64_t top_k;
    double top_p;
  };
  for (Case c : {Case{0, 0, 1.0}, Case{1.0, 0, 1.0}, Case{0.7, 0, 1.0}, Case{1.2, 10, 0.9}}) {
    SamplingParams p;
    p.samples_per_prompt = 2;
    p.max_new_tokens = 24;
    p.temperature = c.temperature;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.seed = 11;
    SCOPED_TRACE(testing::Message() << "temperature " << c.temperature << " top_k " << c.top_k);
    ExpectSameSamples(RunEngine(*engine, model, kPrompts, p), Static(*model, kPrompts, p));
  }
  // Stop ids end a sample as in the static sampler.
  SamplingParams p;
  p.samples_per_prompt = 3;
  p.max_new_tokens = 30;
  p.seed = 4;
  p.stop_ids = {7, 50, 81};
  auto got = RunEngine(*engine, model, kPrompts, p);
  ExpectSameSamples(got, Static(*model, kPrompts, p));
  EXPECT_TRUE(std::any_of(got.begin(), got.end(),
                          [](const Sample& s) { return s.finish == FinishReason::kStop; }));
}

// Requests queued together run in one batch, and each still gets its own samples.
TEST(Engine, ConcurrentRequestsGetTheirOwnSamples) {
  auto model = Load();
  auto engine = MakeEngine(*model, 64);
  std::vector<SamplingParams> params(3);
  for (int i = 0; i < 3; ++i) {
    params[i].samples_per_prompt = 2;
    params[i].max_new_tokens = 10 + 5 * i;
    params[i].temperature = i == 0 ? 0.0 : 1.0;
    params[i].seed = 100 + i;
  }
  std::vector<std::vector<Sample>> out(3);
  std::vector<std::shared_ptr<Engine::Request>> reqs;
  engine->Pause();
  for (int i = 0; i < 3; ++i) {
    auto r = engine->Submit(Snapshot{model, 0, nullptr}, kPrompts, params[i],
                            [&out, i](Sample s) { out[i].push_back(std::move(s)); });
    ASSERT_TRUE(r.ok()) << r.status();
    reqs.push_back(*r);
  }
  engine->Resume();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(Engine::Wait(*reqs[i]).ok());
    SortSamples(out[i]);
    ExpectSameSamples(out[i], Static(*model, kPrompts, params[i]));
  }
  // All 18 sequences decoded together: one prefill, and one decode step per token of the longest.
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.prefill_steps, 1);
  EXPECT_EQ(st.decode_steps, 20 - 1);
}

// Fair admission, on the order samples finish: two seats, a large request of 30 prompts queued
// before a small one of 2 (both while the engine is paused), every sample the same length (no
// stop ids). The small request's prompts are interleaved with the large one's, so both of its
// samples are among the first 4 to finish; first in, first out they came after all 30.
TEST(Engine, SmallRequestIsAdmittedBetweenALargeOnesPrompts) {
  auto model = Load();
  auto engine = MakeEngine(*model, 64, /*max_running=*/2);
  SamplingParams p;
  p.max_new_tokens = 4;
  p.temperature = 1.0;
  p.seed = 9;
  std::vector<int> order;  // 0: the large request's sample, 1: the small one's (engine thread)
  engine->Pause();
  auto large =
      engine->Submit(Snapshot{model, 0, nullptr}, std::vector<std::vector<int32_t>>(30, {1, 5, 9}),
                     p, [&order](Sample) { order.push_back(0); });
  auto small = engine->Submit(Snapshot{model, 0, nullptr}, {{7, 3}, {40, 41}}, p,
                              [&order](Sample) { order.push_back(1); });
  ASSERT_TRUE(large.ok() && small.ok());
  engine->Resume();
  ASSERT_TRUE(Engine::Wait(**large).ok());
  ASSERT_TRUE(Engine::Wait(**small).ok());
  ASSERT_EQ(order.size(), 32u);
  const auto first4 = std::vector<int>(order.begin(), order.begin() + 4);
  EXPECT_EQ(std::count(first4.begin(), first4.end(), 1), 2) << ::testing::PrintToString(order);
}

// A pool too small for all sequences at once: the youngest are preempted and recomputed, and the
// samples are those of an engine that never preempts.
TEST(Engine, PreemptionGivesTheSameSamples) {
  auto model = Load();
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 40;
  p.seed = 8;
  auto roomy = MakeEngine(*model, 64);
  auto tight = MakeEngine(*model, 9);  // 8 blocks of 16 tokens for 6 sequences of up to 48
  for (double temperature : {0.0, 1.0}) {
    p.temperature = temperature;
    ExpectSameSamples(RunEngine(*tight, model, kPrompts, p), RunEngine(*roomy, model, kPrompts, p),
                      1e-4);
  }
  EXPECT_GT(tight->stats().preemptions, 0);
  EXPECT_EQ(roomy->stats().preemptions, 0);
  EXPECT_LE(tight->stats().peak_used_blocks, 8);
}

// 256 sequences of mixed lengths through a pool of 48 blocks: all finish, the pool's peak use
// stays within it (and the pool within its byte budget), preempting as needed.
TEST(Engine, MemoryStaysWithinTheBudget) {
  auto model = Load();
  EngineOptions o;
  o.kv_cache_bytes = 48.0 * 16 * model->PagedSpec().kv_bytes_per_token + 100;  // 48 blocks
  o.max_running = 64;
  auto made = Engine::Create(*model, o);
  ASSERT_TRUE(made.ok()) << made.status();
  Engine& engine = **made;
  const EngineStats before = engine.stats();
  EXPECT_EQ(before.usable_blocks, 47);
  EXPECT_LE(before.pool_bytes, o.kv_cache_bytes);
  std::mt19937 rng(5);
  std::vector<std::shared_ptr<Engine::Request>> reqs;
  std::vector<std::vector<int64_t>> lengths(8);
  int64_t samples = 0;
  engine.Pause();
  for (int r = 0; r < 8; ++r) {
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 16; ++i) {
      std::vector<int32_t> prompt(1 + rng() % 30);
      for (auto& t : prompt) t = rng() % 96;
      prompts.push_back(prompt);
    }
    SamplingParams p;
    p.samples_per_prompt = 2;
    p.max_new_tokens = 4 + 9 * r;  // 4 .. 67
    p.seed = r;
    auto req = engine.Submit(Snapshot{model, 0, nullptr}, prompts, p, [&samples, r](Sample s) {
      ++samples;
      EXPECT_EQ(s.response_length(), 4 + 9 * r);
    });
    ASSERT_TRUE(req.ok()) << req.status();
    reqs.push_back(*req);
  }
  engine.Resume();
  for (auto& r : reqs) ASSERT_TRUE(Engine::Wait(*r).ok());
  EXPECT_EQ(samples, 256);
  const EngineStats st = engine.stats();
  EXPECT_LE(st.peak_used_blocks, st.usable_blocks);
  EXPECT_GE(st.peak_used_blocks, st.usable_blocks - 4);  // and it was used
  EXPECT_GT(st.preemptions, 0);
}

// A few sequences run 20x longer than the rest: while work waits, every decode step runs a full
// batch (the finished short ones are replaced at once).
TEST(Engine, LongTailKeepsTheBatchFull) {
  auto model = Load();
  const int64_t max_running = 8;
  auto engine = MakeEngine(*model, 200, max_running);
  std::vector<std::shared_ptr<Engine::Request>> reqs;
  engine->Pause();
  auto submit = [&](int64_t prompt_token, int64_t max_new) {
    SamplingParams p;
    p.max_new_tokens = max_new;
    p.seed = prompt_token;
    auto r = engine->Submit(Snapshot{model, 0, nullptr}, {{prompt_token, 3, 4}}, p, [](Sample) {});
    ASSERT_TRUE(r.ok()) << r.status();
    reqs.push_back(*r);
  };
  for (int i = 0; i < 3; ++i) submit(i, 100);  // the long tail
  for (int i = 0; i < 40; ++i) submit(i, 5);   // the rest
  engine->Resume();
  for (auto& r : reqs) ASSERT_TRUE(Engine::Wait(*r).ok());
  const EngineStats st = engine->stats();
  EXPECT_GT(st.waiting_decode_steps, 20);
  EXPECT_EQ(st.waiting_decoded_tokens, st.waiting_decode_steps * max_running);
  // Every token of every sequence but its first (from the prefill) is one decode row.
  EXPECT_EQ(st.decoded_tokens, 3 * 99 + 40 * 4);
  // A static batch of 8 would run 100 steps for each batch holding a long sequence; here the
  // short ones ride along: 99 steps in all.
  EXPECT_EQ(st.decode_steps, 99);
}

// Two samples of a long prompt share its blocks: one copy of the partly filled last block.
TEST(Engine, SamplesShareThePromptBlocks) {
  auto model = Load();
  std::vector<int32_t> prompt(100);
  for (int i = 0; i < 100; ++i) prompt[i] = (i * 7) % 96;
  SamplingParams p;
  p.max_new_tokens = 4;
  auto one = MakeEngine(*model, 64);
  RunEngine(*one, model, {prompt}, p);
  auto two = MakeEngine(*model, 64);
  p.samples_per_prompt = 2;
  RunEngine(*two, model, {prompt}, p);
  const int64_t single = one->stats().peak_used_blocks;
  EXPECT_EQ(single, 7);  // 103 tokens of 16
  EXPECT_LT(two->stats().peak_used_blocks, 2 * single);
  EXPECT_EQ(two->stats().peak_used_blocks, single + 1);
  EXPECT_EQ(two->stats().copy_on_writes, 1);
  EXPECT_EQ(two->stats().prefill_tokens, 100);  // the prompt ran once
}

TEST(Engine, FullQueueAndOversizedRequestsAreResourceExhausted) {
  auto model = Load();
  auto engine = MakeEngine(*model, 5, 256, /*max_requests=*/1);  // 4 blocks: 64 tokens
  SamplingParams p;
  p.max_new_tokens = 8;
  engine->Pause();
  auto first = engine->Submit(Snapshot{model, 0, nullptr}, kPrompts, p, [](Sample) {});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = engine->Submit(Snapshot{model, 0, nullptr}, kPrompts, p, [](Sample) {});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(second.status().message()).find("queue is full: 1 requests"),
            std::string::npos)
      << second.status();
  engine->Resume();
  EXPECT_TRUE(Engine::Wait(**first).ok());
  // 60 + 8 tokens need 5 blocks of the 4: never admissible.
  auto big =
      engine->Submit(Snapshot{model, 0, nullptr}, {std::vector<int32_t>(60, 1)}, p, [](Sample) {});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(big.status().message()).find("--kv-cache-gb"), std::string::npos)
      << big.status();
  EXPECT_NE(std::string(big.status().message()).find("(4 blocks"), std::string::npos)
      << big.status();
  // The engine keeps serving.
  EXPECT_EQ(RunEngine(*engine, model, kPrompts, p).size(), 3u);
}

TEST(Engine, CancellationRemovesTheRequestsSequences) {
  auto model = Load();
  auto engine = MakeEngine(*model, 64);
  SamplingParams p;
  p.max_new_tokens = 200;
  p.samples_per_prompt = 2;
  int polls = 0, samples = 0;
  absl::Status st = engine->Generate(
      Snapshot{model, 0, nullptr}, kPrompts, p, [&](Sample) { ++samples; },
      [&] { return ++polls > 5; });
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  EXPECT_EQ(samples, 0);
  // Its blocks are free again: another request can use the whole pool.
  p.max_new_tokens = 20;
  p.seed = 2;
  ExpectSameSamples(RunEngine(*engine, model, kPrompts, p), Static(*model, kPrompts, p));
}

// A request on weights with a NaN fails with FAILED_PRECONDITION naming the sample and position,
// returning no sample; a request of healthy weights in the same steps (the same draw) gets its
// samples, and so does a later one on the blocks the failed request used.
TEST(Engine, NonFiniteModelFailsItsRequestOnly) {
  auto model = Load();
  auto broken = Load();
  {
    torch::NoGradGuard no_grad;
    broken->named_parameters()["model.norm.weight"][3] = std::numeric_limits<float>::quiet_NaN();
  }
  auto engine = MakeEngine(*model, 64);
  for (double temperature : {0.0, 1.0}) {
    SCOPED_TRACE(testing::Message() << "temperature " << temperature);
    SamplingParams p;
    p.samples_per_prompt = 2;
    p.max_new_tokens = 12;
    p.temperature = temperature;
    p.seed = 5;
    std::vector<Sample> good, bad;
    engine->Pause();
    auto r_bad = engine->Submit(Snapshot{broken, 1, nullptr}, kPrompts, p,
                                [&](Sample s) { bad.push_back(std::move(s)); });
    auto r_good = engine->Submit(Snapshot{model, 0, nullptr}, kPrompts, p,
                                 [&](Sample s) { good.push_back(std::move(s)); });
    ASSERT_TRUE(r_bad.ok() && r_good.ok());
    engine->Resume();
    absl::Status st = Engine::Wait(**r_bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(std::string(st.message()).find("response token 0"), std::string::npos) << st;
    EXPECT_NE(std::string(st.message()).find("non-finite"), std::string::npos) << st;
    EXPECT_TRUE(bad.empty());
    ASSERT_TRUE(Engine::Wait(**r_good).ok());
    SortSamples(good);
    ExpectSameSamples(good, Static(*model, kPrompts, p));
    ExpectSameSamples(RunEngine(*engine, model, kPrompts, p), Static(*model, kPrompts, p));
  }
}

TEST(Engine, ModelWithoutPagedCacheIsRefused) {
  struct NoPaged : lm::CausalLM {
    NoPaged() : CausalLM(lm::ModelConfig{}) { config_.model_type = "toy_without_paging"; }
    torch::Tensor Forward(const lm::PackedBatch&, const lm::ForwardOptions&) override { return {}; }
    torch::Tensor Decode(const torch::Tensor&, lm::KVCache&) override { return {}; }
    lm::KVCache NewKVCache(int64_t, int64_t) const override { return {}; }
    torch::Tensor LmHeadWeight() override { return {}; }
  } model;
  auto e = Engine::Create(model, EngineOptions{});
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(e.status().message()).find("toy_without_paging"), std::string::npos);
}

// A bf16 model on the CPU gets bf16 pools, and the engine samples from it like the static sampler
// does (greedy; bf16 rounding of the two attention paths may flip a near tie).
TEST(Engine, Bf16ModelOnCpuHasBf16Pools) {
  auto model = Load();
  model->to(torch::kBFloat16);
  EXPECT_EQ(model->PagedSpec().kv_bytes_per_token, 2 * 2 * 2 * 16 * 2);
  auto cache = model->NewPagedKVCache(4, 16, 1);
  EXPECT_EQ(cache.k[0].scalar_type(), torch::kBFloat16);
  EXPECT_EQ(cache.bytes(), 4 * 16 * model->PagedSpec().kv_bytes_per_token);
  auto engine = MakeEngine(*model, 64);
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 12;
  p.temperature = 0;
  auto got = RunEngine(*engine, model, kPrompts, p), want = Static(*model, kPrompts, p);
  ASSERT_EQ(got.size(), want.size());
  int same = 0;
  for (size_t i = 0; i < got.size(); ++i) same += got[i].tokens == want[i].tokens;
  EXPECT_GE(same, 4);
}

// --- on a GPU: bf16 pools, and the engine's samples those of the static sampler there ---

TEST(Engine, CudaBf16KvCache) {
  SKIP_WITHOUT_CUDA();
  auto model = Load();
  model->to(torch::kCUDA, torch::kBFloat16);
  auto engine = MakeEngine(*model, 64);
  EXPECT_GE(engine->stats().pool_bytes, 64 * 16 * model->PagedSpec().kv_bytes_per_token);
  EXPECT_EQ(model->PagedSpec().kv_bytes_per_token, 2 * 2 * 2 * 16 * 2);  // bf16
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 12;
  p.temperature = 0;
  auto got = RunEngine(*engine, model, kPrompts, p), want = Static(*model, kPrompts, p);
  ASSERT_EQ(got.size(), want.size());
  int same = 0;
  for (size_t i = 0; i < got.size(); ++i) same += got[i].tokens == want[i].tokens;
  EXPECT_GE(same, 4);  // bf16 rounding of two attention paths may flip a near tie
}

// --- through the gRPC service ---

class Server {
 public:
  // `generator` null: the service's own static sampler.
  Server(WeightStore* store, lm::Generator* generator) : auth_("s3cret") {
    ServiceOptions so;
    so.limits.vocab_size = 96;
    so.limits.max_seq_len = 256;
    so.generator = generator;
    opd::v1::ServiceInfo info;
    service_ = std::make_unique<RolloutService>(store, &auth_, so, info);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
  }
  ~Server() { server_->Shutdown(); }

  std::vector<Sample> Generate(const std::vector<std::vector<int32_t>>& prompts,
                               const SamplingParams& p, grpc::Status* status) {
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials());
    auto stub = opd::v1::Rollout::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.AddMetadata(opd::rpc::kAuthMetadataKey, opd::rpc::BearerValue("s3cret"));
    opd::v1::GenerateRequest req;
    for (const auto& pr : prompts) req.add_prompts()->mutable_tokens()->Add(pr.begin(), pr.end());
    req.set_samples_per_prompt(static_cast<int32_t>(p.samples_per_prompt));
    auto* m = req.mutable_params();
    m->set_temperature(p.temperature);
    m->set_max_new_tokens(static_cast<int32_t>(p.max_new_tokens));
    m->set_seed(p.seed);
    req.set_return_routing(p.return_routing);
    auto reader = stub->Generate(&ctx, req);
    std::vector<Sample> out;
    opd::v1::Sample msg;
    while (reader->Read(&msg)) {
      Sample s;
      s.prompt_index = msg.prompt_index();
      s.sample_index = msg.sample_index();
      s.SetPrompt(prompts.at(msg.prompt_index()));  // the wire carries the response alone
      s.tokens.insert(s.tokens.end(), msg.tokens().begin(), msg.tokens().end());
      s.logprobs.resize(msg.tokens_size());
      std::memcpy(s.logprobs.data(), msg.logprobs().data(), 4 * s.logprobs.size());
      s.finish = msg.finish_reason() == opd::v1::FINISH_REASON_STOP ? FinishReason::kStop
                                                                    : FinishReason::kLength;
      out.push_back(std::move(s));
    }
    *status = reader->Finish();
    SortSamples(out);
    return out;
  }

 private:
  opd::rpc::Authenticator auth_;
  std::unique_ptr<RolloutService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// The service hands every request to the one generator it holds (lm/generate/generator.h), and
// refuses routing for a generator that cannot record it, naming the generator.
class FakeGenerator final : public lm::Generator {
 public:
  absl::Status Generate(const Snapshot& snapshot, const std::vector<std::vector<int32_t>>& prompts,
                        const SamplingParams& params, const std::function<void(Sample)>& on_sample,
                        const std::function<bool()>& cancelled) override {
    ++calls;
    version_seen = snapshot.version;
    for (size_t p = 0; p < prompts.size(); ++p) {
      for (int64_t s = 0; s < params.samples_per_prompt; ++s) {
        Sample out;
        out.prompt_index = static_cast<int64_t>(p);
        out.sample_index = s;
        out.SetPrompt(prompts[p]);
        out.tokens.insert(out.tokens.end(), {7, static_cast<int32_t>(p), static_cast<int32_t>(s)});
        out.logprobs = {-0.5f, -0.25f, -0.125f};
        out.finish = FinishReason::kStop;
        on_sample(std::move(out));
      }
    }
    return cancelled && cancelled() ? absl::CancelledError("cancelled") : absl::OkStatus();
  }
  bool RecordsRouting() const override { return false; }
  const char* name() const override { return "fake"; }
  int calls = 0;
  int64_t version_seen = -1;
};

TEST(Service, HandsEveryRequestToItsGenerator) {
  WeightStore store(Load(), 5);
  FakeGenerator fake;
  Server server(&store, &fake);
  SamplingParams p;
  p.samples_per_prompt = 2;
  grpc::Status st;
  auto got = server.Generate(kPrompts, p, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(fake.calls, 1);
  EXPECT_EQ(fake.version_seen, 5);
  ASSERT_EQ(got.size(), kPrompts.size() * 2);
  for (const Sample& s : got) {
    EXPECT_EQ(ResponseIds(s), (std::vector<int64_t>{7, s.prompt_index, s.sample_index}));
    EXPECT_EQ(std::vector<int32_t>(s.prompt().begin(), s.prompt().end()), kPrompts[s.prompt_index]);
    EXPECT_EQ(s.logprobs, (std::vector<float>{-0.5f, -0.25f, -0.125f}));
    EXPECT_EQ(s.finish, FinishReason::kStop);
  }
  p.return_routing = true;
  server.Generate(kPrompts, p, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(st.error_message().find("(fake)"), std::string::npos) << st.error_message();
  EXPECT_EQ(fake.calls, 1) << "a refused request reached the generator";
}

TEST(Engine, ThroughTheGrpcServiceSameAsTheStaticService) {
  auto model = Load();
  WeightStore store(model);
  auto engine = MakeEngine(*model, 64);
  Server paged(&store, engine.get()), fixed(&store, nullptr);
  for (double temperature : {0.0, 1.0}) {
    SamplingParams p;
    p.samples_per_prompt = 2;
    p.max_new_tokens = 16;
    p.temperature = temperature;
    p.seed = 21;
    grpc::Status a, b;
    auto got = paged.Generate(kPrompts, p, &a);
    auto want = fixed.Generate(kPrompts, p, &b);
    ASSERT_TRUE(a.ok()) << a.error_message();
    ASSERT_TRUE(b.ok()) << b.error_message();
    EXPECT_EQ(got.size(), 6u);
    ExpectSameSamples(got, want);
    ExpectSameSamples(got, Static(*model, kPrompts, p));
  }
  // A request the pool can never hold: RESOURCE_EXHAUSTED over the wire, naming the budget.
  auto small = MakeEngine(*model, 3);
  Server tiny(&store, small.get());
  SamplingParams p;
  p.max_new_tokens = 40;
  grpc::Status st;
  tiny.Generate({std::vector<int32_t>(10, 1)}, p, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("--kv-cache-gb"), std::string::npos) << st.error_message();
}

// Over the wire, on the engine and on the static sampler: a temperature that underflows is
// INVALID_ARGUMENT naming it and the minimum, and weights that produce NaN never stream a NaN
// log-prob with OK (FAILED_PRECONDITION; no sample).
TEST(Engine, ThroughTheGrpcServiceNoNaNIsServedWithOk) {
  auto model = Load();
  model->named_parameters()["model.norm.weight"].detach()[3] =
      std::numeric_limits<float>::quiet_NaN();
  WeightStore store(model);
  auto engine = MakeEngine(*model, 64);
  Server paged(&store, engine.get()), fixed(&store, nullptr);
  for (Server* server : {&paged, &fixed}) {
    SCOPED_TRACE(server == &paged ? "engine" : "static sampler");
    SamplingParams p;
    p.samples_per_prompt = 2;
    p.max_new_tokens = 8;
    grpc::Status st;
    for (double t : {double(1e-45f), std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
      p.temperature = t;
      server->Generate(kPrompts, p, &st);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << t;
      EXPECT_NE(st.error_message().find("temperature"), std::string::npos) << st.error_message();
      EXPECT_NE(st.error_message().find("0.0001"), std::string::npos) << st.error_message();
    }
    for (double t : {0.0, 1.0}) {
      p.temperature = t;
      auto got = server->Generate(kPrompts, p, &st);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
      EXPECT_NE(st.error_message().find("non-finite"), std::string::npos) << st.error_message();
      EXPECT_TRUE(got.empty());
    }
  }
}

}  // namespace
}  // namespace rollout
