#include "trainer/opd/step_learner.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "lm/model/logprobs.h"
#include "lm/model/moe.h"
#include "lm/model/routing_trace.h"
#include "lm/util/status.h"
#include "trainer/opd/step_pipeline.h"

namespace trainer {
namespace {

// The tensors of one micro-batch: its samples (prompt + response) packed as documents; the rows of
// the packed hidden states that predict the response tokens (row p of a document predicts token
// p + 1, so the response tokens [P, L) are predicted by rows [P - 1, L - 1)); the tokens; and for
// routing replay the rollout's experts, [T, moe_layers, top_k] packed as the batch, -1 at each
// document's last token (never fed to the rollout; its row predicts nothing).
struct MicroBatch {
  lm::PackedBatch batch;
  torch::Tensor rows, targets, replay_experts;
};

MicroBatch Pack(const StepPipeline& p, const std::vector<size_t>& slots, const lm::ModelConfig& mc,
                bool replay, torch::Device device) {
  lm::RoutingTrace routing(mc);                 // the micro-batch's tokens, packed as the batch
  std::vector<absl::Span<const int32_t>> docs;  // the samples' tokens, read in place
  std::vector<int64_t> rows, targets;
  int64_t tokens = 0;
  for (size_t slot : slots) {
    const lm::Sample& s = p.samples()[slot];
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    for (int64_t t = s.response_start; t < len; ++t) {
      rows.push_back(tokens + t - 1);
      targets.push_back(s.tokens[t]);
    }
    if (replay) {  // fed positions as the rollout routed them (checked on arrival), the last own
      TORCH_CHECK(routing.Append(s.routed_experts).ok(), "routing replay: a partial position");
      routing.AppendUnrouted(1);
    }
    docs.push_back(s.tokens);
    tokens += len;
  }
  MicroBatch mb;
  mb.batch = lm::PackedBatch::FromSpans(docs);
  mb.batch.input_ids = mb.batch.input_ids.to(device);
  mb.batch.position_ids = mb.batch.position_ids.to(device);
  mb.rows = torch::tensor(rows, torch::kInt64).to(device);
  mb.targets = torch::tensor(targets, torch::kInt64).to(device);
  if (replay) mb.replay_experts = routing.ToTensor().to(device);
  return mb;
}

}  // namespace

StepLearner::StepLearner(StepLearnerOptions options, lm::CausalLM& model,
                         DistributedOptimizer& optimizer, lm::dist::ProcessGroup& group,
                         torch::Device device, Precision precision,
                         std::vector<std::string> metric_domains)
    : opts_(std::move(options)),
      model_(model),
      optimizer_(optimizer),
      group_(group),
      device_(device),
      precision_(precision),
      metric_domains_(std::move(metric_domains)) {}

void StepLearner::AddSamples(const StepPipeline& p, int64_t learner_version, StepStats* st) const {
  for (const lm::Sample& s : p.samples()) {
    st->response_tokens += s.response_length();
    st->total_tokens += static_cast<int64_t>(s.tokens.size());
    st->max_response = std::max(st->max_response, s.response_length());
    st->sequences += s.response_length() > 0 ? 1 : 0;
    const double lag = static_cast<double>(learner_version - s.weight_version);
    st->staleness_sum += lag;
    st->staleness_max = std::max(st->staleness_max, lag);
    st->truncated += s.finish == lm::FinishReason::kLength;
  }
}

absl::Status StepLearner::Learn(const StepPipeline& p, const std::vector<size_t>& slots,
                                bool defer_backward, bool poison, StepStats* st) {
  if (st->domain_sums.empty()) st->domain_sums.assign(metric_domains_.size() * kDomainSums, 0.0);
  const MicroBatch mb = Pack(p, slots, model_.config(), opts_.routing_replay, device_);
  std::vector<float> old_lp, teacher_lp, topk_lp;
  std::vector<int64_t> topk_ids, lengths;
  for (size_t slot : slots) {
    const lm::Sample& s = p.samples()[slot];
    const lm::SequenceScore& sc = p.scores(slot);
    lengths.push_back(static_cast<int64_t>(s.logprobs.size()));
    old_lp.insert(old_lp.end(), s.logprobs.begin(), s.logprobs.end());
    teacher_lp.insert(teacher_lp.end(), sc.logprobs.begin(), sc.logprobs.end());
    topk_ids.insert(topk_ids.end(), sc.topk_ids.begin(), sc.topk_ids.end());
    topk_lp.insert(topk_lp.end(), sc.topk_logprobs.begin(), sc.topk_logprobs.end());
  }
  ForwardPrecision autocast(precision_, device_);
  lm::ForwardOptions fwd;
  fwd.checkpoint_layers = opts_.activation_checkpointing;
  // Routing replay: the rollout's experts; the recorder sees what the learner's router would have
  // picked (lm/model/moe.h), compared below as sets per (token, MoE layer).
  std::vector<torch::Tensor> own_routing;
  std::optional<lm::ScopedRoutingRecorder> record;
  if (mb.replay_experts.defined()) {
    fwd.replay_experts = mb.replay_experts;
    record.emplace(&own_routing);
  }
  auto hidden = model_.Forward(mb.batch, fwd).index_select(0, mb.rows);
  record.reset();
  if (mb.replay_experts.defined()) AddRoutingMismatch(mb.replay_experts, own_routing, st);
  lm::LogprobOptions lo;
  lo.temperature = opts_.temperature;
  torch::Tensor entropy;
  auto lp = lm::TokenLogprobs(hidden, model_.LmHeadWeight(), mb.targets, lo, &entropy);
  auto lp_old = torch::tensor(old_lp).to(device_);
  auto lp_teacher = torch::tensor(teacher_lp).to(device_);
  // The step's normaliser comes later (the top of the file): token weights 1, or 1/|y|.
  const auto weights = TokenWeights(lengths, opts_.normalization, 1, 1, lp_old.options());
  torch::Tensor loss;
  if (opts_.form == LossForm::kTopK) {
    const int64_t n = hidden.size(0), k = opts_.top_k;
    auto ids = torch::tensor(topk_ids, torch::kInt64).to(device_).view({n, k});
    auto student_k =
        StudentTopKLogprobs(hidden, model_.LmHeadWeight(), ids, mb.targets, lp, opts_.temperature);
    auto teacher_k = torch::tensor(topk_lp).view({n, k}).to(device_);
    loss = TopKLoss(student_k, teacher_k, weights, opts_.divergence, opts_.alpha);
    SampledTokenLoss(lp.detach(), lp_old, lp_teacher, weights, lengths, opts_.loss,
                     &st->loss);  // stats only
  } else {
    loss = SampledTokenLoss(lp, lp_old, lp_teacher, weights, lengths, opts_.loss, &st->loss);
  }
  if (poison) loss = loss * std::numeric_limits<double>::quiet_NaN();
  if (defer_backward) {
    deferred_loss_ = loss;
  } else {
    RETURN_IF_ERROR(optimizer_.Backward(loss));
  }
  st->loss_value += loss.item<double>();
  st->teacher_lp_sum += lp_teacher.sum().item<double>();
  st->student_lp_sum += lp.detach().sum().item<double>();
  st->entropy_sum += entropy.sum().item<double>();
  AddDomainSums(p, slots, lp, teacher_lp, st);
  return absl::OkStatus();
}

absl::Status StepLearner::ExpectBackwards(int64_t micro_batches) {
  return optimizer_.ExpectBackwards(micro_batches);
}

void StepLearner::BackwardDeferred() {
  if (!deferred_loss_.defined()) return;
  optimizer_.ExpectLastBackward();
  deferred_loss_.backward();
  deferred_loss_ = torch::Tensor();
}

absl::Status StepLearner::Normalize(const StepStats& st) {
  if (scale_) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<double> counts,
                   group_.AllReduceDoubles({static_cast<double>(st.response_tokens),
                                            static_cast<double>(st.sequences)}));
  scale_ =
      1.0 / std::max(opts_.normalization == Normalization::kToken ? counts[0] : counts[1], 1.0);
  return absl::OkStatus();
}

