// Packed (varlen) causal attention against the formula: softmax(q k^T * scale + causal mask
// within each document) v, computed in fp64 with the KV heads repeated for GQA. The path under
// test builds no mask (CPU: causal flash-style SDPA over right-padded buckets of documents; CUDA:
// one FlashAttention varlen launch), so this reference is independent of it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/SDPBackend.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "gpu.h"
#include "lm/model/layers.h"

namespace {

// Block-diagonal causal attention in fp64: q [T, Hq, D], k/v [T, Hkv, D].
torch::Tensor Reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::vector<int64_t>& cu, double scale) {
  const int64_t T = q.size(0), group = q.size(1) / k.size(1);
  auto qd = q.to(torch::kFloat64).transpose(0, 1);  // [Hq, T, D]
  auto kd = k.to(torch::kFloat64).repeat_interleave(group, 1).transpose(0, 1);
  auto vd = v.to(torch::kFloat64).repeat_interleave(group, 1).transpose(0, 1);
  std::vector<int64_t> doc(T);
  for (size_t b = 0; b + 1 < cu.size(); ++b)
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) doc[t] = static_cast<int64_t>(b);
  auto d = torch::tensor(doc, torch::kInt64);
  auto pos = torch::arange(T);
  auto allowed = (d.unsqueeze(1) == d.unsqueeze(0)) & (pos.unsqueeze(1) >= pos.unsqueeze(0));
  auto scores = torch::matmul(qd, kd.transpose(1, 2)) * scale;
  scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1), vd).transpose(0, 1);  // [T, Hq, D]
}

double MaxAbs(const torch::Tensor& x) {
  return x.abs().max().item<double>();
}

struct Case {
  std::vector<int64_t> lengths;
  int64_t hq, hkv, d;
};

std::vector<int64_t> Cumulative(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

// Ragged documents (length 1 among them), GQA 1, 2 and 4, a single document.
std::vector<Case> Cases() {
  return {{{7, 1, 33, 12, 64, 2}, 4, 4, 16},
          {{5, 40, 1, 1, 17}, 4, 2, 32},
          {{100, 3, 61}, 8, 2, 64},
          {{129}, 4, 1, 16}};
}

TEST(VarlenAttention, MatchesTheFormulaForwardAndBackward) {
  torch::manual_seed(3);
  for (const Case& c : Cases()) {
    const auto cu = Cumulative(c.lengths);
    const int64_t T = cu.back();
    const int64_t max_len = *std::max_element(c.lengths.begin(), c.lengths.end());
    auto q = torch::randn({T, c.hq, c.d}).requires_grad_();
    auto k = torch::randn({T, c.hkv, c.d}).requires_grad_();
    auto v = torch::randn({T, c.hkv, c.d}).requires_grad_();
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    auto out = lm::VarlenCausalAttention(q, k, v, cu, scale);
    auto w = torch::randn_like(out);  // a random cotangent exercises every output row
    auto grads = torch::autograd::grad({(out * w).sum()}, {q, k, v});

    auto qr = q.detach().to(torch::kFloat64).requires_grad_();
    auto kr = k.detach().to(torch::kFloat64).requires_grad_();
    auto vr = v.detach().to(torch::kFloat64).requires_grad_();
    auto ref = Reference(qr, kr, vr, cu, scale);
    auto ref_grads = torch::autograd::grad({(ref * w.to(torch::kFloat64)).sum()}, {qr, kr, vr});

    // fp32 against fp64: a D-term dot product and a softmax-weighted sum over at most max_len
    // keys each carry at most ~(D + max_len) fp32 roundings relative to the largest magnitude
    // involved; the gradients chain two such products (x2).
    const double eps = std::numeric_limits<float>::epsilon();
    const double tol = (c.d + max_len) * eps;
    ASSERT_EQ(out.sizes(), ref.sizes());
    EXPECT_LE(MaxAbs(out.detach().to(torch::kFloat64) - ref), tol * MaxAbs(ref))
        << "forward, hq " << c.hq << " hkv " << c.hkv;
    const char* names[] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
      EXPECT_LE(MaxAbs(grads[i].to(torch::kFloat64) - ref_grads[i]), 2 * tol * MaxAbs(ref_grads[i]))
          << "d" << names[i] << ", hq " << c.hq << " hkv " << c.hkv;
    }
  }
}

