#include "rollout/weight_sync.h"

#include <optional>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/dist/process_group.h"
#include "lm/model/model.h"
#include "lm/model/placement.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "lm/util/threads.h"
#include "rpc/tensor_codec.h"

namespace rollout {
namespace {

constexpr int64_t kMaxBucketBytes = int64_t{1} << 30;
constexpr double kMaxTimeoutS = 24 * 3600;

constexpr int kMaxWorld = 1 << 16;

// Places the concatenated wire bytes of the announced tensors, as they arrive, into the staged
// update (one piece per tensor piece), in manifest order: device bytes straight into an in-place
// update's parameters, host bytes (or device bytes copied to the host once per bucket) into a
// host-staged one. Without an update (it could not be staged) the bytes are dropped.
class StreamPlacer {
 public:
  // `device_model`: the model is on a device (not the CPU).
  // `tensors`: the manifest's, checked (it outlives this).
  StreamPlacer(const std::vector<WireTensor>& tensors, StagedWeights* staged, bool device_model)
      : tensors_(tensors),
        staged_(staged),
        to_device_(staged && staged->in_place() && device_model) {
    for (const WireTensor& t : tensors) {
      int64_t n = opd::rpc::WireDtypeSize(t.dtype);
      for (int64_t d : t.shape) n *= d;
      bytes_.push_back(n);
    }
  }

  // The next bytes.numel() bytes of the stream (uint8, contiguous, on the CPU or the device).
  absl::Status Place(const torch::Tensor& bytes) {
    if (staged_ == nullptr) return absl::OkStatus();
    if (to_device_ && bytes.device().is_cpu())
      return absl::InternalError("host bytes for an update written in place on the device");
    // A host-staged update from a device bucket: one copy to the host per bucket.
    const torch::Tensor host =
        to_device_ || bytes.device().is_cpu() ? bytes : bytes.to(torch::kCPU);
    const char* data = to_device_ ? nullptr : static_cast<const char*>(host.data_ptr());
    int64_t at = 0, n = bytes.numel();
    for (;;) {
      RETURN_IF_ERROR(SkipComplete());
      if (n == 0) return absl::OkStatus();
      if (i_ == bytes_.size())
        return absl::InvalidArgumentError(
            "the broadcast carries more bytes than the manifest's tensors add up to");
      const int64_t take = std::min(n, bytes_[i_] - off_);
      RETURN_IF_ERROR(to_device_ ? staged_->AddDeviceBytes(Name(), off_, bytes.narrow(0, at, take))
                                 : AddHost(data + at, take));
      off_ += take;
      at += take;
      n -= take;
    }
  }
  // Zero-byte tensors at the end get their (empty) piece.
  absl::Status Finish() { return staged_ == nullptr ? absl::OkStatus() : SkipComplete(); }

 private:
  const std::string& Name() const { return tensors_[i_].name; }

  // Past complete tensors; zero-byte ones still get their (empty) piece.
  absl::Status SkipComplete() {
    while (i_ < bytes_.size() && off_ == bytes_[i_]) {
      if (bytes_[i_] == 0) RETURN_IF_ERROR(AddHost(nullptr, 0));
      ++i_;
      off_ = 0;
    }
    return absl::OkStatus();
  }

  absl::Status AddHost(const char* data, int64_t n) {
    if (to_device_) return staged_->AddDeviceBytes(Name(), off_, torch::empty({0}, torch::kUInt8));
    WireTensor piece = tensors_[i_];
    piece.offset = off_;
    piece.data = std::string_view(data, static_cast<size_t>(n));
    return staged_->Add(piece);
  }

