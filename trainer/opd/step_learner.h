// The learner's part of an OPD step: each micro-batch's forward, the loss (trainer/opd/opd_loss.h)
// and its backward, the step's sums, and the reductions over the ranks.
//
// The loss's step-global normaliser (the step's response tokens, or responses, over every rank) is
// known only once every rank has all its samples, so micro-batches are learned without it (token
// weights 1, or 1/|y| per response) and the summed gradients are multiplied by it once, after the
// reduction (DistributedOptimizer::ReduceAndClip's grad_scale); the logged sums likewise. So a
// micro-batch can be learned as soon as it is scored.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "lm/dist/process_group.h"
#include "lm/model/model.h"
#include "trainer/common/mixed_precision.h"
#include "trainer/common/zero1.h"
#include "trainer/opd/opd_config.h"
#include "trainer/opd/opd_loss.h"
#include "trainer/opd/rollout_pool.h"

namespace trainer {

class StepPipeline;

// Sums of one domain's samples in a step, in the order they are all-reduced.
enum DomainSum {
  kDomainSequences,
  kDomainTokens,
  kDomainKl,
  kDomainTeacherLp,
  kDomainStudentLp,
  kDomainSums
};

// Sums over a step's response tokens (every rank's once Finish returned), and its timings.
struct StepStats {
  LossStats loss;
  double loss_value = 0;
  double teacher_lp_sum = 0, student_lp_sum = 0, entropy_sum = 0;
  double grad_norm = 0, lr = 0;
  bool skipped = false;
  int64_t response_tokens = 0, total_tokens = 0, max_response = 0, sequences = 0;
  // Routing replay: replayed (token, MoE layer) pairs, and those whose learner top-k (as a set)
  // differs from the rollout's.
  double routing_pairs = 0, routing_mismatches = 0;
  // The samples' weight-version lag and truncation: sums until Finish, then means.
  double staleness_sum = 0, staleness_max = 0, truncated = 0;
  double domain_fallbacks = 0;  // samples scored by the default pool for a down domain pool
  SampleStats samples;
  // Busy seconds of each phase (the slowest rank's), the step's wall time, and their ratio:
  // time/overlap = (sample + score + learn + push) / step, above 1 when phases overlapped.
  double sample_s = 0, score_s = 0, learn_s = 0, push_s = 0, step_s = 0;
  // metric_domains.size() x kDomainSums, row-major (DomainSum).
  std::vector<double> domain_sums;
};

struct StepLearnerOptions {
  SampledTokenLossOptions loss;
  LossForm form = LossForm::kSampled;
  int64_t top_k = 0;
  TopKDivergence divergence = TopKDivergence::kMixed;
  double alpha = 0.5;
  Normalization normalization = Normalization::kToken;
  double temperature = 1.0;  // the sampler's (the learner's log-probs use it too)
  bool activation_checkpointing = false;
  bool routing_replay = false;
  double max_grad_norm = 1.0;
};

class StepLearner {
 public:
  StepLearner(StepLearnerOptions options, lm::CausalLM& model, DistributedOptimizer& optimizer,
              lm::dist::ProcessGroup& group, torch::Device device, Precision precision,
              std::vector<std::string> metric_domains);

  // Forward and loss of the micro-batch of `slots` (samples of `p`, scored); its backward now, or
  // in BackwardDeferred when `defer_backward` (the step's last, whose backward starts the
  // optimizer's reductions). `poison` makes the loss NaN (debug.nan_steps).
  absl::Status Learn(const StepPipeline& p, const std::vector<size_t>& slots, bool defer_backward,
                     bool poison, StepStats* st);
  void BackwardDeferred();
  // Lockstep learning (ZeRO-2 over several ranks, whose backwards reduce-scatter as they run):
  // collective, after every rank has its micro-batches scored and before the first Learn, which
  // then must not defer.
  absl::Status ExpectBackwards(int64_t micro_batches);
  // Collective: the step's loss normaliser from every rank's sample counts (AddSamples). Finish
  // computes it when not yet done; lockstep learning computes it first, so that no rank's
  // all-reduce meets another's reduce-scatter.
  absl::Status Normalize(const StepStats& st);
  // The rank's samples' own statistics (every sample of the share, learned or not).
  void AddSamples(const StepPipeline& p, int64_t learner_version, StepStats* st) const;

  // Collective, after every rank has agreed its micro-batches are learned: the step's
  // normaliser, the deferred backward, the gradients' reduction and clip, and every sum over the
  // ranks. Returns the gradient norm in st.
  absl::Status Finish(StepStats* st);

 private:
  void AddRoutingMismatch(const torch::Tensor& replayed, const std::vector<torch::Tensor>& own,
                          StepStats* st) const;
  void AddDomainSums(const StepPipeline& p, const std::vector<size_t>& slots,
                     const torch::Tensor& lp, const std::vector<float>& teacher_lp,
                     StepStats* st) const;
  size_t MetricRow(const std::string& domain) const;
  absl::Status ReduceStats(StepStats* st);

  const StepLearnerOptions opts_;
  lm::CausalLM& model_;
  DistributedOptimizer& optimizer_;
  lm::dist::ProcessGroup& group_;
  const torch::Device device_;
  const Precision precision_;
  const std::vector<std::string> metric_domains_;
  torch::Tensor deferred_loss_;  // the last micro-batch's, until BackwardDeferred
  std::optional<double> scale_;  // the step's normaliser, once Normalize ran
};

// A step's metrics for the domains with metrics of their own: mean per-token reverse KL, teacher
// and student log-probs (NaN for a domain without tokens), tokens and sequences.
std::map<std::string, double> DomainKl(const StepStats& st,
                                       const std::vector<std::string>& metric_domains);

}  // namespace trainer
