// In-process tests of the rollout worker's domain objects: the batched sampler (seeds, greedy,
// log-probs against the teacher path, top-k/top-p filtering, stop ids, shared prefill) and the
// versioned weight store (validation and atomic replacement). Models: the tiny random fixtures.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <random>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/generate/sampler.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/util/limits.h"
#include "lm/util/splitmix.h"
#include "rollout/generate_request.h"
#include "rollout/weights.h"
#include "rpc/wire_tensor.h"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "tests/wire_testing.h"

using testing_util::MaxAbsDiff;
using testing_util::ResponseIds;

namespace rollout {

// The generation types and the sampler (lm/generate) the rollout code here builds on.
using lm::Draws;
using lm::DrawTokens;
using lm::FilteredLogits;
using lm::FilteredLogprobs;
using lm::FinishReason;
using lm::KvBytesPerToken;
using lm::Sample;
using lm::SampleResponses;
using lm::SamplerStats;
using lm::SampleSeed;
using lm::SamplingParams;
namespace {

constexpr const char* kModel = "moe_tied_topk8";  // vocab 96, 256 positions

std::shared_ptr<lm::CausalLM> Load(const std::string& fixture = kModel) {
  // One thread: tiny models gain nothing from more, and OpenMP's spinning threads crawl on a
  // machine whose cores are busy with other work (CI, parallel builds).
  torch::set_num_threads(1);
  auto m = lm::LoadModel(std::string(OPD_FIXTURES_DIR) + "/" + fixture + "/model");
  EXPECT_TRUE(m.ok()) << m.status();
  (*m)->eval();
  return *m;
}

const std::vector<std::vector<int64_t>> kPrompts = {
    {1, 5, 9, 13, 2}, {7, 3}, {40, 41, 42, 43, 44, 45, 46, 47}};
// The same prompts as the generators and the request checks take them (host ids, int32).
const std::vector<std::vector<int32_t>> kHostPrompts = testing_util::HostIds(kPrompts);

std::vector<Sample> SampleAll(lm::CausalLM& model, const std::vector<std::vector<int64_t>>& prompts,
                              const SamplingParams& params, SamplerStats* stats = nullptr) {
  std::vector<Sample> out;
  auto st = SampleResponses(model, testing_util::HostIds(prompts), params,
                            [&](Sample s) { out.push_back(std::move(s)); });
  EXPECT_TRUE(st.ok()) << st.status();
  if (stats && st.ok()) *stats = *st;
  std::sort(out.begin(), out.end(), [](const Sample& a, const Sample& b) {
    return std::tie(a.prompt_index, a.sample_index) < std::tie(b.prompt_index, b.sample_index);
  });
  return out;
}

// Greedy decoding by full forwards, no KV cache: an independent reference.
std::vector<int64_t> GreedyByForward(lm::CausalLM& model, std::vector<int64_t> seq, int64_t n) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    auto h = model.Forward(lm::PackedBatch::FromSequences({seq}));
    const int64_t next = model.Logits(h[h.size(0) - 1]).argmax().item<int64_t>();
    out.push_back(next);
    seq.push_back(next);
  }
  return out;
}

// Teacher-path log-probs (packed forward, chunked LM head) of `response` after `prompt`.
std::vector<float> TeacherPath(lm::CausalLM& model, const std::vector<int64_t>& prompt,
                               const std::vector<int64_t>& response, double temperature) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> seq = prompt;
  seq.insert(seq.end(), response.begin(), response.end());
  auto lp = lm::SequenceLogprobs(model, lm::PackedBatch::FromSequences({seq}), temperature);
  auto tail =
      lp.narrow(0, static_cast<int64_t>(prompt.size()) - 1, static_cast<int64_t>(response.size()))
          .contiguous();
  return std::vector<float>(tail.data_ptr<float>(), tail.data_ptr<float>() + tail.numel());
}

