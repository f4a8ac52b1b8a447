#include "trainer/opd/opd.h"

#include "trainer/opd/opd_job.h"

namespace trainer::opd_detail {

absl::Status OpdJob::LoadPrompts() {
  const std::string tok = c_.model.tokenizer.empty() ? c_.model.path : c_.model.tokenizer;
  ASSIGN_OR_RETURN(tokenizer_, lm::Tokenizer::Load(tok));
  if (tokenizer_->vocab_size() > model_->config().vocab_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the tokenizer (", tokenizer_->vocab_size(),
        " ids) does not fit the student's vocabulary (", model_->config().vocab_size, ")"));
  }
  lm::PromptDatasetOptions o;
  for (const auto& s : c_.prompts.sources) o.sources.push_back({s.name, s.files, s.weight});
  o.max_prompt_len = static_cast<int32_t>(c_.prompts.max_prompt_len);
  o.skip_bad_lines = c_.prompts.skip_bad_lines;
  o.shuffle = c_.prompts.shuffle;
  o.seed = static_cast<uint64_t>(c_.prompts.seed);
  o.chat_format = ChatFormatOf(c_.model.chat_format);
  o.drop_final_assistant = true;
  ASSIGN_OR_RETURN(prompts_, lm::PromptDataset::Load(*tokenizer_, o));
  lm::log::Info(absl::StrCat("prompts: ", prompts_->stats().Summary()));
  if (c_.heldout.sources.empty()) return absl::OkStatus();
  // The held-out set: the first num_prompts prompts in file order, the same at every evaluation.
  o.sources.clear();
  for (const auto& s : c_.heldout.sources) o.sources.push_back({s.name, s.files, s.weight});
  o.shuffle = false;
  ASSIGN_OR_RETURN(std::unique_ptr<lm::PromptDataset> heldout,
                   lm::PromptDataset::Load(*tokenizer_, o));
  heldout_prompts_ = heldout->NextBatch(static_cast<size_t>(c_.heldout.num_prompts));
  lm::log::Info(absl::StrCat("held-out prompts: ", heldout_prompts_.size(), ", evaluated every ",
                             c_.heldout.every, " steps"));
  return absl::OkStatus();
}

absl::Status OpdJob::ConnectRollout() {
  opd::rpc::ClientOptions base;
  base.secret = secret_;
  base.tls = ClientTls(c_.auth);
  base.timeout = absl::Seconds(c_.rollout.timeout_s);
  base.canceller = canceller_;
  ASSIGN_OR_RETURN(rollout_, RolloutPool::Connect(
                                 c_.rollout.endpoints, base, tokenizer_->Fingerprint(),
                                 model_->config().vocab_size, PushOptionsOf(c_.rollout), device_));
  return absl::OkStatus();
}

// Rank r learns micro-batches r, r + N, ... of the step (each rank packs them all the same way).
std::vector<MicroBatch> OpdJob::MyMicroBatches(const Rollouts& r) {
  std::vector<MicroBatch> all = MakeMicroBatches(r), mine;
  for (size_t i = static_cast<size_t>(group_->rank()); i < all.size();
       i += static_cast<size_t>(group_->size()))
    mine.push_back(std::move(all[i]));
  return mine;
}

// Sums (and extremes) of the step's statistics over the ranks, so every rank logs and decides
// (convergence, non-finite steps) on the same numbers.
absl::Status OpdJob::ReduceStats(StepStats* st) {
  if (group_->size() == 1) return absl::OkStatus();
  LossStats& l = st->loss;
  ASSIGN_OR_RETURN(std::vector<double> sums,
                   group_->AllReduceDoubles({st->loss_value, st->teacher_lp_sum, st->student_lp_sum,
                                             st->entropy_sum, l.reverse_kl_sum, l.ratio_sum,
                                             l.clipped, l.mismatch_abs_sum, l.tokens,
                                             st->routing_pairs, st->routing_mismatches}));
  const double inf = std::numeric_limits<double>::infinity();
  ASSIGN_OR_RETURN(
      std::vector<double> lo,
      group_->AllReduceDoubles({l.tokens > 0 ? l.ratio_min : inf}, lm::dist::ReduceOp::kMin));
  ASSIGN_OR_RETURN(
      std::vector<double> hi,
      group_->AllReduceDoubles({l.tokens > 0 ? l.ratio_max : -inf}, lm::dist::ReduceOp::kMax));
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
  l.ratio_min = std::isfinite(lo[0]) ? lo[0] : 0;
  l.ratio_max = std::isfinite(hi[0]) ? hi[0] : 0;
  if (!st->domain_sums.empty()) {
    ASSIGN_OR_RETURN(st->domain_sums, group_->AllReduceDoubles(st->domain_sums));
  }
  return absl::OkStatus();
}

