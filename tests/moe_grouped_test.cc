// The experts as grouped GEMMs (lm/model/moe_grouped.h), on the CPU: the sort of the pairs into
// padded expert groups, and the forward and backward against autograd through the per-expert
// reference (lm::MoeExpertsCpu). The same code runs on CUDA tensors for the learner (with
// LibTorch's CUTLASS grouped GEMM in bf16 on Hopper); moe_kernels_test holds its GPU cases.
//
// Tolerance: each result of the grouped path is compared with an fp64 run of the reference and
// must be as close to it as the fp32 reference itself, within a factor 4 (the two paths sum the
// same products in other orders and round h and gu at other points), plus 64 fp32 ulps of the
// largest value for a reference that happens to land exactly.
#include <cstdio>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/model/moe.h"
#include "lm/model/moe_grouped.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"

using testing_util::MaxAbsDiff;

namespace {

constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff

struct Layer {
  torch::Tensor x, ids, weights, gate_up, down, dy;
};

// T tokens, E experts of width I over hidden H, top-k; the experts `idle` receive no token.
Layer MakeLayer(int64_t T, int64_t H, int64_t I, int64_t E, int64_t k,
                const std::vector<int64_t>& idle = {}, uint64_t seed = 1) {
  torch::manual_seed(seed);
  Layer l;
  l.x = torch::randn({T, H});
  auto scores = torch::rand({T, E});
  for (int64_t e : idle) scores.select(1, e).fill_(-1.0);
  l.ids = std::get<1>(scores.topk(k, 1));
  l.weights = torch::rand({T, k});
  l.gate_up = torch::randn({E, 2 * I, H}) / 8;
  l.down = torch::randn({E, H, I}) / 8;
  l.dy = torch::randn({T, H});
  return l;
}

using Grads = std::vector<torch::Tensor>;  // y, dx, dweights, dgate_up, ddown

// y and the gradients of <dy, y> through `experts`, in dtype `dt`.
template <class F>
Grads Run(const Layer& l, torch::Dtype dt, F experts) {
  std::vector<torch::Tensor> in = {l.x, l.weights, l.gate_up, l.down};
  for (auto& t : in) t = t.to(dt).detach().requires_grad_(true);
  auto y = experts(in[0], l.ids, in[1], in[2], in[3]);
  auto g = torch::autograd::grad({y}, in, {l.dy.to(dt)});
  return {y.detach(), g[0], g[1], g[2], g[3]};
}

Grads Reference(const Layer& l, torch::Dtype dt) {
  return Run(l, dt, lm::MoeExpertsCpu);
}

Grads Grouped(const Layer& l, torch::Dtype dt, lm::MoeForwardKernel kernel = nullptr) {
  return Run(l, dt,
             [kernel](const auto& x, const auto& ids, const auto& w, const auto& gu,
                      const auto& dn) { return lm::MoeExpertsGrouped(x, ids, w, gu, dn, kernel); });
}

// Every result of `ours` as close to `exact` as `ref` is, within the file's tolerance.
void ExpectAsAccurate(const Grads& ours, const Grads& ref, const Grads& exact) {
  const char* names[] = {"y", "dx", "dweights", "dgate_up", "ddown"};
  for (size_t i = 0; i < exact.size(); ++i) {
    const double scale = exact[i].abs().max().item<double>();
    const double ours_err = MaxAbsDiff(ours[i], exact[i]), ref_err = MaxAbsDiff(ref[i], exact[i]);
    std::printf("%-9s grouped %.2e  per-expert %.2e  (max %.2e)\n", names[i], ours_err, ref_err,
                scale);
    EXPECT_LE(ours_err, 4 * ref_err + 64 * kU * scale) << names[i];
  }
}

TEST(MoeGrouped, SortPairsByExpertIsStablePaddedAndInvertible) {
  torch::manual_seed(3);
  const int64_t T = 53, k = 4, E = 9, align = lm::kExpertGroupAlign;
  auto ids = std::get<1>(torch::rand({T, E}).masked_fill(torch::arange(E).eq(4), -1).topk(k, 1));
  ids[5][1] = -1;  // out of range: dropped
  ids[17][3] = E;
  const auto rows = lm::SortPairsByExpert(ids, E);
  const int64_t R = lm::ExpertRows::Rows(T * k, E, align);
  ASSERT_EQ(rows.pair_of_row.size(0), R);
  ASSERT_EQ(rows.group_ends.scalar_type(), torch::kInt32);
  auto flat = ids.reshape({-1});
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t end = rows.group_ends[e].item<int64_t>();
    std::vector<int64_t> expected;
    for (int64_t p = 0; p < T * k; ++p)
      if (flat[p].item<int64_t>() == e) expected.push_back(p);
    const int64_t padded = (static_cast<int64_t>(expected.size()) + align - 1) / align * align;
    ASSERT_EQ(end - start, padded) << "expert " << e;
    for (int64_t r = start; r < end; ++r) {
      const size_t i = static_cast<size_t>(r - start);
      const int64_t want = i < expected.size() ? expected[i] : -1;  // in pair order, then padding
      ASSERT_EQ(rows.pair_of_row[r].item<int64_t>(), want) << "expert " << e << " row " << r;
      if (want >= 0) {
        EXPECT_EQ(rows.row_of_pair[want].item<int64_t>(), r);
      }
    }
    start = end;
  }
  EXPECT_EQ(rows.group_ends[4].item<int64_t>(), rows.group_ends[3].item<int64_t>()) << "idle";
  EXPECT_TRUE(rows.pair_of_row.narrow(0, start, R - start).eq(-1).all().item<bool>());
  EXPECT_EQ(rows.row_of_pair[5 * k + 1].item<int64_t>(), -1);
  EXPECT_EQ(rows.row_of_pair[17 * k + 3].item<int64_t>(), -1);
  EXPECT_EQ(rows.row_of_pair.ge(0).sum().item<int64_t>(), T * k - 2);
}