  const std::vector<WireTensor>& tensors_;
  StagedWeights* staged_;
  const bool to_device_;  // bytes go into the parameters on the device (AddDeviceBytes)
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
  // The two-rank group (world_size 0): learner rank 0 and this worker, the backend ours to pick.
  Membership m{1, 2, req.learner_cuda() && device_.is_cuda() ? "nccl" : "gloo"};
  if (req.world_size() != 0) {
    if (req.world_size() < 2 || req.world_size() > kMaxWorld)
      return absl::InvalidArgumentError(
          absl::StrCat("world_size ", req.world_size(), " is not in [2, ", kMaxWorld, "]"));
    if (req.rank() < 1 || req.rank() >= req.world_size())
      return absl::InvalidArgumentError(absl::StrCat("rank ", req.rank(), " is not in [1, ",
                                                     req.world_size(), ") (rank 0 is a learner)"));
    if (req.backend() != "gloo" && req.backend() != "nccl")
      return absl::InvalidArgumentError(
          absl::StrCat("backend '", req.backend(), "' is neither gloo nor nccl"));
    if (req.backend() == "nccl" && !device_.is_cuda())
      return absl::FailedPreconditionError(absl::StrCat("backend nccl: this worker's model is on ",
                                                        device_.str(), ", not on a CUDA device"));
    m = Membership{req.rank(), req.world_size(), req.backend()};
  }
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
    member_ = m;
    parallel_ = req.world_size() != 0;
    timeout_ = absl::Seconds(req.timeout_s());
  }
  old.reset();
  Launch([this, req, m] { RunJoin(req, m); });
  opd::v1::JoinWeightGroupResponse resp;
  resp.set_backend(m.backend);
  resp.set_device(device_.str());
  return resp;
}

void WeightSyncReceiver::RunJoin(opd::v1::JoinWeightGroupRequest req, Membership m) {
  lm::dist::LaunchEnv env{m.rank, m.world, 0, req.store_host(), req.store_port()};
  lm::dist::GroupOptions o;
  o.timeout = absl::Seconds(req.timeout_s());
  o.backend = m.backend;
  auto group = lm::dist::ProcessGroup::Create(
      env, m.backend == "nccl" ? device_ : torch::Device(torch::kCPU), o);
  absl::Status st = group.status();
  if (!st.ok())
    lm::log::Warn(absl::StrCat("weight group '", req.group_id(), "' did not form: ", st.message()));
  else
    lm::log::Info(absl::StrCat("joined weight group '", req.group_id(), "' (", m.backend, ", rank ",
                               m.rank, " of ", m.world, ") at ", req.store_host(), ":",
                               req.store_port()));
  absl::MutexLock lock(&mu_);
  if (st.ok()) group_ = std::move(*group);
  state_ = st.ok() ? State::kReady : State::kNone;
  ++stats_.joins;
  stats_.last_join = st;
}

namespace {

// The parallel push's shares: one per learner rank (ranks 0..L-1, below ours), adding up to the
// manifest's bytes.
absl::Status CheckShares(const opd::v1::SyncWeightsRequest& req, int rank, int64_t bytes) {
  const int64_t senders = req.sender_bytes_size();
  if (senders >= rank + 1 || senders < 1)
    return absl::InvalidArgumentError(absl::StrCat(senders,
                                                   " senders in sender_bytes; this worker is rank ",
                                                   rank, " and the learner ranks come first"));
  int64_t sum = 0;
  for (int64_t b : req.sender_bytes()) {
    if (b < 0 || b > bytes)
      return absl::InvalidArgumentError(
          absl::StrCat("sender_bytes entry ", b, " is not in [0, ", bytes, "]"));
    sum += b;
  }
  if (sum != bytes)
    return absl::InvalidArgumentError(
        absl::StrCat("sender_bytes add up to ", sum, " bytes; the manifest's tensors are ", bytes));
  return absl::OkStatus();
}

}  // namespace

// Where a parallel update goes (rollout/weights.h): into place when nothing holds the weights
// and the buckets arrive where the model is; else staged in host memory.
absl::StatusOr<std::unique_ptr<StagedWeights>> WeightSyncReceiver::StageParallel(
    const opd::v1::SyncWeightsRequest& req, const std::string& backend) {
  const bool buckets_on_model_device = (backend == "nccl") == device_.is_cuda();
  if (buckets_on_model_device) {
    auto in_place = store_->StageInPlace(req.version(), req.manifest());
    if (in_place.ok() || in_place.status().code() == absl::StatusCode::kInvalidArgument)
      return in_place;
  }
  return store_->StageAnnounced(req.version(), req.manifest());
}

absl::StatusOr<opd::v1::SyncWeightsResponse> WeightSyncReceiver::Start(
    const opd::v1::SyncWeightsRequest& req) {
  const int64_t b = req.bucket_bytes();
  if (b < 8 || b % 8 != 0 || b > kMaxBucketBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("bucket_bytes ", b, " is not a multiple of 8 in [8, ", kMaxBucketBytes, "]"));
  Membership m;
  bool parallel = false;
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
    m = member_;
    parallel = parallel_;
    if (parallel != (req.sender_bytes_size() > 0))
      return absl::InvalidArgumentError(
          parallel ? "sender_bytes is empty in a group of every learner rank"
                   : "sender_bytes is set in a two-rank group (join with world_size)");
    state_ = State::kSyncing;  // reserved while the update is staged
  }
  auto release = [this](absl::Status st) {
    absl::MutexLock lock(&mu_);
    state_ = State::kReady;
    return st;
  };
  opd::rpc::ParamShapes shapes;
  for (const auto& p : store_->Current().model->named_parameters())
    shapes[p.key()] = p.value().sizes().vec();
  auto announced = opd::rpc::ReadManifest(req.manifest(), shapes);
  if (!announced.ok()) return release(announced.status());
  const int64_t bytes = announced->bytes;
  absl::StatusOr<std::unique_ptr<StagedWeights>> staged;
  if (parallel) {
    if (absl::Status st = CheckShares(req, m.rank, bytes); !st.ok()) return release(st);
    // A worker that cannot take this version still follows the broadcasts (every member of the
    // group must) and says why in its verdict.
    staged = StageParallel(req, m.backend);
    if (!staged.ok() && staged.status().code() == absl::StatusCode::kInvalidArgument)
      return release(staged.status());
  } else {
    staged = store_->StageAnnounced(req.version(), req.manifest());
    if (!staged.ok()) return release(staged.status());
  }
  opd::v1::SyncWeightsResponse resp;
  resp.set_bytes(bytes);
  {
    absl::MutexLock lock(&mu_);
    pending_ = staged.ok() ? std::move(*staged) : nullptr;
    pending_error_ = staged.status();
  }
  Launch([this, req, tensors = std::move(announced->tensors)] { RunSync(req, tensors); });
  return resp;
}

