// The stage convergence rule: step budget, plateau of the smoothed metric, and exact resume.
#include <cmath>

#include <gtest/gtest.h>

#include "trainer/convergence.h"

namespace opd {
namespace {

TEST(Convergence, StepBudget) {
  ConvergenceRule r;
  r.max_steps = 3;
  ConvergenceTracker t(r);
  EXPECT_FALSE(t.Update(1.0));
  EXPECT_FALSE(t.Update(0.5));
  EXPECT_TRUE(t.Update(0.1));
  EXPECT_EQ(t.reason(), "max_steps");
}

TEST(Convergence, PlateauStopsOnlyAfterImprovementStalls) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 5;
  r.min_rel_improvement = 0.05;
  r.ema_beta = 0.5;
  ConvergenceTracker t(r);
  int stopped_at = -1;
  // Falls fast for 20 steps (10% per step), then flat: the rule must wait for the flat part.
  for (int i = 0; i < 100 && stopped_at < 0; ++i) {
    const double v = i < 20 ? std::pow(0.9, i) : std::pow(0.9, 20);
    if (t.Update(v)) stopped_at = i;
  }
  EXPECT_GT(stopped_at, 20);
  EXPECT_LT(stopped_at, 40);
  EXPECT_EQ(t.reason(), "plateau");
}

TEST(Convergence, MinStepsHoldsThePlateauRule) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 2;
  r.min_steps = 10;
  ConvergenceTracker t(r);
  for (int i = 0; i < 9; ++i) EXPECT_FALSE(t.Update(1.0)) << i;
  EXPECT_TRUE(t.Update(1.0));
}

TEST(Convergence, ResumeFromJsonContinuesIdentically) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 4;
  r.min_rel_improvement = 0.01;
  ConvergenceTracker a(r), b(r);
  std::vector<double> values;
  for (int i = 0; i < 60; ++i) values.push_back(1.0 / (1 + i * 0.3) + 0.01 * (i % 3));
  for (int i = 0; i < 10; ++i) a.Update(values[i]);
  ConvergenceTracker resumed(r);
  resumed.FromJson(nlohmann::json::parse(a.ToJson().dump()));
  for (int i = 0; i < 10; ++i) b.Update(values[i]);
  for (int i = 10; i < 60; ++i) {
    const bool x = resumed.Update(values[i]), y = b.Update(values[i]);
    ASSERT_EQ(x, y) << i;
    ASSERT_DOUBLE_EQ(resumed.smoothed(), b.smoothed());
    if (x) break;
  }
}

}  // namespace
}  // namespace opd
