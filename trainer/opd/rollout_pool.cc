#include "trainer/opd/rollout_pool.h"

#include <cmath>
#include <future>
#include <numeric>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "trainer/opd/teacher_pool.h"  // IsTransient

namespace trainer {
namespace {

constexpr float kLogprobSlack = 1e-3f;  // a log-prob is <= 0, up to rounding

// Which worker samples each pending prompt in round `round`: round 0 spreads by index over every
// worker (so every rank's share spreads over all of them); later rounds over the workers still
// standing (`live`).
std::vector<std::vector<size_t>> SpreadPrompts(const std::vector<IndexedPrompt>& prompts,
                                               const std::vector<size_t>& pending,
                                               const std::vector<size_t>& live, size_t workers,
                                               int round) {
  std::vector<std::vector<size_t>> by_worker(workers);
  for (size_t pos : pending) {
    const uint64_t index = static_cast<uint64_t>(prompts[pos].index);
    by_worker[round == 0 ? index % workers
                         : live[(index + static_cast<uint64_t>(round)) % live.size()]]
        .push_back(pos);
  }
  return by_worker;
}

}  // namespace

WeightPushOptions PushOptionsOf(const OpdRolloutConfig& r) {
  WeightPushOptions o;
  o.mode = r.weight_sync;
  o.store_host = r.weight_sync_host;
  o.group_timeout = absl::Seconds(r.weight_sync_timeout_s);
  o.bucket_bytes = r.weight_sync_bucket_mb << 20;
  return o;
}

SampleStats SummarizeSamples(const std::vector<lm::Sample>& samples, int64_t learner_version) {
  SampleStats st;
  if (samples.empty()) return st;
  double lag_sum = 0, truncated = 0;
  for (const auto& s : samples) {
    const double lag = static_cast<double>(learner_version - s.weight_version);
    lag_sum += lag;
    st.staleness_max = std::max(st.staleness_max, lag);
    truncated += s.finish == lm::FinishReason::kLength;
  }
  const double n = static_cast<double>(samples.size());
  st.staleness_mean = lag_sum / n;
  st.truncated_frac = truncated / n;
  return st;
}

absl::StatusOr<std::unique_ptr<RolloutPool>> RolloutPool::Connect(
    const std::vector<std::string>& endpoints, const opd::rpc::ClientOptions& base,
    const std::string& tokenizer_fingerprint, int64_t vocab_size) {
  if (endpoints.empty()) return absl::InvalidArgumentError("no rollout worker endpoints");
  auto pool = std::make_unique<RolloutPool>();
  pool->vocab_size_ = vocab_size;
  pool->canceller_ = base.canceller;
  for (const auto& ep : endpoints) {
    auto opts = base;
    opts.address = ep;
    auto client = opd::rpc::RolloutClient::Create(opts);
    if (!client.ok()) return client.status();
    auto info = (*client)->Info();
    if (!info.ok()) return info.status();
    if (info->vocab_size() != vocab_size) {
      return absl::FailedPreconditionError(
          absl::StrCat("rollout worker ", ep, " serves vocabulary size ", info->vocab_size(),
                       ", the student has ", vocab_size));
    }
    if (!tokenizer_fingerprint.empty() && info->tokenizer_fingerprint() != "none" &&
        info->tokenizer_fingerprint() != tokenizer_fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rollout worker ", ep, " has tokenizer fingerprint ", info->tokenizer_fingerprint(),
          ", the student's is ", tokenizer_fingerprint));
    }
    pool->clients_.push_back(std::move(*client));
  }
  return pool;
}