namespace {

// The two-rank data phase (rollout.proto, SyncWeightsRequest): frames until the empty one, each
// fed into the staged update. A bad tensor does not stop the reception (the learner keeps
// broadcasting; both sides stay in step), it is the outcome. Returns the outcome; `broken` says
// whether a collective failed (the group is then unusable, and nobody is left to tell).
absl::Status Receive(lm::dist::ProcessGroup& group, torch::Device device,
                     const opd::v1::SyncWeightsRequest& req, const std::vector<WireTensor>& tensors,
                     StagedWeights* staged, bool* broken) {
  StreamPlacer placer(tensors, staged, /*device_model=*/false);  // host-staged
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
    if (outcome.ok()) outcome = placer.Place(data[0]);
  }
  RETURN_IF_ERROR(outcome);
  return placer.Finish();
}

// The parallel data phase: each learner rank's share, in rank order, in buckets of
// min(bucket_bytes, what is left), every one into the staged update as it lands (on the device,
// the copies are queued behind the broadcast on the receiving thread's stream; the next broadcast
// into the same bucket waits for them: no synchronisation per tensor).
absl::Status ReceiveShares(lm::dist::ProcessGroup& group, torch::Device device, bool device_model,
                           const opd::v1::SyncWeightsRequest& req,
                           const std::vector<WireTensor>& tensors, StagedWeights* staged,
                           absl::Status outcome, bool* broken) {
  StreamPlacer placer(tensors, staged, device_model);
  int64_t largest = 0;
  for (int64_t b : req.sender_bytes()) largest = std::max(largest, b);
  torch::Tensor bucket = torch::empty({std::min(req.bucket_bytes(), std::max<int64_t>(largest, 1))},
                                      torch::TensorOptions().device(device).dtype(torch::kUInt8));
  int64_t buckets = 0;
  for (int r = 0; r < req.sender_bytes_size(); ++r) {
    for (int64_t left = req.sender_bytes(r); left > 0; ++buckets) {
      const int64_t n = std::min(left, bucket.numel());
      std::vector<torch::Tensor> data{bucket.narrow(0, 0, n)};
      if (absl::Status st = group.Broadcast(data, r); !st.ok()) {
        *broken = true;
        return absl::UnavailableError(absl::StrCat("weight sync of version ", req.version(),
                                                   " broke in bucket ", buckets, " (from rank ", r,
                                                   "): ", st.message()));
      }
      if (outcome.ok()) outcome = placer.Place(data[0]);
      left -= n;
    }
  }
  RETURN_IF_ERROR(outcome);
  return placer.Finish();
}

// Commits a received update and logs what serves now; `applied` says what that is.
absl::Status CommitReceived(WeightStore& store, int64_t version,
                            std::unique_ptr<StagedWeights> staged, absl::Duration received_in,
                            opd::v1::UpdateWeightsResponse* applied) {
  const int64_t tensors = staged->tensors_received(), bytes = staged->bytes_received();
  const bool in_place = staged->in_place();
  const absl::Time t0 = absl::Now();
  CommitState state = CommitState::kServing;
  RETURN_IF_ERROR(store.Commit(std::move(staged), &state));
  applied->set_version(version);
  applied->set_tensors(tensors);
  applied->set_bytes(bytes);
  lm::log::Info(absl::StrCat(
      "weight sync: version ", version,
      state == CommitState::kPending ? " accepted (serves once the requests on the old one end)"
                                     : " serving",
      " (", tensors, " tensors, ", bytes, " bytes ", in_place ? "written in place" : "staged",
      "; received in ", absl::FormatDuration(received_in), ", committed in ",
      absl::FormatDuration(absl::Now() - t0), ")"));
  return absl::OkStatus();
}

}  // namespace

