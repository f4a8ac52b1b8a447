// The keyed token draw (lm::SampleRows, lm/generate/sampler.h): its arithmetic
// (kernels/cpu/draw_math.h: Philox as at::philox_engine computes it, fp64 exp and log from
// correctly rounded operations, exact integer weights and thresholds), the CPU kernel against an
// independent fp64 reference of the filtered distribution (sort, cumulative sums, inverse CDF in
// token order), its determinism (a row's token depends on nothing but its logits, key and
// position), and on a GPU the CUDA kernel bit for bit against the CPU kernel with no host sync.
//
// Tolerances:
//   - Exp64/Log64 against libm: 13 correctly rounded steps whose errors stay below ~3 ulps of the
//     result, plus the Taylor truncation (< 4e-18): 1e-15 relative (4.5 ulps).
//   - Tokens against the reference: the kernel's weights are round(exp(d) 2^S), each within
//     1/2 + 1e-15 exp(d) 2^S of the exact value, so every running sum (in units of the total,
//     which is >= 2^S) is within V (2^-(S+1) + 1e-15) of the reference's, and the target within
//     2^-S more. The token must be the reference's unless the target lies within that distance
//     of a boundary of the reference's cumulative sums (then either neighbour is right); random
//     logits put no boundary that close (the test counts such rows and expects none here).
//   - Log-probs: the reference's fp64 value rounded to fp32 (half an fp32 ulp) plus the
//     weights' rounding (V 2^-S of the total, relative): 2^-24 |lp| + 1e-9.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <ATen/core/PhiloxRNGEngine.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/cpu/draw_math.h"
#include "lm/generate/sampler.h"
#include "tests/gpu.h"

#ifdef OPD_TEST_CUDA_SYNC
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

using lm::SampledRows;
using lm::SamplerRows;
using lm::SamplingParams;

// ---- the arithmetic ----

