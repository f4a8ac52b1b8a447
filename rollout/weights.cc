#include "rollout/weights.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lm/generate/sampler.h"
#include "lm/model/model.h"
#include "lm/model/placement.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "lm/util/threads.h"
#include "rpc/tensor_codec.h"

namespace rollout {

// What the store and its updates share (updates outlive no store: the store drops its pending
// one, and a stream's update is dropped with the stream).
struct StoreState {
  StoreState(std::shared_ptr<lm::CausalLM> m, int64_t v, WeightStoreOptions o)
      : model(std::move(m)), options(o), version(v) {}

  const std::shared_ptr<lm::CausalLM> model;  // the one copy of the weights, never replaced
  const WeightStoreOptions options;
  mutable absl::Mutex mu;
  int64_t version ABSL_GUARDED_BY(mu);  // serving
  std::shared_ptr<const lm::PackedWeight> lm_head ABSL_GUARDED_BY(mu);
  int64_t readers ABSL_GUARDED_BY(mu) = 0;  // snapshots alive (their leases)
  // An in-place update, or a commit's copy, is writing the parameters: Acquire waits.
  bool writing ABSL_GUARDED_BY(mu) = false;
  std::unique_ptr<StagedWeights> pending ABSL_GUARDED_BY(mu);
  absl::Status damage ABSL_GUARDED_BY(mu);  // why the weights are a mix of two versions
  bool stop ABSL_GUARDED_BY(mu) = false;
};

namespace {

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape.vec(), ", "), "]");
}

// Held by every copy of a snapshot; the last copy's end is the end of a reader.
class Lease {
 public:
  explicit Lease(std::shared_ptr<StoreState> s) : s_(std::move(s)) {}
  ~Lease() {
    absl::MutexLock lock(&s_->mu);
    --s_->readers;
  }

 private:
  std::shared_ptr<StoreState> s_;
};

Snapshot SnapshotLocked(const std::shared_ptr<StoreState>& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  ++s->readers;
  return Snapshot{s->model, s->version, s->lm_head, std::make_shared<const Lease>(s)};
}

absl::Status CheckVersion(int64_t version, int64_t accepted) {
  if (version >= kMaxWeightVersion)
    return absl::InvalidArgumentError(
        absl::StrCat("weight version ", version, " is not below 2^53 = ", kMaxWeightVersion,
                     ", the first version refused (rollout/weights.h)"));
  if (version > accepted) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("weight version ", version, " is not above the serving version ", accepted));
}

absl::Status PendingError(const StoreState& s) ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
  return absl::UnavailableError(absl::StrCat(
      "weight version ", s.pending->version(), " is accepted and waits for ", s.readers,
      " request(s) sampling with version ", s.version, " to end; push again after them"));
}

// A host tensor shaped and typed like `param`: page-locked when `param` is on CUDA, so that the
// commit's copies are DMA (the caching host allocator keeps the blocks for the next update).
torch::Tensor HostLike(const torch::Tensor& param) {
  auto o = torch::TensorOptions().dtype(param.scalar_type()).device(torch::kCPU);
  if (param.is_cuda()) o = o.pinned_memory(true);
  return torch::empty(param.sizes(), o);
}

// The bytes of a contiguous tensor, flat.
torch::Tensor ByteView(const torch::Tensor& t) {
  return t.reshape({-1}).view(torch::kUInt8);
}

}  // namespace

StagedWeights::StagedWeights(std::shared_ptr<StoreState> store, int64_t version,
                             int64_t base_version, bool in_place)
    : store_(std::move(store)),
      version_(version),
      base_version_(base_version),
      in_place_(in_place) {}

StagedWeights::~StagedWeights() {
  if (!in_place_ || settled_) return;
  // An in-place update that ends here never committed: whatever it wrote is a mix.
  const bool wrote = bytes_ > 0 || complete_ > 0;
  absl::MutexLock lock(&store_->mu);
  store_->writing = false;
  if (wrote) {
    store_->damage = absl::FailedPreconditionError(absl::StrCat(
        "the in-place update to weight version ", version_,
        " failed after it had written part of the weights (the worker serves a mix of versions ",
        store_->version, " and ", version_, "); push every tensor"));
    lm::log::Warn(std::string(store_->damage.message()));
  }
}

