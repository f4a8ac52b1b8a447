// The stage convergence rule: step budget, plateau of the smoothed metric, and exact resume.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/opd/convergence.h"

namespace trainer {
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

// A smoothed KL that rises by more than the threshold over the window has not plateaued: the old
// rule read the negative improvement as "improved by less than 2%" and ended the stage.
TEST(Convergence, RisingMetricIsNotAPlateau) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 3;
  r.min_rel_improvement = 0.02;
  r.ema_beta = 0.0;  // no smoothing: the window compares raw values
  ConvergenceTracker t(r);
  for (int i = 0; i < 12; ++i) EXPECT_FALSE(t.Update(1.0 + 0.1 * i)) << i;
  EXPECT_EQ(t.reason(), "");
  // Once it levels off the rule fires, when the whole window is level (2.1 -> 2.2 is a 4.8% rise).
  int stopped_at = -1;
  for (int i = 0; i < 10 && stopped_at < 0; ++i) {
    if (t.Update(2.2)) stopped_at = i;
  }
  EXPECT_EQ(stopped_at, 3);
  EXPECT_EQ(t.reason(), "plateau");
}

// A rise smaller than the threshold is noise around a plateau, as is a fall that small.
TEST(Convergence, SmallRiseWithinTheThresholdIsAPlateau) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 2;
  r.min_rel_improvement = 0.05;
  r.ema_beta = 0.0;
  ConvergenceTracker t(r);
  EXPECT_FALSE(t.Update(1.00));
  EXPECT_FALSE(t.Update(1.01));
  EXPECT_TRUE(t.Update(1.02));
}

// After a teacher swap the window starts again: the values before the swap (KL to the old
// teacher) are neither compared with those after it nor averaged into them.
TEST(Convergence, RestartWindowForgetsTheOldTeachersValues) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 3;
  r.min_rel_improvement = 0.05;
  r.ema_beta = 0.5;
  r.max_steps = 100;
  ConvergenceTracker t(r);
  for (double v : {4.0, 2.0, 1.0}) EXPECT_FALSE(t.Update(v));
  t.RestartWindow();
  // KL to the new teacher is flat at 3.0: the average starts there, not between 1.0 and 3.0.
  EXPECT_FALSE(t.Update(3.0));
  EXPECT_DOUBLE_EQ(t.smoothed(), 3.0);
  EXPECT_FALSE(t.Update(3.0));
  EXPECT_FALSE(t.Update(3.0));
  EXPECT_TRUE(t.Update(3.0));  // window + 1 values since the swap
  EXPECT_EQ(t.reason(), "plateau");
  EXPECT_EQ(t.steps(), 7);  // the stage's step count (max_steps, min_steps) carries on
}

// A restart survives a checkpoint taken right after it.
TEST(Convergence, RestartIsPartOfTheSavedState) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 2;
  r.min_rel_improvement = 0.05;
  r.ema_beta = 0.5;
  ConvergenceTracker a(r);
  for (double v : {4.0, 1.0}) a.Update(v);  // ema 2.5: without the restart 3.0 would give 2.75
  a.RestartWindow();
  ConvergenceTracker b(r);
  b.FromJson(nlohmann::json::parse(a.ToJson().dump()));
  for (ConvergenceTracker* t : {&a, &b}) {
    EXPECT_FALSE(t->Update(3.0));
    EXPECT_DOUBLE_EQ(t->smoothed(), 3.0);
  }
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

// A skipped step's non-finite KL counts as a step but is not averaged: one NaN used to make the
// smoothed value NaN for the rest of the stage, so the plateau rule never fired.
TEST(Convergence, NonFiniteValuesAreSkipped) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 2;
  r.min_rel_improvement = 0.05;
  r.ema_beta = 0.5;
  r.max_steps = 100;
  ConvergenceTracker t(r);
  EXPECT_FALSE(t.Update(1.0));
  EXPECT_FALSE(t.Update(std::numeric_limits<double>::quiet_NaN()));
  EXPECT_FALSE(t.Update(std::numeric_limits<double>::infinity()));
  EXPECT_DOUBLE_EQ(t.smoothed(), 1.0);
  EXPECT_EQ(t.steps(), 3);
  EXPECT_FALSE(t.Update(1.0));
  EXPECT_TRUE(t.Update(1.0));  // window + 1 finite values: a plateau
  EXPECT_EQ(t.reason(), "plateau");
  EXPECT_DOUBLE_EQ(t.smoothed(), 1.0);
}

// The budget still counts a skipped step, also when it is the last one.
TEST(Convergence, NonFiniteValueCountsTowardsTheBudget) {
  ConvergenceRule r;
  r.max_steps = 2;
  ConvergenceTracker t(r);
  EXPECT_FALSE(t.Update(1.0));
  EXPECT_TRUE(t.Update(std::numeric_limits<double>::quiet_NaN()));
  EXPECT_EQ(t.reason(), "max_steps");
}

// A state with a skipped value round-trips through the checkpoint's JSON: the NaN used to be
// written as `null`, and FromJson threw on it, so the job could not resume.
TEST(Convergence, StateWithASkippedValueResumes) {
  ConvergenceRule r;
  r.plateau = true;
  r.window = 3;
  r.min_rel_improvement = 0.01;
  r.ema_beta = 0.5;
  ConvergenceTracker a(r), b(r);
  for (ConvergenceTracker* t : {&a, &b}) {
    t->Update(2.0);
    t->Update(std::numeric_limits<double>::quiet_NaN());
    t->Update(1.0);
  }
  const std::string saved = a.ToJson().dump();
  EXPECT_EQ(saved.find("null"), std::string::npos) << saved;
  ConvergenceTracker resumed(r);
  ASSERT_NO_THROW(resumed.FromJson(nlohmann::json::parse(saved)));
  EXPECT_EQ(resumed.steps(), 3);
  EXPECT_DOUBLE_EQ(resumed.smoothed(), b.smoothed());
  for (int i = 0; i < 30; ++i) {
    const bool x = resumed.Update(0.5), y = b.Update(0.5);
    ASSERT_EQ(x, y) << i;
    ASSERT_DOUBLE_EQ(resumed.smoothed(), b.smoothed());
    if (x) break;
  }
  EXPECT_EQ(resumed.reason(), "plateau");
}

