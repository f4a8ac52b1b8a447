// A process group over LibTorch's own distributed engine (c10d): Gloo on CPU tensors, NCCL on
// CUDA tensors, a TCPStore rendezvous at MASTER_ADDR:MASTER_PORT. Jobs launch the way PyTorch jobs
// launch (torchrun, srun, a Kubernetes indexed Job): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
// MASTER_PORT in the environment.
//
// Every collective is called by every rank in the same order. A collective that fails (a peer
// exited, a link broke) or outlives the group's timeout comes back as an error naming the
// operation and this rank, never as a hang or an abort; the group is unusable after that, and the
// caller is expected to end the job (its last checkpoint stays the one to resume from).
//
// With one process (no WORLD_SIZE, or WORLD_SIZE=1) there is no group at all: every collective
// returns at once with its input unchanged, so single-process code pays nothing.
//
// c10d's headers stay in process_group.cc: including this header costs nothing extra.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace lm::dist {

// Where this process sits in the job.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;

  bool distributed() const { return world_size > 1; }

  // Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Without WORLD_SIZE (or with 1)
  // the job is one process. Errors name the variable and its value: a non-number, RANK outside
  // [0, WORLD_SIZE), a missing MASTER_ADDR/MASTER_PORT when WORLD_SIZE > 1, a port out of range.
  static absl::StatusOr<LaunchEnv> FromEnvironment();
};

struct GroupOptions {
  // Every collective, and the rendezvous, fails after this long instead of waiting for ever.
  absl::Duration timeout = absl::Minutes(10);
  // "auto" (NCCL for CUDA devices, Gloo otherwise), "gloo" or "nccl".
  std::string backend = "auto";
};

enum class ReduceOp { kSum, kMax, kMin };

// A connection of its own to the group's key-value store (the TCPStore rank 0 hosts), for small
// values ranks publish and poll beside the collectives (lm/dist/rank_sync.h). Every call fails
// after the timeout it was opened with, so a stopped or dead host is an error, not a hang.
class StoreClient {
 public:
  virtual ~StoreClient() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // The key's value, or nullopt while it is not set (never waits for it).
  virtual absl::StatusOr<std::optional<std::string>> TryGet(const std::string& key) = 0;
  virtual absl::Status Delete(const std::string& key) = 0;
};

// A collective in flight; Wait() returns its outcome (once).
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual absl::Status Wait() = 0;
};

class ProcessGroup {
 public:
  // One process: the trivial group.
  ProcessGroup();
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // Joins the job's group: rendezvous through a TCPStore served by rank 0, then the backend for
  // `device`. Returns the trivial group when env.world_size == 1.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Create(const LaunchEnv& env,
                                                              torch::Device device,
                                                              const GroupOptions& options = {});

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool is_root() const { return rank_ == 0; }
  const std::string& backend() const { return backend_name_; }

  // In place over every rank: tensors[i] becomes the reduction of every rank's tensors[i].
  absl::Status AllReduce(std::vector<torch::Tensor>& tensors, ReduceOp op = ReduceOp::kSum);
  std::unique_ptr<PendingCollective> AllReduceAsync(std::vector<torch::Tensor>& tensors);
  // In place: every rank's tensors become root's.
  absl::Status Broadcast(std::vector<torch::Tensor>& tensors, int root = 0);
  // `input` (size() * n elements, contiguous) summed over ranks; this rank keeps chunk rank() in
  // `output` (n elements).
  absl::Status ReduceScatterSum(torch::Tensor& output, const torch::Tensor& input);
  // The same, in flight: `output` and `input` (contiguous) must stay alive and untouched until
  // Wait() returns.
  std::unique_ptr<PendingCollective> ReduceScatterSumAsync(torch::Tensor output,
                                                           torch::Tensor input);
  // `output` (size() * n elements) = the ranks' `input`s (n elements each) in rank order.
  absl::Status AllGather(torch::Tensor& output, const torch::Tensor& input);
  // Root's bytes on every rank.
  absl::Status BroadcastBytes(std::string* bytes, int root = 0);
  // Every rank's bytes (any length, empty included), in rank order, on every rank.
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine);
  absl::Status Barrier();

  // Convenience reductions of host scalars (one collective each).
  absl::StatusOr<std::vector<double>> AllReduceDoubles(std::vector<double> values,
                                                       ReduceOp op = ReduceOp::kSum);
  // Whether any rank passed true (e.g. a stop signal that reached only some ranks).
  absl::StatusOr<bool> AnyRank(bool value);

  // A new connection to the group's store whose calls fail after `timeout`. FAILED_PRECONDITION
  // for the trivial group (there is no store).
  absl::StatusOr<std::unique_ptr<StoreClient>> ConnectStore(absl::Duration timeout) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, size_ = 1;
  std::string backend_name_ = "none";
  torch::Device device_{torch::kCPU};
  LaunchEnv env_;
};

// What c10d's NCCL backend is told before a group is made (environment variables it reads when a
// ProcessGroupNCCL is constructed): wait() blocks and throws when a collective fails or outlives
// the timeout (TORCH_NCCL_BLOCKING_WAIT=1), and the watchdog then aborts the communicators without
// taking the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, CleanUpOnly; LibTorch's default,
// 3, kills the process). So a timeout on NCCL is the same UNAVAILABLE as on Gloo, and the job
// saves its checkpoint. Values a user set otherwise are replaced, with a warning.
void PrepareNcclErrorHandling();

}  // namespace lm::dist