// The first chunk of a tensor fixes its wire dtype (announced updates: the announced one).
absl::Status StagedWeights::Begin(const std::string& name, Target& t, WireDtype dtype,
                                  const std::vector<int64_t>& shape, bool device_bytes) {
  if (shape != t.param.sizes().vec()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': shape ",
                                                   ShapeString(shape), ", the model's is ",
                                                   ShapeString(t.param.sizes())));
  }
  if (t.wire_dtype.has_value() && dtype != *t.wire_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': dtype ", WireDtypeName(dtype),
                     ", the manifest announced ", WireDtypeName(*t.wire_dtype)));
  }
  const torch::Dtype wire = opd::rpc::TorchDtype(dtype);
  if (in_place_ && wire != t.param.scalar_type())
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': dtype ", WireDtypeName(dtype),
        "; an in-place update takes the model's, ", opd::rpc::DtypeName(t.param.scalar_type())));
  if (device_bytes != (in_place_ && !t.param.device().is_cpu()))
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': ", device_bytes ? "device" : "host", " bytes for a ",
        in_place_ ? "" : "host-", "staged update of a model on ", t.param.device().str()));
  t.wire_dtype = dtype;
  t.total = t.param.numel() * opd::rpc::WireDtypeSize(dtype);
  if (!in_place_) {
    t.dst = HostLike(t.param);
    host_bytes_ += static_cast<int64_t>(t.dst.nbytes());
  }
  // Host bytes go straight into the destination in its own dtype; otherwise they gather in a
  // buffer that is cast once complete.
  if (!device_bytes && wire != t.dst.scalar_type())
    t.buffer = torch::empty({t.total}, torch::kUInt8);
  t.started = true;
  return absl::OkStatus();
}

absl::Status StagedWeights::Next(std::string_view name, const std::vector<int64_t>& shape,
                                 WireDtype dtype, int64_t offset, int64_t bytes, bool device_bytes,
                                 Target** target) {
  auto it = targets_.find(name);
  if (it == targets_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", std::string(name), "' is not a parameter of the model"));
  }
  const std::string& key = it->first;
  Target& t = it->second;
  if (!t.expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", key, "' is not in the update's manifest"));
  }
  if (key != current_) {
    if (!current_.empty()) {
      const Target& prev = targets_.find(current_)->second;
      if (prev.filled != prev.total) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", current_, "' ended after ",
                                                       prev.filled, " of ", prev.total, " bytes"));
      }
    }
    if (t.started) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", key, "' was sent twice"));
    }
    current_ = key;
    RETURN_IF_ERROR(Begin(key, t, dtype, shape, device_bytes));
  } else if (shape != t.param.sizes().vec() || dtype != t.wire_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", key, "': a chunk with shape ", ShapeString(shape), " and dtype ",
                     WireDtypeName(dtype), " after chunks with ", ShapeString(t.param.sizes()),
                     " and ", WireDtypeName(*t.wire_dtype)));
  }
  if (t.done) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", key, "' was already complete"));
  }
  if (offset != t.filled) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", key, "': chunk at byte ", offset, ", expected byte ", t.filled));
  }
  if (t.filled + bytes > t.total) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", key, "': ", t.filled + bytes, " bytes, more than its ", t.total));
  }
  *target = &t;
  return absl::OkStatus();
}

absl::Status StagedWeights::Finish(const std::string& name, Target& t) {
  ++complete_;
  t.done = true;
  if (t.checksum.has_value()) {
    const uint64_t got = t.hash.Digest();
    if (got != *t.checksum) {
      return absl::DataLossError(absl::StrFormat(
          "tensor '%s': its %d bytes have checksum %016x, the manifest announced %016x", name,
          t.total, got, *t.checksum));
    }
  }
  if (t.buffer.defined()) {
    torch::NoGradGuard no_grad;
    t.dst.copy_(t.buffer.view(opd::rpc::TorchDtype(*t.wire_dtype)).view(t.dst.sizes()));
    t.buffer = torch::Tensor();
  }
  // On the device, every tensor is checked at once in CheckComplete (one synchronisation).
  return t.dst.device().is_cpu() ? CheckFinite(name, t) : absl::OkStatus();
}