TEST(KeyedDraw, PhiloxIsAtensPhiloxEngine) {
  for (uint64_t key : {uint64_t{0}, uint64_t{1}, lm::SampleSeed(1234, 3, 1), ~uint64_t{0}})
    for (uint64_t pos :
         {uint64_t{0}, uint64_t{1}, uint64_t{7}, (uint64_t{1} << 32) + 5, ~uint64_t{0}}) {
      at::philox_engine engine(key, /*subsequence=*/0, /*offset=*/pos);
      const draw::Philox4 block = draw::Philox(
          draw::Philox4{{static_cast<uint32_t>(pos), static_cast<uint32_t>(pos >> 32), 0, 0}},
          static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
      uint32_t words[4];
      for (uint32_t& w : words) w = engine();
      for (int i = 0; i < 4; ++i) EXPECT_EQ(block.v[i], words[i]) << key << " " << pos << " " << i;
      const uint64_t u = ((static_cast<uint64_t>(words[0]) << 32) | words[1]) >> 11;
      EXPECT_EQ(draw::Uniform53(key, pos), u);
    }
}

TEST(KeyedDraw, ExpAndLogAreAccurate) {
  EXPECT_EQ(draw::Exp64(0.0), 1.0);
  EXPECT_EQ(draw::Exp64(-std::numeric_limits<double>::infinity()), 0.0);
  EXPECT_EQ(draw::Exp64(-800.0), 0.0);
  EXPECT_EQ(draw::Log64(1.0), 0.0);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> xs(-707.0, 0.0), ys(0.0, 62.0);
  double worst_exp = 0, worst_log = 0;
  for (int i = 0; i < 200000; ++i) {
    const double x = i < 1000 ? -i * 1e-3 : xs(rng);
    worst_exp = std::max(worst_exp, std::abs(draw::Exp64(x) - std::exp(x)) / std::exp(x));
    const double y = std::exp2(ys(rng));
    worst_log = std::max(worst_log, std::abs(draw::Log64(y) - std::log(y)) / std::log(y));
  }
  EXPECT_LE(worst_exp, 1e-15);
  EXPECT_LE(worst_log, 1e-15);
  std::cout << "Exp64 / Log64 worst relative error against libm: " << worst_exp << " / "
            << worst_log << "\n";
}

TEST(KeyedDraw, IntegerThresholdsAreExact) {
  // ceil(p * total): dyadic p against a 128-bit product, and p = 0.1 (whose double is above
  // 0.1: 10 x 0.1 is just above 1, so the ceiling is 2).
  std::mt19937_64 rng(3);
  for (int i = 0; i < 10000; ++i) {
    const uint64_t total = rng() >> 2, num = 1 + rng() % ((uint64_t{1} << 20) - 1);
    const double p = std::ldexp(static_cast<double>(num), -20);
    const unsigned __int128 prod = static_cast<unsigned __int128>(num) * total;
    const uint64_t want = static_cast<uint64_t>((prod + ((uint64_t{1} << 20) - 1)) >> 20);
    ASSERT_EQ(draw::CeilFraction(p, total), want) << p << " " << total;
  }
  EXPECT_EQ(draw::CeilFraction(0.1, 10), 2u);
  EXPECT_EQ(draw::CeilFraction(0.5, 7), 4u);
  EXPECT_EQ(draw::CeilFraction(1 - 0x1.0p-53, uint64_t{1} << 62), (uint64_t{1} << 62) - 512);
  EXPECT_EQ(draw::CeilFraction(std::numeric_limits<double>::denorm_min(), 5), 1u);
  // floor(u 2^-53 total) against a 128-bit product.
  for (int i = 0; i < 10000; ++i) {
    const uint64_t u = rng() >> 11, total = rng() >> 1;
    const unsigned __int128 prod = static_cast<unsigned __int128>(u) * total;
    ASSERT_EQ(draw::Target(u, total), static_cast<uint64_t>(prod >> 53));
  }
  EXPECT_EQ(draw::Target((uint64_t{1} << 53) - 1, 1000), 999u);
  // Weights: exp(0) = 1 is exactly 2^S, and the weights of a vocabulary sum below 2^62.
  for (int64_t V :
       {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{1000}, int64_t{151936}, int64_t{1} << 20}) {
    const int S = draw::WeightBits(V);
    EXPECT_EQ(draw::Weight(0.0, S), uint64_t{1} << S);
    EXPECT_LE(static_cast<unsigned __int128>(V) << S, static_cast<unsigned __int128>(1) << 62);
  }
  EXPECT_EQ(draw::Weight(-std::numeric_limits<double>::infinity(), 44), 0u);
}

// ---- the CPU kernel against the reference ----

// The reference token and log-prob of one row in fp64, from the definitions: weights exp((x -
// max) / T); top-k and top-p kept sets by a stable descending sort; the first token in token
// order whose running weight exceeds u * total. `near` is set when u * total lies within `eps`
// (relative to the total) of a boundary of the running sums.
struct RefDraw {
  int64_t token = -1;
  double logprob = 0;
  bool near = false;
  std::vector<bool> kept;
};

RefDraw Reference(const float* x, int64_t V, double T, int64_t k, double p, uint64_t u53,
                  double eps) {
  RefDraw r;
  const double m = *std::max_element(x, x + V);
  std::vector<double> e(V);
  for (int64_t i = 0; i < V; ++i) e[i] = std::exp((static_cast<double>(x[i]) - m) / T);
  std::vector<int64_t> order(V);
  for (int64_t i = 0; i < V; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  const int64_t nk = k > 0 && k < V ? k : V;
  r.kept.assign(V, false);
  double kept_total = 0;
  for (int64_t j = 0; j < nk; ++j) kept_total += e[order[j]];
  double before = 0;
  for (int64_t j = 0; j < nk; ++j) {
    if (p > 0 && p < 1 && before >= p * kept_total) break;
    r.kept[order[j]] = true;
    before += e[order[j]];
  }
  double total = 0;
  for (int64_t i = 0; i < V; ++i)
    if (r.kept[i]) total += e[i];
  const double target = std::ldexp(static_cast<double>(u53), -53) * total;
  double acc = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!r.kept[i]) continue;
    r.near = r.near || std::abs(acc - target) <= eps * total;
    acc += e[i];
    r.near = r.near || std::abs(acc - target) <= eps * total;
    if (acc > target && r.token < 0) r.token = i;
  }
  r.logprob = std::log(e[r.token] / total);
  return r;
}

