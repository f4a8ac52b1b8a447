#include "rollout/weight_sync.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/dist/process_group.h"
#include "lm/model/placement.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "lm/util/threads.h"
#include "rpc/tensor_codec.h"

namespace rollout {
namespace {

constexpr int64_t kMaxBucketBytes = int64_t{1} << 30;
constexpr double kMaxTimeoutS = 24 * 3600;

// Feeds the concatenated wire bytes of the announced tensors, as they arrive, into the staged
// update as chunks (one per tensor piece), in manifest order.
class ManifestCursor {
 public:
  ManifestCursor(const opd::v1::WeightManifest& m, StagedWeights* staged) : m_(m), staged_(staged) {
    for (const auto& t : m.tensors()) {
      int64_t n = static_cast<int64_t>(c10::elementSize(*opd::rpc::DtypeFromName(t.dtype())));
      for (int64_t d : t.shape()) n *= d;
      bytes_.push_back(n);
    }
  }

  absl::Status Feed(const char* data, int64_t n) {
    for (;;) {
      // Past complete tensors; zero-byte ones still get their (empty) chunk.
      while (i_ < bytes_.size() && off_ == bytes_[i_]) {
        if (bytes_[i_] == 0) RETURN_IF_ERROR(Add(data, 0));
        ++i_;
        off_ = 0;
      }
      if (n == 0) return absl::OkStatus();
      if (i_ == bytes_.size())
        return absl::InvalidArgumentError(
            "the broadcast carries more bytes than the manifest's tensors add up to");
      const int64_t take = std::min(n, bytes_[i_] - off_);
      RETURN_IF_ERROR(Add(data, take));
      off_ += take;
      data += take;
      n -= take;
    }
  }

 private:
  absl::Status Add(const char* data, int64_t n) {
    const auto& t = m_.tensors(static_cast<int>(i_));
    ChunkView v;
    v.name = t.name();
    v.shape.assign(t.shape().begin(), t.shape().end());
    v.dtype = t.dtype();
    v.offset = off_;
    v.data = std::string_view(data, static_cast<size_t>(n));
    return staged_->Add(v);
  }

  const opd::v1::WeightManifest& m_;
  StagedWeights* staged_;
  std::vector<int64_t> bytes_;
  size_t i_ = 0;
  int64_t off_ = 0;
};

}  // namespace

WeightSyncReceiver::WeightSyncReceiver(WeightStore* store, torch::Device device)
    : store_(store), device_(device) {}

WeightSyncReceiver::~WeightSyncReceiver() {
  absl::MutexLock lock(&launch_mu_);
  if (worker_.joinable()) worker_.join();
}

void WeightSyncReceiver::Launch(std::function<void()> fn) {
  absl::MutexLock lock(&launch_mu_);
  if (worker_.joinable()) worker_.join();  // it has ended: the state was kNone or kReady
  worker_ = std::thread([fn = std::move(fn), device = device_] {
    lm::BindThreadToDevice(device);  // the receive's NCCL calls and copies go to the model's device
    fn();
  });
}

absl::StatusOr<opd::v1::JoinWeightGroupResponse> WeightSyncReceiver::Join(
    const opd::v1::JoinWeightGroupRequest& req) {
  if (req.group_id().empty()) return absl::InvalidArgumentError("group_id is empty");
  if (req.store_host().empty()) return absl::InvalidArgumentError("store_host is empty");
  if (req.store_port() < 1 || req.store_port() > 65535)
    return absl::InvalidArgumentError(
        absl::StrCat("store_port ", req.store_port(), " is not a TCP port"));
  if (!(req.timeout_s() > 0 && req.timeout_s() <= kMaxTimeoutS))
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_s ", req.timeout_s(), " is not in (0, ", kMaxTimeoutS, "]"));
  const std::string backend = req.learner_cuda() && device_.is_cuda() ? "nccl" : "gloo";
  std::unique_ptr<lm::dist::ProcessGroup> old;  // closed outside the lock
  {
    absl::MutexLock lock(&mu_);
    // A sync ending (its verdict sent) or a join finishing is waited for, within its timeout.
    auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return state_ != State::kJoining && state_ != State::kSyncing;
    };
    mu_.AwaitWithTimeout(absl::Condition(&idle), timeout_);
    if (state_ == State::kJoining || state_ == State::kSyncing)
      return absl::UnavailableError(absl::StrCat(
          "a weight group ", state_ == State::kJoining ? "join" : "sync", " is in progress"));
    old = std::move(group_);
    state_ = State::kJoining;
    group_id_ = req.group_id();
    backend_ = backend;
    timeout_ = absl::Seconds(req.timeout_s());
  }
  old.reset();
  Launch([this, req, backend] { RunJoin(req, backend); });
  opd::v1::JoinWeightGroupResponse resp;
  resp.set_backend(backend);
  resp.set_device(device_.str());
  return resp;
}