// Routing replay: replayed [T, L, k] (-1 rows not replayed) against the learner's own top-k per
// MoE layer ([T, k] each), as sets.
void OpdJob::AddRoutingMismatch(const torch::Tensor& replayed,
                                const std::vector<torch::Tensor>& own, StepStats* st) {
  torch::NoGradGuard no_grad;
  if (own.size() != static_cast<size_t>(replayed.size(1))) return;        // not a recordable model
  const auto rollout = std::get<0>(replayed.to(torch::kInt64).sort(-1));  // [T, L, k]
  const auto learner = std::get<0>(torch::stack(own, 1).to(rollout.device()).sort(-1));
  const auto replayed_pair = (rollout >= 0).all(-1);  // [T, L]
  const auto differs = (rollout != learner).any(-1) & replayed_pair;
  st->routing_pairs += replayed_pair.sum().item<double>();
  st->routing_mismatches += differs.sum().item<double>();
}

// Packs samples (prompt + response) into micro-batches of at most micro_batch_tokens tokens (a
// longer sample gets a micro-batch of its own). Row p of a document predicts token p + 1, so the
// response tokens [P, L) are predicted by rows [P - 1, L - 1).
std::vector<MicroBatch> OpdJob::MakeMicroBatches(const Rollouts& r) {
  std::vector<MicroBatch> out;
  std::vector<std::vector<int64_t>> docs;
  std::vector<int64_t> rows, targets;
  std::vector<int32_t> routing;  // routing replay: [tokens, moe layers, top_k], packed as docs
  const bool replay = c_.rollout.routing_replay;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < model_->config().num_hidden_layers; ++l)
    moe_layers += model_->config().IsMoeLayer(l);
  const int64_t per_token = moe_layers * model_->config().num_experts_per_tok;
  int64_t tokens = 0;
  std::vector<size_t> current;  // the samples of the micro-batch being packed
  auto flush = [&] {
    if (docs.empty()) return;
    MicroBatch mb;
    // Only the micro-batches this rank learns (every Nth, from its rank) get tensors; the others
    // keep their sample indices alone.
    const size_t ranks = static_cast<size_t>(group_->size());
    if (out.size() % ranks == static_cast<size_t>(group_->rank())) {
      mb.batch = lm::PackedBatch::FromSequences(docs);
      mb.batch.input_ids = mb.batch.input_ids.to(device_);
      mb.batch.position_ids = mb.batch.position_ids.to(device_);
      mb.rows = torch::tensor(rows, torch::kInt64).to(device_);
      mb.targets = torch::tensor(targets, torch::kInt64).to(device_);
      if (replay) {
        mb.replay_experts = torch::tensor(routing, torch::kInt32)
                                .view({tokens, moe_layers, model_->config().num_experts_per_tok})
                                .to(device_);
      }
    }
    mb.response_tokens = static_cast<int64_t>(rows.size());
    mb.samples = std::move(current);
    out.push_back(std::move(mb));
    current.clear();
    docs.clear();
    rows.clear();
    targets.clear();
    routing.clear();
    tokens = 0;
  };
  for (size_t i = 0; i < r.samples.size(); ++i) {
    const lm::Sample& s = r.samples[i];
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    if (tokens > 0 && tokens + len > c_.train.micro_batch_tokens) flush();
    for (int64_t t = s.response_start; t < len; ++t) {
      rows.push_back(tokens + t - 1);  // the row of the token before predicts it
      targets.push_back(s.tokens[t]);
    }
    if (replay) {  // fed positions as the rollout routed them (CheckRouting), the last own
      routing.insert(routing.end(), s.routed_experts.begin(), s.routed_experts.end());
      routing.insert(routing.end(), per_token, -1);
    }
    docs.emplace_back(s.tokens.begin(), s.tokens.end());
    current.push_back(i);
    tokens += len;
  }
  flush();
  return out;
}

