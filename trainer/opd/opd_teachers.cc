// The OPD job's teachers: the stage's pools (its default one and one per data domain), scoring a
// step's samples on them, swaps at step boundaries, and the held-out evaluation.
#include "trainer/opd/opd_job.h"

namespace trainer::opd_detail {

// One response per held-out prompt from the weights just pushed (the same seed every time), each
// scored by the stage's teachers: the per-response mean of log p_student - log p_teacher over its
// tokens, on every rank (rank 0 evaluates, the others receive its values or its error).
absl::StatusOr<std::vector<double>> OpdJob::EvaluateHeldout() {
  std::string bytes, verdict;
  if (group_->is_root()) {
    absl::StatusOr<std::vector<double>> kl = HeldoutReverseKl();
    if (kl.ok())
      bytes.assign(reinterpret_cast<const char*>(kl->data()), kl->size() * sizeof(double));
    else
      verdict = std::string(kl.status().message());
  }
  RETURN_IF_ERROR(group_->BroadcastBytes(&verdict));
  if (!verdict.empty()) return absl::UnavailableError(verdict);
  RETURN_IF_ERROR(group_->BroadcastBytes(&bytes));
  std::vector<double> out(bytes.size() / sizeof(double));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(double));
  return out;
}

absl::StatusOr<std::vector<double>> OpdJob::HeldoutReverseKl() {
  std::vector<std::vector<int32_t>> ids;
  for (const auto& p : heldout_prompts_) ids.push_back(p.prompt_ids);
  opd::rpc::GenerateOptions g;
  g.samples_per_prompt = 1;
  g.temperature = static_cast<float>(c_.rollout.temperature);
  g.top_p = static_cast<float>(c_.rollout.top_p);
  g.top_k = static_cast<int32_t>(c_.rollout.top_k);
  g.max_new_tokens = static_cast<int32_t>(c_.rollout.max_new_tokens);
  ASSIGN_OR_RETURN(g.stop_token_ids, lm::ChatFormat::StopIds(*tokenizer_));
  g.seed = static_cast<uint64_t>(c_.heldout.seed);
  ASSIGN_OR_RETURN(const auto samples, rollout_->Generate(ids, g));
  opd::rpc::ScoreOptions so;
  so.temperature = static_cast<float>(c_.loss.teacher_temperature);
  ASSIGN_OR_RETURN(const auto scores,
                   teachers_->Score(samples, so, [] { return StopRequested(); }));
  std::vector<double> kl;
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto& student = samples[i].logprobs;
    const auto& teacher = scores.at(i).logprobs;
    if (student.empty() || teacher.size() != student.size())
      return absl::InternalError(absl::StrCat("held-out prompt ", samples[i].prompt_index, ": ",
                                              teacher.size(), " teacher log-probs for ",
                                              student.size(), " sampled tokens"));
    double sum = 0;
    for (size_t t = 0; t < student.size(); ++t) sum += student[t] - teacher[t];
    kl.push_back(sum / static_cast<double>(student.size()));
  }
  return kl;
}

absl::Status OpdJob::StartStage(size_t index, bool resumed) {
  const OpdStageConfig& s = c_.stages[index];
  TeacherPoolOptions po;
  po.client.secret = secret_;
  po.client.tls = ClientTls(c_.auth);
  po.client.timeout = absl::Seconds(c_.train.teacher_timeout_s);
  po.score_deadline = absl::Seconds(c_.train.score_deadline_s);
  po.client.canceller = canceller_;
  TeacherRequirements req = StudentRequirements(*tokenizer_, model_->config().vocab_size);
  ASSIGN_OR_RETURN(teachers_, TeacherPool::Connect(s.name, s.teachers, req, po));
  domain_teachers_.clear();
  metric_domains_.clear();
  for (const auto& d : s.domains) {
    ASSIGN_OR_RETURN(domain_teachers_[d.domain],
                     TeacherPool::Connect(DomainPoolName(s.name, d.domain), d.teachers, req, po));
    metric_domains_.push_back(d.domain);
  }
  if (!s.domains.empty()) metric_domains_.push_back(kOtherDomain);
  if (!resumed) {
    ConvergenceRule rule;
    rule.max_steps = s.max_steps;
    rule.plateau = s.plateau.enabled;
    rule.window = s.plateau.window;
    rule.min_rel_improvement = s.plateau.min_rel_improvement;
    rule.ema_beta = s.plateau.ema_beta;
    rule.min_steps = s.plateau.min_steps;
    rule.heldout = s.plateau.metric == PlateauMetric::kHeldout;
    rule.z = s.plateau.z;
    domain_trackers_.clear();
    if (s.plateau.per_domain) {
      // Each domain's KL has the plateau rule; the stage's own tracker keeps the step budget.
      ConvergenceRule per = rule;
      per.max_steps = 0;
      for (const auto& d : s.domains)
        domain_trackers_[d.domain] = std::make_unique<ConvergenceTracker>(per);
      rule.plateau = false;
    }
    tracker_ = std::make_unique<ConvergenceTracker>(rule);
  }
  stage_ = index;
  lm::log::Info(absl::StrFormat("stage %d/%d '%s': teachers %s", index + 1, c_.stages.size(),
                                s.name, absl::StrJoin(s.teachers, ", ")));
  return absl::OkStatus();
}

