#include "trainer/opd/score_stream.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "lm/util/log.h"
#include "trainer/opd/teacher_pool.h"

namespace trainer {

struct ScoreStream::PoolQueue {
  std::shared_ptr<TeacherPool> pool;
  // Slot -> sample: calls take the lowest slots first, the order the learner consumes them in, so
  // that the first micro-batch is scored first whatever order the samples arrived in.
  std::map<size_t, const lm::Sample*> queued;
  int calls = 0;        // in flight
  int64_t started = 0;  // calls made so far (the replica rotation)
};

TeacherPool& TeacherPools::For(const std::string& domain) const {
  auto it = by_domain.find(domain);
  return it == by_domain.end() ? *fallback : *it->second;
}

std::vector<std::shared_ptr<TeacherPool>> TeacherPools::all() const {
  std::vector<std::shared_ptr<TeacherPool>> out = {fallback};
  for (const auto& [domain, pool] : by_domain) out.push_back(pool);
  return out;
}

ScoreStream::ScoreStream(TeacherPools pools, ScoreStreamOptions options, OnScored on_scored,
                         OnFailed on_failed)
    : pools_(std::move(pools)),
      opts_(std::move(options)),
      on_scored_(std::move(on_scored)),
      on_failed_(std::move(on_failed)) {
  size_t n = 0;
  {
    absl::MutexLock lock(&mu_);
    for (std::shared_ptr<TeacherPool>& p : pools_.all()) {
      queues_.push_back(std::make_unique<PoolQueue>());
      queues_.back()->pool = std::move(p);
    }
    n = queues_.size();
  }
  const size_t workers = n * static_cast<size_t>(std::max(opts_.max_calls_per_pool, 1));
  for (size_t i = 0; i < workers; ++i) workers_.emplace_back([this] { Work(); });
}

ScoreStream::~ScoreStream() {
  Cancel();
  for (auto& t : workers_) t.join();
}

void ScoreStream::Add(size_t slot, const lm::Sample* sample) {
  absl::MutexLock lock(&mu_);
  AddLocked(slot, sample);
}

void ScoreStream::AddAll(const std::vector<std::pair<size_t, const lm::Sample*>>& samples) {
  absl::MutexLock lock(&mu_);
  for (const auto& [slot, sample] : samples) AddLocked(slot, sample);
}

void ScoreStream::AddLocked(size_t slot, const lm::Sample* sample) {
  TeacherPool* pool = &pools_.For(sample->domain);
  ++outstanding_;
  for (auto& q : queues_) {
    if (q->pool.get() == pool) {
      q->queued.emplace(slot, sample);
      return;
    }
  }
  const absl::Status bad = absl::InternalError(
      absl::StrCat("sample of domain '", sample->domain, "' has no pool among the stream's"));
  if (error_.ok()) error_ = bad;
}

void ScoreStream::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

void ScoreStream::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  closed_ = true;
  if (error_.ok() && outstanding_ > 0) error_ = absl::CancelledError("scoring cancelled");
  for (auto& q : queues_) q->queued.clear();
}

bool ScoreStream::Stopped() const {
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_ || !error_.ok()) return true;
  }
  return opts_.stop && opts_.stop();
}

absl::Status ScoreStream::Wait() {
  absl::MutexLock lock(&mu_);
  const auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !error_.ok() || (closed_ && outstanding_ == 0);
  };
  mu_.Await(absl::Condition(&done));
  return error_;
}

int64_t ScoreStream::fallbacks() const {
  absl::MutexLock lock(&mu_);
  return fallbacks_;
}

double ScoreStream::busy_seconds() const {
  absl::MutexLock lock(&mu_);
  double s = busy_s_;
  if (in_flight_ > 0) s += static_cast<double>(absl::GetCurrentTimeNanos() - busy_since_ns_) * 1e-9;
  return s;
}