absl::Status RolloutPool::CheckSample(const lm::Sample& s, int32_t samples_per_prompt,
                                      int64_t min_version, const std::string& address) const {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("rollout worker ", address,
                                            " sent an invalid sample (prompt ", s.prompt_index,
                                            ", sample ", s.sample_index, "): ", what));
  };
  if (s.sample_index < 0 || s.sample_index >= samples_per_prompt)
    return bad(
        absl::StrCat("sample_index ", s.sample_index, " is outside [0, ", samples_per_prompt, ")"));
  const absl::Span<const int32_t> response = s.response();  // the prompt is ours
  if (response.empty()) return bad("tokens is empty");
  for (size_t t = 0; t < response.size(); ++t) {
    if (response[t] < 0 || response[t] >= vocab_size_)
      return bad(absl::StrCat("tokens[", t, "] = ", response[t], " is outside the vocabulary [0, ",
                              vocab_size_, ")"));
  }
  if (s.logprobs.size() != response.size())
    return bad(absl::StrCat("logprobs has ", s.logprobs.size(), " entries for ", response.size(),
                            " tokens"));
  for (size_t t = 0; t < s.logprobs.size(); ++t) {
    if (!std::isfinite(s.logprobs[t]) || s.logprobs[t] > kLogprobSlack)
      return bad(absl::StrCat("logprobs[", t, "] = ", s.logprobs[t], " is not a log-probability"));
  }
  const int64_t max_version = sent_version_.load();
  if (min_version >= 0 && (s.weight_version < min_version || s.weight_version > max_version))
    return bad(absl::StrCat("weight_version ", s.weight_version, " is not in [", min_version, ", ",
                            max_version, "] (the versions pushed to it)"));
  return absl::OkStatus();
}

// What the calls of one Stream share: which (prompt, sample) pairs have arrived, over every
// round (a prompt sent again after a failure keeps what its first worker sent).
struct RolloutPool::Round {
  const std::vector<IndexedPrompt>* prompts = nullptr;
  int32_t samples_per_prompt = 1;
  int64_t min_version = -1;
  absl::Mutex mu;
  std::vector<std::vector<int>> got ABSL_GUARDED_BY(mu);  // [position][sample]: the call, or -1
  int next_call ABSL_GUARDED_BY(mu) = 0;
  // Written only by Stream's thread, as each call of a round returns.
  std::vector<bool> failed;  // [worker]: failed transiently, given no more prompts
  std::string failures;      // the transient errors that moved prompts to other workers

  // A new Stream over `all`: no sample has arrived yet and no worker has failed.
  void Start(const std::vector<IndexedPrompt>& all, const lm::SamplingParams& params,
             int64_t acked_version, size_t workers) {
    prompts = &all;
    samples_per_prompt = static_cast<int32_t>(std::max<int64_t>(params.samples_per_prompt, 1));
    min_version = acked_version;
    {
      absl::MutexLock lock(&mu);
      got.assign(all.size(), std::vector<int>(static_cast<size_t>(samples_per_prompt), -1));
    }
    failed.assign(workers, false);
  }

  int32_t Missing(size_t position) {
    absl::MutexLock lock(&mu);
    return static_cast<int32_t>(std::count(got[position].begin(), got[position].end(), -1));
  }

  // The positions of `pending` that still miss a sample.
  std::vector<size_t> Unfinished(const std::vector<size_t>& pending) {
    std::vector<size_t> still;
    for (size_t pos : pending)
      if (Missing(pos) > 0) still.push_back(pos);
    return still;
  }

  std::vector<size_t> LiveWorkers() const {
    std::vector<size_t> live;
    for (size_t i = 0; i < failed.size(); ++i)
      if (!failed[i]) live.push_back(i);
    return live;
  }
};

