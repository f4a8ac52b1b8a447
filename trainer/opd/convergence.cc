#include "trainer/opd/convergence.h"

#include <cmath>

namespace trainer {

bool ConvergenceTracker::Update(double value) {
  // An empty history is the first step or the first after RestartWindow(): the average starts at
  // the value itself instead of mixing in the values before.
  ema_ = history_.empty() ? value : rule_.ema_beta * ema_ + (1.0 - rule_.ema_beta) * value;
  ++steps_;
  history_.push_back(ema_);
  while (static_cast<int64_t>(history_.size()) > rule_.window + 1) history_.pop_front();
  if (rule_.max_steps > 0 && steps_ >= rule_.max_steps) {
    reason_ = "max_steps";
    return true;
  }
  if (rule_.plateau && steps_ >= rule_.min_steps &&
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
  ema_ = j.at("ema").get<double>();
  auto h = j.at("history").get<std::vector<double>>();
  history_.assign(h.begin(), h.end());
  reason_ = j.at("reason").get<std::string>();
}

}  // namespace trainer