struct Config {
  double temperature;
  int64_t top_k;
  double top_p;
};

// Draws every row of `logits` on `device` at positions 7 b + 3 and checks it against Reference.
void CheckAgainstReference(const torch::Tensor& logits, const Config& c, torch::Device device) {
  const int64_t B = logits.size(0), V = logits.size(1);
  SamplingParams params;
  params.seed = 99;
  params.temperature = c.temperature;
  params.top_k = c.top_k;
  params.top_p = c.top_p;
  params.stop_ids = {5, 17};
  std::vector<int64_t> prompts(B), samples(B, 1), positions(B);
  for (int64_t b = 0; b < B; ++b) prompts[b] = b, positions[b] = 7 * b + 3;
  const SamplerRows rows = lm::MakeSamplerRows(params, prompts, samples, positions, device);
  auto got = lm::SampleRows(logits.to(device), rows);
  ASSERT_TRUE(got.ok()) << got.status();
  const auto tokens = got->tokens.cpu(), logprobs = got->logprobs.cpu(),
             stopped = got->stopped.cpu();
  const double eps = V * (std::ldexp(1.0, -draw::WeightBits(V)) + 2e-15);
  const auto x = logits.contiguous();
  int near = 0;
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t u53 = draw::Uniform53(lm::SampleSeed(99, b, 1), 7 * b + 3);
    const RefDraw ref =
        Reference(x.data_ptr<float>() + b * V, V, c.temperature, c.top_k, c.top_p, u53, eps);
    const int64_t token = tokens[b].item<int64_t>();
    const std::string what = "row " + std::to_string(b) + " T " + std::to_string(c.temperature) +
                             " k " + std::to_string(c.top_k) + " p " + std::to_string(c.top_p);
    near += ref.near;
    if (!ref.near) {
      EXPECT_EQ(token, ref.token) << what;
      EXPECT_NEAR(logprobs[b].item<float>(), ref.logprob,
                  std::ldexp(std::abs(ref.logprob), -24) + 1e-9)
          << what;
    }
    EXPECT_TRUE(ref.kept[token]) << what << ": token " << token << " outside the kept set";
    EXPECT_EQ(stopped[b].item<bool>(), token == 5 || token == 17) << what;
  }
  EXPECT_EQ(near, 0) << "rows whose target fell within the rounding of a boundary";
}

const std::vector<Config> kConfigs = {{1.0, 0, 1.0},  {0.7, 0, 1.0},   {1.3, 50, 1.0},
                                      {0.9, 0, 0.8},  {1.2, 200, 0.5}, {1.0, 1, 1.0},
                                      {1.0, 0, 1e-9}, {2.5, 7, 0.95}};

torch::Tensor RandomLogits(int64_t B, int64_t V, uint64_t seed) {
  torch::manual_seed(seed);
  auto logits = torch::randn({B, V}) * 2;
  // Masked entries (-inf) are never drawn and weigh nothing.
  logits.index_put_({torch::arange(B), torch::randint(0, V, {B})},
                    -std::numeric_limits<float>::infinity());
  return logits;
}

TEST(KeyedDraw, CpuEqualsTheFilteredDistributionReference) {
  const auto logits = RandomLogits(64, 3000, 1);
  for (const Config& c : kConfigs) CheckAgainstReference(logits, c, torch::kCPU);
}