absl::Status OpdJob::Learn(const Rollouts& r, const std::vector<MicroBatch>& mine,
                           const std::vector<opd::rpc::ScoreOutput>& scores, StepStats* st) {
  const auto t0 = Clock::now();
  for (const auto& s : r.samples) {
    st->response_tokens += s.response_length();
    st->total_tokens += static_cast<int64_t>(s.tokens.size());
    st->max_response = std::max(st->max_response, s.response_length());
  }
  int64_t sequences = 0;  // responses with a token: the "sequence" normalisation's count
  for (const auto& s : r.samples) sequences += s.response_length() > 0 ? 1 : 0;
  st->domain_sums.assign(metric_domains_.size() * kDomainSums, 0.0);
  const bool poison = Contains(c_.debug.nan_steps, step_ + 1);
  lm::LogprobOptions lo;
  lo.temperature = c_.rollout.temperature;
  ForwardPrecision autocast(optimizer_->precision(), device_);
  for (size_t m = 0; m < mine.size(); ++m) {
    const MicroBatch& mb = mine[m];
    // One process may abandon the step here; several ranks agree on stops at step boundaries.
    if (group_->size() == 1 && StopRequested()) {
      optimizer_->ZeroGrad();
      return absl::CancelledError("stop requested");
    }
    std::vector<float> old_lp, teacher_lp, topk_lp;
    std::vector<int64_t> topk_ids, lengths;
    for (size_t i : mb.samples) {
      const auto& s = r.samples[i];
      lengths.push_back(static_cast<int64_t>(s.logprobs.size()));
      old_lp.insert(old_lp.end(), s.logprobs.begin(), s.logprobs.end());
      teacher_lp.insert(teacher_lp.end(), scores[i].logprobs.begin(), scores[i].logprobs.end());
      topk_ids.insert(topk_ids.end(), scores[i].topk_ids.begin(), scores[i].topk_ids.end());
      topk_lp.insert(topk_lp.end(), scores[i].topk_logprobs.begin(), scores[i].topk_logprobs.end());
    }
    lm::ForwardOptions fwd;
    fwd.checkpoint_layers = c_.train.activation_checkpointing;
    // Routing replay: the rollout's experts; the recorder sees what the learner's router would
    // have picked (lm/model/moe.h), compared below as sets per (token, MoE layer).
    std::vector<torch::Tensor> own_routing;
    std::optional<lm::ScopedRoutingRecorder> record;
    if (mb.replay_experts.defined()) {
      fwd.replay_experts = mb.replay_experts;
      record.emplace(&own_routing);
    }
    auto hidden = model_->Forward(mb.batch, fwd).index_select(0, mb.rows);
    record.reset();
    if (mb.replay_experts.defined()) AddRoutingMismatch(mb.replay_experts, own_routing, st);
    torch::Tensor entropy;
    auto lp = lm::TokenLogprobs(hidden, model_->LmHeadWeight(), mb.targets, lo, &entropy);
    auto lp_old = torch::tensor(old_lp).to(device_);
    auto lp_teacher = torch::tensor(teacher_lp).to(device_);
    const auto weights = TokenWeights(lengths, c_.loss.normalization, st->response_tokens,
                                      sequences, lp_old.options());
    torch::Tensor loss;
    if (c_.loss.form == LossForm::kTopK) {
      const int64_t n = hidden.size(0), k = c_.loss.top_k;
      auto ids = torch::tensor(topk_ids, torch::kInt64).to(device_).view({n, k});
      auto student_k = StudentTopKLogprobs(hidden, model_->LmHeadWeight(), ids, mb.targets, lp,
                                           c_.rollout.temperature);
      auto teacher_k = torch::tensor(topk_lp).view({n, k}).to(device_);
      loss = TopKLoss(student_k, teacher_k, weights, c_.loss.divergence, c_.loss.alpha);
      SampledTokenLoss(lp.detach(), lp_old, lp_teacher, weights, lengths, loss_opts_,
                       &st->loss);  // stats only
    } else {
      loss = SampledTokenLoss(lp, lp_old, lp_teacher, weights, lengths, loss_opts_, &st->loss);
    }
    if (poison) loss = loss * std::numeric_limits<double>::quiet_NaN();  // debug.nan_steps
    if (m + 1 == mine.size()) optimizer_->ExpectLastBackward();
    loss.backward();
    st->loss_value += loss.item<double>();
    st->teacher_lp_sum += lp_teacher.sum().item<double>();
    st->student_lp_sum += lp.detach().sum().item<double>();
    st->entropy_sum += entropy.sum().item<double>();
    AddDomainSums(r, mb, lp, teacher_lp, st);
  }
  // Buckets, then statistics, on every rank (see sft.cc: a rank with no micro-batch sends its
  // buckets in ReduceAndClip).
  ASSIGN_OR_RETURN(st->grad_norm, optimizer_->ReduceAndClip(c_.optim.max_grad_norm));
  RETURN_IF_ERROR(ReduceStats(st));
  st->lr = NextLr();
  st->skipped = !std::isfinite(st->loss_value) || !std::isfinite(st->grad_norm);
  RETURN_IF_ERROR(ApplyUpdate(st->skipped, st->lr, r.cursor_after));  // step_ counts this step now
  st->learn_s = Seconds(t0);
  return absl::OkStatus();
}