// Weights with a NaN or an infinity make every log-prob sampled from them NaN: such an update is
// refused whole. Checked in the model's dtype, so that a wire value the cast overflows (an fp32
// 1e5 into float16) counts too.
absl::Status StagedWeights::CheckFinite(const std::string& name, const Target& t) {
  torch::NoGradGuard no_grad;
  if (!t.dst.is_floating_point() || torch::isfinite(t.dst).all().item<bool>())
    return absl::OkStatus();
  const int64_t bad = torch::isfinite(t.dst).logical_not().sum().item<int64_t>();
  const std::string model_dtype = opd::rpc::DtypeName(t.dst.scalar_type());
  const std::string wire_dtype = WireDtypeName(*t.wire_dtype);
  return absl::InvalidArgumentError(
      absl::StrCat("tensor '", name, "': ", bad, " of its ", t.dst.numel(),
                   " values are not finite (NaN or infinity)",
                   wire_dtype == model_dtype
                       ? ""
                       : absl::StrCat(" after the cast from ", wire_dtype, " to ", model_dtype),
                   "; the update is refused and the serving weights stay"));
}

// The device tensors of an in-place update, counted on the device and read once; the names only
// when something is wrong.
absl::Status StagedWeights::CheckDeviceFinite() const {
  torch::NoGradGuard no_grad;
  torch::Tensor bad;
  for (const auto& [name, t] : targets_) {
    if (!t.expected || !t.done || t.dst.device().is_cpu() || !t.dst.is_floating_point()) continue;
    torch::Tensor n = torch::isfinite(t.dst).logical_not().sum();
    bad = bad.defined() ? bad + n : n;
  }
  if (!bad.defined() || bad.item<int64_t>() == 0) return absl::OkStatus();
  for (const auto& [name, t] : targets_) {
    if (!t.expected || !t.done || t.dst.device().is_cpu() || !t.dst.is_floating_point()) continue;
    RETURN_IF_ERROR(CheckFinite(name, t));
  }
  return absl::OkStatus();
}

absl::Status StagedWeights::Add(const WireTensor& chunk) {
  Target* t = nullptr;
  RETURN_IF_ERROR(Next(chunk.name, chunk.shape, chunk.dtype, chunk.offset,
                       static_cast<int64_t>(chunk.data.size()), false, &t));
  if (!chunk.data.empty()) {
    char* dst = static_cast<char*>(t->buffer.defined() ? t->buffer.data_ptr() : t->dst.data_ptr());
    std::memcpy(dst + t->filled, chunk.data.data(), chunk.data.size());
    if (t->checksum.has_value()) t->hash.Update(chunk.data.data(), chunk.data.size());
  }
  t->filled += static_cast<int64_t>(chunk.data.size());
  bytes_ += static_cast<int64_t>(chunk.data.size());
  if (t->filled == t->total) return Finish(current_, *t);
  return absl::OkStatus();
}

