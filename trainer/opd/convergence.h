// When an OPD stage is done: a step budget and/or a plateau of a smoothed metric.
//
// Plateau rule: the metric (by default the mean per-token reverse KL, lower is better) is
// smoothed with an exponential moving average; the stage has converged when, after at least
// `min_steps`, the smoothed value moved by less than `min_rel_improvement` (a fraction) over the
// last `window` steps: |ema[t - window] - ema[t]| / |ema[t - window]| < min_rel_improvement.
// The change is taken in absolute value: a metric that rises (the student drifting away from
// the teacher, or a new teacher's higher KL) has not plateaued, so it does not end the stage.
//
// Held-out rule (`heldout`): the training batches hold other prompts every step, so their KL is
// noisy and at lr 1e-6 real progress can hide in it. With a fixed held-out prompt set evaluated
// every few steps, the plateau is judged on the evaluations instead: after `min_steps`, with
// m_prev and m_last the means of the previous and the last `window` evaluations' per-sample
// values and se the standard error of their difference (each window's from its pooled
// per-sample variance), the stage has converged when even an optimistic reading of the
// improvement is small: (m_prev - m_last) + z * se < min_rel_improvement * |m_prev|. Noise makes
// se large and so keeps the stage running; only max_steps ends a stage whose evaluations are too
// noisy to tell. (The per-sample values are treated as independent: an approximation, as the
// same prompts recur in every evaluation.)
//
// RestartWindow() (called when the stage's teachers are swapped) forgets the smoothed history:
// KL to the new teachers is another quantity, and comparing it with KL to the old ones would
// read a drop or a rise that no training step caused. The step count, and with it max_steps and
// min_steps, carries on.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace trainer {

struct ConvergenceRule {
  int64_t max_steps = 0;              // 0: no step budget
  bool plateau = false;               // enable the plateau rule
  int64_t window = 20;                // W
  double min_rel_improvement = 0.02;  // X as a fraction (0.02 = 2%)
  double ema_beta = 0.9;              // ema = beta * ema + (1 - beta) * value
  int64_t min_steps = 0;              // never stop on a plateau before this many steps
  bool heldout = false;               // judge the plateau on held-out evaluations (above)
  double z = 2.0;                     // the held-out rule's confidence multiplier
};

// One held-out evaluation's per-sample values, summarised: count, mean and the sum of squared
// deviations from the mean (Welford's M2).
struct EvalSummary {
  int64_t n = 0;
  double mean = 0, m2 = 0;
  static EvalSummary Of(const std::vector<double>& values);
  EvalSummary Pooled(const EvalSummary& other) const;  // the summary of both sets together
  double StandardError() const;                        // of the mean; infinite below 2 values
};

class ConvergenceTracker {
 public:
  explicit ConvergenceTracker(ConvergenceRule rule) : rule_(rule) {}

  // Records the metric of the step just finished; returns true when the stage is done. A
  // non-finite value (a skipped step) counts towards max_steps / min_steps but is not averaged.
  bool Update(double value);
  // Records a held-out evaluation (one value per sample); returns true when the held-out rule
  // says the stage is done.
  bool UpdateHeldout(const std::vector<double>& per_sample);
  // Ends the stage for a reason the caller decided (every domain's own rule has converged).
  void MarkConverged(std::string reason) { reason_ = std::move(reason); }
  // Starts the plateau window (and the moving average) afresh from the next value.
  void RestartWindow();
  // RestartWindow, and a plateau reached before is forgotten (a domain whose teacher was swapped
  // has not converged on the new one). A step budget reached stays reached.
  void Reopen();
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
  std::deque<double> history_;     // last window + 1 smoothed values
  std::deque<EvalSummary> evals_;  // the held-out rule's last 2 * window evaluations
  std::string reason_;
};

}  // namespace trainer
