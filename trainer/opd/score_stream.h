// Scores samples while they are still arriving: each sample goes to the teacher pool of its
// domain as soon as it is added, so teachers work while the student samples the rest.
//
// Per pool, at most `max_calls_per_pool` Score calls run at once; a call takes whatever of the
// pool's samples are queued when it starts, lowest slot first (at most `max_call_tokens` tokens,
// at least one sample), so samples that arrive while the teachers are busy are scored together,
// in the order the learner consumes them. The groups
// therefore depend on arrival times; the scores do not, where the teacher scores each sequence
// the same whatever shares its batch (opd-teacher does: teacher_service/scorer.h).
//
// The first failure (a pool that gives up, a reply of the wrong size) ends the stream: the other
// calls are stopped and Wait() returns that error naming the pool. Nothing is scored twice.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "lm/generate/sampling.h"
#include "rpc/client.h"

namespace trainer {

class TeacherPool;

// The pools a stage scores on: a pool per data domain that has its own, the rest on `fallback`.
// Shared with the streams that use them, which may outlive a swap by a few calls.
struct TeacherPools {
  std::shared_ptr<TeacherPool> fallback;
  std::map<std::string, std::shared_ptr<TeacherPool>> by_domain;
  // A domain pool whose every replica is down sends its samples to `fallback` (on_domain_down:
  // default_pool; its pools give up instead of waiting: give_up_when_all_down).
  bool domain_down_to_fallback = false;

  TeacherPool& For(const std::string& domain) const;
  std::vector<std::shared_ptr<TeacherPool>> all() const;  // fallback first
};

struct ScoreStreamOptions {
  opd::rpc::ScoreOptions score;
  int max_calls_per_pool = 4;
  int64_t max_call_tokens = 65536;
  // Polled by the pools between retries; a true ends the stream CANCELLED.
  std::function<bool()> stop;
  // The calls of each pool go to its replicas in turn, starting at rank + step (ScoreSpread's
  // replica_hint), so that every rank's calls spread over every replica.
  int rank = 0;
  int64_t step = 0;
};

class ScoreStream {
 public:
  // Each sample goes to `pools.For(sample.domain)`. `on_scored(slot, scores)` runs once per
  // added slot, on a worker thread; `on_failed(error)` once, when the stream fails (not when it
  // is cancelled).
  using OnScored = std::function<void(size_t slot, lm::SequenceScore scores)>;
  using OnFailed = std::function<void(const absl::Status& error)>;
  ScoreStream(TeacherPools pools, ScoreStreamOptions options, OnScored on_scored,
              OnFailed on_failed = nullptr);
  ~ScoreStream();  // cancels what is left and joins the workers
  ScoreStream(const ScoreStream&) = delete;
  ScoreStream& operator=(const ScoreStream&) = delete;

  // Queues a sample for scoring. `sample` must outlive the stream (the caller's slot).
  void Add(size_t slot, const lm::Sample* sample);
  // Queues samples at once (phase by phase: the calls' groups then depend on nothing but the
  // samples and the token budget).
  void AddAll(const std::vector<std::pair<size_t, const lm::Sample*>>& samples);
  // No more samples will be added: once the queued ones are scored the workers end.
  void Close();
  // Ends the calls in flight (their pools stop between retries) and drops what is queued.
  void Cancel();
  // Blocks until every added sample is scored (after Close) or the stream failed.
  absl::Status Wait();
  // Seconds during which at least one call was in flight.
  double busy_seconds() const;
  // Samples a down domain pool handed to the fallback pool.
  int64_t fallbacks() const;

 private:
  struct Item {
    size_t slot;
    const lm::Sample* sample;
  };
  struct PoolQueue;
  void AddLocked(size_t slot, const lm::Sample* sample) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Work();
  // The pool with queued work and a free call, or -1.
  int ReadyPool() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ScoreGroup(TeacherPool& pool, const std::vector<Item>& group, int64_t replica_hint);
  bool Stopped() const;

  const TeacherPools pools_;
  const ScoreStreamOptions opts_;
  const OnScored on_scored_;
  const OnFailed on_failed_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<PoolQueue>> queues_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;  // added, not yet scored
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t fallbacks_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  double busy_s_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t busy_since_ns_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;
};

}  // namespace trainer