absl::Status StagedWeights::AddDeviceBytes(std::string_view name, int64_t offset,
                                           const torch::Tensor& bytes) {
  auto it = targets_.find(name);
  if (it == targets_.end())
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", std::string(name), "' is not a parameter of the model"));
  Target* t = nullptr;
  // Unannounced, device bytes are the model's own (an in-place update takes no other dtype).
  auto dtype = it->second.wire_dtype.has_value()
                   ? absl::StatusOr<WireDtype>(*it->second.wire_dtype)
                   : opd::rpc::WireDtypeOf(it->second.param.scalar_type());
  if (!dtype.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", it->first, "': ", dtype.status().message()));
  RETURN_IF_ERROR(
      Next(name, it->second.param.sizes().vec(), *dtype, offset, bytes.numel(), true, &t));
  if (t->checksum.has_value())
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", it->first, "': a checksum was announced; device bytes carry none"));
  if (bytes.numel() > 0) {
    torch::NoGradGuard no_grad;
    ByteView(t->dst).narrow(0, t->filled, bytes.numel()).copy_(bytes, /*non_blocking=*/true);
  }
  t->filled += bytes.numel();
  bytes_ += bytes.numel();
  if (t->filled == t->total) return Finish(it->first, *t);
  return absl::OkStatus();
}

absl::Status StagedWeights::CheckComplete() {
  std::vector<std::string> missing;
  size_t expected = 0;
  for (const auto& [name, t] : targets_) {
    if (!t.expected) continue;
    ++expected;
    if (!t.started || t.filled != t.total) missing.push_back(name);
  }
  if (missing.empty()) return in_place_ ? CheckDeviceFinite() : absl::OkStatus();
  const size_t shown = std::min<size_t>(missing.size(), 5);
  return absl::InvalidArgumentError(
      absl::StrCat(missing.size(), " of ", expected, " tensors missing or incomplete: ",
                   absl::StrJoin(missing.begin(), missing.begin() + shown, ", "),
                   missing.size() > shown ? ", ..." : ""));
}

// Host-to-device copies on a stream of the copying thread's own (the decode steps' stream is not
// blocked behind them), then one synchronisation. On the CPU a plain copy.
void StagedWeights::CopyIntoPlace() {
  torch::NoGradGuard no_grad;
  const torch::Device device = store_->model->LmHeadWeight().device();
  std::optional<c10::Stream> side;
  std::optional<c10::StreamGuard> on_side;
  if (!device.is_cpu()) {
    const c10::impl::VirtualGuardImpl impl(device.type());
    side = impl.getStreamFromGlobalPool(device);
    on_side.emplace(*side);
  }
  for (auto& [name, t] : targets_) {
    if (!t.expected || !t.dst.defined() || t.dst.is_same(t.param)) continue;
    t.param.copy_(t.dst, /*non_blocking=*/!device.is_cpu());
  }
  if (side) side->synchronize();
}

bool StagedWeights::TouchesLmHead() const {
  const void* head = store_->model->LmHeadWeight().data_ptr();
  for (const auto& [name, t] : targets_)
    if (t.expected && t.param.data_ptr() == head) return true;
  return false;
}

WeightStore::WeightStore(std::shared_ptr<lm::CausalLM> model, int64_t version,
                         WeightStoreOptions options)
    : state_(std::make_shared<StoreState>(std::move(model), version, options)) {
  auto head = lm::PackLmHead(*state_->model);
  {
    absl::MutexLock lock(&state_->mu);
    state_->lm_head = std::move(head);
  }
  if (options.commit == WeightStoreOptions::Commit::kAfterReaders)
    committer_ = std::thread([this] { CommitLoop(); });
}

WeightStore::~WeightStore() {
  std::unique_ptr<StagedWeights> dropped;  // its destructor takes the lock
  {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;
    dropped = std::move(state_->pending);
  }
  if (committer_.joinable()) committer_.join();
}

Snapshot WeightStore::Current() const {
  absl::MutexLock lock(&state_->mu);
  return SnapshotLocked(state_);
}

absl::StatusOr<Snapshot> WeightStore::Acquire(absl::Time deadline) const {
  StoreState& s = *state_;
  absl::MutexLock lock(&s.mu);
  auto ready = [&s]() ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
    return s.stop || (!s.writing && s.pending == nullptr);
  };
  if (!s.mu.AwaitWithDeadline(absl::Condition(&ready), deadline))
    return absl::UnavailableError(
        absl::StrCat("the request's deadline passed while weight version ",
                     s.pending ? s.pending->version() : s.version + 1, " was being ",
                     s.pending ? "committed" : "written", " (", s.readers,
                     " request(s) still sampling with version ", s.version, ")"));
  if (!s.damage.ok()) return s.damage;
  return SnapshotLocked(state_);
}

int64_t WeightStore::accepted_version() const {
  absl::MutexLock lock(&state_->mu);
  return state_->pending ? state_->pending->version() : state_->version;
}

absl::Status WeightStore::damage() const {
  absl::MutexLock lock(&state_->mu);
  return state_->damage;
}

