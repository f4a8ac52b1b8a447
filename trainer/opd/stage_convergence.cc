#include "trainer/opd/stage_convergence.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_format.h"

namespace trainer {

void StageConvergence::Start(const OpdStageConfig& stage, bool heldout_set) {
  stage_ = stage;
  ConvergenceRule rule;
  rule.max_steps = stage.max_steps;
  rule.plateau = stage.plateau.enabled;
  rule.window = stage.plateau.window;
  rule.min_rel_improvement = stage.plateau.min_rel_improvement;
  rule.ema_beta = stage.plateau.ema_beta;
  rule.min_steps = stage.plateau.min_steps;
  rule.heldout = ResolvedPlateauMetric(stage.plateau.metric, heldout_set,
                                       stage.plateau.per_domain) == PlateauMetric::kHeldout;
  rule.z = stage.plateau.z;
  domains_.clear();
  if (stage.plateau.per_domain) {
    // Each domain's KL has the plateau rule; the stage's own tracker keeps the step budget.
    ConvergenceRule per = rule;
    per.max_steps = 0;
    for (const auto& d : stage.domains)
      domains_[d.domain] = std::make_unique<ConvergenceTracker>(per);
    rule.plateau = false;
  }
  tracker_ = std::make_unique<ConvergenceTracker>(rule);
}

void StageConvergence::Restore(const nlohmann::json& state) {
  tracker_->FromJson(state.at("convergence"));
  const nlohmann::json domains = state.value("domain_convergence", nlohmann::json::object());
  for (auto& [domain, tracker] : domains_) {
    if (domains.contains(domain)) tracker->FromJson(domains.at(domain));
  }
}

nlohmann::json StageConvergence::ToJson() const {
  nlohmann::json out = {{"convergence", tracker_->ToJson()}};
  if (!domains_.empty()) {
    nlohmann::json domains = nlohmann::json::object();
    for (const auto& [domain, tracker] : domains_) domains[domain] = tracker->ToJson();
    out["domain_convergence"] = domains;
  }
  return out;
}

bool StageConvergence::OnStep(int64_t step, double reverse_kl,
                              const std::map<std::string, double>& domain_kl) {
  if (tracker_->Update(reverse_kl)) {
    RecordEnd(step);
    return true;
  }
  if (domains_.empty()) return false;
  // A domain that has converged stays so; once every domain has, the stage ends.
  bool all = true;
  for (auto& [domain, tracker] : domains_) {
    if (!tracker->reason().empty()) continue;
    auto it = domain_kl.find(domain);
    const double kl = it == domain_kl.end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
    if (tracker->Update(kl)) {
      log_(absl::StrFormat("step %d: domain '%s' of stage '%s' converged (%s)", step, domain,
                           stage_.name, tracker->reason()));
    } else {
      all = false;
    }
  }
  if (!all) return false;
  tracker_->MarkConverged("domains_plateau");
  RecordEnd(step);
  return true;
}

bool StageConvergence::OnHeldout(int64_t step, const std::vector<double>& per_response) {
  if (finished() || !tracker_->UpdateHeldout(per_response)) return false;
  RecordEnd(step);
  return true;
}

void StageConvergence::OnSwap(const std::string& domain,
                              const std::vector<std::string>& endpoints) {
  tracker_->RestartWindow();  // the stage's KL mixes every pool's
  if (domain.empty()) {
    stage_.teachers = endpoints;
    return;
  }
  if (auto it = domains_.find(domain); it != domains_.end()) it->second->Reopen();
}

void StageConvergence::RecordEnd(int64_t step) {
  summaries_.push_back({{"stage", stage_.name},
                        {"steps", tracker_->steps()},
                        {"end_step", step},
                        {"reason", tracker_->reason()},
                        {"smoothed_reverse_kl", tracker_->smoothed()},
                        {"teachers", stage_.teachers}});
  log_(absl::StrFormat("stage '%s' finished after %d steps (%s): smoothed reverse KL %.4f",
                       stage_.name, tracker_->steps(), tracker_->reason(), tracker_->smoothed()));
}

}  // namespace trainer