// Qwen3's vocabulary (151,936): weights of 2^44 and many radix bins.
TEST(KeyedDraw, CpuEqualsTheReferenceAtQwenVocabulary) {
  const auto logits = RandomLogits(3, 151936, 2) * 3;
  for (const Config& c : {kConfigs[0], kConfigs[2], kConfigs[3], kConfigs[4]})
    CheckAgainstReference(logits, c, torch::kCPU);
}

SamplerRows Rows(int64_t B, double temperature, int64_t top_k, double top_p,
                 torch::Device device = torch::kCPU) {
  SamplingParams p;
  p.seed = 5;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  std::vector<int64_t> prompts(B, 0), samples(B, 0), positions(B);
  for (int64_t b = 0; b < B; ++b) positions[b] = b;
  return lm::MakeSamplerRows(p, prompts, samples, positions, device);
}

// Greedy takes the first of equal maxima (log-prob 0); broken rows (NaN, +inf, all -inf, a
// negative or NaN temperature) give token 0 and a NaN log-prob, never a crash.
TEST(KeyedDraw, GreedyAndBrokenRows) {
  const float inf = std::numeric_limits<float>::infinity();
  auto logits = torch::randn({6, 10});
  logits[0][3] = 9, logits[0][7] = 9;
  logits[1][2] = std::nanf("");
  logits[2][4] = inf;
  logits[3].fill_(-inf);
  auto rows = Rows(6, 0.0, 0, 1.0);
  auto greedy = lm::SampleRows(logits, rows);
  ASSERT_TRUE(greedy.ok());
  EXPECT_EQ(greedy->tokens[0].item<int64_t>(), 3);
  EXPECT_EQ(greedy->logprobs[0].item<float>(), 0.0f);
  for (int b : {1, 2, 3}) {
    EXPECT_TRUE(std::isnan(greedy->logprobs[b].item<float>())) << b;
    EXPECT_EQ(greedy->tokens[b].item<int64_t>(), 0) << b;
  }
  rows.temperature = torch::tensor({1.0, 1.0, 1.0, 1.0, -1.0, std::nan("")}, torch::kFloat64);
  auto sampled = lm::SampleRows(logits, rows);
  ASSERT_TRUE(sampled.ok());
  EXPECT_TRUE(std::isfinite(sampled->logprobs[0].item<float>()));
  for (int b : {1, 2, 3, 4, 5}) EXPECT_TRUE(std::isnan(sampled->logprobs[b].item<float>())) << b;
  EXPECT_FALSE(sampled->stopped.any().item<bool>());
}

// Among equal logits the lower ids are kept: top-k 3 of 10 equal logits keeps 0, 1, 2; top-p
// 0.35 keeps the ids whose mass before them is below 0.35 (0..3); top-k 5 then top-p 0.5 keeps
// 0, 1, 2. Every kept id is drawn over 300 positions, and nothing else.
TEST(KeyedDraw, TiesKeepTheLowerIdsFirst) {
  auto logits = torch::full({300, 10}, 1.5f);
  for (auto [k, p, kept] :
       {std::tuple<int64_t, double, int64_t>{3, 1.0, 3}, {0, 0.35, 4}, {5, 0.5, 3}}) {
    auto out = lm::SampleRows(logits, Rows(300, 1.0, k, p));
    ASSERT_TRUE(out.ok());
    std::map<int64_t, int> seen;
    for (int64_t b = 0; b < 300; ++b) ++seen[out->tokens[b].item<int64_t>()];
    EXPECT_EQ(static_cast<int64_t>(seen.size()), kept) << "k " << k << " p " << p;
    EXPECT_EQ(seen.rbegin()->first, kept - 1) << "k " << k << " p " << p;
    EXPECT_NEAR(out->logprobs[0].item<float>(), -std::log(static_cast<double>(kept)), 1e-6);
  }
}