bool WeightStore::AwaitNoPending(absl::Duration timeout) const {
  StoreState& s = *state_;
  absl::MutexLock lock(&s.mu);
  auto done = [&s]()
                  ABSL_SHARED_LOCKS_REQUIRED(s.mu) { return s.pending == nullptr && !s.writing; };
  return s.mu.AwaitWithTimeout(absl::Condition(&done), timeout);
}

absl::StatusOr<std::unique_ptr<StagedWeights>> WeightStore::Stage(int64_t version) const {
  return StageUpdate(version, nullptr, false);
}

absl::StatusOr<std::unique_ptr<StagedWeights>> WeightStore::StageAnnounced(
    int64_t version, const opd::v1::WeightManifest& manifest) const {
  return StageUpdate(version, &manifest, false);
}

absl::StatusOr<std::unique_ptr<StagedWeights>> WeightStore::StageInPlace(
    int64_t version, const opd::v1::WeightManifest& manifest) const {
  return StageUpdate(version, &manifest, true);
}

absl::StatusOr<std::unique_ptr<StagedWeights>> WeightStore::StageUpdate(
    int64_t version, const opd::v1::WeightManifest* manifest, bool in_place) const {
  StoreState& s = *state_;
  // Everything is checked against the model before anything is allocated.
  std::map<std::string, torch::Tensor, std::less<>> params;
  opd::rpc::ParamShapes shapes;
  for (const auto& p : s.model->named_parameters()) {
    params[p.key()] = p.value();
    shapes[p.key()] = p.value().sizes().vec();
  }
  opd::rpc::Announcement announced;  // a full update announces nothing
  if (manifest) {
    ASSIGN_OR_RETURN(announced, opd::rpc::ReadManifest(*manifest, shapes));
  }
  // Without a base, the update does not start from a given version (full, or all announced).
  const bool has_base = announced.base_version.has_value();
  const int64_t base_version = announced.base_version.value_or(0);
  const bool full = !manifest || (!has_base && announced.tensors.size() == params.size());
  int64_t serving = 0;
  {
    absl::MutexLock lock(&s.mu);
    auto not_writing = [&s]() ABSL_SHARED_LOCKS_REQUIRED(s.mu) { return !s.writing || s.stop; };
    s.mu.AwaitWithTimeout(absl::Condition(&not_writing), s.options.writer_wait);
    serving = s.version;
    RETURN_IF_ERROR(CheckVersion(version, s.pending ? s.pending->version() : s.version));
    if (s.pending) return PendingError(s);
    if (s.writing)
      return absl::UnavailableError(
          absl::StrCat("weight version ", version, ": an update is being written in place"));
    if (has_base && base_version != s.version)
      return absl::FailedPreconditionError(
          absl::StrCat("weight version ", version, " updates version ", base_version,
                       ", but version ", s.version, " is serving (send every tensor)"));
    if (!s.damage.ok() && !full)
      return absl::FailedPreconditionError(absl::StrCat(
          "weight version ", version, ": ", s.damage.message(), " (send every tensor)"));
    if (in_place && s.readers > 0)
      return absl::FailedPreconditionError(absl::StrCat(
          "weight version ", version, ": the serving weights are in use by ", s.readers,
          " snapshot(s); an in-place update needs none (stage it in host memory)"));
    if (in_place) s.writing = true;
  }
  // From here an in-place update owns the weights; dropping it gives them back.
  auto staged = std::unique_ptr<StagedWeights>(
      new StagedWeights(state_, version, has_base ? serving : -1, in_place));
  staged->expected_bytes_ = manifest ? announced.bytes : -1;
  staged->full_ = full;
  for (auto& [name, p] : params) {
    if (!p.is_contiguous())
      return absl::InternalError(absl::StrCat("parameter '", name, "' is not contiguous"));
    StagedWeights::Target& t = staged->targets_[name];
    t.param = p;
    t.dst = in_place ? p : torch::Tensor();
    t.expected = manifest == nullptr;
  }
  for (const WireTensor& a : announced.tensors) {
    StagedWeights::Target& t = staged->targets_.at(a.name);
    t.expected = true;
    t.checksum = a.checksum;
    t.wire_dtype = a.dtype;
  }
  return staged;
}