// Rank 0 pushes (every rank holds the same weights after a step); all ranks learn the outcome.
absl::Status OpdJob::PushWeights() {
  torch::NoGradGuard no_grad;
  ++weight_version_;
  absl::Status pushed =
      group_->is_root() ? rollout_->PushWeights(*model_, weight_version_) : absl::OkStatus();
  std::string verdict = pushed.ok() ? "" : std::string(pushed.message());
  RETURN_IF_ERROR(group_->BroadcastBytes(&verdict));
  if (!pushed.ok()) return pushed;
  if (!verdict.empty()) return absl::UnavailableError(absl::StrCat("rank 0: ", verdict));
  return absl::OkStatus();
}

// Per domain: the mean per-token reverse KL, teacher and student log-probs (NaN for a domain
// without tokens this step: no value rather than a made-up 0), its tokens and sequences.
Scalars OpdJob::DomainScalars(const StepStats& st) const {
  Scalars out;
  for (size_t d = 0; d < metric_domains_.size(); ++d) {
    const double* row = &st.domain_sums[d * kDomainSums];
    const double tokens = row[kDomainTokens];
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const std::string& name = metric_domains_[d];
    out.push_back({"teacher_kl/" + name, tokens > 0 ? row[kDomainKl] / tokens : nan});
    out.push_back({"teacher_logprob/" + name, tokens > 0 ? row[kDomainTeacherLp] / tokens : nan});
    out.push_back({"student_logprob/" + name, tokens > 0 ? row[kDomainStudentLp] / tokens : nan});
    out.push_back({"tokens/" + name, tokens});
    out.push_back({"sequences/" + name, row[kDomainSequences]});
  }
  return out;
}

void OpdJob::LogStep(const StepStats& st) {
  if (!metrics_) return;  // rank 0 keeps the run's records
  const double n = static_cast<double>(std::max<int64_t>(st.response_tokens, 1));
  const double samples =
      static_cast<double>(c_.train.prompts_per_step * c_.rollout.samples_per_prompt);
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
                 {"opd/smoothed_reverse_kl", tracker_->smoothed()},
                 {"opd/weight_version", static_cast<double>(weight_version_)},
                 {"opd/teacher_failovers", static_cast<double>(teachers_->failovers())},
                 {"optim/lr", st.lr},
                 {"optim/grad_norm", st.grad_norm},
                 {"optim/skipped", st.skipped ? 1.0 : 0.0},
                 {"time/sample_s", st.sample_s},
                 {"time/sample_work_s", st.sample_work_s},
                 {"rollout/staleness_mean", st.samples.staleness_mean},
                 {"rollout/staleness_max", st.samples.staleness_max},
                 {"rollout/truncated_frac", st.samples.truncated_frac},
                 {"time/score_s", st.score_s},
                 {"time/learn_s", st.learn_s},
                 {"time/push_s", st.push_s},
                 {"time/step_s", st.step_s},
                 {"throughput/tokens_per_s", static_cast<double>(st.total_tokens) / st.step_s}});
  if (!metric_domains_.empty()) metrics_->Log(step_, DomainScalars(st));
  progress_->Update({step_, st.loss.reverse_kl_sum / n, st.lr,
                     static_cast<double>(st.total_tokens) / st.step_s, st.grad_norm, st.skipped},
                    st.step_s);
}