// A row's draw depends only on its logits, key and position: alone or in a batch, on one thread
// or several, the same bits; another position gives another uniform.
TEST(KeyedDraw, RowsDoNotDependOnTheirBatchOrThreads) {
  const auto logits = RandomLogits(16, 500, 4);
  const auto rows = Rows(16, 0.8, 40, 0.9);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  auto one = lm::SampleRows(logits, rows);
  at::set_num_threads(std::max(2, threads));
  auto many = lm::SampleRows(logits, rows);
  at::set_num_threads(threads);
  ASSERT_TRUE(one.ok() && many.ok());
  EXPECT_TRUE(torch::equal(one->tokens, many->tokens));
  EXPECT_TRUE(torch::equal(one->logprobs, many->logprobs));
  for (int64_t b : {0, 9, 15}) {
    SamplerRows alone{rows.keys.narrow(0, b, 1),        rows.positions.narrow(0, b, 1),
                      rows.temperature.narrow(0, b, 1), rows.top_k.narrow(0, b, 1),
                      rows.top_p.narrow(0, b, 1),       rows.stop_ids.narrow(0, b, 1)};
    auto a = lm::SampleRows(logits.narrow(0, b, 1), alone);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->tokens[0].item<int64_t>(), many->tokens[b].item<int64_t>()) << b;
    EXPECT_EQ(a->logprobs[0].item<float>(), many->logprobs[b].item<float>()) << b;
  }
  EXPECT_NE(draw::Uniform53(rows.keys[0].item<int64_t>(), 0),
            draw::Uniform53(rows.keys[0].item<int64_t>(), 1));
}

// 4000 positions of one row: the empirical distribution matches exp(log-prob) of the filtered
// distribution (total variation below 0.05; its expectation for 6 outcomes and 4000 draws is
// about 0.015) and nothing outside the top-k is drawn.
TEST(KeyedDraw, FollowsTheFilteredDistribution) {
  torch::manual_seed(11);
  const auto row = torch::randn({1, 8});
  const int64_t n = 4000;
  auto logits = row.expand({n, 8}).contiguous();
  auto out = lm::SampleRows(logits, Rows(n, 1.3, 6, 1.0));
  ASSERT_TRUE(out.ok());
  const auto lp = lm::FilteredLogprobs(row, 1.3, 6, 1.0)[0];
  std::map<int64_t, int> counts;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = out->tokens[i].item<int64_t>();
    ++counts[t];
    EXPECT_NEAR(out->logprobs[i].item<float>(), lp[t].item<float>(), 1e-5);
  }
  EXPECT_EQ(counts.size(), 6u);
  double tv = 0;
  for (int64_t t = 0; t < 8; ++t)
    tv += std::abs(counts[t] / double(n) - std::exp(lp[t].item<double>()));
  EXPECT_LT(tv / 2, 0.05);
}

TEST(KeyedDraw, BadInputsAreRefusedNamingTheTensor) {
  const auto logits = torch::randn({4, 10});
  auto rows = Rows(4, 1.0, 0, 1.0);
  auto expect = [&](const SamplerRows& r, const torch::Tensor& l, const std::string& needle) {
    auto s = lm::SampleRows(l, r);
    ASSERT_FALSE(s.ok()) << needle;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(s.status().message()).find(needle), std::string::npos) << s.status();
  };
  expect(rows, logits.to(torch::kFloat64), "logits");
  expect(rows, logits.narrow(0, 0, 3), "keys");
  auto r = rows;
  r.positions = r.positions.to(torch::kInt32);
  expect(r, logits, "positions");
  r = rows;
  r.temperature = r.temperature.to(torch::kFloat32);
  expect(r, logits, "temperature");
  r = rows;
  r.top_p = torch::Tensor();
  expect(r, logits, "top_p");
  r = rows;
  r.stop_ids = r.stop_ids.view({-1});
  expect(r, logits, "stop_ids");
}

