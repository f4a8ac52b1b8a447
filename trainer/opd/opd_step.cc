// One OPD step on one learner rank (OpdJob::Step runs them in order):
//   1. at the boundary, a teacher swap (every rank takes part; ApplyTeacherSwap);
//   2. this rank's own phases, which take as long as they take: its share of the step's prompts
//      sampled on the rollout workers, each sample scored by its domain's teachers as it arrives,
//      each micro-batch learned as soon as its samples are scored (the last one's backward kept;
//      LearnLocally);
//   3. the ranks agree on the outcome (lm/dist/rank_sync.h), so that a failure on one rank ends
//      the step on every rank, at the same point, before any collective (LearnAndAgree);
//   4. the collective end: the loss normaliser, the last backward with its reductions, the
//      update, the step's sums (ReduceAndUpdate);
//   5. the stage's rules fed (TrackStep); the push of the new weights, agreed (PushStepWeights);
//      the held-out evaluation of the step before applied (ApplyHeldout) and this step's
//      launched; logs (ReportStep), checkpoints and the next stage (EndStageOrCheckpoint).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "trainer/common/job_util.h"
#include "trainer/common/signals.h"
#include "trainer/opd/opd_job.h"

namespace trainer::opd_detail {
namespace {

bool Contains(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// The error of a phase, named by it ("sampling: ...").
absl::Status InPhase(const std::string& phase, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(phase, ": ", s.message()));
}

// The loss and learner settings of a step, from the job's configuration.
StepLearnerOptions LearnerOptionsOf(const OpdConfig& c) {
  StepLearnerOptions lo;
  lo.loss.correction = c.loss.correction;
  lo.loss.kl_coef = c.loss.kl_coef;
  lo.loss.tis_cap = c.loss.tis_cap;
  lo.loss.clip_low = c.loss.clip_low;
  lo.loss.clip_high = c.loss.clip_high;
  lo.loss.kl_discount = c.loss.kl_discount;
  lo.form = c.loss.form;
  lo.top_k = c.loss.top_k;
  lo.divergence = c.loss.divergence;
  lo.alpha = c.loss.alpha;
  lo.normalization = c.loss.normalization;
  lo.temperature = c.rollout.temperature;
  lo.activation_checkpointing = c.train.activation_checkpointing;
  lo.routing_replay = c.rollout.routing_replay;
  lo.max_grad_norm = c.optim.max_grad_norm;
  return lo;
}

}  // namespace

absl::Status OpdJob::LearnLocally(int64_t step, StepLearner& learner,
                                  std::unique_ptr<StepPipeline>& pipe,
                                  std::vector<std::vector<size_t>>* held, StepStats* st) {
  sync_->SetPhase(absl::StrCat("step ", step, ": sampling, scoring and learning"));
  ASSIGN_OR_RETURN(pipe, source_->Next(step));
  // Samples scored by other teachers (a prefetch before a swap or a new stage) are scored anew.
  if (pipe->scoring_generation() != teachers_->generation())
    pipe->StartScoring(teachers_->pools(), ScoringOptions(), teachers_->generation());
  // One-step-off: the next step's prompts are drawn now and sampled once this step's are in, on
  // the weights the workers serve now; its samples are scored as they come, like these.
  if (c_.train.async) {
    source_->Prefetch(step + 1, pipe.get());
    if (StepPipeline* next = source_->prefetched())
      next->StartScoring(teachers_->pools(), ScoringOptions(), teachers_->generation());
  }
  const bool throw_here = Contains(c_.debug.throw_while_learning_steps, step) &&
                          (c_.debug.fail_rank < 0 || c_.debug.fail_rank == group_->rank());
  const bool poison = Contains(c_.debug.nan_steps, step);
  int64_t learned = 0;
  double learn_s = 0;
  for (;;) {
    if (StopRequested()) {
      pipe->Cancel(absl::CancelledError("stop requested"));
      return absl::CancelledError("stop requested");
    }
    absl::StatusOr<std::optional<StepPipeline::MicroBatchSlots>> mb = pipe->NextMicroBatch();
    if (!mb.ok()) return InPhase("sampling and scoring", mb.status());
    if (!*mb) break;
    if (throw_here)
      throw std::runtime_error(absl::StrCat("debug.throw_while_learning_steps: step ", step,
                                            " on rank ", group_->rank()));
    if (held) {  // learned in lockstep, after every rank's are scored
      held->push_back(std::move((*mb)->slots));
      sync_->Progress(absl::StrCat("micro-batch ", held->size(), " scored"));
      continue;
    }
    const auto t0 = Clock::now();
    // The step's last micro-batch keeps its backward for after the agreement: it starts the
    // optimizer's reductions, which every rank must enter together.
    RETURN_IF_ERROR(
        InPhase("learning", learner.Learn(*pipe, (*mb)->slots, (*mb)->last, poison, st)));
    learn_s += Seconds(t0);
    sync_->Progress(absl::StrCat("micro-batch ", ++learned, " learned"));
  }
  learner.AddSamples(*pipe, weight_version_, st);
  st->sample_s = pipe->sample_seconds();
  st->score_s = pipe->score_busy_seconds();
  st->domain_fallbacks = static_cast<double>(pipe->score_fallbacks());
  st->learn_s = learn_s;
  return absl::OkStatus();
}

// Collective: every rank's held micro-batches, each backward reduce-scattering as it runs (a rank
// with fewer adds rounds of zeros: trainer/common/gradient_reducer.h).
absl::Status OpdJob::LearnInLockstep(int64_t step, StepLearner& learner, const StepPipeline& pipe,
                                     const std::vector<std::vector<size_t>>& held, StepStats* st) {
  const bool poison = Contains(c_.debug.nan_steps, step);
  const auto t0 = Clock::now();
  try {
    RETURN_IF_ERROR(learner.Normalize(*st));
    RETURN_IF_ERROR(learner.ExpectBackwards(static_cast<int64_t>(held.size())));
    for (const std::vector<size_t>& slots : held) {
      RETURN_IF_ERROR(learner.Learn(pipe, slots, /*defer_backward=*/false, poison, st));
      sync_->Progress("micro-batch learned");
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("learning: ", e.what()));
  }
  st->learn_s += Seconds(t0);
  return absl::OkStatus();
}

absl::Status OpdJob::Step() {
  RETURN_IF_ERROR(ApplyTeacherSwap());
  const int64_t step = step_ + 1;
  const auto t0 = Clock::now();
  StepStats st;
  StepLearner learner(LearnerOptionsOf(c_), *model_, *optimizer_, *group_, device_, precision_,
                      teachers_->metric_domains());
  std::unique_ptr<StepPipeline> pipe;
  RETURN_IF_ERROR(LearnAndAgree(step, learner, pipe, &st));
  RETURN_IF_ERROR(ReduceAndUpdate(step, learner, *pipe, &st));
  pipe.reset();
  // The step is complete from here (step_ counts it), and so is its bookkeeping: whatever fails
  // after this is checkpointed as this step.
  bool stage_over = TrackStep(st);
  const absl::Status pushed = PushStepWeights(&st);
  st.step_s = Seconds(t0);
  ReportStep(st);
  // Only the step's distribution failed, after its bookkeeping: the checkpoint is of this step
  // (a resumed job pushes its weights first), and it owes this step's evaluation.
  if (!pushed.ok()) {
    if (heldout_->Due(step_)) heldout_->Owe(step_);
    return FailStep(pushed, "the weight push");
  }
  RETURN_IF_ERROR(ApplyHeldout(&stage_over));
  if (heldout_->Due(step_))
    heldout_->Launch(step_, source_->rollout(), *teachers_, ScoringOptions());
  RETURN_IF_ERROR(CheckNonFinite(c_.train.max_consecutive_nonfinite));
  return EndStageOrCheckpoint(stage_over);
}

// The boundary: a teacher swap queued on rank 0's admin server, applied on every rank.
absl::Status OpdJob::ApplyTeacherSwap() {
  absl::StatusOr<std::optional<StageTeachers::Applied>> applied =
      teachers_->ApplyPendingSwap(admin_.get(), is_root(), *sync_);
  // A rank that stopped answering at the swap's meeting point ends every rank as at any other.
  if (!applied.ok() && sync_->broken()) return FailStep(applied.status(), "a teacher swap");
  RETURN_IF_ERROR(applied.status());
  const std::optional<StageTeachers::Applied>& swap = *applied;
  if (swap && swap->running) {
    convergence_->OnSwap(swap->domain, teachers_->stage().teachers);
    progress_->Log(absl::StrFormat(
        "teacher swap applied at step %d: stage '%s'%s", step_, swap->stage,
        swap->domain.empty() ? "" : absl::StrCat(" (domain '", swap->domain, "')")));
  }
  return absl::OkStatus();
}

// This rank's own phases (sampling, scoring and, unless in lockstep, learning), then the meeting
// where every rank agrees on their outcome, so that a failure anywhere ends the step everywhere.
absl::Status OpdJob::LearnAndAgree(int64_t step, StepLearner& learner,
                                   std::unique_ptr<StepPipeline>& pipe, StepStats* st) {
  // ZeRO-2 over several ranks reduce-scatters inside each backward, which every rank must enter
  // together: the micro-batches are then learned in lockstep once every rank's are scored, and
  // only sampling and scoring overlap (stage 1 learns each as soon as it is scored).
  const bool lockstep = optimizer_->stage() == ZeroStage::kTwo && group_->size() > 1;
  std::vector<std::vector<size_t>> held;
  absl::Status local;
  try {
    local = LearnLocally(step, learner, pipe, lockstep ? &held : nullptr, st);
  } catch (const std::exception& e) {  // LibTorch reports failures (e.g. out of memory) by throwing
    local = absl::InternalError(absl::StrCat("learning: ", e.what()));
  }
  if (!local.ok()) optimizer_->ZeroGrad();  // the step is abandoned on every rank
  const absl::Status agreed =
      sync_->Agree(absl::StrCat("step ", step, lockstep ? ": scored" : ": learned"), local);
  if (!agreed.ok()) return FailStep(agreed, absl::StrCat("step ", step));
  if (lockstep) {
    sync_->SetPhase(absl::StrCat("step ", step, ": learning in lockstep"));
    if (absl::Status s = LearnInLockstep(step, learner, *pipe, held, st); !s.ok())
      return FailStep(s, absl::StrCat("step ", step, ": learning"));
  }
  return absl::OkStatus();
}

// Collective from here: every rank agreed that it learned its share. The reductions, then the
// update (skipped when the loss or the gradient is not finite), which moves step_ on.
absl::Status OpdJob::ReduceAndUpdate(int64_t step, StepLearner& learner, const StepPipeline& pipe,
                                     StepStats* st) {
  sync_->SetPhase(absl::StrCat("step ", step, ": reductions"));
  const auto t_reduce = Clock::now();
  if (absl::Status s = learner.Finish(st); !s.ok())
    return FailStep(s, absl::StrCat("step ", step, ": the reductions"));
  st->learn_s += Seconds(t_reduce);
  st->lr = NextLr();
  st->skipped = !std::isfinite(st->loss_value) || !std::isfinite(st->grad_norm);
  return ApplyUpdate(st->skipped, st->lr, pipe.prompts().cursor_after);
}

// The completed step's bookkeeping: its non-finite count and the stage's rules. True when they
// end the stage.
bool OpdJob::TrackStep(const StepStats& st) {
  CountNonFinite(st.skipped, st.loss_value, st.grad_norm);
  // A skipped step (non-finite loss or gradient) changed nothing: its KL is not averaged.
  const double reverse_kl =
      st.skipped
          ? std::numeric_limits<double>::quiet_NaN()
          : st.loss.reverse_kl_sum / static_cast<double>(std::max<int64_t>(st.response_tokens, 1));
  const bool stage_over =
      convergence_->OnStep(step_, reverse_kl, DomainKl(st, teachers_->metric_domains()));
  if (stage_over) done_ = stage_ + 1 == c_.stages.size();
  return stage_over;
}

// The new weights to the rollout workers, timed into st->push_s; the debug hooks fail here as a
// torch error in the push or a worker that cannot take the weights would.
absl::Status OpdJob::PushStepWeights(StepStats* st) {
  if (Contains(c_.debug.throw_after_update_steps, step_))
    throw std::runtime_error(absl::StrCat("debug.throw_after_update_steps: step ", step_));
  const auto t_push = Clock::now();
  absl::Status pushed = PushWeights();
  if (pushed.ok() && Contains(c_.debug.fail_push_steps, step_))
    pushed = absl::UnavailableError(absl::StrCat("debug.fail_push_steps: step ", step_));
  st->push_s = Seconds(t_push);
  return pushed;
}

// What rank 0's admin server answers about the run, and the step's records.
void OpdJob::ReportStep(const StepStats& st) {
  if (admin_)
    admin_->SetStatus(
        {c_.stages[stage_].name, step_, teachers_->stage().teachers, weight_version_});
  LogStep(st);
}

// A finished stage is checkpointed and the next one started; otherwise the periodic checkpoint.
absl::Status OpdJob::EndStageOrCheckpoint(bool stage_over) {
  if (stage_over) {
    // This stage's evaluation is of this stage's teachers: applied (logged) before they go.
    if (heldout_->pending_step() >= 0) {
      ASSIGN_OR_RETURN(std::vector<double> kl, heldout_->Collect(*sync_, *group_));
      LogHeldout(step_, kl);
    }
    // The checkpoint records the finished stage (its rule says why); a resume from it starts
    // the next stage. The next stage's teachers are checked before any step is spent on them.
    RETURN_IF_ERROR(SaveCheckpoint());
    if (!done_) {
      RETURN_IF_ERROR(StartStage(stage_ + 1));
      convergence_->Start(c_.stages[stage_], !c_.heldout.sources.empty());
    }
  } else if (c_.checkpoint.every > 0 && step_ % c_.checkpoint.every == 0) {
    RETURN_IF_ERROR(SaveCheckpoint());
  }
  return absl::OkStatus();
}

// Every rank publishes the same weights (each sends its share: trainer/opd/weight_push.h) and
// learns the same report; the ranks agree on it, and on the versions the workers may now answer
// with.
absl::Status OpdJob::PushWeights() {
  torch::NoGradGuard no_grad;
  ++weight_version_;
  sync_->SetPhase(absl::StrCat("pushing weight version ", weight_version_));
  absl::StatusOr<PublishReport> report = publisher_->Publish(*model_, weight_version_);
  const absl::Status pushed = report.ok() ? report->status : report.status();
  RETURN_IF_ERROR(
      sync_->Agree(absl::StrCat("weight version ", weight_version_, " pushed"), pushed));
  source_->rollout().NoteVersions(weight_version_);
  return absl::OkStatus();
}

// The evaluation launched after the previous step's push is applied now, at this fixed step: it
// feeds the stage's rule unless the stage has already ended.
absl::Status OpdJob::ApplyHeldout(bool* stage_over) {
  if (heldout_->pending_step() < 0 || heldout_->pending_step() == step_) return absl::OkStatus();
  const int64_t evaluated = heldout_->pending_step();
  sync_->SetPhase(absl::StrCat("waiting for the held-out evaluation of step ", evaluated));
  absl::StatusOr<std::vector<double>> kl = heldout_->Collect(*sync_, *group_);
  if (!kl.ok()) return FailStep(kl.status(), "the held-out evaluation");
  LogHeldout(evaluated, *kl);
  if (!*stage_over && convergence_->OnHeldout(step_, *kl)) {
    *stage_over = true;
    done_ = stage_ + 1 == c_.stages.size();
  }
  return absl::OkStatus();
}

void OpdJob::LogHeldout(int64_t evaluated_step, const std::vector<double>& kl) {
  const EvalSummary e = EvalSummary::Of(kl);
  if (metrics_)
    metrics_->Log(step_, {{"opd/heldout_reverse_kl", e.mean},
                          {"opd/heldout_reverse_kl_se", e.StandardError()},
                          {"opd/heldout_samples", static_cast<double>(e.n)},
                          {"opd/heldout_step", static_cast<double>(evaluated_step)}});
  progress_->Log(absl::StrFormat(
      "step %d: held-out reverse KL of step %d's weights %.5f (se %.5f, %d responses)", step_,
      evaluated_step, e.mean, e.StandardError(), e.n));
}

void OpdJob::LogStep(const StepStats& st) {
  if (!metrics_) return;  // rank 0 keeps the run's records
  const double n = static_cast<double>(std::max<int64_t>(st.response_tokens, 1));
  const double samples = static_cast<double>(std::max<int64_t>(st.sequences, 1));
  const double busy = st.sample_s + st.score_s + st.learn_s + st.push_s;
  metrics_->Log(step_,
                {{"opd/reverse_kl", st.loss.reverse_kl_sum / n},
                 {"opd/loss", st.loss_value},
                 {"opd/teacher_logprob", st.teacher_lp_sum / n},
                 {"opd/student_logprob", st.student_lp_sum / n},
                 {"opd/student_entropy", st.entropy_sum / n},
                 {"opd/response_len_mean", static_cast<double>(st.response_tokens) / samples},
                 {"opd/response_len_max", static_cast<double>(st.max_response)},
                 {"opd/ratio_mean", st.loss.ratio_sum / n},
                 {"opd/ratio_min", st.loss.ratio_min},
                 {"opd/ratio_max", st.loss.ratio_max},
                 {"opd/clip_frac", st.loss.clipped / n},
                 {"opd/sampler_learner_abs_diff", st.loss.mismatch_abs_sum / n},
                 // Routing replay: the trained forward's gap above is the replayed one; the
                 // share of (fed token, MoE layer) whose learner top-k differs from the rollout's.
                 {"opd/routing_mismatch_frac",
                  st.routing_pairs > 0 ? st.routing_mismatches / st.routing_pairs : 0.0},
                 {"opd/stage", static_cast<double>(stage_)},
                 {"opd/smoothed_reverse_kl", convergence_->smoothed()},
                 {"opd/weight_version", static_cast<double>(weight_version_)},
                 {"opd/teacher_failovers", static_cast<double>(teachers_->failovers())},
                 {"opd/domain_fallbacks", st.domain_fallbacks},
                 {"rollout/failovers", static_cast<double>(source_->rollout().failovers())},
                 {"optim/lr", st.lr},
                 {"optim/grad_norm", st.grad_norm},
                 {"optim/skipped", st.skipped ? 1.0 : 0.0},
                 {"rollout/staleness_mean", st.samples.staleness_mean},
                 {"rollout/staleness_max", st.samples.staleness_max},
                 {"rollout/truncated_frac", st.samples.truncated_frac},
                 {"time/sample_s", st.sample_s},
                 {"time/score_s", st.score_s},
                 {"time/learn_s", st.learn_s},
                 {"time/push_s", st.push_s},
                 {"time/step_s", st.step_s},
                 {"time/overlap", st.step_s > 0 ? busy / st.step_s : 0.0},
                 {"throughput/tokens_per_s", static_cast<double>(st.total_tokens) / st.step_s}});
  const std::vector<std::string>& domains = teachers_->metric_domains();
  if (!domains.empty()) {
    Scalars out;
    for (size_t d = 0; d < domains.size(); ++d) {
      const double* row = &st.domain_sums[d * kDomainSums];
      const double tokens = row[kDomainTokens];
      const double nan = std::numeric_limits<double>::quiet_NaN();
      out.push_back({"teacher_kl/" + domains[d], tokens > 0 ? row[kDomainKl] / tokens : nan});
      out.push_back(
          {"teacher_logprob/" + domains[d], tokens > 0 ? row[kDomainTeacherLp] / tokens : nan});
      out.push_back(
          {"student_logprob/" + domains[d], tokens > 0 ? row[kDomainStudentLp] / tokens : nan});
      out.push_back({"tokens/" + domains[d], tokens});
      out.push_back({"sequences/" + domains[d], row[kDomainSequences]});
    }
    metrics_->Log(step_, out);
  }
  progress_->Update({step_, st.loss.reverse_kl_sum / n, st.lr,
                     static_cast<double>(st.total_tokens) / st.step_s, st.grad_norm, st.skipped},
                    st.step_s);
}

}  // namespace trainer::opd_detail
