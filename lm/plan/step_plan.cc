#include "lm/plan/step_plan.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace lm::plan {

double EstimatedSeconds(const TimePlan& t, const std::string& kind, const Efficiencies& e) {
  double sum = 0;
  for (const TimeTerm& term : t.terms) {
    double share = 1;
    if (term.bound == "compute")
      share = kind == "learner" ? e.learn_compute : e.forward_compute;
    else if (term.bound == "HBM")
      share = kind == "rollout" ? e.decode_hbm : e.stream_hbm;
    sum += term.seconds / share;
  }
  return sum;
}

StepPlan PlanStep(const ProcessPlan& rollout, const ProcessPlan& teacher,
                  const ProcessPlan& learner, const StepShape& shape, const Efficiencies& e) {
  StepPlan p;
  p.sample = EstimatedSeconds(rollout.time, "rollout", e);
  p.score = EstimatedSeconds(teacher.time, "teacher", e);
  TimePlan passes = learner.time, optimizer;
  if (!passes.terms.empty()) {
    optimizer.terms.push_back(passes.terms.back());
    passes.terms.pop_back();
  }
  p.learn = EstimatedSeconds(passes, "learner", e);
  p.optimizer = EstimatedSeconds(optimizer, "learner", e);
  p.push = static_cast<double>(shape.student_weight_bytes) / e.push_bytes_per_s;
  p.score_call = p.score / static_cast<double>(std::max<int64_t>(shape.score_calls, 1));
  p.micro_batch = p.learn / static_cast<double>(std::max<int64_t>(shape.micro_batches, 1));
  const auto s = [](double x) { return FormatSeconds(x); };
  if (!shape.pipeline) {
    p.step = p.sample + p.score + p.learn + p.optimizer + p.push;
    p.formula = absl::StrFormat(
        "phase by phase: sample %s + score %s + learn %s + optimizer %s + "
        "push %s",
        s(p.sample), s(p.score), s(p.learn), s(p.optimizer), s(p.push));
  } else if (shape.async) {
    const double learn_side = p.learn + p.optimizer + p.push;
    p.step = std::max({p.sample, p.score + p.score_call, learn_side}) + p.micro_batch;
    p.formula = absl::StrFormat(
        "pipelined, one-step-off: max(sample %s, score %s + last call %s, learn %s + optimizer %s "
        "+ push %s) + last micro-batch %s",
        s(p.sample), s(p.score), s(p.score_call), s(p.learn), s(p.optimizer), s(p.push),
        s(p.micro_batch));
  } else {
    const double tail = p.score_call + p.micro_batch + p.optimizer + p.push;
    p.step = std::max({p.sample, p.score, p.learn}) + tail;
    p.formula = absl::StrFormat(
        "pipelined: max(sample %s, score %s, learn %s) + tail (last call %s + last micro-batch %s "
        "+ optimizer %s + push %s)",
        s(p.sample), s(p.score), s(p.learn), s(p.score_call), s(p.micro_batch), s(p.optimizer),
        s(p.push));
  }
  return p;
}

}  // namespace lm::plan
