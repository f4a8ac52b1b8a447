// fp32 logits and fp32 routers (issue #25 item 3), on the bf16 Qwen3-MoE fixtures, for every
// token the static sampler and the paged engine sample:
//   - from the same hidden states, the rollout's head (DecodeLogits, the draw's log-prob) equals
//     the learner's recompute (lm::TokenLogprobs, what trainer/opd/opd.cc runs) within the fp32
//     rounding bound below, and the old bf16-rounded logits miss that bound (negative control);
//   - wherever the rollout's forward and the learner's compute the same rows (the prompt, in a
//     forward of the prompt alone), every MoE layer picks the same experts; a bf16 rollout's
//     router and the learner's fp32 one give bit-identical logits, and the old bf16 router flips
//     near-ties (negative control). Over the learner's forward of prompt + response the prompt
//     rows are not the same computation: the CPU's bf16 attention rounds differently with the
//     document's length (18 tokens against the prefill's 6), so near-ties there are reported.
// The recorded log-probs themselves are compared and reported, not held to the bound: the bf16
// body (a decode step, a packed prefill) rounds differently from the learner's one forward of
// prompt + response, which neither the head nor the router can remove.
//
// The bound. Both sides multiply the same bf16 operands (a product of two bf16 numbers is exact
// in fp32) and sum H of them in fp32, in different orders (a [B, H] decode GEMM or the packed
// head against the learner's [N, H] chunk). A recursive fp32 sum of H terms in any order is off
// from the exact sum by at most gamma_H * S, gamma_H = H u / (1 - H u), u = 2^-24, S = sum_h
// |hidden_h weight_vh|; two such sums differ by at most 2 gamma_H S. A log-prob z_t - lse(z)
// moves by at most |dz_t| + max_v |dz_v|, so |d logprob| <= 4 gamma_H max_v S_v, plus the
// softmax's and the log's own fp32 rounding, a few u per nat: kSlack. The old logits, rounded
// to bf16 before the log-softmax, are off by up to 2^-9 |z| each; the negative control below
// shows they miss this bound on the fixtures, so the check can fail.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/generate/sampler.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/model/precision.h"
#include "nlohmann/json.hpp"
#include "rollout/engine.h"
#include "rollout/weights.h"
#include "tests/gpu.h"
#include "tests/testing.h"

