// OPD losses against an independent PyTorch reference of the same formulas, on fixed inputs:
// loss values within 1e-6 and gradients within 1e-6 (fp32, same elementwise math).
#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/io/hf_model_dir.h"
#include "lm/io/safetensors.h"
#include "lm/model/logprobs.h"
#include "lm/model/precision.h"
#include "trainer/opd/opd_loss.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

class OpdLoss : public ::testing::Test {
 protected:
  // Inputs are fixed; the Python reference runs once for the whole suite.
  static void SetUpTestSuite() {
    torch::manual_seed(7);
    const int64_t N = 257, k = 8;
    lp_ = -torch::rand({N}) * 3;
    lp_old_ = lp_ + 0.3 * torch::randn({N});  // sampler a little off the learner: ratios spread
    lp_teacher_ = -torch::rand({N}) * 3;
    // Full-vocabulary distributions over V = 64 ids; the teacher sends its top-k.
    student_full_ = torch::randn({N, kVocab}) * 2;
    teacher_full_ = torch::log_softmax(torch::randn({N, kVocab}) * 2, -1);
    auto top = teacher_full_.topk(k, -1);
    teacher_k_ = std::get<0>(top).contiguous();
    topk_ids_ = std::get<1>(top);
    dir_ = fs::temp_directory_path() / ("opd_loss_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    std::vector<std::pair<std::string, torch::Tensor>> in = {
        {"lp", lp_},
        {"lp_old", lp_old_},
        {"lp_teacher", lp_teacher_},
        {"student_full", student_full_},
        {"teacher_full", teacher_full_},
        {"normaliser", torch::tensor({kNorm}, torch::kFloat32)}};
    std::vector<lm::TensorToWrite> w;
    for (auto& [n, t] : in) {
      t = t.contiguous();
      w.push_back(
          {n, lm::DType::kF32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.nbytes())});
    }
    ASSERT_TRUE(lm::WriteSafetensors((dir_ / "in.safetensors").string(), w).ok());
    const std::string cmd =
        std::string(OPD_PYTHON) + " " + OPD_SOURCE_DIR + "/tests/python/opd_loss_reference.py " +
        (dir_ / "in.safetensors").string() + " " + (dir_ / "out.safetensors").string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    auto f = lm::SafetensorsFile::Open((dir_ / "out.safetensors").string());
    ASSERT_TRUE(f.ok()) << f.status();
    for (const auto& [n, v] : (*f)->tensors()) ref_[n] = lm::TensorFromView(v, *f).clone();
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  void CheckSampled(const std::string& name, Correction c) {
    SampledTokenLossOptions o;
    o.correction = c;
    auto lp = lp_.clone().requires_grad_(true);
    LossStats stats;
    auto loss = SampledTokenLoss(lp, lp_old_, lp_teacher_, kNorm, o, &stats);
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), ref_[name + ".loss"].item<double>(), 1e-6) << name;
    EXPECT_LE((lp.grad() - ref_[name + ".grad"]).abs().max().item<double>(), 1e-6) << name;
    EXPECT_EQ(stats.tokens, lp_.numel());
    EXPECT_NEAR(stats.reverse_kl_sum, (lp_ - lp_teacher_).sum().item<double>(), 1e-3);
  }

  static constexpr float kNorm = 300.0f;  // the step's token count exceeds this micro-batch's
  static constexpr int64_t kVocab = 64;
  static inline torch::Tensor lp_, lp_old_, lp_teacher_, student_full_, teacher_full_, teacher_k_,
      topk_ids_;
  static inline std::map<std::string, torch::Tensor> ref_;
  static inline fs::path dir_;
};

TEST_F(OpdLoss, SampledTokenNoCorrection) {
  CheckSampled("none", Correction::kNone);
}
TEST_F(OpdLoss, SampledTokenTruncatedIs) {
  CheckSampled("tis", Correction::kTruncatedIs);
}
TEST_F(OpdLoss, SampledTokenPpoClip) {
  CheckSampled("ppo", Correction::kPpoClip);
}

TEST_F(OpdLoss, TopKForwardReverseMixed) {
  for (auto [name, div, alpha] : {std::tuple{"forward", TopKDivergence::kForward, 1.0},
                                  {"reverse", TopKDivergence::kReverse, 0.0},
                                  {"mixed", TopKDivergence::kMixed, 0.5}}) {
    auto s = student_full_.clone().requires_grad_(true);
    auto loss =
        TopKLoss(torch::log_softmax(s, -1).gather(1, topk_ids_), teacher_k_, kNorm, div, alpha);
    loss.backward();
    const std::string key = std::string("topk_") + name;
    EXPECT_NEAR(loss.item<double>(), ref_[key + ".loss"].item<double>(), 1e-6) << name;
    EXPECT_LE((s.grad() - ref_[key + ".grad"]).abs().max().item<double>(), 1e-6) << name;
  }
}