// The one seed mixer keeps the bits every pinned stream was drawn with: the values below were
// computed from the formulas each caller wrote by hand before (SplitMix64(SplitMix64(s) ^ v) for
// a step's seed and the data mixture's streams; SplitMix64 of that ^ sample for a sample's
// stream), so a sample, a data order or a resumed step's seed cannot drift.
TEST(Sampler, SeedsMixThroughOneMixerWithTheirOldBits) {
  EXPECT_EQ(lm::MixSeed(7, 3), 0x6baa78681a99f995ULL);
  EXPECT_EQ(lm::MixSeed(1234, 5, 1), 0xb382e3543b68f619ULL);
  EXPECT_EQ(SampleSeed(1234, 5, 1), 0xb382e3543b68f619ULL);
  // A negative seed index and int64 seeds travel as their uint64 bits.
  EXPECT_EQ(SampleSeed(0, -1, 2), 0xbaf439c84dd990c8ULL);
  // Mixing is not associative: a mixed seed mixed again is another stream.
  EXPECT_NE(lm::MixSeed(lm::MixSeed(1234, 5), 1), lm::MixSeed(1234, 5, 1));
}

// Host token ids (int32 spans) pack into the same int64 batch as the int64 sequences.
TEST(Sampler, PackedBatchFromSpansEqualsFromSequences) {
  const std::vector<int32_t> a = {5, 9, 33, 2}, b = {70000, 1}, empty;
  const lm::PackedBatch want = lm::PackedBatch::FromSequences({{5, 9, 33, 2}, {}, {70000, 1}});
  const lm::PackedBatch got =
      lm::PackedBatch::FromSpans(std::vector<absl::Span<const int32_t>>{a, empty, b});
  EXPECT_EQ(got.cu_seqlens, want.cu_seqlens);
  EXPECT_EQ(got.input_ids.scalar_type(), torch::kInt64);
  EXPECT_TRUE(torch::equal(got.input_ids, want.input_ids));
  EXPECT_TRUE(torch::equal(got.position_ids, want.position_ids));
}

TEST(Sampler, SameSeedSameSamplesOtherSeedOthers) {
  auto model = Load();
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 12;
  p.seed = 1234;
  auto a = SampleAll(*model, kPrompts, p), b = SampleAll(*model, kPrompts, p);
  ASSERT_EQ(a.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens);
    EXPECT_EQ(a[i].logprobs, b[i].logprobs);
  }
  // The two samples of a prompt differ (independent streams), and so does another seed.
  EXPECT_NE(a[0].tokens, a[1].tokens);
  p.seed = 99;
  auto c = SampleAll(*model, kPrompts, p);
  int differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i].tokens != c[i].tokens;
  EXPECT_GE(differ, 4);
}

TEST(Sampler, SampleDoesNotDependOnItsBatch) {
  auto model = Load();
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 10;
  p.seed = 7;
  auto together = SampleAll(*model, kPrompts, p);
  // Prompt 2 alone is prompt index 0 there, so its seed stream differs: compare prompt 0 instead.
  auto alone = SampleAll(*model, {kPrompts[0]}, p);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(alone[s].tokens, together[s].tokens);
    EXPECT_LE(MaxAbsDiff(alone[s].logprobs, together[s].logprobs), 1e-5);
  }
}

TEST(Sampler, GreedyEqualsArgmaxDecoding) {
  auto model = Load();
  SamplingParams p;
  p.max_new_tokens = 16;
  p.temperature = 0;
  p.samples_per_prompt = 2;
  auto out = SampleAll(*model, kPrompts, p);
  for (const auto& s : out) {
    EXPECT_EQ(ResponseIds(s), GreedyByForward(*model, kPrompts[s.prompt_index], 16))
        << "prompt " << s.prompt_index;
    for (float lp : s.logprobs) EXPECT_EQ(lp, 0.0f);  // a point mass
  }
  // The limit temperature -> 0 of sampling is greedy too.
  p.temperature = 1e-4;
  for (const auto& s : SampleAll(*model, kPrompts, p)) {
    EXPECT_EQ(ResponseIds(s), GreedyByForward(*model, kPrompts[s.prompt_index], 16));
  }
  // And so is top-k = 1 at any temperature.
  p.temperature = 1.5;
  p.top_k = 1;
  for (const auto& s : SampleAll(*model, kPrompts, p)) {
    EXPECT_EQ(ResponseIds(s), GreedyByForward(*model, kPrompts[s.prompt_index], 16));
  }
}

