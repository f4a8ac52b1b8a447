#include "trainer/opd/convergence.h"

#include <cmath>
#include <limits>

namespace trainer {

bool ConvergenceTracker::Update(double value) {
  ++steps_;
  // A non-finite value (a skipped step) counts as a step of the budget but leaves the average
  // and the window alone: folded in, one NaN would make the average NaN for the rest of the stage
  // (the plateau rule could never fire) and the checkpoint would hold `null`.
  const bool finite = std::isfinite(value);
  if (finite) {
    // An empty history is the first step or the first after RestartWindow(): the average starts
    // at the value itself instead of mixing in the values before.
    ema_ = history_.empty() ? value : rule_.ema_beta * ema_ + (1.0 - rule_.ema_beta) * value;
    history_.push_back(ema_);
    while (static_cast<int64_t>(history_.size()) > rule_.window + 1) history_.pop_front();
  }
  if (rule_.max_steps > 0 && steps_ >= rule_.max_steps) {
    reason_ = "max_steps";
    return true;
  }
  if (finite && rule_.plateau && !rule_.heldout && steps_ >= rule_.min_steps &&
      static_cast<int64_t>(history_.size()) == rule_.window + 1) {
    const double before = history_.front(), now = history_.back();
    const double change = std::abs(before - now) / std::max(std::abs(before), 1e-12);
    if (change < rule_.min_rel_improvement) {
      reason_ = "plateau";
      return true;
    }
  }
  return false;
}

EvalSummary EvalSummary::Of(const std::vector<double>& values) {
  EvalSummary s;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    ++s.n;
    const double delta = v - s.mean;
    s.mean += delta / static_cast<double>(s.n);
    s.m2 += delta * (v - s.mean);
  }
  return s;
}

EvalSummary EvalSummary::Pooled(const EvalSummary& other) const {
  if (n == 0) return other;
  if (other.n == 0) return *this;
  EvalSummary s;
  s.n = n + other.n;
  const double delta = other.mean - mean;
  s.mean = mean + delta * static_cast<double>(other.n) / static_cast<double>(s.n);
  s.m2 = m2 + other.m2 +
         delta * delta * static_cast<double>(n) * static_cast<double>(other.n) /
             static_cast<double>(s.n);
  return s;
}

double EvalSummary::StandardError() const {
  if (n < 2) return std::numeric_limits<double>::infinity();
  return std::sqrt(m2 / static_cast<double>(n - 1) / static_cast<double>(n));
}

bool ConvergenceTracker::UpdateHeldout(const std::vector<double>& per_sample) {
  const EvalSummary e = EvalSummary::Of(per_sample);
  if (e.n == 0) return false;  // nothing finite to judge by
  evals_.push_back(e);
  const size_t w = static_cast<size_t>(rule_.window);
  while (evals_.size() > 2 * w) evals_.pop_front();
  if (!rule_.plateau || !rule_.heldout || evals_.size() < 2 * w || steps_ < rule_.min_steps)
    return false;
  EvalSummary prev, last;
  for (size_t i = 0; i < w; ++i) prev = prev.Pooled(evals_[i]);
  for (size_t i = w; i < 2 * w; ++i) last = last.Pooled(evals_[i]);
  const double se = std::hypot(prev.StandardError(), last.StandardError());
  const double optimistic = (prev.mean - last.mean) + rule_.z * se;
  if (optimistic < rule_.min_rel_improvement * std::abs(prev.mean)) {
    reason_ = "heldout_plateau";
    return true;
  }
  return false;
}

void ConvergenceTracker::Reopen() {
  RestartWindow();
  if (reason_ != "max_steps") reason_.clear();
}

void ConvergenceTracker::RestartWindow() {
  history_.clear();
  evals_.clear();  // held-out KL to the new teachers is another quantity too
}

nlohmann::json ConvergenceTracker::ToJson() const {
  nlohmann::json evals = nlohmann::json::array();
  for (const EvalSummary& e : evals_) evals.push_back({e.n, e.mean, e.m2});
  return {{"steps", steps_},
          {"ema", ema_},
          {"history", std::vector<double>(history_.begin(), history_.end())},
          {"heldout", evals},
          {"reason", reason_}};
}

void ConvergenceTracker::FromJson(const nlohmann::json& j) {
  steps_ = j.at("steps").get<int64_t>();
  // A checkpoint written before non-finite values were skipped may hold `null` (JSON has no
  // NaN): such entries are dropped rather than failing the resume.
  const auto& e = j.at("ema");
  ema_ = e.is_number() ? e.get<double>() : 0.0;
  history_.clear();
  for (const auto& v : j.at("history")) {
    if (v.is_number() && std::isfinite(v.get<double>())) history_.push_back(v.get<double>());
  }
  if (!history_.empty() && !e.is_number()) ema_ = history_.back();
  evals_.clear();  // absent from checkpoints written before the held-out rule
  for (const auto& v : j.value("heldout", nlohmann::json::array()))
    evals_.push_back({v.at(0).get<int64_t>(), v.at(1).get<double>(), v.at(2).get<double>()});
  reason_ = j.at("reason").get<std::string>();
}

}  // namespace trainer