// With the student equal to the teacher, the sampled-token gradient vanishes (zero advantage)
// and every top-k divergence is zero.
TEST_F(OpdLoss, ZeroWhenStudentMatchesTeacher) {
  auto lp = lp_teacher_.clone().requires_grad_(true);
  SampledTokenLossOptions o;
  auto loss = SampledTokenLoss(lp, lp_teacher_, lp_teacher_, kNorm, o, nullptr);
  loss.backward();
  EXPECT_EQ(lp.grad().abs().max().item<double>(), 0.0);
  EXPECT_NEAR(TopKLoss(teacher_k_, teacher_k_, kNorm, TopKDivergence::kMixed, 0.5).item<double>(),
              0.0, 1e-7);
}

// The tail bucket: a student that keeps the teacher's proportions on the teacher's top-k but puts
// 90% more of its mass elsewhere (q = 0.1 p on the top-k). Renormalised over the top-k alone,
// every divergence was 0 here; over k + 1 buckets, with S the teacher's top-k mass, reverse KL is
// 0.1 S log 0.1 + (1 - 0.1 S) log((1 - 0.1 S) / (1 - S)) per token (computed in fp64; 1e-5
// relative covers the fp32 sums of 8 terms and the logs).
TEST_F(OpdLoss, TopKSeesStudentMassOutsideTheTeachersTopK) {
  auto student_k = teacher_k_ + std::log(0.1);
  const auto S = teacher_k_.to(torch::kFloat64).exp().sum(-1);
  const auto q_tail = 1.0 - 0.1 * S;
  const auto expected =
      ((0.1 * S * std::log(0.1) + q_tail * torch::log(q_tail / (1.0 - S))).sum() / kNorm)
          .item<double>();
  const double got =
      TopKLoss(student_k, teacher_k_, kNorm, TopKDivergence::kReverse, 0).item<double>();
  EXPECT_GT(got, 0.5);
  EXPECT_NEAR(got, expected, 1e-5 * expected);
  EXPECT_GT(TopKLoss(student_k, teacher_k_, kNorm, TopKDivergence::kForward, 1).item<double>(),
            0.5);
}

// The student's top-k log-probs from the hidden states and the LM head, without [n, V] logits or
// an [n, k, H] gather, against log_softmax(hidden W^T / T) gathered at the ids, forward and
// backward (fp32; bmm against matmul sums H = 32 products in another order: 1e-5).
TEST(OpdLossTopK, StudentTopKLogprobsEqualTheFullSoftmax) {
  torch::manual_seed(3);
  const int64_t n = 37, H = 32, V = 50, k = 6;
  const double T = 0.7;
  auto hidden = torch::randn({n, H}).requires_grad_(true);
  auto weight = (torch::randn({V, H}) * 0.3).requires_grad_(true);
  auto ids = torch::randint(V, {n, k}, torch::kInt64);
  auto targets = torch::randint(V, {n}, torch::kInt64);
  auto full = torch::log_softmax(torch::matmul(hidden, weight.t()) / T, -1);
  auto lp = full.gather(1, targets.unsqueeze(1)).squeeze(1);
  auto ours = StudentTopKLogprobs(hidden, weight, ids, targets, lp, T);
  auto ref = full.gather(1, ids);
  EXPECT_LE((ours - ref).abs().max().item<double>(), 1e-5);
  auto g = torch::randn({n, k});
  auto [gh, gw] = [&] {
    auto r = torch::autograd::grad({ours}, {hidden, weight}, {g}, /*retain_graph=*/true);
    return std::pair{r[0], r[1]};
  }();
  auto r = torch::autograd::grad({ref}, {hidden, weight}, {g});
  EXPECT_LE((gh - r[0]).abs().max().item<double>(), 1e-5);
  EXPECT_LE((gw - r[1]).abs().max().item<double>(), 1e-5);
}

