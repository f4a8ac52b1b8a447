// What the rollout engine's tests share (tests/engine_test.cc, tests/engine_admission_test.cc):
// the tiny fixture model, runs of the engine and of the static sampler, and the comparison of
// their samples.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/generate/sampler.h"
#include "lm/model/model.h"
#include "rollout/engine.h"
#include "tests/testing.h"

namespace rollout::engine_testing {

inline constexpr const char* kModel = "moe_tied_topk8";  // vocab 96, 256 positions

inline std::shared_ptr<lm::CausalLM> Load(const std::string& fixture = kModel) {
  torch::set_num_threads(1);  // tiny models gain nothing from more (see sampler_test)
  auto m = lm::LoadModel(std::string(OPD_FIXTURES_DIR) + "/" + fixture + "/model");
  EXPECT_TRUE(m.ok()) << m.status();
  (*m)->eval();
  return *m;
}

inline const std::vector<std::vector<int32_t>> kPrompts = {
    {1, 5, 9, 13, 2}, {7, 3}, {40, 41, 42, 43, 44, 45, 46, 47}};

inline void SortSamples(std::vector<lm::Sample>& out) {
  std::sort(out.begin(), out.end(), [](const lm::Sample& a, const lm::Sample& b) {
    return std::tie(a.prompt_index, a.sample_index) < std::tie(b.prompt_index, b.sample_index);
  });
}

inline std::vector<lm::Sample> Static(lm::CausalLM& model,
                                      const std::vector<std::vector<int32_t>>& prompts,
                                      const lm::SamplingParams& p, int64_t max_batch_kv_bytes = 0) {
  std::vector<lm::Sample> out;
  auto st = lm::SampleResponses(
      model, prompts, p, [&](lm::Sample s) { out.push_back(std::move(s)); }, nullptr, nullptr,
      max_batch_kv_bytes);
  EXPECT_TRUE(st.ok()) << st.status();
  SortSamples(out);
  return out;
}

inline std::vector<lm::Sample> RunEngine(Engine& engine, std::shared_ptr<lm::CausalLM> model,
                                         const std::vector<std::vector<int32_t>>& prompts,
                                         const lm::SamplingParams& p) {
  std::vector<lm::Sample> out;
  absl::Status st = engine.Generate(
      Snapshot{std::move(model), 0, nullptr}, prompts, p,
      [&](lm::Sample s) { out.push_back(std::move(s)); }, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  SortSamples(out);
  return out;
}

inline std::unique_ptr<Engine> MakeEngine(const lm::CausalLM& model, int64_t num_blocks,
                                          int64_t max_running = 256, int64_t max_requests = 64,
                                          int64_t max_prefill_tokens = 8192) {
  EngineOptions o;
  o.num_blocks = num_blocks;
  o.max_running = max_running;
  o.max_requests = max_requests;
  o.max_prefill_tokens = max_prefill_tokens;
  auto e = Engine::Create(model, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

// The same samples: equal tokens and finish reasons, log-probs within `tol` (the engine's
// attention sums in another order than the static sampler's, a preempted sequence's recompute in
// another than its decode steps: fp32 rounding of the logits, far below 1e-5 for these models).
inline void ExpectSameSamples(const std::vector<lm::Sample>& a, const std::vector<lm::Sample>& b,
                              double tol = 1e-5) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt_index, b[i].prompt_index);
    EXPECT_EQ(a[i].sample_index, b[i].sample_index);
    EXPECT_EQ(a[i].tokens, b[i].tokens)
        << "prompt " << a[i].prompt_index << " sample " << a[i].sample_index;
    EXPECT_LE(testing_util::MaxAbsDiff(a[i].logprobs, b[i].logprobs), tol);
    EXPECT_EQ(a[i].finish, b[i].finish);
  }
}

}  // namespace rollout::engine_testing
