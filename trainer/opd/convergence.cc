#include "trainer/opd/convergence.h"

#include <cmath>

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
  if (finite && rule_.plateau && steps_ >= rule_.min_steps &&
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

void ConvergenceTracker::RestartWindow() {
  history_.clear();
}

nlohmann::json ConvergenceTracker::ToJson() const {
  return {{"steps", steps_},
          {"ema", ema_},
          {"history", std::vector<double>(history_.begin(), history_.end())},
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
  reason_ = j.at("reason").get<std::string>();
}

}  // namespace trainer
