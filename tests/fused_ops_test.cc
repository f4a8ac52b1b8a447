// The fused small ops (lm::FastPaths::add_rms_norm, qk_norm_rope, route_topk, route_weights):
// the CPU twins (kernels/cpu/fused_ops.h) and the CUDA kernels (kernels/cuda/fused_ops.cuh, the
// router's TopkSoftmax) against today's library op chains (RMSNormImpl::Reference, Rope::Apply,
// softmax + topk), at the shapes Marco-Nano and Qwen3-30B use (hidden 2048, heads 16/8 and 32/4
// x 128, 128 experts top-8) and odd ones (dims not a multiple of 8, partial RoPE), plus the
// model code that takes them (RMSNormImpl::forward/AddForward, QkNormRope, lm::Route and
// RouteForced, RouterImpl::Fp32Weight). GPU cases skip without a device (tests/gpu.h).
//
// Bounds (u = 2^-24, gamma_n = n u / (1 - n u), elementwise, against the reference's values):
//   - RMSNorm, fp32: the fused op and the library sum the same n squares in another order; any
//     order's error is at most gamma_n of the sum, so the two means differ by at most 2 gamma_n
//     relative, the rsqrt (half the exponent) by gamma_n, plus a rounding in each of sqrt, the
//     division, x * r and w * n on each side: (gamma_n + 8u) |out|.
//   - RMSNorm, bf16: the same ops, with the normalised row and the product rounded to bf16 on
//     both sides (a bf16 ulp is at most 2^-7 relative); two values that differ by d round to
//     values at most d + 1 ulp apart, twice: (gamma_n + 8u + 2^-6) |out|.
//   - q/k-norm + RoPE, fp32: the op order is the reference's, so only the norm's factor differs
//     (as above): (gamma_D + 8u) (|n_d cos_d| + |n_p sin_d|), n the normalised values, p the
//     rotation partner.
//   - q/k-norm + RoPE, bf16: the reference rounds the normalised row, its product with the
//     weight, cos and sin, both products and their sum to bf16 (each half an ulp, <= 2^-8
//     relative); the fused op rounds once. First order: 4 roundings per product term and one
//     sum on each side: (6 2^-8 (1.1 for second-order terms) + gamma_D + 8u) (|n_d cos_d| +
//     |n_p sin_d|). Against the exact math (fp64) the fused op is within half a bf16 ulp plus
//     the fp32 bound.
//   - Router weights: exp within an ulp on each side (glibc's expf, the library's vectorised exp
//     or CUDA's expf), a sum of E of them in another order, a division, and for renormalisation
//     a sum of k and one more division: (gamma_E + gamma_k + 10u) |w|.
#include <cmath>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/model/fast_paths.h"
#include "lm/model/layers.h"
#include "lm/model/moe.h"
#include "tests/gpu.h"