namespace rollout {

// The generation types and the sampler (lm/generate) the rollout code here builds on.
using lm::DecodeLogits;
using lm::DrawTokens;
using lm::Sample;
using lm::SampleResponses;
using lm::SamplingParams;
namespace {

const std::string kFixtures = OPD_BF16_FIXTURES_DIR;
constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff
constexpr double kSlack = 1e-6;         // softmax, log and the fp64 log of an fp32 probability

std::vector<std::string> MoeFixtures() {
  return {"moe_tied_topk8", "moe_untied_top1_sparse2"};
}

std::shared_ptr<lm::CausalLM> LoadBf16(const std::string& name, torch::Device device) {
  lm::LoadOptions o;
  o.dtype = torch::kBFloat16;
  o.device = device;
  auto m = lm::LoadModel(kFixtures + "/" + name + "/model", o);
  EXPECT_TRUE(m.ok()) << m.status() << " (run `ctest -R make_bf16_fixtures`)";
  if (!m.ok()) return nullptr;
  (*m)->eval();
  return *m;
}

std::vector<std::vector<int64_t>> Prompts(const std::string& name) {
  std::ifstream in(kFixtures + "/" + name + "/inputs.json");
  auto seqs = nlohmann::json::parse(in)["sequences"].get<std::vector<std::vector<int64_t>>>();
  for (auto& s : seqs) s.resize(std::min<size_t>(s.size(), 6));
  return seqs;
}

SamplingParams Params() {
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.temperature = 1.0;
  p.max_new_tokens = 12;
  p.seed = 7;
  p.return_routing = true;
  return p;
}

// The learner's recompute of one sample (prompt + response through the model's Forward, then
// lm::TokenLogprobs at the rows before each response token) and, from the same hidden states,
// what the rollout's head makes of them: DecodeLogits (the sampler's and the engine's decode
// head) and DrawTokens' log-prob, log(softmax(z))[t] in fp64 of the fp32 probability.
struct Recompute {
  torch::Tensor learner, rollout_head, bf16_head, bound;  // [R] per response token
  torch::Tensor experts;         // the learner's routers: [P + R - 1, layers, k], sorted within k
  torch::Tensor prompt_experts;  // the same over a forward of the prompt alone: [P, layers, k]
};

torch::Tensor SampledLogprob(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::softmax(logits, -1)
      .gather(1, targets.unsqueeze(1))
      .squeeze(1)
      .to(torch::kFloat64)
      .log()
      .cpu();
}

Recompute Learner(lm::CausalLM& model, const std::vector<int64_t>& prompt, const Sample& s) {
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> response = testing_util::ResponseIds(s);
  std::vector<int64_t> seq = prompt;
  seq.insert(seq.end(), response.begin(), response.end());
  auto batch = lm::PackedBatch::FromSequences({seq});
  const auto device = model.LmHeadWeight().device();
  batch.input_ids = batch.input_ids.to(device);
  batch.position_ids = batch.position_ids.to(device);
  std::vector<torch::Tensor> routing;
  torch::Tensor hidden;
  {
    lm::ScopedRoutingRecorder record(&routing);
    hidden = model.Forward(batch);
  }
  const int64_t P = prompt.size(), R = response.size();
  auto rows = torch::arange(P - 1, P + R - 1, torch::kInt64).to(device);
  auto targets = torch::tensor(response, torch::kInt64).to(device);
  auto h = hidden.index_select(0, rows);
  const auto& w = model.LmHeadWeight();
  Recompute r;
  r.learner = lm::TokenLogprobs(h, w, targets).to(torch::kCPU, torch::kFloat64);
  // The rollout's head decodes one row per sequence per step: row by row here.
  std::vector<torch::Tensor> z;
  for (int64_t i = 0; i < R; ++i) z.push_back(DecodeLogits(model, nullptr, h.narrow(0, i, 1)));
  r.rollout_head = SampledLogprob(torch::cat(z), targets);
  auto old = lm::LogitsFp32(h, w).to(torch::kBFloat16).to(torch::kFloat32);  // before the fix
  r.bf16_head = SampledLogprob(old, targets);
  const int64_t H = h.size(1);
  const double gamma = H * kU / (1 - H * kU);
  auto S = torch::mm(h.abs().to(torch::kFloat64), w.abs().to(torch::kFloat64).t());
  r.bound = (4 * gamma * std::get<0>(S.max(1)) + kSlack).cpu();
  for (auto& t : routing) t = std::get<0>(t.sort(-1)).to(torch::kCPU);
  r.experts = torch::stack(routing, 1).narrow(0, 0, P + R - 1);  // the last token is not fed
  std::vector<torch::Tensor> alone;
  {
    lm::ScopedRoutingRecorder record(&alone);
    auto p = lm::PackedBatch::FromSequences({prompt});
    p.input_ids = p.input_ids.to(device);
    p.position_ids = p.position_ids.to(device);
    model.Forward(p);
  }
  for (auto& t : alone) t = std::get<0>(t.sort(-1)).to(torch::kCPU);
  r.prompt_experts = torch::stack(alone, 1);
  return r;
}

struct Gaps {
  int64_t tokens = 0;
  double head_ratio = 0, head_worst = 0, bf16_worst = 0, bound_max = 0;  // same hidden states
  double first_ratio = 0, first_worst = 0;  // the recorded log-prob of the first token
  double later_worst = 0;                   // the recorded log-probs after the first token
  int64_t prompt_expert_mismatches = 0;     // (token, layer) pairs over the prompts alone
  int64_t prompt_in_full_mismatches = 0;    // the same over the forward of prompt + response
  int64_t response_expert_mismatches = 0, response_pairs = 0;
};

double Max(const torch::Tensor& t) {
  return t.numel() ? t.max().item<double>() : 0.0;
}

void Add(Gaps& g, const Sample& s, int64_t P, const Recompute& r) {
  auto recorded = torch::tensor(s.logprobs, torch::kFloat32).to(torch::kFloat64);
  g.tokens += recorded.numel();
  auto head = (r.rollout_head - r.learner).abs();
  g.head_ratio = std::max(g.head_ratio, Max(head / r.bound));
  g.head_worst = std::max(g.head_worst, Max(head));
  g.bf16_worst = std::max(g.bf16_worst, Max((r.bf16_head - r.learner).abs()));
  g.bound_max = std::max(g.bound_max, Max(r.bound));
  auto d = (recorded - r.learner).abs();
  g.first_ratio = std::max(g.first_ratio, d[0].item<double>() / r.bound[0].item<double>());
  g.first_worst = std::max(g.first_worst, d[0].item<double>());
  g.later_worst = std::max(g.later_worst, Max(d.narrow(0, 1, d.numel() - 1)));
  auto mine =
      torch::tensor(s.routed_experts, torch::kInt64).view({-1, s.routing_layers, s.routing_top_k});
  auto differ = std::get<0>(mine.sort(-1)).ne(r.experts).any(-1);  // [positions, layers]
  g.prompt_in_full_mismatches += differ.narrow(0, 0, P).sum().item<int64_t>();
  g.prompt_expert_mismatches +=
      std::get<0>(mine.narrow(0, 0, P).sort(-1)).ne(r.prompt_experts).any(-1).sum().item<int64_t>();
  g.response_expert_mismatches += differ.narrow(0, P, differ.size(0) - P).sum().item<int64_t>();
  g.response_pairs += differ.narrow(0, P, differ.size(0) - P).numel();
}

Gaps Compare(lm::CausalLM& model, const std::vector<std::vector<int64_t>>& prompts,
             const std::vector<Sample>& samples) {
  Gaps g;
  for (const auto& s : samples) {
    const auto& prompt = prompts[s.prompt_index];
    Add(g, s, prompt.size(), Learner(model, prompt, s));
  }
  return g;
}

void Report(const std::string& what, const Gaps& g) {
  std::cout << what << ": " << g.tokens << " tokens. Same hidden states: rollout head vs learner "
            << g.head_worst << " nats (worst ratio to the bound " << g.head_ratio
            << ", bound up to " << g.bound_max << "), bf16-rounded head " << g.bf16_worst
            << ". Recorded: first token " << g.first_worst << " (ratio " << g.first_ratio
            << "), later tokens " << g.later_worst << "; experts differ on "
            << g.prompt_expert_mismatches << " prompt (" << g.prompt_in_full_mismatches
            << " against prompt + response) and " << g.response_expert_mismatches << " of "
            << g.response_pairs << " response (token, layer) pairs\n";
  ASSERT_GT(g.tokens, 0);
  EXPECT_LE(g.head_ratio, 1.0) << what;
  // The negative control: the old bf16-rounded logits miss the bound, so the check can fail.
  EXPECT_GT(g.bf16_worst, g.bound_max) << what;
  // Where the rollout's and the learner's forwards compute the same rows (the prompt: the
  // prefill against the learner's forward of the prompt alone), the routers pick the same
  // experts. The recorded log-probs are only reported: the bf16 body itself (a decode step or a
  // packed prefill against the learner's one forward of prompt + response; attention rounds
  // differently with a document's length) rounds differently with the batch's shape, and that,
  // not the head or the router, is the gap that remains.
  EXPECT_EQ(g.prompt_expert_mismatches, 0) << what;
}

std::vector<Sample> Static(lm::CausalLM& model, const std::vector<std::vector<int64_t>>& prompts) {
  std::vector<Sample> out;
  auto st = SampleResponses(model, testing_util::HostIds(prompts), Params(),
                            [&](Sample s) { out.push_back(s); });
  EXPECT_TRUE(st.ok()) << st.status();
  return out;
}

std::vector<Sample> Paged(std::shared_ptr<lm::CausalLM> model,
                          const std::vector<std::vector<int64_t>>& prompts) {
  std::vector<Sample> out;
  EngineOptions o;
  o.num_blocks = 256;
  auto e = Engine::Create(*model, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return out;
  auto st = (*e)->Generate(
      Snapshot{model, 0, nullptr}, testing_util::HostIds(prompts), Params(),
      [&](Sample s) { out.push_back(s); }, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

void CheckRolloutAgainstLearner(torch::Device device) {
  for (const auto& name : MoeFixtures()) {
    auto model = LoadBf16(name, device);
    ASSERT_TRUE(model);
    const auto prompts = Prompts(name);
    Report(name + " static sampler", Compare(*model, prompts, Static(*model, prompts)));
    if (model->SupportsPagedKV())
      Report(name + " paged engine", Compare(*model, prompts, Paged(model, prompts)));
  }
}

TEST(Fp32Logits, LogitsAreFp32AndFp32ModelsUnchanged) {
  torch::manual_seed(0);
  auto h = torch::randn({5, 32}), w = torch::randn({50, 32});
  EXPECT_TRUE(torch::equal(lm::LogitsFp32(h, w), lm::MatmulWeightT(h, w)));  // bit for bit
  auto z = lm::LogitsFp32(h.to(torch::kBFloat16), w.to(torch::kBFloat16));
  EXPECT_EQ(z.scalar_type(), torch::kFloat32);
  // Against the exact product of the bf16 operands (fp64): fp32 rounding, not bf16's.
  auto hb = h.to(torch::kBFloat16).to(torch::kFloat64),
       wb = w.to(torch::kBFloat16).to(torch::kFloat64);
  auto exact = torch::mm(hb, wb.t());
  const double gamma = 32 * kU / (1 - 32 * kU);
  auto S = torch::mm(hb.abs(), wb.abs().t());
  EXPECT_TRUE(((z.to(torch::kFloat64) - exact).abs() <= gamma * S).all().item<bool>());
  EXPECT_EQ(lm::LogitsFp32(h[0], w).sizes(), torch::IntArrayRef({50}));  // one row, 1-D
}

// The router of a bf16 rollout (bf16 x, bf16 gate) against the learner's (fp32 x and an fp32
// gate holding the same values): the same fp32 logits bit for bit, so the same experts; the old
// bf16 router logits flip near-ties.
TEST(Fp32Logits, RoutersRunInFp32AsTheLearnersDo) {
  torch::manual_seed(1);
  const int64_t T = 4096, H = 64, E = 64, k = 8;
  auto x = torch::randn({T, H}).to(torch::kBFloat16);
  auto gate = (torch::randn({E, H}) * 0.1).to(torch::kBFloat16);
  const auto rollout = lm::Route(x, gate, k, /*norm_topk_prob=*/true);
  const auto learner = lm::Route(x.to(torch::kFloat32), gate.to(torch::kFloat32), k, true);
  EXPECT_EQ(rollout.logits.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(rollout.logits, learner.logits));
  EXPECT_TRUE(torch::equal(rollout.ids, learner.ids));
  EXPECT_EQ(rollout.weights.scalar_type(), torch::kBFloat16);  // mixing in the activations' dtype
  auto forced = lm::RouteForced(x, gate, learner.ids, true);
  EXPECT_TRUE(torch::equal(forced.logits, learner.logits));
  // The negative control: top-k over the bf16-rounded logits of before.
  auto old = torch::linear(x, gate);
  auto old_ids = std::get<1>(torch::softmax(old, -1, torch::kFloat32).topk(k, -1));
  auto flipped = std::get<0>(old_ids.sort(-1)).ne(std::get<0>(learner.ids.sort(-1))).any(-1);
  std::cout << "bf16 router: " << flipped.sum().item<int64_t>() << " of " << T
            << " tokens pick other experts than the fp32 router\n";
  EXPECT_GT(flipped.sum().item<int64_t>(), 0);
}

TEST(Fp32Logits, RolloutLogprobsAndExpertsMatchTheLearnerOnCpu) {
  torch::set_num_threads(1);
  CheckRolloutAgainstLearner(torch::kCPU);
}

TEST(Fp32Logits, RolloutLogprobsAndExpertsMatchTheLearnerOnCuda) {
  SKIP_WITHOUT_CUDA();
  CheckRolloutAgainstLearner(torch::Device(torch::kCUDA, 0));
}

}  // namespace
}  // namespace rollout