TEST(MoeGrouped, ForwardAndBackwardMatchTheReference) {
  for (const auto& [T, E, k] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{37, 12, 3}, {1, 8, 2}, {200, 64, 8}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E));
    const Layer l = MakeLayer(T, 64, 32, E, k, /*idle=*/{5, 6});
    const Grads exact = Reference(l, torch::kFloat64);
    ExpectAsAccurate(Grouped(l, torch::kFloat32), Reference(l, torch::kFloat32), exact);
    // Idle experts get exact zeros.
    const Grads ours = Grouped(l, torch::kFloat32);
    EXPECT_EQ(ours[3].narrow(0, 5, 2).abs().sum().item<double>(), 0.0);
    EXPECT_EQ(ours[4].narrow(0, 5, 2).abs().sum().item<double>(), 0.0);
  }
}

// bf16 (the learner's dtype on a GPU): within bf16's own distance from the exact result, as the
// per-expert path in bf16 is.
TEST(MoeGrouped, Bf16IsAsCloseAsTheReferenceInBf16) {
  const Layer l = MakeLayer(64, 64, 32, 16, 4);
  const Grads exact = Reference(l, torch::kFloat64);
  const Grads ours = Grouped(l, torch::kBFloat16), ref = Reference(l, torch::kBFloat16);
  const char* names[] = {"y", "dx", "dweights", "dgate_up", "ddown"};
  for (size_t i = 0; i < exact.size(); ++i) {
    const double scale = exact[i].abs().max().item<double>();
    const double ours_err = MaxAbsDiff(ours[i], exact[i]), ref_err = MaxAbsDiff(ref[i], exact[i]);
    std::printf("bf16 %-9s grouped %.2e  per-expert %.2e  (max %.2e)\n", names[i], ours_err,
                ref_err, scale);
    // 2^-8 relative is one bf16 rounding of the largest value.
    EXPECT_LE(ours_err, 2 * ref_err + scale / 256) << names[i];
    EXPECT_EQ(ours[i].scalar_type(), torch::kBFloat16) << names[i];
  }
}

// Pairs whose id is outside [0, E) add nothing and get no gradient: the same as routing them to
// any expert with weight zero, except that their weights' gradient is zero too.
TEST(MoeGrouped, OutOfRangeIdsAreDropped) {
  Layer l = MakeLayer(20, 32, 16, 6, 2);
  Layer zeroed = l;
  zeroed.ids = l.ids.clone();
  zeroed.weights = l.weights.clone();
  l.ids[3][0] = -1;
  l.ids[11][1] = 6;
  zeroed.weights[3][0] = 0.0;
  zeroed.weights[11][1] = 0.0;
  const Grads ours = Grouped(l, torch::kFloat32), ref = Reference(zeroed, torch::kFloat32);
  for (size_t i : {0, 1, 3, 4}) EXPECT_LE(MaxAbsDiff(ours[i], ref[i]), 1e-5) << i;
  EXPECT_EQ(ours[2][3][0].item<float>(), 0.0f);
  EXPECT_EQ(ours[2][11][1].item<float>(), 0.0f);
  auto kept = torch::ones({20, 2}, torch::kBool);
  kept[3][0] = false;
  kept[11][1] = false;
  EXPECT_LE(MaxAbsDiff(ours[2].masked_select(kept), ref[2].masked_select(kept)), 1e-5);
}