// Under bf16-mixed (CPU autocast) the top-k log-probs come from the same fp32 arithmetic as the
// sampled token's log-prob that carries their normaliser. Operands are bf16-exact (the learner's
// hidden states and compute weights are bf16), so each product is exact in fp32 and a logit's sum
// of H products errs by at most gamma_H * S (gamma_H = H 2^-24, S = max_n sum_i |h_i w_i|); a
// top-k log-prob (z_k - z_target) / T + lp_target then errs by at most B = 4 gamma_H S / T + 1e-6
// (two logits, the target's log-prob with its log-sum-exp). Student = teacher must then give
// log-probs within B of the exact ones, buckets that sum to 1 (the top-k mass below 1), and a
// mixed KL of at most 2B per token (|sum p (log p - log q)| <= max |log p - log q| on each side).
// Autocast's bf16 bmm erred by ~2^-9 |z| ~ 1e-2 here: a loss far from 0 where student = teacher.
TEST(OpdLossTopK, Bf16MixedTopKLogprobsShareTheFp32Normaliser) {
  torch::manual_seed(11);
  const int64_t n = 48, H = 64, V = 96, k = 8;
  const double T = 1.0;
  auto hidden = torch::randn({n, H}).to(torch::kBFloat16).to(torch::kFloat32);
  auto weight = (torch::randn({V, H}) * 0.5).to(torch::kBFloat16).to(torch::kFloat32);
  auto targets = torch::randint(V, {n}, torch::kInt64);
  const auto exact = torch::log_softmax(
      torch::matmul(hidden.to(torch::kFloat64), weight.to(torch::kFloat64).t()) / T, -1);
  const auto ids = std::get<1>(exact.topk(k, -1));
  const auto teacher_k = exact.gather(1, ids).to(torch::kFloat32);
  const double S = (hidden.abs().to(torch::kFloat64).matmul(weight.abs().to(torch::kFloat64).t()))
                       .max()
                       .item<double>();
  const double B = 4 * static_cast<double>(H) * std::ldexp(1.0, -24) * S / T + 1e-6;
  torch::Tensor student_k;
  {
    lm::Bf16Autocast autocast(true, torch::kCPU);
    lm::LogprobOptions lo;
    lo.temperature = T;
    const auto lp = lm::TokenLogprobs(hidden, weight, targets, lo);
    student_k = StudentTopKLogprobs(hidden, weight, ids, targets, lp, T);
  }
  ASSERT_EQ(student_k.scalar_type(), torch::kFloat32);
  EXPECT_LE((student_k.to(torch::kFloat64) - exact.gather(1, ids)).abs().max().item<double>(), B)
      << "B = " << B;
  EXPECT_LT(student_k.exp().sum(-1).max().item<double>(), 1.0);
  const double kl =
      TopKLoss(student_k, teacher_k, 1.0, TopKDivergence::kMixed, 0.5).item<double>() /
      static_cast<double>(n);
  EXPECT_LE(std::abs(kl), 2 * B) << "per-token KL where student = teacher";
}

// GatheredLogits' weight gradient in a bf16 weight's dtype, accumulated in fp32: equal to the fp32
// gradient rounded once to bf16.
TEST(OpdLossTopK, GatheredLogitsAccumulatesBf16GradientsInFp32) {
  torch::manual_seed(5);
  const int64_t n = 300, H = 16, V = 7, k = 4;  // many contributions per row
  auto hidden = torch::randn({n, H});
  auto w32 = torch::randn({V, H}).to(torch::kBFloat16).to(torch::kFloat32).requires_grad_(true);
  auto w16 = w32.detach().to(torch::kBFloat16).requires_grad_(true);
  auto ids = torch::randint(V, {n, k}, torch::kInt64);
  auto g = torch::randn({n, k});
  GatheredLogits(hidden, w32, ids).backward(g);
  GatheredLogits(hidden, w16, ids).backward(g);
  ASSERT_EQ(w16.grad().scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(w16.grad(), w32.grad().to(torch::kBFloat16)));
}

// Normalisation is over the step's tokens: two micro-batches with the shared normaliser sum to
// the loss of the whole batch.
TEST_F(OpdLoss, MicroBatchesSumToTheStepLoss) {
  SampledTokenLossOptions o;
  const double total = static_cast<double>(lp_.numel());
  auto whole = SampledTokenLoss(lp_, lp_old_, lp_teacher_, total, o, nullptr);
  auto a = SampledTokenLoss(lp_.narrow(0, 0, 100), lp_old_.narrow(0, 0, 100),
                            lp_teacher_.narrow(0, 0, 100), total, o, nullptr);
  auto b = SampledTokenLoss(lp_.narrow(0, 100, 157), lp_old_.narrow(0, 100, 157),
                            lp_teacher_.narrow(0, 100, 157), total, o, nullptr);
  EXPECT_NEAR((a + b).item<double>(), whole.item<double>(), 1e-6);
}

// "token": every token weighs 1 / (the step's tokens); "sequence": each response's tokens share
// 1 / (the step's responses) equally.
TEST(OpdLossOptions, TokenWeightsForBothNormalizations) {
  const std::vector<int64_t> lengths = {2, 5, 1};
  auto token = TokenWeights(lengths, Normalization::kToken, 20, 4, torch::kFloat64);
  EXPECT_TRUE(torch::allclose(token, torch::full({8}, 1.0 / 20, torch::kFloat64)));
  auto seq = TokenWeights(lengths, Normalization::kSequence, 20, 4, torch::kFloat64);
  EXPECT_DOUBLE_EQ(seq.narrow(0, 0, 2).sum().item<double>(), 0.25);
  EXPECT_DOUBLE_EQ(seq.narrow(0, 2, 5).sum().item<double>(), 0.25);
  EXPECT_DOUBLE_EQ(seq[7].item<double>(), 0.25);
  EXPECT_EQ(*lm::ParseChoice<Normalization>("sequence"), Normalization::kSequence);
  EXPECT_FALSE(lm::ParseChoice<Normalization>("tokens").ok());
}