absl::Status StepLearner::Finish(StepStats* st) {
  if (st->domain_sums.empty()) st->domain_sums.assign(metric_domains_.size() * kDomainSums, 0.0);
  // The normaliser first: every rank's response tokens and responses.
  RETURN_IF_ERROR(Normalize(*st));
  const double scale = *scale_;
  BackwardDeferred();
  ASSIGN_OR_RETURN(st->grad_norm, optimizer_.ReduceAndClip(opts_.max_grad_norm, scale));
  st->loss_value *= scale;
  return ReduceStats(st);
}

// Sums (and extremes) of the step's statistics over the ranks, so every rank logs and decides
// (convergence, non-finite steps) on the same numbers.
absl::Status StepLearner::ReduceStats(StepStats* st) {
  LossStats& l = st->loss;
  const double inf = std::numeric_limits<double>::infinity();
  if (group_.size() > 1) {
    ASSIGN_OR_RETURN(
        std::vector<double> sums,
        group_.AllReduceDoubles(
            {st->loss_value, st->teacher_lp_sum, st->student_lp_sum, st->entropy_sum,
             l.reverse_kl_sum, l.ratio_sum, l.clipped, l.mismatch_abs_sum, l.tokens,
             st->routing_pairs, st->routing_mismatches, static_cast<double>(st->response_tokens),
             static_cast<double>(st->total_tokens), static_cast<double>(st->sequences),
             st->staleness_sum, st->truncated, st->domain_fallbacks}));
    st->loss_value = sums[0];
    st->teacher_lp_sum = sums[1];
    st->student_lp_sum = sums[2];
    st->entropy_sum = sums[3];
    l.reverse_kl_sum = sums[4];
    l.ratio_sum = sums[5];
    l.clipped = sums[6];
    l.mismatch_abs_sum = sums[7];
    l.tokens = sums[8];
    st->routing_pairs = sums[9];
    st->routing_mismatches = sums[10];
    st->response_tokens = static_cast<int64_t>(sums[11]);
    st->total_tokens = static_cast<int64_t>(sums[12]);
    st->sequences = static_cast<int64_t>(sums[13]);
    st->staleness_sum = sums[14];
    st->truncated = sums[15];
    st->domain_fallbacks = sums[16];
    ASSIGN_OR_RETURN(std::vector<double> lo,
                     group_.AllReduceDoubles(
                         {l.tokens > 0 ? l.ratio_min : inf, -static_cast<double>(st->max_response),
                          -st->staleness_max, -st->sample_s, -st->score_s, -st->learn_s},
                         lm::dist::ReduceOp::kMin));
    ASSIGN_OR_RETURN(
        std::vector<double> hi,
        group_.AllReduceDoubles({l.tokens > 0 ? l.ratio_max : -inf}, lm::dist::ReduceOp::kMax));
    l.ratio_min = std::isfinite(lo[0]) ? lo[0] : 0;
    l.ratio_max = std::isfinite(hi[0]) ? hi[0] : 0;
    st->max_response = static_cast<int64_t>(-lo[1]);
    st->staleness_max = -lo[2];
    st->sample_s = -lo[3];
    st->score_s = -lo[4];
    st->learn_s = -lo[5];
    if (!st->domain_sums.empty()) {
      ASSIGN_OR_RETURN(st->domain_sums, group_.AllReduceDoubles(st->domain_sums));
    }
  }
  const double n = std::max<double>(static_cast<double>(st->sequences), 1.0);
  st->samples.staleness_mean = st->staleness_sum / n;
  st->samples.staleness_max = st->staleness_max;
  st->samples.truncated_frac = st->truncated / n;
  return absl::OkStatus();
}