absl::Status WeightStore::Commit(std::unique_ptr<StagedWeights> staged, CommitState* state) {
  RETURN_IF_ERROR(staged->CheckComplete());  // an in-place update dropped here: damaged
  StoreState& s = *state_;
  bool apply_now = staged->in_place();
  {
    absl::MutexLock lock(&s.mu);
    if (s.pending) return PendingError(s);
    RETURN_IF_ERROR(CheckVersion(staged->version(), s.version));
    if (staged->base_version_ >= 0 && staged->base_version_ != s.version)
      return absl::FailedPreconditionError(
          absl::StrCat("weight version ", staged->version(), " updates version ",
                       staged->base_version_, ", but version ", s.version,
                       " was committed meanwhile (its unsent tensors would be stale)"));
    if (!staged->in_place()) {
      if (s.writing)
        return absl::UnavailableError(absl::StrCat("weight version ", staged->version(),
                                                   ": an update is being written in place"));
      apply_now = s.options.commit == WeightStoreOptions::Commit::kAtOnce || s.readers == 0;
      if (apply_now) {
        s.writing = true;
      } else {
        lm::log::Info(absl::StrCat("weight version ", staged->version(),
                                   " accepted; it serves once the ", s.readers,
                                   " request(s) sampling with version ", s.version, " end"));
        s.pending = std::move(staged);
        if (state) *state = CommitState::kPending;
        return absl::OkStatus();
      }
    }
  }
  // This thread writes the weights now (Acquire waits; no lease of them is alive, or the caller
  // vouches that nothing computes with them).
  absl::Status applied = Apply(*staged);
  staged->settled_ = true;
  if (state) *state = CommitState::kServing;
  return applied;
}

// Copies a host-staged update into place (nothing to copy for an in-place one), then publishes
// the version; `writing` is held by the caller and released here.
absl::Status WeightStore::Apply(StagedWeights& staged) {
  StoreState& s = *state_;
  const bool head_changed = staged.TouchesLmHead();
  absl::Status st;
  try {
    staged.CopyIntoPlace();
  } catch (const std::exception& e) {  // LibTorch reports device failures by throwing
    st = absl::InternalError(absl::StrCat("copying weight version ", staged.version(),
                                          " into place failed: ", e.what()));
  }
  std::shared_ptr<const lm::PackedWeight> head;
  if (st.ok() && head_changed) head = lm::PackLmHead(*s.model);
  std::shared_ptr<const lm::PackedWeight> old_head;  // released outside the lock
  absl::MutexLock lock(&s.mu);
  s.writing = false;
  if (!st.ok()) {
    s.damage = absl::FailedPreconditionError(
        absl::StrCat(st.message(), " (the worker serves a mix of versions ", s.version, " and ",
                     staged.version(), "); push every tensor"));
    lm::log::Warn(std::string(s.damage.message()));
    return st;
  }
  if (staged.full_) s.damage = absl::OkStatus();
  s.version = staged.version();
  if (head_changed) {
    old_head = std::move(s.lm_head);
    s.lm_head = std::move(head);
  }
  return absl::OkStatus();
}

void WeightStore::CommitLoop() {
  StoreState& s = *state_;
  lm::BindThreadToDevice(s.model->LmHeadWeight().device());
  lm::SetThreadsForThisThread(1);  // copies only; the sampling threads keep the cores
  for (;;) {
    std::unique_ptr<StagedWeights> staged;
    {
      absl::MutexLock lock(&s.mu);
      auto ready = [&s]() ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
        return s.stop || (s.pending != nullptr && s.readers == 0);
      };
      s.mu.Await(absl::Condition(&ready));
      if (s.stop) return;
      staged = std::move(s.pending);
      s.writing = true;  // Acquire keeps waiting, now for the copy
    }
    const int64_t version = staged->version();
    const absl::Time t0 = absl::Now();
    absl::Status st = Apply(*staged);
    staged->settled_ = true;
    if (st.ok())
      lm::log::Info(absl::StrCat("weight version ", version, " serving (copied into place in ",
                                 absl::FormatDuration(absl::Now() - t0), ")"));
    staged.reset();  // its host copy goes now
  }
}

}  // namespace rollout