TEST(Sampler, LogprobsEqualTeacherPath) {
  auto model = Load();
  for (double temperature : {1.0, 0.7}) {
    SamplingParams p;
    p.samples_per_prompt = 2;
    p.max_new_tokens = 20;
    p.temperature = temperature;
    p.seed = 5;
    double worst = 0;
    for (const auto& s : SampleAll(*model, kPrompts, p)) {
      worst = std::max(worst, MaxAbsDiff(s.logprobs, TeacherPath(*model, kPrompts[s.prompt_index],
                                                                 ResponseIds(s), temperature)));
    }
    EXPECT_LE(worst, 1e-4) << "temperature " << temperature;
  }
}

TEST(Sampler, FilteredLogprobsTopKTopP) {
  torch::manual_seed(0);
  auto logits = torch::randn({4, 50}) * 3;
  const float inf = std::numeric_limits<float>::infinity();
  // top-k: exactly the k largest survive, renormalised.
  auto lp = FilteredLogprobs(logits, 0.8, 5, 1.0);
  for (int64_t b = 0; b < 4; ++b) {
    auto [v, i] = logits[b].topk(5);
    auto keep = torch::full({50}, -inf);
    keep.index_put_({i}, torch::log_softmax(v / 0.8, -1));
    EXPECT_TRUE(torch::allclose(lp[b], keep, 1e-5, 1e-6));
  }
  // top-p: the smallest most-likely set with mass >= p, by brute force.
  const double top_p = 0.6;
  lp = FilteredLogprobs(logits, 1.0, 0, top_p);
  for (int64_t b = 0; b < 4; ++b) {
    auto probs = torch::softmax(logits[b], -1);
    auto [sp, si] = probs.sort(-1, true);
    double mass = 0;
    std::vector<int64_t> kept;
    for (int64_t j = 0; j < 50 && mass < top_p; ++j) {
      kept.push_back(si[j].item<int64_t>());
      mass += sp[j].item<double>();
    }
    auto keep = torch::full({50}, -inf);
    auto idx = torch::tensor(kept);
    keep.index_put_({idx}, torch::log_softmax(logits[b].index_select(0, idx), -1));
    EXPECT_TRUE(torch::allclose(lp[b], keep, 1e-5, 1e-6)) << "row " << b;
  }
  // top-k then top-p: the nucleus of the renormalised top-k.
  auto both = FilteredLogprobs(logits, 1.0, 10, 0.5);
  auto ref = FilteredLogprobs(FilteredLogprobs(logits, 1.0, 10, 1.0), 1.0, 0, 0.5);
  EXPECT_TRUE(torch::allclose(both, ref, 1e-5, 1e-6));
}

TEST(Sampler, SamplesFollowTheFilteredDistribution) {
  auto model = Load();
  // 4000 one-token samples of one prompt: the empirical distribution matches exp(log-prob)
  // (total variation below 0.05), and every sampled token is inside the top-k.
  SamplingParams p;
  p.samples_per_prompt = 4000;
  p.max_new_tokens = 1;
  p.top_k = 8;
  p.temperature = 1.3;
  p.seed = 3;
  auto out = SampleAll(*model, {kPrompts[0]}, p);
  torch::NoGradGuard no_grad;
  auto h = model->Forward(lm::PackedBatch::FromSequences({kPrompts[0]}));
  auto lp = FilteredLogprobs(model->Logits(h[h.size(0) - 1]).unsqueeze(0), 1.3, 8, 1.0)[0];
  std::map<int64_t, int> counts;
  for (const auto& s : out) {
    ++counts[s.response()[0]];
    EXPECT_NEAR(s.logprobs[0], lp[s.response()[0]].item<float>(), 1e-5);
    EXPECT_TRUE(std::isfinite(s.logprobs[0])) << "token outside the top-k";
  }
  double tv = 0;
  for (int64_t t = 0; t < lp.size(0); ++t) {
    tv += std::abs(counts[t] / 4000.0 - std::exp(lp[t].item<double>()));
  }
  EXPECT_LT(tv / 2, 0.05);
}