int ScoreStream::ReadyPool() const {
  for (size_t i = 0; i < queues_.size(); ++i) {
    if (!queues_[i]->queued.empty() && queues_[i]->calls < opts_.max_calls_per_pool)
      return static_cast<int>(i);
  }
  return -1;
}

void ScoreStream::Work() {
  for (;;) {
    std::vector<Item> group;
    PoolQueue* q = nullptr;
    int64_t hint = 0;
    {
      absl::MutexLock lock(&mu_);
      const auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return cancelled_ || !error_.ok() || ReadyPool() >= 0 || (closed_ && outstanding_ == 0);
      };
      mu_.Await(absl::Condition(&wake));
      const int ready = ReadyPool();
      if (cancelled_ || !error_.ok() || ready < 0) return;
      q = queues_[static_cast<size_t>(ready)].get();
      // Whatever is queued, lowest slot first, up to the token budget (at least one sample).
      int64_t tokens = 0;
      while (!q->queued.empty()) {
        const auto [slot, sample] = *q->queued.begin();
        const int64_t len = static_cast<int64_t>(sample->tokens.size());
        if (!group.empty() && tokens + len > opts_.max_call_tokens) break;
        tokens += len;
        group.push_back({slot, sample});
        q->queued.erase(q->queued.begin());
      }
      ++q->calls;
      hint = opts_.rank + opts_.step + q->started++;
      if (in_flight_++ == 0) busy_since_ns_ = absl::GetCurrentTimeNanos();
    }
    const absl::Status st = ScoreGroup(*q->pool, group, hint);
    bool failed = false;
    {
      absl::MutexLock lock(&mu_);
      --q->calls;
      if (--in_flight_ == 0)
        busy_s_ += static_cast<double>(absl::GetCurrentTimeNanos() - busy_since_ns_) * 1e-9;
      const bool to_fallback = !st.ok() && absl::IsUnavailable(st) &&
                               pools_.domain_down_to_fallback && q->pool != pools_.fallback &&
                               !cancelled_;
      if (to_fallback) {
        if (fallbacks_ == 0)
          lm::log::Warn(absl::StrCat(st.message(),
                                     "; its samples go to the stage's default pool "
                                     "(on_domain_down: default_pool)"));
        fallbacks_ += static_cast<int64_t>(group.size());
        for (const Item& it : group)
          queues_.front()->queued.emplace(it.slot, it.sample);  // the fallback's
        continue;
      }
      if (st.ok()) {
        outstanding_ -= static_cast<int64_t>(group.size());
      } else if (error_.ok() && !cancelled_) {
        error_ = st;
        failed = true;
      }
    }
    if (failed && on_failed_) on_failed_(st);
  }
}

absl::Status ScoreStream::ScoreGroup(TeacherPool& pool, const std::vector<Item>& group,
                                     int64_t replica_hint) {
  std::vector<lm::Sample> inputs;  // the sequences alone (not the routing or log-probs)
  inputs.reserve(group.size());
  for (const Item& it : group)
    inputs.push_back(lm::Sample::ToScore(it.sample->tokens, it.sample->response_start));
  absl::StatusOr<std::vector<lm::SequenceScore>> scores = pool.Score(
      inputs, opts_.score, [this] { return Stopped(); }, ScoreSpread{0, 0, replica_hint});
  if (!scores.ok()) return scores.status();
  for (size_t j = 0; j < group.size(); ++j) {
    const lm::Sample& s = *group[j].sample;
    if (static_cast<int64_t>((*scores)[j].logprobs.size()) != s.response_length())
      return absl::InternalError(absl::StrCat("teacher pool '", pool.stage(), "' returned ",
                                              (*scores)[j].logprobs.size(),
                                              " scores for a response of ", s.response_length(),
                                              " tokens (prompt ", s.prompt_index, ")"));
  }
  for (size_t j = 0; j < group.size(); ++j) on_scored_(group[j].slot, std::move((*scores)[j]));
  return absl::OkStatus();
}

}  // namespace trainer