// Feeds the stage's rule; on convergence logs the stage summary and returns true.
bool OpdJob::FinishStageIfConverged(double reverse_kl) {
  if (!tracker_->Update(reverse_kl)) return false;
  RecordStageEnd();
  return true;
}

// plateau.per_domain: feeds each domain's KL to its rule (a domain that has converged stays so);
// once every domain has, the stage ends.
bool OpdJob::FinishStageOnDomains(const StepStats& st) {
  bool all = true;
  for (auto& [domain, tracker] : domain_trackers_) {
    if (!tracker->reason().empty()) continue;
    const double* row = &st.domain_sums[MetricRow(domain) * kDomainSums];
    // A skipped step, or one without this domain's samples, counts as a step but is not averaged.
    const double kl = st.skipped || row[kDomainTokens] == 0
                          ? std::numeric_limits<double>::quiet_NaN()
                          : row[kDomainKl] / row[kDomainTokens];
    if (tracker->Update(kl)) {
      progress_->Log(absl::StrFormat("step %d: domain '%s' of stage '%s' converged (%s)", step_,
                                     domain, c_.stages[stage_].name, tracker->reason()));
    } else {
      all = false;
    }
  }
  if (!all) return false;
  tracker_->MarkConverged("domains_plateau");
  RecordStageEnd();
  return true;
}

// Feeds a held-out evaluation to the stage's rule, as FinishStageIfConverged.
bool OpdJob::FinishStageOnHeldout(const std::vector<double>& kl) {
  if (!tracker_->UpdateHeldout(kl)) return false;
  RecordStageEnd();
  return true;
}

void OpdJob::LogHeldout(const std::vector<double>& kl) {
  const EvalSummary e = EvalSummary::Of(kl);
  if (metrics_)
    metrics_->Log(step_, {{"opd/heldout_reverse_kl", e.mean},
                          {"opd/heldout_reverse_kl_se", e.StandardError()},
                          {"opd/heldout_samples", static_cast<double>(e.n)}});
  progress_->Log(absl::StrFormat("step %d: held-out reverse KL %.5f (se %.5f, %d responses)", step_,
                                 e.mean, e.StandardError(), e.n));
}

void OpdJob::RecordStageEnd() {
  const auto& s = c_.stages[stage_];
  nlohmann::json summary = {{"stage", s.name},
                            {"steps", tracker_->steps()},
                            {"end_step", step_},
                            {"reason", tracker_->reason()},
                            {"smoothed_reverse_kl", tracker_->smoothed()},
                            {"teachers", s.teachers}};
  stage_summaries_.push_back(summary);
  progress_->Log(
      absl::StrFormat("stage '%s' finished after %d steps (%s): smoothed reverse KL %.4f", s.name,
                      tracker_->steps(), tracker_->reason(), tracker_->smoothed()));
}

nlohmann::json OpdJob::JobState() const {
  nlohmann::json state = {{"stage", stage_},
                          {"stage_name", c_.stages[stage_].name},
                          {"stage_done", done_},
                          {"convergence", tracker_->ToJson()},
                          {"stage_summaries", stage_summaries_},
                          {"swapped_teachers", swapped_},
                          {"swapped_domain_teachers", swapped_domains_},
                          {"weight_version", weight_version_}};
  if (!domain_trackers_.empty()) {
    nlohmann::json domains = nlohmann::json::object();
    for (const auto& [domain, tracker] : domain_trackers_) domains[domain] = tracker->ToJson();
    state["domain_convergence"] = domains;
  }
  // One-step-off: the next step's samples are in kPrefetchedFile (WriteJobFiles).
  if (settled_ && settled_->ok())
    state["prefetched"] = {{"file", kPrefetchedFile},
                           {"samples", (*settled_)->samples.size()},
                           {"prompts_hash", std::to_string(PromptsHash((*settled_)->prompts))}};
  return state;
}

