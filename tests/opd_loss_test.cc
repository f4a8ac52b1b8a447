// OPD losses against an independent PyTorch reference of the same formulas, on fixed inputs:
// loss values within 1e-6 and gradients within 1e-6 (fp32, same elementwise math).
#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/io/checkpoint.h"
#include "lm/io/safetensors.h"
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
    student_k_ = torch::randn({N, k}) * 2;
    teacher_k_ = torch::log_softmax(torch::randn({N, k}) * 2, -1);
    dir_ = fs::temp_directory_path() / ("opd_loss_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    std::vector<std::pair<std::string, torch::Tensor>> in = {
        {"lp", lp_},
        {"lp_old", lp_old_},
        {"lp_teacher", lp_teacher_},
        {"student_k", student_k_},
        {"teacher_k", teacher_k_},
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
  static inline torch::Tensor lp_, lp_old_, lp_teacher_, student_k_, teacher_k_;
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
    auto s = student_k_.clone().requires_grad_(true);
    auto loss = TopKLoss(s, teacher_k_, kNorm, div, alpha);
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

TEST(OpdLossParse, NamesAndErrors) {
  EXPECT_EQ(*ParseCorrection("ppo"), Correction::kPpoClip);
  EXPECT_EQ(*ParseTopKDivergence("mixed"), TopKDivergence::kMixed);
  auto bad = ParseCorrection("clipped");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("clipped"), std::string::npos);
}

}  // namespace
}  // namespace trainer
