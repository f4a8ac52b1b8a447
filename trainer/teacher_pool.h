// The teacher replicas of one OPD stage.
//
// Score() spreads a step's sequences over the healthy replicas in parallel. A replica that fails
// with a transient status (UNAVAILABLE, DEADLINE_EXCEEDED, ...) is taken out of rotation and its
// share is retried on another; it comes back once its health check passes. Every sequence is
// scored exactly once: results are written to the input's own slot, and a share is either fully
// applied or retried whole. With no healthy replica the pool waits with backoff (and says so) until
// one returns or `stop` is set; it never hands back partial scores.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/client.h"

namespace opd {

// What every teacher must agree on with the student.
struct TeacherRequirements {
  std::string tokenizer_fingerprint;  // empty: not checked
  int64_t vocab_size = 0;             // 0: not checked
};

struct TeacherPoolOptions {
  rpc::ClientOptions client;  // address is filled per replica
  absl::Duration backoff_initial = absl::Milliseconds(500);
  absl::Duration backoff_max = absl::Seconds(30);
  int max_sequences_per_call = 64;  // a replica's share is sent in calls of at most this many
};

class TeacherPool {
 public:
  // Connects to every endpoint and checks its Info() against `req`: a mismatch (or an endpoint
  // that cannot be reached) is an error naming the endpoint, before any step is spent on it.
  TeacherPool(std::string stage, TeacherPoolOptions opts)
      : stage_(std::move(stage)), opts_(std::move(opts)) {}
  static absl::StatusOr<std::unique_ptr<TeacherPool>> Connect(
      const std::string& stage, const std::vector<std::string>& endpoints,
      const TeacherRequirements& req, const TeacherPoolOptions& opts);

  // Scores every input (one output per input, in order). Cancelled if `stop()` returns true while
  // waiting for a healthy replica.
  absl::StatusOr<std::vector<rpc::ScoreOutput>> Score(const std::vector<rpc::ScoreInput>& inputs,
                                                      const rpc::ScoreOptions& score_opts,
                                                      const std::function<bool()>& stop = nullptr);

  const std::string& stage() const { return stage_; }
  std::vector<std::string> endpoints() const;
  int healthy_count() const;
  int64_t failovers() const { return failovers_.load(); }

 private:
  struct Replica {
    std::unique_ptr<rpc::TeacherClient> client;
    rpc::ClientOptions opts;
    bool healthy = true;
  };
  std::vector<int> HealthyReplicas();  // re-admits replicas whose health check passes
  absl::Status WaitForHealthy(const std::function<bool()>& stop, const std::string& last_error);

  std::string stage_;
  TeacherPoolOptions opts_;
  mutable absl::Mutex mu_;
  std::vector<Replica> replicas_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> failovers_{0};
};

// True for statuses worth retrying on another replica.
bool IsTransient(const absl::Status& s);

}  // namespace opd