// R_t = d_t + gamma R_{t+1}, restarting at each response.
TEST(OpdLossOptions, DiscountedSumsStayWithinAResponse) {
  auto d = torch::tensor({1.0, 2.0, 4.0, 8.0, 16.0}, torch::kFloat64);
  auto r = DiscountedSums(d, {3, 2}, 0.5);
  EXPECT_TRUE(torch::equal(
      r, torch::tensor({1.0 + 1.0 + 1.0, 2.0 + 2.0, 4.0, 8.0 + 8.0, 16.0}, torch::kFloat64)));
  EXPECT_TRUE(torch::equal(DiscountedSums(d, {3, 2}, 0), d));
}

// The sampled estimator's expected gradient, on a tabular policy small enough to enumerate every
// response (V = 3 tokens, length 2: the expectation is an exact sum over the 9 responses weighted
// by their probability, so this is the Monte-Carlo estimator's mean without its noise): with
// gamma = 0 it is the gradient of the per-token reverse KL (each position's KL(q || p) under a
// prefix distribution held fixed), with gamma = 1 the gradient of the sequence-level reverse KL.
// fp64 throughout; the two sides sum the same terms in another order (1e-12).
TEST(OpdLossOptions, ExpectedGradientIsTheExactReverseKlGradient) {
  torch::manual_seed(11);
  const auto f64 = torch::kFloat64;
  const int64_t V = 3;
  auto th1 = torch::randn({V}, f64).requires_grad_(true);
  auto th2 = torch::randn({V, V}, f64).requires_grad_(true);
  const auto p1 = torch::log_softmax(torch::randn({V}, f64), -1);
  const auto p2 = torch::log_softmax(torch::randn({V, V}, f64), -1);
  auto expected_gradient = [&](double gamma) {
    SampledTokenLossOptions o;
    o.correction = Correction::kNone;
    o.kl_discount = gamma;
    const auto q1 = torch::log_softmax(th1, -1);
    const auto q2 = torch::log_softmax(th2, -1);
    torch::Tensor total = torch::zeros({}, f64);
    for (int64_t a = 0; a < V; ++a)
      for (int64_t b = 0; b < V; ++b) {
        auto lp = torch::stack({q1[a], q2[a][b]});
        auto lpt = torch::stack({p1[a], p2[a][b]});
        auto loss = SampledTokenLoss(lp, lp.detach(), lpt, torch::ones({2}, f64), {2}, o, nullptr);
        total = total + (q1[a] + q2[a][b]).exp().detach() * loss;
      }
    auto g = torch::autograd::grad({total}, {th1, th2});
    return torch::cat({g[0].reshape(-1), g[1].reshape(-1)});
  };
  auto exact_gradient = [&](bool sequence_level) {
    const auto q1 = torch::log_softmax(th1, -1);
    const auto q2 = torch::log_softmax(th2, -1);
    const auto kl1 = (q1.exp() * (q1 - p1)).sum();
    const auto kl2 = (q2.exp() * (q2 - p2)).sum(-1);  // [V]: KL at position 2 after each a
    const auto w = sequence_level ? q1.exp() : q1.exp().detach();
    auto g = torch::autograd::grad({kl1 + (w * kl2).sum()}, {th1, th2});
    return torch::cat({g[0].reshape(-1), g[1].reshape(-1)});
  };
  EXPECT_LE((expected_gradient(0) - exact_gradient(false)).abs().max().item<double>(), 1e-12);
  EXPECT_LE((expected_gradient(1) - exact_gradient(true)).abs().max().item<double>(), 1e-12);
  // The two objectives differ here, so the test tells the discounts apart.
  EXPECT_GT((exact_gradient(true) - exact_gradient(false)).abs().max().item<double>(), 1e-3);
}

// The loss's options are the config's words (trainer/opd/opd_config.h), parsed once.
TEST(OpdLossParse, NamesAndErrors) {
  EXPECT_EQ(*lm::ParseChoice<Correction>("ppo"), Correction::kPpoClip);
  EXPECT_EQ(*lm::ParseChoice<TopKDivergence>("mixed"), TopKDivergence::kMixed);
  EXPECT_STREQ(lm::ChoiceName(Correction::kTruncatedIs), "tis");
  auto bad = lm::ParseChoice<Correction>("clipped");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "'clipped' is not one of none, tis, ppo");
}

}  // namespace
}  // namespace trainer
