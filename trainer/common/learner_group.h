// Joining the learner's c10d group: where a learner rank runs (its device, from train.device and
// LOCAL_RANK), the job's process group, and the check that every rank was launched alike.
#pragma once

#include <memory>
#include <string>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lm/dist/process_group.h"
#include "trainer/common/sections.h"

namespace trainer {

// Where a learner rank runs: its device (cuda:LOCAL_RANK on a GPU node) and the job's group.
struct LearnerPlacement {
  torch::Device device{torch::kCPU};
  std::unique_ptr<lm::dist::ProcessGroup> group;
};
// train.device for a rank with local rank `local_rank` on a node with `cuda_devices` CUDA devices
// (0: no CUDA): cpu; cuda:N as given; cuda (and auto when CUDA is there) is cuda:LOCAL_RANK, so
// each rank of a node takes its own GPU (LOCAL_RANK unset: 0). Errors name the value and what is
// missing.
absl::StatusOr<torch::Device> ResolveLearnerDevice(const std::string& spec, int local_rank,
                                                   int cuda_devices);

// Collective: fails on every rank, naming `what` and the ranks, unless every rank passed the same
// `value` as rank 0 (ranks launched with different configs or models would otherwise exchange
// tensors that do not belong together).
absl::Status CheckSameOnEveryRank(lm::dist::ProcessGroup& group, const std::string& value,
                                  const std::string& what);

// Collective: OK on every rank when `mine` is OK on every rank; otherwise every rank returns the
// lowest failing rank's status (its code, its message prefixed with "rank R: " when there are
// several ranks), so that a check each rank makes of its own share fails the job the same way
// everywhere.
absl::Status AgreeOnStatus(lm::dist::ProcessGroup& group, const absl::Status& mine);

// Reads the launcher's environment (lm::dist::LaunchEnv), picks the device (`device` as
// train.device: auto | cpu | cuda | cuda:N, ResolveLearnerDevice), and joins the job's group with
// collectives that time out after `timeout_s` on `backend`. One process: the trivial group.
absl::StatusOr<LearnerPlacement> JoinLearnerGroup(const std::string& device, double timeout_s,
                                                  DistBackend backend);

}  // namespace trainer