// A step that cannot finish. When a stop signal is what failed it, stops as for the signal;
// otherwise ends the calls still in flight (the one-step-off prefetch), checkpoints the last
// completed step and returns the error saying what failed.
absl::Status OpdJob::FailStep(const absl::Status& error, const std::string& what) {
  absl::StatusOr<bool> stop = group_->AnyRank(StopRequested());
  if (stop.ok() && *stop) return StopForSignal();
  canceller_->Cancel();
  progress_->Log(absl::StrFormat("%s failed: %s; writing a checkpoint of step %d", what,
                                 error.message(), step_));
  const absl::Status saved = SaveCheckpoint();
  return absl::Status(
      error.code(),
      absl::StrCat(what, " failed: ", error.message(),
                   saved.ok() ? absl::StrFormat("; step %d is checkpointed, resume with the same "
                                                "command once the cause is fixed",
                                                step_)
                              : absl::StrCat("; the checkpoint failed too: ", saved.message())));
}

void OpdJob::CheckpointAfterException() {
  canceller_->Cancel();
  TrainingJob::CheckpointAfterException();
}

absl::Status OpdJob::Resume(const std::string& checkpoint) {
  ASSIGN_OR_RETURN(nlohmann::json state, ResumeCommon(checkpoint));
  weight_version_ = state.at("weight_version").get<int64_t>();
  stage_summaries_ = state.at("stage_summaries");
  // Endpoints swapped in through the admin RPC outlive a restart; the config's others stand.
  swapped_ = state.value("swapped_teachers", nlohmann::json::object());
  swapped_domains_ = state.value("swapped_domain_teachers", nlohmann::json::object());
  for (auto& s : c_.stages) {
    if (swapped_.contains(s.name)) s.teachers = swapped_[s.name].get<std::vector<std::string>>();
    if (!swapped_domains_.contains(s.name)) continue;
    for (auto& d : s.domains) {
      if (swapped_domains_[s.name].contains(d.domain))
        d.teachers = swapped_domains_[s.name][d.domain].get<std::vector<std::string>>();
    }
  }
  stage_ = state.at("stage").get<size_t>();
  if (stage_ >= c_.stages.size() ||
      c_.stages[stage_].name != state.at("stage_name").get<std::string>()) {
    return absl::FailedPreconditionError(
        absl::StrCat(checkpoint, ": stage '", state.at("stage_name").get<std::string>(),
                     "' is not stage ", stage_ + 1, " of the config"));
  }
  done_ = state.at("stage_done").get<bool>();
  lm::log::Info(absl::StrFormat("resumed from %s at step %d (stage '%s')", checkpoint, step_,
                                c_.stages[stage_].name));
  return absl::OkStatus();
}

