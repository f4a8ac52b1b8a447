// When the running stage is done: its rule (trainer/opd/convergence.h) over the training KL or
// the held-out evaluations, the per-domain rules (plateau.per_domain), the windows a teacher swap
// restarts, and the record of every finished stage. Its state is part of every checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "trainer/opd/convergence.h"
#include "trainer/opd/opd_config.h"

namespace trainer {

class StageConvergence {
 public:
  // `log` receives the lines a person reads (a domain converged, a stage finished).
  explicit StageConvergence(std::function<void(const std::string&)> log) : log_(std::move(log)) {}

  // A fresh rule for `stage` (its step budget and plateau settings); `heldout_set`: the config
  // has held-out prompts (plateau.metric auto then watches them).
  void Start(const OpdStageConfig& stage, bool heldout_set);
  // The running stage's rules as a checkpoint saved them.
  void Restore(const nlohmann::json& state);
  nlohmann::json ToJson() const;  // the fields Restore reads

  // The step's training KL (NaN for a skipped step) and, per domain with a rule, its KL (NaN
  // when the domain had no tokens). True when the stage is done.
  bool OnStep(int64_t step, double reverse_kl, const std::map<std::string, double>& domain_kl);
  // A held-out evaluation's per-response values, applied at `step`. True when the stage is done.
  bool OnHeldout(int64_t step, const std::vector<double>& per_response);
  // A teacher swap of the running stage (`endpoints` of its default pool when `domain` is ""):
  // the KL it changes restarts its window, and a domain's own rule is reopened (it has not
  // converged on the new teacher).
  void OnSwap(const std::string& domain, const std::vector<std::string>& endpoints);

  bool finished() const { return !tracker_->reason().empty(); }
  double smoothed() const { return tracker_->smoothed(); }
  // The stages finished so far, with their end step and reason.
  const nlohmann::json& summaries() const { return summaries_; }
  void RestoreSummaries(const nlohmann::json& s) { summaries_ = s; }

 private:
  void RecordEnd(int64_t step);

  std::function<void(const std::string&)> log_;
  OpdStageConfig stage_;
  std::unique_ptr<ConvergenceTracker> tracker_;
  std::map<std::string, std::unique_ptr<ConvergenceTracker>> domains_;
  nlohmann::json summaries_ = nlohmann::json::array();
};

}  // namespace trainer