namespace {

constexpr double kU = 0x1.0p-24;
double Gamma(int64_t n) {
  return n * kU / (1 - n * kU);
}

// max |got - want| / bound over the elements (fp64); infinity on a NaN or a shape mismatch.
double WorstRatio(const torch::Tensor& got, const torch::Tensor& want, const torch::Tensor& bound) {
  if (got.sizes() != want.sizes()) return INFINITY;
  auto g = got.to(torch::kCPU, torch::kFloat64), w = want.to(torch::kCPU, torch::kFloat64);
  if (g.isnan().any().item<bool>() || w.isnan().any().item<bool>()) return INFINITY;
  if (g.numel() == 0) return 0.0;
  return ((g - w).abs() / (bound.to(torch::kCPU, torch::kFloat64) + 1e-30)).max().item<double>();
}

const lm::FastPaths& Cpu() {
  return lm::FastPathsFor(torch::kCPU);
}
const lm::FastPaths& Cuda() {
  return lm::FastPathsFor(torch::kCUDA);
}

// ---- RMSNorm with the residual add ----

lm::RMSNorm Norm(int64_t H, torch::ScalarType dtype) {
  lm::RMSNorm n(H, 1e-6);
  torch::NoGradGuard no_grad;
  n->weight.copy_(torch::rand({H}) + 0.5);
  n->to(dtype);
  return n;
}

// The fused op on `device` against the reference at rows x H with and without a residual.
void CheckAddRmsNorm(const lm::FastPaths& fast, torch::Device device, torch::ScalarType dtype) {
  ASSERT_NE(fast.add_rms_norm, nullptr);
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  double worst = 0;
  for (int64_t H : {2048, 64, 20})
    for (int64_t rows : {1, 5, 256})
      for (bool add : {true, false}) {
        auto norm = Norm(H, dtype);
        auto x = (torch::randn({rows, H}) * 3).to(dtype);
        auto r = add ? (torch::randn({rows, H}) * 5).to(dtype) : torch::Tensor();
        auto sum_ref = add ? x + r : x;
        auto ref = norm->Reference(sum_ref);
        torch::Tensor out, sum;
        ASSERT_TRUE(fast.add_rms_norm(x.to(device), add ? r.to(device) : r, norm->weight.to(device),
                                      norm->eps, &out, &sum))
            << "H " << H << " rows " << rows;
        const std::string what = "H " + std::to_string(H) + " rows " + std::to_string(rows) +
                                 (add ? " with" : " without") + " residual";
        EXPECT_EQ(out.scalar_type(), dtype);
        if (add) {
          EXPECT_TRUE(torch::equal(sum.cpu(), sum_ref)) << what << ": the add rounds alike";
        }
        const double rel = Gamma(H) + 8 * kU + (dtype == torch::kFloat32 ? 0.0 : 0x1.0p-6);
        // |out| of the exact math: w * x * r in fp64.
        auto s64 = sum_ref.to(torch::kFloat64);
        auto exact = norm->weight.to(torch::kFloat64) * s64 *
                     torch::rsqrt(s64.pow(2).mean(-1, true) + norm->eps);
        const double ratio = WorstRatio(out, ref, rel * exact.abs() * (1 + 0x1.0p-7));
        EXPECT_LE(ratio, 1.0) << what;
        worst = std::max(worst, ratio);
      }
  std::cout << "add_rms_norm " << device << " " << dtype << ": worst error / bound " << worst
            << "\n";
}

TEST(FusedOps, CpuTwinsAreRegistered) {
  EXPECT_NE(Cpu().add_rms_norm, nullptr);
  EXPECT_NE(Cpu().qk_norm_rope, nullptr);
  EXPECT_NE(Cpu().route_topk, nullptr);
  EXPECT_NE(Cpu().route_weights, nullptr);
}

TEST(FusedOps, AddRmsNormCpuEqualsReferenceFp32) {
  CheckAddRmsNorm(Cpu(), torch::kCPU, torch::kFloat32);
}

TEST(FusedOps, AddRmsNormCpuEqualsReferenceBf16) {
  CheckAddRmsNorm(Cpu(), torch::kCPU, torch::kBFloat16);
}

// The module takes the fused op without autograd (its result bit for bit) and the op chain with
// it; AddForward leaves x + residual in the residual either way.
TEST(FusedOps, RmsNormModuleTakesTheFusedOpWithoutAutograd) {
  torch::manual_seed(5);
  auto norm = Norm(64, torch::kFloat32);
  auto x = torch::randn({7, 64}), r = torch::randn({7, 64});
  torch::Tensor fused, sum;
  ASSERT_TRUE(Cpu().add_rms_norm(x, r, norm->weight.detach(), norm->eps, &fused, &sum));
  {
    torch::NoGradGuard no_grad;
    torch::Tensor residual = r;
    auto out = norm->AddForward(x, residual);
    EXPECT_TRUE(torch::equal(out, fused));
    EXPECT_TRUE(torch::equal(residual, r + x));
    torch::Tensor plain, unused;
    ASSERT_TRUE(Cpu().add_rms_norm(x, {}, norm->weight.detach(), norm->eps, &plain, &unused));
    EXPECT_TRUE(torch::equal(norm->forward(x), plain));
  }
  ASSERT_TRUE(norm->weight.requires_grad());
  torch::Tensor residual = r;
  auto out = norm->AddForward(x, residual);
  EXPECT_TRUE(out.requires_grad()) << "autograd takes the op chain";
  EXPECT_TRUE(torch::equal(out.detach(), norm->Reference(r + x).detach()));
  EXPECT_TRUE(torch::equal(residual, r + x));
}

// ---- q/k-norm + RoPE ----

struct QkCase {
  int64_t tokens, q_heads, kv_heads, dim, rotary;
};

void CheckQkNormRope(const lm::FastPaths& fast, torch::Device device, torch::ScalarType dtype) {
  ASSERT_NE(fast.qk_norm_rope, nullptr);
  torch::NoGradGuard no_grad;
  torch::manual_seed(9);
  double worst = 0, worst_exact = 0;
  // Marco-Nano 16/8 x 128, Qwen3-30B 32/4 x 128, partial RoPE, a dim not a multiple of 8.
  for (QkCase c : {QkCase{5, 16, 8, 128, 128}, QkCase{3, 32, 4, 128, 128}, QkCase{4, 4, 2, 64, 32},
                   QkCase{2, 3, 1, 12, 12}}) {
    lm::RMSNorm q_norm = Norm(c.dim, dtype), k_norm = Norm(c.dim, dtype);
    lm::Rope rope(c.rotary, 1e6);
    auto positions = torch::randint(0, 40000, {c.tokens}, torch::kInt64);
    auto [cos, sin] = rope.Tables(positions);
    auto q = (torch::randn({c.tokens, c.q_heads, c.dim}) * 2).to(dtype);
    auto k = (torch::randn({c.tokens, c.kv_heads, c.dim}) * 2).to(dtype);
    auto q_ref = rope.Apply(q_norm->Reference(q), cos, sin);
    auto k_ref = rope.Apply(k_norm->Reference(k), cos, sin);
    auto qd = q.to(device), kd = k.to(device);
    auto q_out = torch::empty_like(qd), k_out = torch::empty_like(kd);
    ASSERT_TRUE(fast.qk_norm_rope(qd, kd, q_norm->weight.to(device), k_norm->weight.to(device),
                                  cos.to(device), sin.to(device), 1e-6, q_out, k_out));
    // In place gives the same bits.
    auto qi = qd.clone(), ki = kd.clone();
    ASSERT_TRUE(fast.qk_norm_rope(qi, ki, q_norm->weight.to(device), k_norm->weight.to(device),
                                  cos.to(device), sin.to(device), 1e-6, qi, ki));
    EXPECT_TRUE(torch::equal(qi, q_out));
    EXPECT_TRUE(torch::equal(ki, k_out));
    EXPECT_TRUE(torch::equal(qd, q.to(device))) << "out of place leaves q alone";
    const std::string what = std::to_string(c.q_heads) + "/" + std::to_string(c.kv_heads) + " x " +
                             std::to_string(c.dim) + " rotary " + std::to_string(c.rotary);
    const double rel = Gamma(c.dim) + 8 * kU + (dtype == torch::kFloat32 ? 0 : 6 * 0x1.0p-8 * 1.1);
    for (auto [x, w, got, ref] : {std::tuple{q, q_norm->weight, q_out, q_ref},
                                  std::tuple{k, k_norm->weight, k_out, k_ref}}) {
      // The exact math in fp64 and its magnitude terms |n_d cos_d| + |n_p sin_d|.
      auto x64 = x.to(torch::kFloat64);
      auto n = w.to(torch::kFloat64) * x64 * torch::rsqrt(x64.pow(2).mean(-1, true) + 1e-6);
      auto nr = n.narrow(-1, 0, c.rotary);
      const int64_t h = c.rotary / 2;
      auto partner = torch::cat({nr.narrow(-1, h, h), nr.narrow(-1, 0, h)}, -1);
      auto c64 = cos.to(torch::kFloat64).unsqueeze(1), s64 = sin.to(torch::kFloat64).unsqueeze(1);
      auto sign = torch::cat({-torch::ones({h}), torch::ones({h})}).to(torch::kFloat64);
      auto exact = n.clone();
      exact.narrow(-1, 0, c.rotary).copy_(nr * c64 + sign * partner * s64);
      auto mag = n.abs().clone();
      mag.narrow(-1, 0, c.rotary).copy_(nr.abs() * c64.abs() + partner.abs() * s64.abs());
      const double ratio = WorstRatio(got, ref, rel * mag);
      EXPECT_LE(ratio, 1.0) << what;
      worst = std::max(worst, ratio);
      // Against the exact math: half an ulp of the dtype plus the fp32 bound.
      const double half_ulp = dtype == torch::kFloat32 ? 0.5 * kU : 0x1.0p-8;
      const double ratio_exact =
          WorstRatio(got, exact, (Gamma(c.dim) + 8 * kU) * mag + half_ulp * exact.abs() * 1.01);
      EXPECT_LE(ratio_exact, 1.0) << what << " against the exact math";
      worst_exact = std::max(worst_exact, ratio_exact);
    }
  }
  std::cout << "qk_norm_rope " << device << " " << dtype << ": worst error / bound " << worst
            << " (against the exact math " << worst_exact << ")\n";
}

TEST(FusedOps, QkNormRopeCpuEqualsReferenceFp32) {
  CheckQkNormRope(Cpu(), torch::kCPU, torch::kFloat32);
}

TEST(FusedOps, QkNormRopeCpuEqualsReferenceBf16) {
  CheckQkNormRope(Cpu(), torch::kCPU, torch::kBFloat16);
}

// lm::QkNormRope takes the fused op without autograd (in place over its inputs when asked) and
// the reference chain with it.
TEST(FusedOps, QkNormRopeModelEntryTakesTheFusedOpWithoutAutograd) {
  torch::manual_seed(2);
  lm::RMSNorm q_norm = Norm(16, torch::kFloat32), k_norm = Norm(16, torch::kFloat32);
  lm::Rope rope(16, 10000);
  auto [cos, sin] = rope.Tables(torch::arange(3));
  auto q = torch::randn({3, 4, 16}), k = torch::randn({3, 2, 16});
  auto q_out = torch::empty_like(q), k_out = torch::empty_like(k);
  ASSERT_TRUE(Cpu().qk_norm_rope(q, k, q_norm->weight.detach(), k_norm->weight.detach(), cos, sin,
                                 1e-6, q_out, k_out));
  {
    torch::NoGradGuard no_grad;
    auto qc = q.clone(), kc = k.clone();
    auto [qo, ko] = lm::QkNormRope(qc, kc, *q_norm, *k_norm, rope, cos, sin, /*in_place=*/true);
    EXPECT_TRUE(torch::equal(qo, q_out));
    EXPECT_TRUE(torch::equal(ko, k_out));
    EXPECT_EQ(qo.data_ptr(), qc.data_ptr()) << "in place";
  }
  auto [qg, kg] = lm::QkNormRope(q, k, *q_norm, *k_norm, rope, cos, sin, /*in_place=*/true);
  EXPECT_TRUE(qg.requires_grad());
  EXPECT_TRUE(torch::equal(qg.detach(), rope.Apply(q_norm->Reference(q), cos, sin).detach()));
  EXPECT_TRUE(torch::equal(kg.detach(), rope.Apply(k_norm->Reference(k), cos, sin).detach()));
}

// ---- router softmax + top-k ----

std::pair<torch::Tensor, torch::Tensor> ReferenceRoute(const torch::Tensor& logits, int64_t k,
                                                       bool renorm) {
  auto probs = torch::softmax(logits, -1, torch::kFloat32);
  auto [w, ids] = probs.topk(k, -1);
  if (renorm) w = w / w.sum(-1, true);
  return {w, ids};
}

void CheckRouter(const lm::FastPaths& fast, torch::Device device) {
  ASSERT_NE(fast.route_topk, nullptr);
  torch::NoGradGuard no_grad;
  torch::manual_seed(4);
  double worst = 0;
  for (int64_t E : {128, 64, 8})
    for (int64_t k : {1, 2, 8})
      for (int64_t T : {1, 7, 300})
        for (bool renorm : {true, false}) {
          auto logits = torch::randn({T, E}) * 3;
          auto [w_ref, ids_ref] = ReferenceRoute(logits, k, renorm);
          torch::Tensor w, ids;
          ASSERT_TRUE(fast.route_topk(logits.to(device), k, renorm, &w, &ids));
          const std::string what = "E " + std::to_string(E) + " k " + std::to_string(k) + " T " +
                                   std::to_string(T) + (renorm ? " renorm" : "");
          EXPECT_EQ(ids.scalar_type(), torch::kInt64);
          EXPECT_EQ(w.scalar_type(), torch::kFloat32);
          EXPECT_TRUE(torch::equal(ids.cpu(), ids_ref)) << what;
          const double ratio = WorstRatio(
              w, w_ref, (Gamma(E) + Gamma(k) + 10 * kU) * w_ref.abs().to(torch::kFloat64));
          EXPECT_LE(ratio, 1.0) << what;
          worst = std::max(worst, ratio);
        }
  // Exact ties (multiples of 1/4, whole rows equal): the lower expert id first, i.e. a stable
  // descending sort. torch.topk leaves the order of equal values unspecified.
  auto tied = (torch::randn({64, 128}) * 4).round().clamp(-32, 32) / 4;
  tied[0].fill_(0.5);
  tied[1].narrow(0, 64, 64).fill_(3.0);
  torch::Tensor w, ids;
  ASSERT_TRUE(fast.route_topk(tied.to(device), 8, true, &w, &ids));
  auto stable = std::get<1>(tied.sort(/*stable=*/true, 1, /*descending=*/true)).narrow(1, 0, 8);
  EXPECT_TRUE(torch::equal(ids.cpu(), stable));
  std::cout << "route_topk " << device << ": worst error / bound " << worst << "\n";
}

TEST(FusedOps, RouterTopkCpuEqualsReference) {
  CheckRouter(Cpu(), torch::kCPU);
}

// NaN logits give NaN weights (a broken model shows), never a crash or a read out of bounds.
TEST(FusedOps, RouterTopkCpuPassesNaNOn) {
  auto logits = torch::randn({3, 16});
  logits[1][5] = std::nan("");
  torch::Tensor w, ids;
  ASSERT_TRUE(Cpu().route_topk(logits, 4, true, &w, &ids));
  EXPECT_TRUE(w[1].isnan().all().item<bool>());
  EXPECT_EQ(ids[1][0].item<int64_t>(), 5);
  EXPECT_FALSE(w[0].isnan().any().item<bool>());
}

// route_weights at the router's own ids is route_topk's weights bit for bit, and at any ids the
// softmax there; lm::Route and RouteForced take them without autograd, the op chain with it.
TEST(FusedOps, RouteAndReplayTakeTheFusedRouterWithoutAutograd) {
  torch::manual_seed(8);
  const int64_t T = 9, H = 32, E = 16, k = 4;
  auto x = torch::randn({T, H});
  auto gate = torch::randn({E, H}, torch::requires_grad());
  torch::Tensor w_fast, ids_fast, w_at;
  auto logits = torch::linear(x, gate.detach());
  ASSERT_TRUE(Cpu().route_topk(logits, k, true, &w_fast, &ids_fast));
  ASSERT_TRUE(Cpu().route_weights(logits, ids_fast, true, &w_at));
  EXPECT_TRUE(torch::equal(w_at, w_fast));
  auto other = torch::randint(0, E, {T, k}, torch::kInt64);
  torch::Tensor w_other;
  ASSERT_TRUE(Cpu().route_weights(logits, other, false, &w_other));
  auto want = torch::softmax(logits, -1).gather(1, other);
  EXPECT_LE(WorstRatio(w_other, want, (Gamma(E) + 10 * kU) * want.abs().to(torch::kFloat64)), 1);
  {
    torch::NoGradGuard no_grad;
    lm::Routing r = lm::Route(x, gate, k, true);
    EXPECT_TRUE(torch::equal(r.ids, ids_fast));
    EXPECT_TRUE(torch::equal(r.weights, w_fast));
    // Replaying its own routing, with one row left to the router (-1), gives the same weights.
    auto forced = ids_fast.clone();
    forced[3].fill_(-1);
    lm::Routing replay = lm::RouteForced(x, gate, forced, true);
    EXPECT_TRUE(torch::equal(replay.ids, ids_fast));
    EXPECT_TRUE(torch::equal(replay.weights, w_fast));
  }
  lm::Routing train = lm::Route(x, gate, k, true);
  EXPECT_TRUE(train.weights.requires_grad()) << "autograd takes the op chain";
  auto [w_ref, ids_ref] = ReferenceRoute(logits, k, true);
  EXPECT_TRUE(torch::equal(train.ids, ids_ref));
  EXPECT_TRUE(torch::equal(train.weights.detach(), w_ref));
}

// ---- the router's fp32 gate ----

// A bf16 gate is converted to fp32 once (later calls return the same tensor, no new copy), again
// after an in-place update (into the same tensor, so a captured graph reads the new values) and
// never when the gate is fp32 or needs a gradient.
TEST(FusedOps, RouterGateIsConvertedOnceAndAfterUpdates) {
  torch::manual_seed(6);
  lm::Router router(8, 32);
  {
    torch::NoGradGuard no_grad;
    router->weight.normal_();
  }
  EXPECT_EQ(router->Fp32Weight().data_ptr(), router->weight.data_ptr()) << "fp32: itself";
  router->to(torch::kBFloat16);
  {
    torch::NoGradGuard no_grad;
    auto a = router->Fp32Weight();
    EXPECT_EQ(a.scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(a, router->weight.to(torch::kFloat32)));
    auto b = router->Fp32Weight();
    EXPECT_EQ(a.data_ptr(), b.data_ptr()) << "converted again while the copy is alive";
    router->weight.copy_(torch::randn({8, 32}).to(torch::kBFloat16));  // a weight update
    auto c = router->Fp32Weight();
    EXPECT_EQ(c.data_ptr(), a.data_ptr()) << "refreshed in place";
    EXPECT_TRUE(torch::equal(c, router->weight.to(torch::kFloat32)));
    router->weight.mul_(2);
    EXPECT_TRUE(torch::equal(router->Fp32Weight(), router->weight.to(torch::kFloat32)));
  }
  // Under autograd a gate that needs a gradient is used as it is (Route casts it in the graph).
  ASSERT_TRUE(router->weight.requires_grad());
  EXPECT_EQ(router->Fp32Weight().data_ptr(), router->weight.data_ptr());
}

// ---- CUDA ----

TEST(FusedOps, AddRmsNormCudaEqualsReference) {
  SKIP_WITHOUT_CUDA();
  CheckAddRmsNorm(Cuda(), torch::kCUDA, torch::kFloat32);
  CheckAddRmsNorm(Cuda(), torch::kCUDA, torch::kBFloat16);
}

TEST(FusedOps, QkNormRopeCudaEqualsReference) {
  SKIP_WITHOUT_CUDA();
  CheckQkNormRope(Cuda(), torch::kCUDA, torch::kFloat32);
  CheckQkNormRope(Cuda(), torch::kCUDA, torch::kBFloat16);
}

TEST(FusedOps, RouterTopkCudaEqualsReference) {
  SKIP_WITHOUT_CUDA();
  CheckRouter(Cuda(), torch::kCUDA);
}

// The CUDA kernels and the CPU twins compute the same function: fp32 within the fp32 bounds
// above (twice: each side against the reference), routing ids equal.
TEST(FusedOps, CudaKernelsAgreeWithTheCpuTwins) {
  SKIP_WITHOUT_CUDA();
  torch::NoGradGuard no_grad;
  torch::manual_seed(12);
  auto norm = Norm(2048, torch::kFloat32);
  auto x = torch::randn({64, 2048}), r = torch::randn({64, 2048});
  torch::Tensor oc, sc, og, sg;
  ASSERT_TRUE(Cpu().add_rms_norm(x, r, norm->weight, 1e-6, &oc, &sc));
  ASSERT_TRUE(Cuda().add_rms_norm(x.cuda(), r.cuda(), norm->weight.cuda(), 1e-6, &og, &sg));
  EXPECT_TRUE(torch::equal(sc, sg.cpu()));
  EXPECT_LE(WorstRatio(og, oc, 2 * (Gamma(2048) + 8 * kU) * oc.abs().to(torch::kFloat64)), 1);
  auto logits = torch::randn({256, 128}) * 3;
  torch::Tensor wc, ic, wg, ig;
  ASSERT_TRUE(Cpu().route_topk(logits, 8, true, &wc, &ic));
  ASSERT_TRUE(Cuda().route_topk(logits.cuda(), 8, true, &wg, &ig));
  EXPECT_TRUE(torch::equal(ic, ig.cpu()));
  EXPECT_LE(
      WorstRatio(wg, wc, 2 * (Gamma(128) + Gamma(8) + 10 * kU) * wc.abs().to(torch::kFloat64)), 1);
}

}  // namespace