absl::Status OpdJob::Init(const JobArgs& args) {
  RETURN_IF_ERROR(JoinGroup(c_.train, c_.dist));
  const bool root = group_->is_root();
  ASSIGN_OR_RETURN(secret_, opd::rpc::LoadSecret(c_.auth.secret_file));
  loss_opts_.correction = c_.loss.correction;
  loss_opts_.kl_coef = c_.loss.kl_coef;
  loss_opts_.tis_cap = c_.loss.tis_cap;
  loss_opts_.clip_low = c_.loss.clip_low;
  loss_opts_.clip_high = c_.loss.clip_high;
  loss_opts_.kl_discount = c_.loss.kl_discount;
  schedule_ = {c_.optim.lr, c_.optim.min_lr, c_.optim.warmup_steps, 1};
  int64_t total = 0;
  for (const auto& s : c_.stages) total += s.max_steps;
  schedule_.total_steps = std::max<int64_t>(total, 1);

  ASSIGN_OR_RETURN(const std::string resume_from, AgreeOnCheckpoint(args, c_.run));
  const bool resumed = !resume_from.empty();
  if (resumed) {
    RETURN_IF_ERROR(Resume(resume_from));
  } else {
    torch::manual_seed(static_cast<uint64_t>(c_.train.seed));
    RETURN_IF_ERROR(LoadStudent(c_.model.path));
  }
  if (c_.rollout.routing_replay && !model_->SupportsRoutingReplay())
    return absl::InvalidArgumentError(
        absl::StrCat("rollout.routing_replay: a ", model_->config().model_type,
                     " student does not support routing replay (qwen3_moe students do)"));
  RETURN_IF_ERROR(LoadPrompts());
  if (resumed) {
    RETURN_IF_ERROR(prompts_->Seek(cursor_));
    ASSIGN_OR_RETURN(const nlohmann::json state, ReadTrainerState(resume_from));
    RETURN_IF_ERROR(LoadPrefetched(resume_from, state));
  }
  cursor_ = prompts_->cursor();
  if (root) {  // only rank 0 talks to the rollout workers
    RETURN_IF_ERROR(ConnectRollout());
    ASSIGN_OR_RETURN(const int64_t served, rollout_->MaxWeightVersion());
    weight_version_ = std::max(weight_version_, served);  // versions only grow, across restarts
  }
  if (!resumed) {
    RETURN_IF_ERROR(StartStage(stage_, false));
  } else {
    ASSIGN_OR_RETURN(nlohmann::json state, ReadTrainerState(resume_from));
    const bool stage_finished = !state.at("convergence").at("reason").get<std::string>().empty();
    if (stage_finished && !done_) {
      RETURN_IF_ERROR(StartStage(stage_ + 1, false));
    } else {
      RETURN_IF_ERROR(StartStage(stage_, false));
      tracker_->FromJson(state.at("convergence"));
      const nlohmann::json domains = state.value("domain_convergence", nlohmann::json::object());
      for (auto& [domain, tracker] : domain_trackers_) {
        if (domains.contains(domain)) tracker->FromJson(domains.at(domain));
      }
    }
  }
  if (root && !c_.admin.listen.empty()) {
    LearnerServerOptions ao;
    ao.listen = c_.admin.listen;
    ao.secret = secret_;
    ao.port_file = c_.admin.port_file;
    ao.tls = AdminTls(c_.auth);
    ao.insecure = c_.admin.insecure;
    for (const auto& s : c_.stages) {
      ao.stages.push_back(s.name);
      for (const auto& d : s.domains) ao.stage_domains[s.name].push_back(d.domain);
    }
    ASSIGN_OR_RETURN(admin_, LearnerServer::Start(ao));
  }
  RETURN_IF_ERROR(OpenRecords(schedule_.total_steps, c_.logging, resumed));
  // The workers serve the student we start from (the SFT model, or the resumed checkpoint).
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(PushWeights());
  if (root)
    lm::log::Info(absl::StrFormat(
        "pushed the student's weights to %d rollout worker(s) as version %d (%.1fs)",
        rollout_->size(), weight_version_, Seconds(t0)));
  return absl::OkStatus();
}

