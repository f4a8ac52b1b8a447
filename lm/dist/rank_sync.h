// Waits that match the work: how the learner's ranks meet after a phase of variable length
// (sampling, scoring, a held-out evaluation, a weight push) without waiting inside a collective,
// whose fixed timeout cannot tell a long phase from a dead peer.
//
// Every rank publishes a heartbeat through the group's store: a background thread writes, every
// beat interval, a counter that only advances while the process runs, with what the rank says it
// is doing (its phase and its last progress). Agree(point, status) is where ranks meet: each
// writes its own outcome, then waits, however long, for the others' outcomes while their
// heartbeats advance. It gives up only when a missing rank's heartbeat has not advanced for the
// stall timeout (a stopped, hung or dead process, or an unreachable store host), with an error
// naming that rank, the point, its phase and its last progress; it then tells the other ranks
// that it gave up, so that they end too instead of waiting for it.
//
// A phase that is alive but never finishes is not a stall: each phase bounds itself (the rollout
// and scoring deadlines), fails, and brings that failure to the next Agree, where every rank
// learns it. So collectives are only ever entered once every rank has agreed that it can.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "lm/dist/process_group.h"

namespace lm::dist {

struct RankSyncOptions {
  // A missing rank whose heartbeat has not advanced for this long ends the wait.
  absl::Duration stall_timeout = absl::Minutes(5);
  absl::Duration beat_interval = absl::Seconds(1);
  // Polls of the store while waiting start this often and back off to beat_interval.
  absl::Duration first_poll = absl::Milliseconds(5);
  // Off in tests that simulate a rank that stops (the thread never beats).
  bool heartbeat = true;
};

class RankSync {
 public:
  // The trivial group needs no store: Agree returns the rank's own status at once.
  static absl::StatusOr<std::unique_ptr<RankSync>> Create(const ProcessGroup& group,
                                                          RankSyncOptions options = {});
  // Rank `rank` of `size` meeting through `store` (any StoreClient: tests give one that fails).
  static std::unique_ptr<RankSync> WithStore(int rank, int size, std::unique_ptr<StoreClient> store,
                                             RankSyncOptions options = {});
  ~RankSync();
  RankSync(const RankSync&) = delete;
  RankSync& operator=(const RankSync&) = delete;

  // What this rank is doing, shown to a peer that gives up waiting for it. Any thread.
  void SetPhase(std::string phase);
  void Progress(std::string detail);

  // Every rank calls Agree with the same points in the same order. Returns, on every rank, the
  // outcome of the lowest rank that failed (its message prefixed with "learner rank R: " on the
  // other ranks), or OK when all passed OK. DEADLINE_EXCEEDED when a rank stalled (see the top of
  // the file), ABORTED when another rank gave up waiting; after either, broken() is true and no
  // collective can be trusted: the job ends without one.
  absl::Status Agree(const std::string& point, const absl::Status& mine);
  // Agree, and every rank's `payload` (small: it travels through the store), in rank order.
  absl::StatusOr<std::vector<std::string>> Exchange(const std::string& point,
                                                    const absl::Status& mine,
                                                    const std::string& payload);
  bool broken() const { return broken_.load(); }

 private:
  RankSync(int rank, int size, std::unique_ptr<StoreClient> store, RankSyncOptions options);
  void Beat();
  std::string Describe() const;
  absl::Status GiveUp(absl::Status why);

  const int rank_, size_;
  const RankSyncOptions opts_;
  std::unique_ptr<StoreClient> store_;  // null for the trivial group
  int64_t points_ = 0;                  // Agree calls so far (the same on every rank)
  std::atomic<bool> broken_{false};
  mutable absl::Mutex mu_;
  std::string phase_ ABSL_GUARDED_BY(mu_), detail_ ABSL_GUARDED_BY(mu_);
  absl::Time detail_at_ ABSL_GUARDED_BY(mu_);
  absl::Mutex store_mu_;  // the store connection is used by the beat thread and Agree
  absl::Notification stop_;
  std::thread beater_;
};

}  // namespace lm::dist