void WeightSyncReceiver::RunJoin(opd::v1::JoinWeightGroupRequest req, std::string backend) {
  lm::dist::LaunchEnv env{1, 2, 0, req.store_host(), req.store_port()};
  lm::dist::GroupOptions o;
  o.timeout = absl::Seconds(req.timeout_s());
  o.backend = backend;
  auto group = lm::dist::ProcessGroup::Create(
      env, backend == "nccl" ? device_ : torch::Device(torch::kCPU), o);
  absl::Status st = group.status();
  if (!st.ok())
    lm::log::Warn(absl::StrCat("weight group '", req.group_id(), "' did not form: ", st.message()));
  else
    lm::log::Info(absl::StrCat("joined weight group '", req.group_id(), "' (", backend, ") at ",
                               req.store_host(), ":", req.store_port()));
  absl::MutexLock lock(&mu_);
  if (st.ok()) group_ = std::move(*group);
  state_ = st.ok() ? State::kReady : State::kNone;
  ++stats_.joins;
  stats_.last_join = st;
}

absl::StatusOr<opd::v1::SyncWeightsResponse> WeightSyncReceiver::Start(
    const opd::v1::SyncWeightsRequest& req) {
  const int64_t b = req.bucket_bytes();
  if (b < 8 || b % 8 != 0 || b > kMaxBucketBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("bucket_bytes ", b, " is not a multiple of 8 in [8, ", kMaxBucketBytes, "]"));
  {
    absl::MutexLock lock(&mu_);
    // The learner's rendezvous returns at about the time ours does, and it hears a sync's
    // verdict just before our side of it ends: wait for our side to finish.
    auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return state_ != State::kJoining && state_ != State::kSyncing;
    };
    mu_.AwaitWithTimeout(absl::Condition(&idle), timeout_);
    if (state_ == State::kSyncing) return absl::UnavailableError("a weight sync is in progress");
    if (state_ != State::kReady || group_id_ != req.group_id())
      return absl::FailedPreconditionError(
          absl::StrCat("no weight group '", req.group_id(), "' (join it first)"));
    state_ = State::kSyncing;  // reserved while the update is staged
  }
  auto staged =
      store_->StageAnnounced(req.version(), Announced(req.manifest()), BaseVersion(req.manifest()));
  if (!staged.ok()) {
    absl::MutexLock lock(&mu_);
    state_ = State::kReady;
    return staged.status();
  }
  opd::v1::SyncWeightsResponse resp;
  resp.set_bytes((*staged)->expected_bytes());
  {
    absl::MutexLock lock(&mu_);
    pending_ = std::move(*staged);
  }
  Launch([this, req] { RunSync(req); });
  return resp;
}