absl::Status OpdJob::Run() {
  InstallStopHandlers();
  // The signal handler only sets a flag; this ends the calls in flight (deadlines up to an hour).
  StopCallback cancel_calls([c = canceller_] { c->Cancel(); });
  while (!done_) {
    ASSIGN_OR_RETURN(const bool stop, StopAgreed());
    if (stop) return StopForSignal();
    RETURN_IF_ERROR(ApplyPendingSwap());
    const auto t0 = Clock::now();
    StepStats st;
    absl::StatusOr<Rollouts> sampled = ShareRollouts(NextRollouts());
    if (!sampled.ok()) return FailStep(sampled.status(), "sampling");
    Rollouts r = std::move(*sampled);
    st.sample_s = Seconds(t0);
    st.sample_work_s = r.seconds;
    st.samples = SummarizeSamples(r.samples, weight_version_);
    // One-step-off: the next step's sampling runs on the current weights while this step learns.
    if (c_.train.async) prefetch_ = LaunchSampling();
    auto t1 = Clock::now();
    const std::vector<MicroBatch> mine = MyMicroBatches(r);
    auto scores = Score(r, mine);
    // A rank whose share could not be scored fails the step for every rank.
    ASSIGN_OR_RETURN(const bool scoring_failed, group_->AnyRank(!scores.ok()));
    if (scoring_failed)
      return FailStep(scores.ok()
                          ? absl::UnavailableError("another rank's share failed (see its log)")
                          : scores.status(),
                      "scoring");
    st.score_s = Seconds(t1);
    if (absl::Status s = Learn(r, mine, *scores, &st); !s.ok()) return FailStep(s, "learning");
    // The step is complete from here (step_ counts it), and so is its bookkeeping: whatever fails
    // after this is checkpointed as this step.
    CountNonFinite(st.skipped, st.loss_value, st.grad_norm);
    // A skipped step (non-finite loss or gradient) changed nothing: its KL is not averaged.
    const double reverse_kl =
        st.skipped ? std::numeric_limits<double>::quiet_NaN()
                   : st.loss.reverse_kl_sum /
                         static_cast<double>(std::max<int64_t>(st.response_tokens, 1));
    bool stage_over = FinishStageIfConverged(reverse_kl);
    if (!stage_over && !domain_trackers_.empty()) stage_over = FinishStageOnDomains(st);
    if (stage_over) done_ = stage_ + 1 == c_.stages.size();
    if (Contains(c_.debug.throw_after_update_steps, step_))
      throw std::runtime_error(absl::StrCat("debug.throw_after_update_steps: step ", step_));
    t1 = Clock::now();
    absl::Status pushed = PushWeights();
    if (pushed.ok() && Contains(c_.debug.fail_push_steps, step_))
      pushed = absl::UnavailableError(absl::StrCat("debug.fail_push_steps: step ", step_));
    st.push_s = Seconds(t1);
    st.step_s = Seconds(t0);
    if (admin_)
      admin_->SetStatus(
          {c_.stages[stage_].name, step_, c_.stages[stage_].teachers, weight_version_});
    LogStep(st);
    // Only the step's distribution failed, after its bookkeeping: the checkpoint is of this step
    // (a resumed job pushes its weights first).
    if (!pushed.ok()) return FailStep(pushed, "the weight push");
    if (!heldout_prompts_.empty() && step_ % c_.heldout.every == 0) {
      absl::StatusOr<std::vector<double>> kl = EvaluateHeldout();
      if (!kl.ok()) return FailStep(kl.status(), "the held-out evaluation");
      LogHeldout(*kl);
      if (!stage_over && FinishStageOnHeldout(*kl)) {
        stage_over = true;
        done_ = stage_ + 1 == c_.stages.size();
      }
    }
    RETURN_IF_ERROR(CheckNonFinite(c_.train.max_consecutive_nonfinite));
    if (stage_over) {
      // The checkpoint records the finished stage (its rule says why); a resume from it starts
      // the next stage. The next stage's teachers are checked before any step is spent on them.
      SettlePrefetch();
      RETURN_IF_ERROR(SaveCheckpoint());
      if (!done_) RETURN_IF_ERROR(StartStage(stage_ + 1, false));
    } else if (c_.checkpoint.every > 0 && step_ % c_.checkpoint.every == 0) {
      SettlePrefetch();  // the next step's samples go into the checkpoint
      RETURN_IF_ERROR(SaveCheckpoint());
    }
  }
  if (prefetch_) (void)prefetch_->get();
  progress_->Finish();
  nlohmann::json summary = {{"steps", step_},
                            {"stages", stage_summaries_},
                            {"peak_rss_mb", PeakRssMb()},
                            {"world_size", group_->size()},
                            {"optimizer_state_bytes_per_rank", optimizer_->state_bytes()}};
  if (group_->is_root())
    (void)WriteFileAtomic(run_.path() + "/summary.json", summary.dump(2) + "\n");
  lm::log::Info(absl::StrFormat("done: %d steps over %d stage(s)", step_, stage_summaries_.size()));
  return absl::OkStatus();
}

}  // namespace trainer::opd_detail

namespace trainer {

absl::Status RunOpd(const OpdConfig& config, const JobArgs& args) {
  RETURN_IF_ERROR(ValidateOpdConfig(config));
  for (const std::string& w : OpdConfigWarnings(config)) lm::log::Warn(w);
  return RunTrainingJob(
      "opd", config.run, EncodeConfig(config), args, [&config](RunDir run, std::string yaml) {
        return std::make_unique<opd_detail::OpdJob>(config, std::move(run), std::move(yaml));
      });
}

int OpdMain(const std::vector<std::string>& words) {
  return JobMain<OpdConfig>({"opd", "configs/opd/NAME.yaml", ValidateOpdConfig, RunOpd}, words);
}

}  // namespace trainer