// The host-side inverse-CDF draw the sampler used before it ran on the device: the reference the
// device draw must equal token for token.
int64_t HostDraw(const float* probs, int64_t V, double u) {
  constexpr int64_t kBlock = 1024;
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  std::vector<double> sums(blocks, 0.0);
  for (int64_t j = 0; j < blocks; ++j) {
    // The block sums as the device computes them (a float64 reduction of the float row).
    sums[j] = torch::from_blob(const_cast<float*>(probs) + j * kBlock,
                               {std::min(V, (j + 1) * kBlock) - j * kBlock}, torch::kFloat32)
                  .sum(torch::kFloat64)
                  .item<double>();
  }
  double total = 0;
  for (double b : sums) total += b;
  const double target = u * total;
  double acc = 0;
  int64_t j = 0;
  while (j + 1 < blocks && acc + sums[j] <= target) acc += sums[j++];
  int64_t last_positive = -1;
  for (int64_t i = j * kBlock; i < std::min(V, (j + 1) * kBlock); ++i) {
    if (probs[i] <= 0) continue;
    acc += probs[i];
    last_positive = i;
    if (acc > target) return i;
  }
  if (last_positive >= 0) return last_positive;
  for (int64_t i = V - 1; i >= 0; --i)
    if (probs[i] > 0) return i;
  return 0;
}

// Draws on logits of several blocks (vocab 3000, top-k and top-p zeros included) equal the host
// loop's, and the log-prob is that of the filtered distribution.
TEST(Sampler, DeviceDrawEqualsTheHostLoop) {
  torch::manual_seed(1);
  const int64_t B = 64, V = 3000;
  auto logits = torch::randn({B, V}) * 2;
  for (auto [k, top_p] : {std::pair<int64_t, double>{0, 1.0}, {50, 1.0}, {0, 0.8}, {200, 0.5}}) {
    SamplingParams p;
    p.temperature = 0.9;
    p.top_k = k;
    p.top_p = top_p;
    std::vector<std::mt19937_64> gens, copies;
    for (int64_t i = 0; i < B; ++i) gens.emplace_back(SampleSeed(3, i, 0));
    copies = gens;
    std::vector<std::mt19937_64*> rngs;
    for (auto& g : gens) rngs.push_back(&g);
    const Draws d = DrawTokens(logits, rngs, p);
    auto probs = torch::softmax(FilteredLogits(logits, 0.9, k, top_p), -1).contiguous();
    auto lp = FilteredLogprobs(logits, 0.9, k, top_p);
    for (int64_t i = 0; i < B; ++i) {
      const double u = static_cast<double>(copies[i]() >> 11) * 0x1.0p-53;
      EXPECT_EQ(d.tokens[i], HostDraw(probs.data_ptr<float>() + i * V, V, u)) << "row " << i;
      EXPECT_NEAR(d.logprobs[i], lp[i][d.tokens[i]].item<float>(), 1e-5);
      EXPECT_EQ(gens[i](), copies[i]()) << "one uniform per token";
    }
  }
}

// On a GPU the draw runs there and picks the same tokens as on the CPU.
TEST(Sampler, DeviceDrawOnCudaEqualsCpu) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(2);
  auto logits = torch::randn({32, 5000}) * 2;
  SamplingParams p;
  p.top_k = 100;
  std::vector<std::mt19937_64> a, b;
  for (int i = 0; i < 32; ++i) a.emplace_back(i), b.emplace_back(i);
  std::vector<std::mt19937_64*> ra, rb;
  for (int i = 0; i < 32; ++i) ra.push_back(&a[i]), rb.push_back(&b[i]);
  const Draws cpu = DrawTokens(logits, ra, p), gpu = DrawTokens(logits.to(torch::kCUDA), rb, p);
  EXPECT_EQ(cpu.tokens, gpu.tokens);
  EXPECT_LE(MaxAbsDiff(cpu.logprobs, gpu.logprobs), 1e-5);
}