absl::Status RolloutPool::CallWorker(size_t worker, const std::vector<size_t>& which, Round& round,
                                     const lm::SamplingParams& params,
                                     const std::function<void(lm::Sample)>& on_sample) {
  opd::rpc::RolloutClient& client = *clients_[worker];
  std::vector<absl::Span<const int32_t>> share;  // views of the step's prompts
  lm::SamplingParams p = params;
  p.seed_indices.clear();
  for (size_t pos : which) {
    share.push_back((*round.prompts)[pos].tokens);
    p.seed_indices.push_back((*round.prompts)[pos].index);
  }
  int call = 0;
  {
    absl::MutexLock lock(&round.mu);
    call = round.next_call++;
  }
  absl::Status st = client.StreamGenerate(share, p, [&](lm::Sample s) -> absl::Status {
    RETURN_IF_ERROR(CheckSample(s, round.samples_per_prompt, round.min_version, client.address()));
    const size_t pos = which[static_cast<size_t>(s.prompt_index)];
    {
      absl::MutexLock lock(&round.mu);
      int& from = round.got[pos][static_cast<size_t>(s.sample_index)];
      if (from == call)
        return absl::DataLossError(absl::StrCat("rollout worker ", client.address(),
                                                " sent (prompt_index ", s.prompt_index,
                                                ", sample_index ", s.sample_index, ") twice"));
      if (from >= 0) return absl::OkStatus();  // a failed call sent it already
      from = call;
    }
    s.prompt_index = (*round.prompts)[pos].index;
    on_sample(std::move(s));
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  for (size_t pos : which) {
    if (const int32_t missing = round.Missing(pos); missing > 0)
      return absl::DataLossError(absl::StrCat("rollout worker ", client.address(),
                                              " ended without ", missing, " of prompt ",
                                              (*round.prompts)[pos].index, "'s samples"));
  }
  return absl::OkStatus();
}

bool RolloutPool::FailOver(size_t worker, const absl::Status& st, Round& round) {
  const bool stopped = canceller_ && canceller_->cancelled();
  if (!IsTransient(st) || stopped || absl::IsDataLoss(st)) return false;
  round.failed[worker] = true;
  failovers_.fetch_add(1);
  absl::StrAppend(&round.failures, round.failures.empty() ? "" : "; ", st.message());
  lm::log::Warn(absl::StrCat("rollout worker ", clients_[worker]->address(), " failed (",
                             st.message(), "); its unfinished prompts go to another worker"));
  return true;
}

absl::Status RolloutPool::RunRound(const std::vector<std::vector<size_t>>& by_worker, Round& round,
                                   const lm::SamplingParams& params,
                                   const std::function<void(lm::Sample)>& on_sample) {
  std::vector<std::pair<size_t, std::future<absl::Status>>> calls;
  for (size_t i = 0; i < by_worker.size(); ++i) {
    if (by_worker[i].empty()) continue;
    calls.emplace_back(i, std::async(std::launch::async, [&, i] {
                         return CallWorker(i, by_worker[i], round, params, on_sample);
                       }));
  }
  // Every call is collected before returning, so none outlives this function.
  absl::Status fatal;
  for (auto& [i, call] : calls) {
    absl::Status st = call.get();
    if (st.ok() || FailOver(i, st, round)) continue;
    if (fatal.ok()) fatal = st;
  }
  return fatal;
}

absl::Status RolloutPool::Stream(const std::vector<IndexedPrompt>& prompts,
                                 const lm::SamplingParams& params,
                                 const std::function<void(lm::Sample)>& on_sample, int max_rounds) {
  Round round;
  round.Start(prompts, params, acked_version_.load(), clients_.size());
  std::vector<size_t> pending(prompts.size());
  std::iota(pending.begin(), pending.end(), size_t{0});
  for (int r = 0; r < max_rounds && !pending.empty(); ++r) {
    const std::vector<size_t> live = round.LiveWorkers();
    if (live.empty())
      return absl::UnavailableError(absl::StrCat("every rollout worker failed: ", round.failures));
    const std::vector<std::vector<size_t>> by_worker =
        SpreadPrompts(prompts, pending, live, clients_.size(), r);
    RETURN_IF_ERROR(RunRound(by_worker, round, params, on_sample));
    pending = round.Unfinished(pending);
  }
  if (!pending.empty())
    return absl::UnavailableError(
        absl::StrCat(pending.size(), " prompt(s) unsampled after ", max_rounds,
                     " rounds over the rollout workers: ", round.failures));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<lm::Sample>> RolloutPool::Generate(
    const std::vector<IndexedPrompt>& prompts, const lm::SamplingParams& params) {
  absl::Mutex mu;
  std::vector<lm::Sample> out;
  RETURN_IF_ERROR(Stream(prompts, params, [&](lm::Sample s) {
    absl::MutexLock lock(&mu);
    out.push_back(std::move(s));
  }));
  std::sort(out.begin(), out.end(), [](const lm::Sample& a, const lm::Sample& b) {
    return std::tie(a.prompt_index, a.sample_index) < std::tie(b.prompt_index, b.sample_index);
  });
  return out;
}

absl::StatusOr<int64_t> RolloutPool::MaxWeightVersion() {
  int64_t v = 0;
  for (auto& c : clients_) {
    auto info = c->Info();
    if (!info.ok()) return info.status();
    v = std::max<int64_t>(v, info->weight_version());
  }
  return v;
}

void RolloutPool::NoteVersions(int64_t v) {
  sent_version_.store(std::max(sent_version_.load(), v));
  acked_version_.store(std::max(acked_version_.load(), v));
}

void RolloutPool::RecordPush(int64_t version, bool acknowledged) {
  sent_version_.store(std::max(sent_version_.load(), version));
  if (acknowledged) acked_version_.store(version);
}

}  // namespace trainer
