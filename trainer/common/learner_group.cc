#include "trainer/common/learner_group.h"

#include <torch/cuda.h>

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lm/model/placement.h"
#include "lm/util/log.h"
#include "lm/util/status.h"

namespace trainer {

absl::Status CheckSameOnEveryRank(lm::dist::ProcessGroup& group, const std::string& value,
                                  const std::string& what) {
  if (group.size() == 1) return absl::OkStatus();
  std::string root = value;
  RETURN_IF_ERROR(group.BroadcastBytes(&root));
  std::vector<double> differs(static_cast<size_t>(group.size()), 0.0);
  differs[static_cast<size_t>(group.rank())] = root == value ? 0.0 : 1.0;
  ASSIGN_OR_RETURN(differs, group.AllReduceDoubles(differs));
  std::vector<std::string> ranks;
  for (size_t r = 0; r < differs.size(); ++r)
    if (differs[r] > 0) ranks.push_back(std::to_string(r));
  if (ranks.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the ", what, " of rank(s) ", absl::StrJoin(ranks, ", "),
                   " differs from rank 0's: every rank must be launched with the same one"));
}

absl::Status AgreeOnStatus(lm::dist::ProcessGroup& group, const absl::Status& mine) {
  if (group.size() == 1) return mine;
  std::vector<double> failed(static_cast<size_t>(group.size()), 0.0);
  failed[static_cast<size_t>(group.rank())] = mine.ok() ? 0.0 : 1.0;
  ASSIGN_OR_RETURN(failed, group.AllReduceDoubles(failed));
  int first = -1;
  for (size_t r = 0; r < failed.size() && first < 0; ++r)
    if (failed[r] > 0) first = static_cast<int>(r);
  if (first < 0) return absl::OkStatus();
  // The failing rank's code and message, as "<code>\n<message>".
  std::string text = group.rank() == first
                         ? absl::StrCat(static_cast<int>(mine.code()), "\n", mine.message())
                         : std::string();
  RETURN_IF_ERROR(group.BroadcastBytes(&text, first));
  const size_t nl = text.find('\n');
  int code = static_cast<int>(absl::StatusCode::kUnknown);
  if (nl == std::string::npos || !absl::SimpleAtoi(text.substr(0, nl), &code))
    return absl::InternalError(absl::StrCat("rank ", first, " failed (see its log)"));
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat("rank ", first, ": ", text.substr(nl + 1)));
}

absl::StatusOr<torch::Device> ResolveLearnerDevice(const std::string& spec, int local_rank,
                                                   int cuda_devices) {
  if (spec == "cpu" || (spec == "auto" && cuda_devices == 0)) return torch::Device(torch::kCPU);
  int index = local_rank;
  const bool explicit_index = absl::StartsWith(spec, "cuda:");
  if (explicit_index) {
    if (!absl::SimpleAtoi(spec.substr(5), &index) || index < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("train.device: '", spec, "' is not cuda:N with N a device index"));
  } else if (spec != "cuda" && spec != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("train.device: '", spec, "' is not one of auto, cpu, cuda, cuda:N"));
  }
  if (cuda_devices == 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "train.device: ", spec, " but CUDA is not available (no device, or a CPU-only build)"));
  if (index >= cuda_devices)
    return absl::FailedPreconditionError(absl::StrCat(
        "train.device: ", spec, explicit_index ? "" : absl::StrCat(" with LOCAL_RANK=", local_rank),
        " needs cuda:", index, " but this node has ", cuda_devices, " CUDA device(s)"));
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

absl::StatusOr<LearnerPlacement> JoinLearnerGroup(const std::string& device, double timeout_s,
                                                  DistBackend backend) {
  ASSIGN_OR_RETURN(const lm::dist::LaunchEnv env, lm::dist::LaunchEnv::FromEnvironment());
  lm::log::SetRank(env.rank, env.world_size);
  LearnerPlacement p;
  const int cuda_devices =
      torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  ASSIGN_OR_RETURN(p.device, ResolveLearnerDevice(device, env.local_rank, cuda_devices));
  lm::BindThreadToDevice(p.device);  // before the group: NCCL and every later launch use it
  lm::dist::GroupOptions o;
  o.timeout = absl::Seconds(timeout_s);
  o.backend = lm::ChoiceName(backend);  // lm::dist takes the same words
  ASSIGN_OR_RETURN(p.group, lm::dist::ProcessGroup::Create(env, p.device, o));
  if (env.distributed()) {
    lm::log::Info(absl::StrFormat("rank %d of %d (local rank %d) on %s, %s collectives via %s:%d",
                                  env.rank, env.world_size, env.local_rank, p.device.str(),
                                  p.group->backend(), env.master_addr, env.master_port));
  }
  return p;
}

}  // namespace trainer