TEST(Sampler, StopIdsAndMaxNewTokens) {
  auto model = Load();
  SamplingParams p;
  p.temperature = 0;
  p.max_new_tokens = 16;
  auto free_run = ResponseIds(SampleAll(*model, {kPrompts[0]}, p)[0]);
  // Stop at the first token that did not occur before it in the greedy continuation.
  size_t at = 3;
  while (at < free_run.size() && std::find(free_run.begin(), free_run.begin() + at, free_run[at]) !=
                                     free_run.begin() + at) {
    ++at;
  }
  ASSERT_LT(at, free_run.size());
  p.stop_ids = {free_run[at]};
  auto stopped = SampleAll(*model, {kPrompts[0]}, p)[0];
  EXPECT_EQ(stopped.finish, FinishReason::kStop);
  EXPECT_EQ(ResponseIds(stopped),
            std::vector<int64_t>(free_run.begin(), free_run.begin() + at + 1));
  p.stop_ids = {};
  p.max_new_tokens = 5;
  auto cut = SampleAll(*model, {kPrompts[0]}, p)[0];
  EXPECT_EQ(cut.finish, FinishReason::kLength);
  EXPECT_EQ(cut.response_length(), 5);
  EXPECT_EQ(cut.prompt(),
            absl::MakeConstSpan(std::vector<int32_t>(kPrompts[0].begin(), kPrompts[0].end())));
}

TEST(Sampler, SamplesShareThePromptPrefill) {
  auto model = Load();
  SamplingParams p;
  p.samples_per_prompt = 3;
  p.max_new_tokens = 4;
  SamplerStats stats;
  auto out = SampleAll(*model, kPrompts, p, &stats);
  EXPECT_EQ(out.size(), 9u);
  EXPECT_EQ(stats.prefill_tokens, 5 + 2 + 8);  // each prompt once, not once per sample
  EXPECT_EQ(stats.decode_steps, 3);            // the first token comes from the prefill
  EXPECT_EQ(stats.decoded_tokens, 9 * 3);
}

TEST(Sampler, CancellationStopsDecoding) {
  auto model = Load();
  SamplingParams p;
  p.max_new_tokens = 50;
  int polls = 0;
  auto st = SampleResponses(
      *model, kHostPrompts, p, [](Sample) {}, [&] { return ++polls > 3; });
  EXPECT_EQ(st.status().code(), absl::StatusCode::kCancelled);
}

TEST(Sampler, ValidateNamesTheProblem) {
  GenerateLimits limits{96, 256, 8, 64};
  SamplingParams p;
  p.max_new_tokens = 8;
  EXPECT_TRUE(Validate(kHostPrompts, p, limits).ok());
  auto code_and_msg = [&](const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& q,
                          const std::string& needle) {
    auto st = Validate(prompts, q, limits);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(std::string(st.message()).find(needle), std::string::npos) << st;
  };
  code_and_msg({}, p, "no prompts");
  code_and_msg({{1}, {}}, p, "prompt 1: empty");
  code_and_msg({{1}, {3, 96}}, p, "token id 96");
  code_and_msg({{1}, {-1}}, p, "token id -1");
  auto q = p;
  q.max_new_tokens = 300;
  code_and_msg({{1}}, q, "max_new_tokens");
  q = p;
  q.max_new_tokens = 252;
  code_and_msg({{1, 2, 3, 4, 5}}, q, "maximum sequence length 256");
  q = p;
  q.samples_per_prompt = 9;
  code_and_msg({{1}}, q, "samples_per_prompt");
  q = p;
  q.temperature = -1;
  code_and_msg({{1}}, q, "temperature");
  q = p;
  q.top_p = 1.5;
  code_and_msg({{1}}, q, "top_p");
  q = p;
  q.stop_ids = {500};
  code_and_msg({{1}}, q, "stop token id 500");
}