// DrawKeyed returns SampleRows' tokens and log-probs on the host.
TEST(KeyedDraw, DrawKeyedReturnsTheRowsOnTheHost) {
  const auto logits = RandomLogits(8, 300, 6);
  const auto rows = Rows(8, 0.9, 0, 1.0);
  auto d = lm::DrawKeyed(logits, rows);
  auto s = lm::SampleRows(logits, rows);
  ASSERT_TRUE(d.ok() && s.ok());
  for (int64_t b = 0; b < 8; ++b) {
    EXPECT_EQ(d->tokens[b], s->tokens[b].item<int64_t>());
    EXPECT_EQ(d->logprobs[b], s->logprobs[b].item<float>());
  }
}

// ---- CUDA ----

// The device draws the CPU's tokens and log-probs bit for bit: random rows under every
// configuration, ties, broken rows, and Qwen3's vocabulary.
TEST(KeyedDraw, CudaEqualsCpuBitForBit) {
  SKIP_WITHOUT_CUDA();
  auto check = [](const torch::Tensor& logits, const SamplerRows& cpu_rows, const char* what) {
    SamplerRows cuda_rows{cpu_rows.keys.cuda(),        cpu_rows.positions.cuda(),
                          cpu_rows.temperature.cuda(), cpu_rows.top_k.cuda(),
                          cpu_rows.top_p.cuda(),       cpu_rows.stop_ids.cuda()};
    auto c = lm::SampleRows(logits, cpu_rows);
    auto g = lm::SampleRows(logits.cuda(), cuda_rows);
    ASSERT_TRUE(c.ok() && g.ok()) << what;
    EXPECT_TRUE(torch::equal(c->tokens, g->tokens.cpu())) << what;
    EXPECT_TRUE(torch::equal(c->logprobs.nan_to_num(-1), g->logprobs.cpu().nan_to_num(-1))) << what;
    EXPECT_TRUE(torch::equal(c->stopped, g->stopped.cpu())) << what;
  };
  const auto logits = RandomLogits(64, 3000, 1);
  for (const Config& c : kConfigs) {
    const auto rows = Rows(64, c.temperature, c.top_k, c.top_p);
    check(logits, rows, "random");
    CheckAgainstReference(logits, c, torch::kCUDA);
  }
  check(torch::full({300, 10}, 1.5f), Rows(300, 1.0, 5, 0.5), "ties");
  auto broken = torch::randn({4, 10});
  broken[1][2] = std::nanf("");
  broken[2].fill_(-std::numeric_limits<float>::infinity());
  check(broken, Rows(4, 1.0, 0, 1.0), "broken");
  check(broken, Rows(4, 0.0, 0, 1.0), "greedy");
  const auto big = RandomLogits(8, 151936, 2) * 3;
  for (const Config& c : {kConfigs[0], kConfigs[2], kConfigs[4]})
    check(big, Rows(8, c.temperature, c.top_k, c.top_p), "151936");
}

#ifdef OPD_TEST_CUDA_SYNC
// The device draw waits on nothing: with the inputs on the device, no call synchronises.
TEST(KeyedDraw, CudaDrawDoesNotSync) {
  SKIP_WITHOUT_CUDA();
  const auto logits = RandomLogits(32, 151936, 3).cuda();
  const auto cpu_rows = Rows(32, 0.8, 20, 0.9);
  SamplerRows rows{cpu_rows.keys.cuda(),  cpu_rows.positions.cuda(), cpu_rows.temperature.cuda(),
                   cpu_rows.top_k.cuda(), cpu_rows.top_p.cuda(),     cpu_rows.stop_ids.cuda()};
  torch::cuda::synchronize();
  const auto saved = c10::cuda::warning_state().get_sync_debug_mode();
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  absl::StatusOr<SampledRows> out = absl::UnknownError("not run");
  EXPECT_NO_THROW(out = lm::SampleRows(logits, rows));
  c10::cuda::warning_state().set_sync_debug_mode(saved);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->tokens.device().type(), torch::kCUDA);
}
#endif

}  // namespace
