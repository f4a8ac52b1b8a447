#include "rpc/ep_group.h"

#include <signal.h>

#include <cstdlib>

#include <torch/torch.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "lm/model/batch_invariant.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/model.h"
#include "lm/util/log.h"
#include "lm/util/status.h"

namespace opd::rpc {
namespace {

// Command frames: one kind byte, then the payload.
constexpr char kNoop = 'N', kStop = 'S', kCommand = 'C';

absl::Status Broken(const absl::Status& why) {
  return absl::UnavailableError(
      absl::StrCat("the expert-parallel group failed (", why.message(),
                   "); this server no longer serves: restart every rank"));
}

// t summed over the group as ((rank 0's + rank 1's) + rank 2's) + ..., on every rank the same.
absl::Status RankOrderSum(lm::dist::ProcessGroup& group, torch::Tensor& t) {
  const auto flat = t.contiguous().view({-1});
  auto parts = torch::empty({group.size(), flat.numel()}, flat.options());
  auto gathered = parts.view({-1});
  if (absl::Status st = group.AllGather(gathered, flat); !st.ok()) return st;
  auto sum = parts[0].clone();
  for (int r = 1; r < group.size(); ++r) sum.add_(parts[r]);
  t.copy_(sum.view(t.sizes()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<lm::dist::LaunchEnv> ExpertParallelEnv(int world_size_flag) {
  if (world_size_flag < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--world-size=", world_size_flag, " is negative"));
  ASSIGN_OR_RETURN(lm::dist::LaunchEnv env, lm::dist::LaunchEnv::FromEnvironment());
  const int want = world_size_flag == 0 ? env.world_size : world_size_flag;
  if (want != env.world_size) {
    const char* ws = std::getenv("WORLD_SIZE");
    return absl::InvalidArgumentError(absl::StrCat(
        "--world-size=", world_size_flag,
        " disagrees with the environment's WORLD_SIZE=", ws ? ws : "(unset: one process)",
        " (launch every rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as for the "
        "learner)"));
  }
  return env;
}

EpGroup::EpGroup(std::unique_ptr<lm::dist::ProcessGroup> group, absl::Duration heartbeat)
    : group_(std::move(group)), heartbeat_(heartbeat), last_sent_(absl::Now()) {
  if (leader()) heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
}

EpGroup::~EpGroup() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

absl::StatusOr<std::unique_ptr<EpGroup>> EpGroup::Join(const lm::dist::LaunchEnv& env,
                                                       torch::Device device, absl::Duration timeout,
                                                       lm::CausalLM& model,
                                                       const std::string& model_summary) {
  lm::dist::GroupOptions opts;
  opts.timeout = timeout;
  ASSIGN_OR_RETURN(auto pg, lm::dist::ProcessGroup::Create(env, device, opts));
  // Ranks that loaded different models (or dtypes) would all-reduce tensors that do not belong
  // together: every rank refuses.
  std::string summary = model_summary;
  RETURN_IF_ERROR(pg->BroadcastBytes(&summary));
  ASSIGN_OR_RETURN(const bool differs, pg->AnyRank(summary != model_summary));
  if (differs)
    return absl::FailedPreconditionError(absl::StrCat(
        "the ranks of the expert-parallel group loaded different models (rank 0: ", summary,
        "; rank ", env.rank, ": ", model_summary, ")"));
  const lm::ModelConfig& c = model.config();
  auto ep = std::make_shared<lm::ExpertParallel>();
  ep->local = {c.expert_first, c.LocalExperts()};
  lm::dist::ProcessGroup* raw = pg.get();
  ep->all_reduce_sum = [raw](torch::Tensor& t) {
    // Batch-invariant (lm/model/batch_invariant.h), more than two ranks: the backend's all-reduce
    // adds an element's partial sums in an order set by where the element falls in the buffer,
    // i.e. by the batch's size. Gathered and added in rank order instead, every element is
    // ((p0 + p1) + p2) + ... wherever it sits. (Two partial sums add the same either way.)
    if (lm::BatchInvariant() && raw->size() > 2) return RankOrderSum(*raw, t);
    std::vector<torch::Tensor> v{t};
    return raw->AllReduce(v);
  };
  lm::AttachExpertParallel(model, std::move(ep));
  return std::unique_ptr<EpGroup>(new EpGroup(std::move(pg), timeout / 4));
}

absl::Status EpGroup::SendLocked(char kind, const std::string& payload) {
  std::string frame(1, kind);
  frame += payload;
  last_sent_ = absl::Now();
  absl::Status st = group_->BroadcastBytes(&frame);
  if (!st.ok()) broken_ = st;
  return st;
}

void EpGroup::HeartbeatLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), heartbeat_);
    if (stopping_ || !broken_.ok() || absl::Now() - last_sent_ < heartbeat_) continue;
    if (!SendLocked(kNoop, "").ok())
      lm::log::Error(absl::StrCat("expert-parallel heartbeat failed: ", broken_.message()));
  }
}

absl::Status EpGroup::Run(const std::string& command, const Work& work) {
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) return Broken(broken_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (absl::Status st = SendLocked(kCommand, command); !st.ok()) return Broken(st);
  try {
    return work(command);
  } catch (const lm::CollectiveError& e) {
    broken_ = e.status();
  } catch (const std::exception& e) {
    // The followers may be waiting in a collective this rank will never join: the group's state
    // is unknown, so it is not used again.
    broken_ = absl::InternalError(absl::StrCat("rank 0 failed mid-command: ", e.what()));
  }
  lm::log::Error(absl::StrCat("expert-parallel group broken: ", broken_.message()));
  return Broken(broken_);
}

absl::Status EpGroup::Follow(const Work& work, bool kill_on_command) {
  while (true) {
    std::string frame;
    RETURN_IF_ERROR(group_->BroadcastBytes(&frame));
    if (frame.empty()) return absl::InternalError("empty command frame from rank 0");
    if (frame[0] == kNoop) {
      ++heartbeats_;
      continue;
    }
    if (frame[0] == kStop) return absl::OkStatus();
    if (frame[0] != kCommand)
      return absl::InternalError(absl::StrCat("unknown command kind ", int{frame[0]}));
    if (kill_on_command) raise(SIGKILL);
    const std::string command = frame.substr(1);
    try {
      // A status (the same on every rank) is the command's outcome; the group goes on.
      absl::Status st = work(command);
      if (!st.ok()) lm::log::Info(absl::StrCat("command ended: ", st.ToString()));
    } catch (const lm::CollectiveError& e) {
      return e.status();
    } catch (const std::exception& e) {
      // This rank cannot follow the others any more: it ends, and the group fails for all.
      return absl::InternalError(absl::StrCat("rank ", rank(), " failed a command: ", e.what()));
    }
  }
}

absl::Status EpGroup::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  if (!broken_.ok()) return Broken(broken_);
  if (absl::Status st = SendLocked(kStop, ""); !st.ok()) return Broken(st);
  return absl::OkStatus();
}

bool EpGroup::AnyRank(bool value) {
  absl::StatusOr<bool> any = group_->AnyRank(value);
  if (!any.ok()) throw lm::CollectiveError(any.status());
  return *any;
}

}  // namespace opd::rpc