// Temperatures that underflow (logits / temperature overflowing fp32 into NaN) are refused naming
// the field, the value and the minimum; so are NaN, infinite and negative ones. 0 stays greedy,
// and the minimum passes also as the float it travels as on the wire.
TEST(Sampler, ValidateRefusesTemperaturesThatUnderflow) {
  GenerateLimits limits{96, 256, 8, 64};
  SamplingParams p;
  p.max_new_tokens = 8;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double t : {double(1e-45f), 1e-30, 1e-5, nan, inf, -inf, -1.0, -1e-45}) {
    p.temperature = t;
    auto st = Validate(kHostPrompts, p, limits);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << t;
    EXPECT_NE(std::string(st.message()).find("temperature"), std::string::npos) << st;
    EXPECT_NE(std::string(st.message()).find("at least 0.0001"), std::string::npos) << st;
    EXPECT_NE(std::string(st.message()).find(absl::StrCat("got ", t)), std::string::npos) << st;
  }
  for (double t : {0.0, lm::kMinTemperature, double(float(lm::kMinTemperature)), 0.7, 100.0}) {
    p.temperature = t;
    EXPECT_TRUE(Validate(kHostPrompts, p, limits).ok()) << t;
  }
}

// A model with a NaN or an infinity in its weights: sampling (greedy or not) fails with
// FAILED_PRECONDITION naming the sample and the position, and no sample is returned.
TEST(Sampler, NonFiniteModelFailsInsteadOfReturningNaN) {
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    auto model = Load();
    {
      torch::NoGradGuard no_grad;
      model->named_parameters()["model.norm.weight"][3] = bad;
    }
    for (double temperature : {0.0, 1.0}) {
      SCOPED_TRACE(testing::Message() << "weight " << bad << " temperature " << temperature);
      SamplingParams p;
      p.samples_per_prompt = 2;
      p.max_new_tokens = 4;
      p.temperature = temperature;
      int samples = 0;
      auto st = SampleResponses(*model, kHostPrompts, p, [&](Sample) { ++samples; });
      EXPECT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition) << st.status();
      EXPECT_NE(std::string(st.status().message()).find("prompt 0, sample 0"), std::string::npos)
          << st.status();
      EXPECT_NE(std::string(st.status().message()).find("response token 0"), std::string::npos)
          << st.status();
      EXPECT_NE(std::string(st.status().message()).find("non-finite"), std::string::npos)
          << st.status();
      EXPECT_EQ(samples, 0);
    }
  }
}

// A sequence's KV cache per token: keys and values of every layer's KV heads.
TEST(Sampler, KvBytesPerTokenCountsKeysAndValuesOfEveryLayer) {
  lm::ModelConfig c;
  c.num_hidden_layers = 28;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  EXPECT_EQ(KvBytesPerToken(c, 2), 2 * 28 * 8 * 128 * 2);  // Marco-Nano in bf16: 112 KiB
}

// --- the weight store ---

// Bytes [offset, offset + bytes) of the whole-tensor chunk `t`.
WireTensor View(const WireTensor& t, int64_t offset, size_t bytes) {
  WireTensor v = t;
  v.offset = offset;
  v.data = t.data.substr(static_cast<size_t>(offset), bytes);
  return v;
}