// A checkpoint written by the old code (a NaN saved as `null`) still resumes.
TEST(Convergence, OldCheckpointWithNullResumes) {
  ConvergenceRule r;
  r.window = 2;
  ConvergenceTracker t(r);
  const auto j = nlohmann::json::parse(
      R"({"steps": 4, "ema": null, "history": [2.0, 1.5, null], "reason": ""})");
  ASSERT_NO_THROW(t.FromJson(j));
  EXPECT_EQ(t.steps(), 4);
  EXPECT_DOUBLE_EQ(t.smoothed(), 1.5);
  t.Update(1.5);
  EXPECT_TRUE(std::isfinite(t.smoothed()));
}

// One held-out evaluation: n per-sample values mean +- sigma alternating, so that the sample
// standard deviation is sigma * sqrt(n / (n - 1)) exactly and no random draw (nor a libm) enters.
std::vector<double> Eval(double mean, double sigma, int n = 64) {
  std::vector<double> v;
  for (int i = 0; i < n; ++i) v.push_back(mean + (i % 2 == 0 ? sigma : -sigma));
  return v;
}

ConvergenceRule HeldoutRule() {
  ConvergenceRule r;
  r.plateau = true;
  r.heldout = true;
  r.window = 2;  // evaluations per window
  r.min_rel_improvement = 0.02;
  r.z = 2.0;
  return r;
}

TEST(Convergence, EvalSummaryPoolsLikeTheConcatenation) {
  const std::vector<double> a = {1, -1, 1, -1}, b = {3, 5};
  const EvalSummary sa = EvalSummary::Of(a), sb = EvalSummary::Of(b);
  EXPECT_EQ(sa.n, 4);
  EXPECT_DOUBLE_EQ(sa.mean, 0.0);
  EXPECT_DOUBLE_EQ(sa.m2, 4.0);
  EXPECT_DOUBLE_EQ(sa.StandardError(), std::sqrt(4.0 / 3.0 / 4.0));
  std::vector<double> ab = a;
  ab.insert(ab.end(), b.begin(), b.end());
  const EvalSummary pooled = sa.Pooled(sb), direct = EvalSummary::Of(ab);
  EXPECT_EQ(pooled.n, 6);
  // Two summation orders of 6 small integers: equal to a few ulps.
  EXPECT_NEAR(pooled.mean, direct.mean, 1e-14);
  EXPECT_NEAR(pooled.m2, direct.m2, 1e-12);
  EXPECT_TRUE(std::isinf(EvalSummary::Of({2.0}).StandardError()));
}

// A flat held-out KL with little noise is a plateau as soon as both windows are full (the 4th
// evaluation): the improvement 0 plus z * se (2 * hypot of two windows' se, 0.0126 at sigma 0.05
// over 128 values each) is under 2% of 1.0.
TEST(Convergence, HeldoutPlateauStopsWhenConfidentlyFlat) {
  ConvergenceTracker t(HeldoutRule());
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(t.UpdateHeldout(Eval(1.0, 0.05))) << i;
  EXPECT_TRUE(t.UpdateHeldout(Eval(1.0, 0.05)));
  EXPECT_EQ(t.reason(), "heldout_plateau");
}

// The same flat KL with per-sample noise sigma 1.0 (se 0.089 per window): the windows' means are
// equal, which the training-batch rule reads as a plateau, but the difference is not known to
// better than 0.25, so the stage goes on (max_steps ends it if nothing else does).
TEST(Convergence, HeldoutNoiseDoesNotEndTheStage) {
  ConvergenceTracker t(HeldoutRule());
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(t.UpdateHeldout(Eval(1.0, 1.0))) << i;
  EXPECT_EQ(t.reason(), "");
}

// Steady progress of 3% per evaluation (about 6% between windows of two) never looks like a
// plateau, whatever the noise: the optimistic improvement is at least the real one.
TEST(Convergence, HeldoutSteadyProgressIsNotAPlateau) {
  ConvergenceTracker t(HeldoutRule());
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(t.UpdateHeldout(Eval(std::pow(0.97, i), 0.2))) << i;
}

// In held-out mode the training-batch KL only counts steps: a flat training KL ends nothing.
// min_steps holds the held-out rule too, and its evaluations survive a checkpoint.
TEST(Convergence, HeldoutModeIgnoresTheTrainingPlateauAndResumes) {
  ConvergenceRule r = HeldoutRule();
  r.min_steps = 5;
  ConvergenceTracker t(r);
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(t.Update(1.0));
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(t.UpdateHeldout(Eval(1.0, 0.05))) << i;  // 4 < 5 steps
  ConvergenceTracker resumed(r);
  resumed.FromJson(nlohmann::json::parse(t.ToJson().dump()));
  EXPECT_FALSE(resumed.Update(1.0));  // step 5
  EXPECT_TRUE(resumed.UpdateHeldout(Eval(1.0, 0.05)));
  EXPECT_EQ(resumed.reason(), "heldout_plateau");
}

}  // namespace
}  // namespace trainer