// Applies a teacher swap requested through rank 0's admin RPC (already checked by the handler),
// at a step boundary on the training thread, in four moves: rank 0 takes the queued request,
// announces it to every rank, every rank connects its own pool (and all agree), and rank 0 answers
// the caller with the outcome. The swap takes effect only if it worked on every rank; a refused
// swap changes nothing. The returned status is the collectives': a failed one ends the job.
absl::Status OpdJob::ApplyPendingSwap() {
  if (group_->size() == 1 && !admin_) return absl::OkStatus();
  std::unique_ptr<LearnerServer::TakenSwap> taken =
      admin_ && group_->is_root() ? admin_->TakeSwap() : nullptr;
  ASSIGN_OR_RETURN(const std::optional<SwapRequest> swap,
                   AnnounceSwap(taken ? &taken->request() : nullptr));
  if (!swap) return absl::OkStatus();
  absl::Status collective = absl::OkStatus();
  absl::StatusOr<std::unique_ptr<TeacherPool>> pool = ConnectSwap(*swap, &collective);
  if (pool.ok()) InstallSwap(*swap, std::move(*pool));
  if (taken) taken->Answer(pool.status());
  return collective;
}

// Rank 0's request (null: none) on every rank: the stage, domain and endpoints as JSON, or ""
// for none.
absl::StatusOr<std::optional<SwapRequest>> OpdJob::AnnounceSwap(const SwapRequest* mine) {
  std::string announced = mine ? nlohmann::json{{"stage", mine->stage},
                                                {"endpoints", mine->endpoints},
                                                {"domain", mine->domain}}
                                     .dump()
                               : "";
  RETURN_IF_ERROR(group_->BroadcastBytes(&announced));
  if (announced.empty()) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(announced);
  return SwapRequest{j.at("stage").get<std::string>(),
                     j.at("endpoints").get<std::vector<std::string>>(),
                     j.at("domain").get<std::string>()};
}

// Every rank connects to the swap's endpoints (checked against the student as at a stage's
// start) and all agree: one rank that cannot connect refuses the swap for all.
absl::StatusOr<std::unique_ptr<TeacherPool>> OpdJob::ConnectSwap(const SwapRequest& swap,
                                                                 absl::Status* collective) {
  const TeacherRequirements req = StudentRequirements(*tokenizer_, model_->config().vocab_size);
  const std::string name =
      swap.domain.empty() ? swap.stage : DomainPoolName(swap.stage, swap.domain);
  absl::StatusOr<std::unique_ptr<TeacherPool>> pool =
      TeacherPool::Connect(name, swap.endpoints, req, teachers_->options());
  std::vector<double> failed(static_cast<size_t>(group_->size()), 0.0);
  failed[static_cast<size_t>(group_->rank())] = pool.ok() ? 0.0 : 1.0;
  absl::StatusOr<std::vector<double>> agreed = group_->AllReduceDoubles(failed);
  if (!agreed.ok()) return *collective = agreed.status();
  if (!pool.ok()) return pool.status();
  for (size_t r = 0; r < agreed->size(); ++r) {
    if ((*agreed)[r] > 0)
      return absl::UnavailableError(
          absl::StrCat("learner rank ", r, " cannot connect to the new teachers (see its log)"));
  }
  return pool;
}

// The swap takes effect: the config (and the record that outlives a restart) names the new
// endpoints; for the running stage the pool changes now and the windows of the KL it changes
// restart (KL to the new teachers is not comparable with the old).
void OpdJob::InstallSwap(const SwapRequest& swap, std::unique_ptr<TeacherPool> pool) {
  for (auto& s : c_.stages) {
    if (s.name != swap.stage) continue;
    const bool running = &s == &c_.stages[stage_];
    if (swap.domain.empty()) {
      s.teachers = swap.endpoints;
      swapped_[s.name] = swap.endpoints;
      if (running) teachers_ = std::move(pool);
    } else {
      for (auto& d : s.domains) {
        if (d.domain == swap.domain) d.teachers = swap.endpoints;
      }
      swapped_domains_[s.name][swap.domain] = swap.endpoints;
      if (running) {
        domain_teachers_[swap.domain] = std::move(pool);
        if (auto it = domain_trackers_.find(swap.domain); it != domain_trackers_.end())
          it->second->RestartWindow();
      }
    }
    if (running) tracker_->RestartWindow();  // the stage's KL mixes every pool's
    progress_->Log(
        absl::StrFormat("teacher swap applied at step %d: stage '%s'%s now uses %s", step_, s.name,
                        swap.domain.empty() ? "" : absl::StrCat(" (domain '", swap.domain, "')"),
                        absl::StrJoin(swap.endpoints, ", ")));
  }
}