namespace {

// The data phase (rollout.proto, SyncWeightsRequest): frames until the empty one, each fed into
// the staged update. A bad tensor does not stop the reception (the learner keeps broadcasting;
// both sides stay in step), it is the outcome. Returns the outcome; `broken` says whether a
// collective failed (the group is then unusable, and nobody is left to tell).
absl::Status Receive(lm::dist::ProcessGroup& group, torch::Device device,
                     const opd::v1::SyncWeightsRequest& req, StagedWeights* staged, bool* broken) {
  ManifestCursor cursor(req.manifest(), staged);
  const auto on = torch::TensorOptions().device(device);
  std::vector<torch::Tensor> header{torch::empty({1}, on.dtype(torch::kInt64))};
  torch::Tensor bucket = torch::empty({req.bucket_bytes()}, on.dtype(torch::kUInt8));
  absl::Status outcome;
  int64_t frames = 0;
  for (;; ++frames) {
    if (absl::Status st = group.Broadcast(header, 0); !st.ok()) {
      *broken = true;
      return absl::UnavailableError(absl::StrCat("weight sync of version ", req.version(),
                                                 " broke after ", frames,
                                                 " buckets: ", st.message()));
    }
    const int64_t n = header[0].to(torch::kCPU).item<int64_t>();
    if (n == 0) break;
    if (n < 0 || n > req.bucket_bytes()) {
      *broken = true;  // the learner is not following the protocol: the stream cannot be read
      return absl::InvalidArgumentError(absl::StrCat(
          "bucket of ", n, " bytes announced; buckets are at most ", req.bucket_bytes()));
    }
    std::vector<torch::Tensor> data{bucket.narrow(0, 0, n)};
    if (absl::Status st = group.Broadcast(data, 0); !st.ok()) {
      *broken = true;
      return absl::UnavailableError(absl::StrCat("weight sync of version ", req.version(),
                                                 " broke in bucket ", frames, ": ", st.message()));
    }
    if (!outcome.ok()) continue;
    torch::Tensor host = data[0].device().is_cpu() ? data[0] : data[0].to(torch::kCPU);
    outcome = cursor.Feed(static_cast<const char*>(host.data_ptr()), n);
  }
  RETURN_IF_ERROR(outcome);
  return cursor.Feed(nullptr, 0);  // zero-byte tensors at the end
}

}  // namespace

void WeightSyncReceiver::RunSync(opd::v1::SyncWeightsRequest req) {
  lm::SetThreadsForThisThread(1);  // copies only; the sampling threads keep the cores
  std::unique_ptr<StagedWeights> staged;
  lm::dist::ProcessGroup* group;
  std::string backend;
  {
    absl::MutexLock lock(&mu_);
    staged = std::move(pending_);
    group = group_.get();
    backend = backend_;
  }
  bool broken = false;
  const absl::Time t0 = absl::Now();
  absl::Status st = Receive(*group, backend == "nccl" ? device_ : torch::Device(torch::kCPU), req,
                            staged.get(), &broken);
  const absl::Time t1 = absl::Now();
  opd::v1::SyncWeightsResult result;
  if (st.ok()) {
    const int64_t tensors = staged->tensors_received(), bytes = staged->bytes_received();
    st = store_->Commit(std::move(staged));
    if (st.ok()) {
      result.mutable_applied()->set_version(req.version());
      result.mutable_applied()->set_tensors(tensors);
      result.mutable_applied()->set_bytes(bytes);
    }
  }
  staged.reset();  // a failed update's copy goes now
  result.set_code(static_cast<int>(st.code()));
  result.set_message(std::string(st.message()));
  {
    // Counted before the learner hears the verdict, so whoever it tells sees the count.
    absl::MutexLock lock(&mu_);
    ++stats_.syncs;
    stats_.last_sync = st;
  }
  if (!broken) {
    std::string bytes = result.SerializeAsString();
    if (absl::Status sent = group->BroadcastBytes(&bytes, 1); !sent.ok()) {
      broken = true;
      if (st.ok()) st = sent;  // committed, but the learner may not know
    }
  }
  if (st.ok())
    lm::log::Info(absl::StrCat("weight sync: serving version ", req.version(), " (",
                               result.applied().tensors(), " tensors, ", result.applied().bytes(),
                               " bytes; received in ", absl::FormatDuration(t1 - t0),
                               ", committed in ", absl::FormatDuration(absl::Now() - t1), ")"));
  else
    lm::log::Warn(absl::StrCat("weight sync of version ", req.version(), " failed",
                               broken ? " (weight group dropped)" : "", ": ", st.message()));
  std::unique_ptr<lm::dist::ProcessGroup> dropped;
  absl::MutexLock lock(&mu_);
  if (broken) dropped = std::move(group_);
  state_ = broken ? State::kNone : State::kReady;
  stats_.last_sync = st;
}

WeightSyncReceiver::Stats WeightSyncReceiver::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

bool WeightSyncReceiver::Await(int64_t joins, int64_t syncs, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto reached = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stats_.joins >= joins && stats_.syncs >= syncs;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
}

}  // namespace rollout