// The CPU path must land on the flash kernel (which tiles the scores): the math fallback would
// materialise [Hq, L, L] scores, which is what this path exists to avoid.
TEST(VarlenAttention, CpuDocumentsUseTheFlashKernel) {
  for (const Case& c : Cases()) {
    const int64_t L = c.lengths.front();
    auto q = torch::randn({1, c.hq, L, c.d});
    auto k = torch::randn({1, c.hkv, L, c.d});
    const int64_t backend =
        at::_fused_sdp_choice(q, k, k, {}, 0.0, /*is_causal=*/true,
                              1.0 / std::sqrt(static_cast<double>(c.d)), c.hq != c.hkv);
    EXPECT_EQ(backend, static_cast<int64_t>(at::SDPBackend::flash_attention))
        << "hq " << c.hq << " hkv " << c.hkv << " d " << c.d;
  }
}

TEST(VarlenAttention, EmptyDocumentsAndBoundariesChecked) {
  auto q = torch::randn({5, 2, 8}), k = torch::randn({5, 1, 8});
  auto with_empty = lm::VarlenCausalAttention(q, k, k, {0, 2, 2, 5}, 0.3);
  auto without = lm::VarlenCausalAttention(q, k, k, {0, 2, 5}, 0.3);
  EXPECT_TRUE(torch::equal(with_empty, without));
  EXPECT_THROW(lm::VarlenCausalAttention(q, k, k, {0, 4}, 0.3), c10::Error);
}

// CUDA: FlashAttention's varlen kernel in bf16 against the fp64 formula on the same
// bf16-rounded inputs. The kernel accumulates in fp32 and rounds its output to bf16 once: half a
// bf16 ulp (2^-9 relative) plus fp32 accumulation, so 2^-7 of the largest output is generous;
// the backward's bf16 gradients pass through two rounded products and bf16 dO: 2^-5.
TEST(VarlenAttentionGpu, FlashVarlenMatchesTheFormula) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(4);
  for (const Case& c : Cases()) {
    const auto cu = Cumulative(c.lengths);
    const int64_t T = cu.back();
    auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
    auto q = torch::randn({T, c.hq, c.d}, opts).requires_grad_();
    auto k = torch::randn({T, c.hkv, c.d}, opts).requires_grad_();
    auto v = torch::randn({T, c.hkv, c.d}, opts).requires_grad_();
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    auto out = lm::VarlenCausalAttention(q, k, v, cu, scale);
    auto w = torch::randn_like(out);
    auto grads = torch::autograd::grad({(out * w).sum()}, {q, k, v});

    auto cpu = [](const torch::Tensor& x) {
      return x.detach().cpu().to(torch::kFloat64).requires_grad_();
    };
    auto qr = cpu(q), kr = cpu(k), vr = cpu(v);
    auto ref = Reference(qr, kr, vr, cu, scale);
    auto ref_grads =
        torch::autograd::grad({(ref * w.cpu().to(torch::kFloat64)).sum()}, {qr, kr, vr});
    EXPECT_LE(MaxAbs(out.detach().cpu().to(torch::kFloat64) - ref),
              std::ldexp(1.0, -7) * MaxAbs(ref));
    for (int i = 0; i < 3; ++i) {
      EXPECT_LE(MaxAbs(grads[i].cpu().to(torch::kFloat64) - ref_grads[i]),
                std::ldexp(1.0, -5) * MaxAbs(ref_grads[i]))
          << "gradient " << i;
    }
  }
}

}  // namespace