// Stages every tensor of `source` (whole tensors, one chunk each).
absl::Status StageAll(StagedWeights& staged, const testing_util::ModuleWeights& source) {
  for (const auto& t : source.chunks) {
    absl::Status st = staged.Add(t);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// One copy of the weights: a commit writes the update into the serving model, but only once no
// snapshot of the serving version is alive; until then it is pending and the old snapshot keeps
// the old weights (rollout/weights.h).
TEST(WeightStore, CommitWaitsForSnapshotsAndWritesInPlace) {
  auto a = Load();
  auto b = Load();
  b->InitWeights(0.1, 42);
  const torch::Tensor a_head = a->LmHeadWeight().clone();
  WeightStore store(a);
  std::optional<Snapshot> before = store.Current();
  auto staged = store.Stage(1);
  ASSERT_TRUE(staged.ok()) << staged.status();
  auto source = testing_util::WeightsOf(*b);
  ASSERT_TRUE(StageAll(**staged, source).ok());
  // Staging alone changes nothing; the commit waits for the snapshot.
  EXPECT_TRUE(torch::equal(a->LmHeadWeight(), a_head));
  CommitState state = CommitState::kServing;
  ASSERT_TRUE(store.Commit(std::move(*staged), &state).ok());
  EXPECT_EQ(state, CommitState::kPending);
  EXPECT_EQ(store.accepted_version(), 1);
  EXPECT_EQ(store.Current().version, 0);
  EXPECT_TRUE(torch::equal(before->model->LmHeadWeight(), a_head));
  before.reset();  // the last reader of version 0 ends: the commit thread writes version 1
  ASSERT_TRUE(store.AwaitNoPending(absl::Seconds(60)));
  const Snapshot after = store.Current();
  EXPECT_EQ(after.version, 1);
  EXPECT_EQ(after.model, a);  // the same model, now holding b's weights
  auto pb = b->named_parameters(), pn = after.model->named_parameters();
  for (const auto& p : pb) EXPECT_TRUE(torch::equal(pn[p.key()], p.value())) << p.key();
}

TEST(WeightStore, WrongTensorsAreRejected) {
  auto a = Load();
  WeightStore store(a);
  auto source = testing_util::WeightsOf(*a);
  const auto& t = source.chunks[0];
  auto expect_invalid = [](const absl::Status& st, const std::string& needle) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find(needle), std::string::npos) << st;
  };
  {
    auto staged = *store.Stage(1);
    auto v = t;
    v.name = "model.not_a_tensor";
    expect_invalid(staged->Add(v), "not a parameter");
  }
  {
    auto staged = *store.Stage(1);
    auto v = t;
    v.shape = {1, 2, 3};
    expect_invalid(staged->Add(v), "shape [1, 2, 3]");
  }
  {
    // Another wire dtype is cast on arrival (a bf16 push to an fp32 worker), but then the
    // tensor is bf16-sized: fp32's byte count is refused, naming the size.
    auto staged = *store.Stage(1);
    auto v = t;
    v.dtype = opd::rpc::WireDtype::kBFloat16;
    expect_invalid(staged->Add(v),
                   absl::StrCat(t.data.size(), " bytes, more than its ", t.data.size() / 2));
  }
  {
    // A dtype no tensor travels in is refused as the chunk is read, naming the tensor.
    opd::v1::WeightChunk c;
    opd::rpc::ToProto(t, &c);
    c.clear_wire_dtype();
    c.set_dtype("int8");
    auto v = opd::rpc::FromProto(c);
    expect_invalid(v.status(), absl::StrCat("tensor '", t.name, "': unknown dtype 'int8'"));
  }
  {
    auto staged = *store.Stage(1);
    expect_invalid(staged->Add(View(t, 8, 8)), "expected byte 0");  // out of order
  }
  {
    auto staged = *store.Stage(1);
    ASSERT_TRUE(staged->Add(View(t, 0, t.data.size() / 2)).ok());
    expect_invalid(staged->Add(source.chunks[1]), "ended after");
  }
  {
    auto staged = *store.Stage(1);
    ASSERT_TRUE(staged->Add(t).ok());
    ASSERT_TRUE(staged->Add(source.chunks[1]).ok());
    expect_invalid(staged->Add(t), "sent twice");
  }
  {
    // Incomplete: commit refuses and names what is missing.
    auto staged = *store.Stage(1);
    ASSERT_TRUE(staged->Add(t).ok());
    expect_invalid(store.Commit(std::move(staged)), "missing or incomplete");
  }
  // Stale versions.
  EXPECT_EQ(store.Stage(0).status().code(), absl::StatusCode::kFailedPrecondition);
  auto s1 = *store.Stage(1), s2 = *store.Stage(1);
  ASSERT_TRUE(StageAll(*s1, source).ok());
  ASSERT_TRUE(StageAll(*s2, source).ok());
  ASSERT_TRUE(store.Commit(std::move(s1)).ok());
  EXPECT_EQ(store.Commit(std::move(s2)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.Current().version, 1);
}

// A tensor with a NaN or an infinity is refused naming it, whether it arrives in the model's
// dtype or overflows in the cast to it; full and announced updates alike. Nothing changes.
TEST(WeightStore, NonFiniteTensorsAreRefusedNamingThem) {
  auto a = Load();
  auto b = Load();
  b->InitWeights(0.1, 42);
  const std::string victim = "model.layers.0.self_attn.k_proj.weight";
  {
    torch::NoGradGuard no_grad;
    b->named_parameters()[victim][1][2] = std::numeric_limits<float>::quiet_NaN();
  }
  WeightStore store(a);
  auto source = testing_util::WeightsOf(*b);
  auto expect_refused = [&](const absl::Status& st, const std::string& needle) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find("'" + victim + "'"), std::string::npos) << st;
    EXPECT_NE(std::string(st.message()).find(needle), std::string::npos) << st;
  };
  {
    auto staged = *store.Stage(1);
    expect_refused(StageAll(*staged, source), "1 of its");
  }
  {
    const auto& t = *std::find_if(source.chunks.begin(), source.chunks.end(),
                                  [&](const auto& v) { return v.name == victim; });
    WireTensor at = t;
    at.checksum = opd::rpc::Xxh64::Of(t.data.data(), t.data.size());
    auto staged = store.StageAnnounced(1, testing_util::ManifestOf({at}));
    ASSERT_TRUE(staged.ok()) << staged.status();
    expect_refused((*staged)->Add(t), "not finite");
  }
  {
    // A bf16 worker: an fp32 value past bf16's largest (FLT_MAX rounds up) becomes inf.
    auto a16 = lm::LoadModel(std::string(OPD_FIXTURES_DIR) + "/" + kModel + "/model",
                             lm::LoadOptions{torch::kBFloat16, torch::kCPU});
    ASSERT_TRUE(a16.ok()) << a16.status();
    WeightStore store16(*a16);
    auto c = Load();
    {
      torch::NoGradGuard no_grad;
      c->named_parameters()[victim][0][0] = std::numeric_limits<float>::max();
    }
    auto fp32 = testing_util::WeightsOf(*c);
    auto staged = *store16.Stage(1);
    expect_refused(StageAll(*staged, fp32), "after the cast from float32 to bfloat16");
    EXPECT_EQ(store16.Current().version, 0);
  }
  EXPECT_EQ(store.Current().version, 0);
  EXPECT_EQ(store.Current().model, a);
}

