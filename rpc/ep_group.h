// The expert-parallel group of a model server (opd-teacher, opd-rollout with --world-size N):
// N processes launched like the learner (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
// each holding the replicated part of the model and 1/N of its experts
// (lm/model/expert_parallel.h).
//
// Rank 0 (the leader) serves gRPC; the followers listen on nothing. For each unit of work the
// leader broadcasts a command (bytes) and every rank runs the same computation on it, so that the
// MoE layers' all-reduces pair up. Commands are serialised: one at a time on the group.
//
// Failure: a collective that fails (a rank died, a link broke, the timeout passed) makes that
// command UNAVAILABLE, and the group is broken for good: every later command is UNAVAILABLE at
// once. Followers exit non-zero when the group fails, and 0 when the leader stops them (shutdown).
// While idle the leader sends a heartbeat every timeout / 4, so idle followers do not time out.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <torch/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lm/dist/process_group.h"

namespace lm {
class CausalLM;
}

namespace opd::rpc {

// The launch environment for `--world-size` (0: WORLD_SIZE's, or 1 without it). INVALID_ARGUMENT
// naming the flag and the variable when they disagree, or naming the variable when it is bad.
absl::StatusOr<lm::dist::LaunchEnv> ExpertParallelEnv(int world_size_flag);

class EpGroup {
 public:
  // The work of one command on one rank; its status must not depend on the rank (a failure of
  // the group's collectives is reported by throwing lm::CollectiveError).
  using Work = std::function<absl::Status(const std::string& command)>;

  // Joins the group (rendezvous within `timeout`), checks that every rank loaded the same model
  // (`model_summary`), and attaches the group's all-reduce to `model`'s MoE layers.
  static absl::StatusOr<std::unique_ptr<EpGroup>> Join(const lm::dist::LaunchEnv& env,
                                                       torch::Device device, absl::Duration timeout,
                                                       lm::CausalLM& model,
                                                       const std::string& model_summary);
  ~EpGroup();

  bool leader() const { return group_->is_root(); }
  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  lm::dist::ProcessGroup& group() { return *group_; }

  // Leader: sends `command` to the followers, then runs `work(command)` here. UNAVAILABLE when
  // the group is (or becomes) broken; otherwise work's status.
  absl::Status Run(const std::string& command, const Work& work);
  // Follower: runs `work` on each command until the leader stops the group (OK) or the group
  // fails (its error). `kill_on_command`: a test hook, SIGKILL this process when the first
  // command arrives (a rank dying mid-request).
  absl::Status Follow(const Work& work, bool kill_on_command = false);
  // Leader: ends the followers' Follow (no-op when broken). Returns whether the group was intact.
  absl::Status Stop();

  // Whether any rank's `value` is true (one tiny all-reduce; run inside a command, on every
  // rank). Throws lm::CollectiveError when the group fails.
  bool AnyRank(bool value);

  // Follower: the heartbeats received so far (what keeps an idle follower's collective waiting).
  int64_t heartbeats() const { return heartbeats_.load(); }

 private:
  EpGroup(std::unique_ptr<lm::dist::ProcessGroup> group, absl::Duration heartbeat);
  // Sends a command frame (kind + payload); marks the group broken on failure.
  absl::Status SendLocked(char kind, const std::string& payload) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HeartbeatLoop();

  std::unique_ptr<lm::dist::ProcessGroup> group_;
  absl::Duration heartbeat_;
  absl::Mutex mu_;  // one command on the group at a time
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_sent_ ABSL_GUARDED_BY(mu_);
  std::thread heartbeat_thread_;
  std::atomic<int64_t> heartbeats_{0};
};

}  // namespace opd::rpc