// Scores the samples of this rank's micro-batches (every sample on one rank); the result is
// indexed like r.samples, with the other ranks' samples left empty.
absl::StatusOr<std::vector<opd::rpc::ScoreOutput>> OpdJob::Score(
    const Rollouts& r, const std::vector<MicroBatch>& mine) {
  // This rank's samples, grouped by the pool that scores them (their domain's or the default).
  std::map<TeacherPool*, std::vector<size_t>> by_pool;
  for (const MicroBatch& mb : mine) {
    for (size_t i : mb.samples) by_pool[&PoolFor(r.samples[i].domain)].push_back(i);
  }
  std::vector<opd::rpc::ScoreOutput> out(r.samples.size());
  opd::rpc::ScoreOptions so;
  so.temperature = static_cast<float>(c_.loss.teacher_temperature);
  so.top_k = c_.loss.form == LossForm::kTopK ? static_cast<int32_t>(c_.loss.top_k) : 0;
  auto score = [&](TeacherPool* pool, const std::vector<size_t>& which) -> absl::Status {
    std::vector<lm::Sample> inputs;  // the sequences alone (not the routing or log-probs)
    inputs.reserve(which.size());
    for (size_t i : which)
      inputs.push_back(lm::Sample::ToScore(r.samples[i].tokens, r.samples[i].response_start));
    ASSIGN_OR_RETURN(auto scores, pool->Score(inputs, so, [] { return StopRequested(); }));
    for (size_t j = 0; j < scores.size(); ++j) {
      const size_t i = which[j];
      if (static_cast<int64_t>(scores[j].logprobs.size()) != r.samples[i].response_length()) {
        return absl::InternalError(
            absl::StrCat("teacher pool '", pool->stage(), "' returned ", scores[j].logprobs.size(),
                         " scores for a response of ", r.samples[i].response_length(), " tokens"));
      }
      out[i] = std::move(scores[j]);  // each sample has one pool: no two writers share a slot
    }
    return absl::OkStatus();
  };
  // The pools score at once (each spreads over its own replicas); the first error is the step's.
  std::vector<std::future<absl::Status>> running;
  for (const auto& [pool, which] : by_pool)
    running.push_back(std::async(std::launch::async, score, pool, std::cref(which)));
  absl::Status status = absl::OkStatus();
  for (auto& f : running) status.Update(f.get());
  RETURN_IF_ERROR(status);
  return out;
}

// Adds a micro-batch's samples to their domains' sums (one host copy of the learner's log-probs).
void OpdJob::AddDomainSums(const Rollouts& r, const MicroBatch& mb, const torch::Tensor& lp,
                           const std::vector<float>& teacher_lp, StepStats* st) const {
  if (metric_domains_.empty()) return;
  const torch::Tensor student = lp.detach().to(torch::kCPU, torch::kFloat64).contiguous();
  const double* s = student.data_ptr<double>();
  size_t at = 0;
  for (size_t i : mb.samples) {
    double* row = &st->domain_sums[MetricRow(r.samples[i].domain) * kDomainSums];
    const size_t n = static_cast<size_t>(r.samples[i].response_length());
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

// A prompt's data domain (its samples'): its line's "domain", or else its source's name.
const std::string& OpdJob::DomainOf(const lm::PromptExample& p) const {
  if (!p.domain.empty()) return p.domain;
  return c_.prompts.sources[static_cast<size_t>(p.source)].name;
}

TeacherPool& OpdJob::PoolFor(const std::string& domain) {
  auto it = domain_teachers_.find(domain);
  return it == domain_teachers_.end() ? *teachers_ : *it->second;
}

// The row of metric_domains_ a domain's sums go to (kOtherDomain for a domain without a pool).
size_t OpdJob::MetricRow(const std::string& domain) const {
  for (size_t d = 0; d + 1 < metric_domains_.size(); ++d) {
    if (metric_domains_[d] == domain) return d;
  }
  return metric_domains_.size() - 1;
}

}  // namespace trainer::opd_detail