// A version from kMaxWeightVersion (2^53) on is INVALID_ARGUMENT naming it; INT64_MAX would
// otherwise be accepted and make every later push stale, and so did 2^53 itself (issue 41 #22:
// accepted, then every later push refused until a restart). The largest version taken is
// 2^53 - 1, and the one after it is exact as a double (what the learner records).
TEST(WeightStore, VersionsFromTheMaximumOnAreRefused) {
  auto a = Load();
  WeightStore store(a);
  for (int64_t v :
       {std::numeric_limits<int64_t>::max(), kMaxWeightVersion + 1, kMaxWeightVersion}) {
    auto full = store.Stage(v);
    EXPECT_EQ(full.status().code(), absl::StatusCode::kInvalidArgument) << full.status();
    EXPECT_NE(std::string(full.status().message()).find(absl::StrCat("weight version ", v)),
              std::string::npos)
        << full.status();
    EXPECT_NE(std::string(full.status().message()).find("2^53"), std::string::npos)
        << full.status();
    EXPECT_EQ(store.StageAnnounced(v, opd::v1::WeightManifest()).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(kMaxWeightVersion, int64_t{1} << 53);
  const int64_t last = kMaxWeightVersion - 1;
  EXPECT_EQ(static_cast<int64_t>(static_cast<double>(last + 1)), last + 1);
  auto staged = store.StageAnnounced(last, opd::v1::WeightManifest());
  ASSERT_TRUE(staged.ok()) << staged.status();
  ASSERT_TRUE(store.Commit(std::move(*staged)).ok());
  EXPECT_EQ(store.Current().version, last);
}

}  // namespace
}  // namespace rollout