// Routing replay: replayed [T, L, k] (-1 rows not replayed) against the learner's own top-k per
// MoE layer ([T, k] each), as sets.
void StepLearner::AddRoutingMismatch(const torch::Tensor& replayed,
                                     const std::vector<torch::Tensor>& own, StepStats* st) const {
  torch::NoGradGuard no_grad;
  if (own.size() != static_cast<size_t>(replayed.size(1))) return;        // not a recordable model
  const auto rollout = std::get<0>(replayed.to(torch::kInt64).sort(-1));  // [T, L, k]
  const auto learner = std::get<0>(torch::stack(own, 1).to(rollout.device()).sort(-1));
  const auto replayed_pair = (rollout >= 0).all(-1);  // [T, L]
  const auto differs = (rollout != learner).any(-1) & replayed_pair;
  st->routing_pairs += replayed_pair.sum().item<double>();
  st->routing_mismatches += differs.sum().item<double>();
}

// Adds a micro-batch's samples to their domains' sums (one host copy of the learner's log-probs).
void StepLearner::AddDomainSums(const StepPipeline& p, const std::vector<size_t>& slots,
                                const torch::Tensor& lp, const std::vector<float>& teacher_lp,
                                StepStats* st) const {
  if (metric_domains_.empty()) return;
  const torch::Tensor student = lp.detach().to(torch::kCPU, torch::kFloat64).contiguous();
  const double* s = student.data_ptr<double>();
  size_t at = 0;
  for (size_t slot : slots) {
    const lm::Sample& sample = p.samples()[slot];
    double* row = &st->domain_sums[MetricRow(sample.domain) * kDomainSums];
    const size_t n = static_cast<size_t>(sample.response_length());
    row[kDomainSequences] += 1;
    row[kDomainTokens] += static_cast<double>(n);
    for (size_t t = at; t < at + n; ++t) {
      row[kDomainKl] += s[t] - teacher_lp[t];
      row[kDomainTeacherLp] += teacher_lp[t];
      row[kDomainStudentLp] += s[t];
    }
    at += n;
  }
}

// The row of metric_domains_ a domain's sums go to (the last, "other", for a domain without a
// pool of its own).
size_t StepLearner::MetricRow(const std::string& domain) const {
  for (size_t d = 0; d + 1 < metric_domains_.size(); ++d) {
    if (metric_domains_[d] == domain) return d;
  }
  return metric_domains_.size() - 1;
}

std::map<std::string, double> DomainKl(const StepStats& st,
                                       const std::vector<std::string>& metric_domains) {
  std::map<std::string, double> out;
  for (size_t d = 0; d < metric_domains.size(); ++d) {
    const double* row = &st.domain_sums[d * kDomainSums];
    out[metric_domains[d]] = st.skipped || row[kDomainTokens] == 0
                                 ? std::numeric_limits<double>::quiet_NaN()
                                 : row[kDomainKl] / row[kDomainTokens];
  }
  return out;
}

}  // namespace trainer