void WeightSyncReceiver::RunSync(const opd::v1::SyncWeightsRequest& req,
                                 const std::vector<WireTensor>& tensors) {
  lm::SetThreadsForThisThread(1);  // copies only; the sampling threads keep the cores
  std::unique_ptr<StagedWeights> staged;
  absl::Status staging;
  lm::dist::ProcessGroup* group;
  Membership m;
  bool parallel = false;
  {
    absl::MutexLock lock(&mu_);
    staged = std::move(pending_);
    staging = pending_error_;
    group = group_.get();
    m = member_;
    parallel = parallel_;
  }
  bool broken = false;
  const torch::Device on = m.backend == "nccl" ? device_ : torch::Device(torch::kCPU);
  // On CUDA the copies out of each bucket (into the parameters, or to the host) run on a stream of
  // their own, not the decode steps': c10d orders the NCCL stream after it before each broadcast
  // into the bucket and it after the NCCL stream before the copies, and the finiteness check's
  // one read at the end waits for all of them.
  std::optional<c10::StreamGuard> side;
  if (device_.is_cuda())
    side.emplace(c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_));
  const absl::Time t0 = absl::Now();
  absl::Status st = parallel ? ReceiveShares(*group, on, device_.is_cuda(), req, tensors,
                                             staged.get(), staging, &broken)
                             : Receive(*group, on, req, tensors, staged.get(), &broken);
  opd::v1::UpdateWeightsResponse applied;
  if (st.ok())
    st = CommitReceived(*store_, req.version(), std::move(staged), absl::Now() - t0, &applied);
  staged.reset();  // a failed update's copy goes now (an in-place one leaves the store damaged)
  {
    // Counted before the learner hears the verdict, so whoever it tells sees the count.
    absl::MutexLock lock(&mu_);
    ++stats_.syncs;
    stats_.last_sync = st;
  }
  if (!broken) {
    if (absl::Status sent = TellLearners(*group, on, m, parallel, st, applied); !sent.ok()) {
      broken = true;
      if (st.ok()) st = sent;  // committed, but the learner may not know
    }
  }
  if (!st.ok())
    lm::log::Warn(absl::StrCat("weight sync of version ", req.version(), " failed",
                               broken ? " (weight group dropped)" : "", ": ", st.message()));
  std::unique_ptr<lm::dist::ProcessGroup> dropped;
  absl::MutexLock lock(&mu_);
  if (broken) dropped = std::move(group_);
  state_ = broken ? State::kNone : State::kReady;
  stats_.last_sync = st;
}

// The outcome, as each protocol tells it: the parallel push's closing all-gather of verdicts, or
// the two-rank group's serialized result from rank 1.
absl::Status WeightSyncReceiver::TellLearners(lm::dist::ProcessGroup& group, torch::Device on,
                                              const Membership& m, bool parallel,
                                              const absl::Status& outcome,
                                              const opd::v1::UpdateWeightsResponse& applied) {
  if (parallel) {
    opd::rpc::SyncVerdict verdict;
    verdict.present = true;
    verdict.code = static_cast<int32_t>(outcome.code());
    verdict.message = std::string(outcome.message());
    verdict.version = applied.version();
    verdict.tensors = applied.tensors();
    verdict.bytes = applied.bytes();
    return ShareVerdict(group, on, m, verdict);
  }
  opd::v1::SyncWeightsResult result;
  result.set_code(static_cast<int>(outcome.code()));
  result.set_message(std::string(outcome.message()));
  if (outcome.ok()) *result.mutable_applied() = applied;
  std::string bytes = result.SerializeAsString();
  return group.BroadcastBytes(&bytes, 1);
}

// The closing all-gather of the parallel push: every member's fixed record, ours the verdict.
absl::Status WeightSyncReceiver::ShareVerdict(lm::dist::ProcessGroup& group, torch::Device on,
                                              const Membership& m,
                                              const opd::rpc::SyncVerdict& verdict) {
  torch::Tensor mine = torch::empty({opd::rpc::kVerdictBytes}, torch::kUInt8);
  opd::rpc::EncodeVerdict(verdict, mine.data_ptr<uint8_t>());
  torch::Tensor all = torch::empty({opd::rpc::kVerdictBytes * m.world},
                                   torch::TensorOptions().device(on).dtype(torch::kUInt8));
  const torch::Tensor in = mine.to(on);
  return group.AllGather(all, in);
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
