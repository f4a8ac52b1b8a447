// When an OPD stage is done: a step budget and/or a plateau of a smoothed metric.
//
// Plateau rule: the metric (by default the mean per-token reverse KL, lower is better) is
// smoothed with an exponential moving average; the stage has converged when, after at least
// `min_steps`, the smoothed value moved by less than `min_rel_improvement` (a fraction) over the
// last `window` steps: |ema[t - window] - ema[t]| / |ema[t - window]| < min_rel_improvement.
// The change is taken in absolute value: a metric that rises (the student drifting away from
// the teacher, or a new teacher's higher KL) has not plateaued, so it does not end the stage.
//
// RestartWindow() (called when the stage's teachers are swapped) forgets the smoothed history:
// KL to the new teachers is another quantity, and comparing it with KL to the old ones would
// read a drop or a rise that no training step caused. The step count, and with it max_steps and
// min_steps, carries on.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "nlohmann/json.hpp"

namespace trainer {

struct ConvergenceRule {
  int64_t max_steps = 0;              // 0: no step budget
  bool plateau = false;               // enable the plateau rule
  int64_t window = 20;                // W
  double min_rel_improvement = 0.02;  // X as a fraction (0.02 = 2%)
  double ema_beta = 0.9;              // ema = beta * ema + (1 - beta) * value
  int64_t min_steps = 0;              // never stop on a plateau before this many steps
};

class ConvergenceTracker {
 public:
  explicit ConvergenceTracker(ConvergenceRule rule) : rule_(rule) {}

  // Records the metric of the step just finished; returns true when the stage is done. A
  // non-finite value (a skipped step) counts towards max_steps / min_steps but is not averaged.
  bool Update(double value);
  // Starts the plateau window (and the moving average) afresh from the next value.
  void RestartWindow();
  // Why the stage ended ("max_steps" | "plateau"), empty while running.
  const std::string& reason() const { return reason_; }
  int64_t steps() const { return steps_; }
  double smoothed() const { return ema_; }

  // State for checkpoints (resume continues the same rule exactly).
  nlohmann::json ToJson() const;
  void FromJson(const nlohmann::json& j);

 private:
  ConvergenceRule rule_;
  int64_t steps_ = 0;
  double ema_ = 0;
  std::deque<double> history_;  // last window + 1 smoothed values
  std::string reason_;
};

}  // namespace trainer