TEST(MoeGrouped, NoTokens) {
  const Layer l = MakeLayer(0, 32, 16, 4, 2);
  const Grads ours = Grouped(l, torch::kFloat32);
  EXPECT_EQ(ours[0].sizes(), (std::vector<int64_t>{0, 32}));
  EXPECT_EQ(ours[3].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(ours[4].abs().sum().item<double>(), 0.0);
}

// The partial of an expert-parallel rank on a device: all tokens' slots with the ids shifted to
// the rank's range, other ranks' experts dropped, summed in fp32. Two shards' partials add up to
// the whole layer; within a few fp32 ulps of the largest output (k terms added in two groups
// instead of one, and the gu/h roundings of the grouped path: 64 ulps covers both).
TEST(MoeGrouped, Fp32PartialsOfTwoShardsSumToAllExperts) {
  const int64_t E = 8;
  const Layer l = MakeLayer(40, 32, 16, E, 3);
  auto shard = [&](int64_t first) {
    return lm::MoeExpertsGroupedFp32(l.x, l.ids - first, l.weights,
                                     l.gate_up.narrow(0, first, E / 2),
                                     l.down.narrow(0, first, E / 2));
  };
  const auto lo = shard(0), hi = shard(E / 2);
  EXPECT_EQ(lo.scalar_type(), torch::kFloat32);
  torch::NoGradGuard no_grad;
  const auto all = lm::MoeExpertsCpu(l.x, l.ids, l.weights, l.gate_up, l.down);
  EXPECT_LE(MaxAbsDiff(lo + hi, all), 64 * kU * all.abs().max().item<double>());
  EXPECT_TRUE(torch::equal(lo, shard(0))) << "deterministic";
  // bf16 experts: the partial still comes back in fp32 (rounded once, after the all-reduce).
  const auto bf =
      lm::MoeExpertsGroupedFp32(l.x.to(torch::kBFloat16), l.ids, l.weights,
                                l.gate_up.to(torch::kBFloat16), l.down.to(torch::kBFloat16));
  EXPECT_EQ(bf.scalar_type(), torch::kFloat32);
}

// A device's forward kernel is taken when it handles the inputs (and is called without autograd);
// when it returns an undefined tensor the grouped forward runs. The backward is the same.
int kernel_calls = 0;
bool kernel_saw_grad_mode = false;
torch::Tensor CountingKernel(const torch::Tensor& x, const torch::Tensor& ids,
                             const torch::Tensor& weights, const torch::Tensor& gate_up,
                             const torch::Tensor& down) {
  ++kernel_calls;
  kernel_saw_grad_mode = torch::GradMode::is_enabled();
  return lm::MoeExpertsCpu(x, ids, weights, gate_up, down) + 1.0;  // marked, to see it was used
}
torch::Tensor DecliningKernel(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                              const torch::Tensor&, const torch::Tensor&) {
  ++kernel_calls;
  return {};
}

TEST(MoeGrouped, ForwardKernelIsTakenWhereItApplies) {
  const Layer l = MakeLayer(16, 32, 16, 4, 2);
  const Grads plain = Grouped(l, torch::kFloat32);
  kernel_calls = 0;
  const Grads marked = Grouped(l, torch::kFloat32, &CountingKernel);
  EXPECT_EQ(kernel_calls, 1);
  EXPECT_FALSE(kernel_saw_grad_mode);
  EXPECT_LE(MaxAbsDiff(marked[0] - 1.0, plain[0]), 1e-5);
  for (size_t i = 1; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(marked[i], plain[i])) << i;
  const Grads declined = Grouped(l, torch::kFloat32, &DecliningKernel);
  EXPECT_EQ(kernel_calls, 2);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(declined[i], plain[i])) << i;
}

}  // namespace
