// The rollout worker's model, versioned: one copy of the weights on the device, updated in place.
//
// Requests take a Snapshot (the model, its version, its packed LM head and a lease) and keep it
// for their whole duration; the lease tells the store that the serving weights are in use. An
// update is received into a staging area, checked whole (every announced tensor: name, shape,
// dtype, each byte exactly once, the announced checksum when there is one, finite values in the
// model's dtype) and only then committed: copied into the serving parameters once no lease of
// the serving version is alive. So a request samples with one version from its first token to its
// last, never a mix, and an update that fails or is interrupted (its StagedWeights is dropped)
// changes nothing.
//
// Where an update waits (docs/weight-sync.md has the arithmetic for Marco-Nano and Marco-Mini):
//   - host staging (Stage, StageAnnounced): the announced tensors in the model's dtype in host
//     memory, page-locked when the model is on CUDA so that the commit's copies are DMA. The
//     device holds no second model (the old design staged a whole second model there: 15 GiB for
//     Marco-Nano, 32 GiB for Marco-Mini, taken from the KV pool). Requests keep sampling with the
//     serving version while the update arrives (one-step-off: the next step's sampling runs
//     during the push); the commit is one host-to-device copy per tensor on a stream of its own
//     and one synchronisation, about 0.3 s for Marco-Nano at 50 GB/s.
//   - in place (StageInPlace, rollout/weight_sync.h): when no request holds the serving weights
//     (a synchronous step: the push comes after the step's sampling ended), the collective
//     receive writes each bucket straight into the parameters on the device: no staging at all.
//     New requests wait until it ends. A receive that fails half-way has overwritten part of the
//     weights: the store is then *damaged* (Acquire refuses every request, naming the failed
//     version) until an update of every tensor arrives, and the failure is reported to the pusher.
//
// The commit of a host-staged update: with no lease of the serving version alive it is applied at
// once; otherwise it becomes the one *pending* update, applied by the store's commit thread when
// the last such lease ends, and Acquire (what a new request calls) waits for it, so that the
// requests after a push sample with the new version (the learner checks that) and the pending
// update is never starved. A second update while one is pending is UNAVAILABLE.
//
// Two kinds of update: a full one (every parameter) and an announced one (a manifest names exactly
// the tensors that come, with their checksums; the others keep their serving values, and the
// update commits only onto the version it was staged from). Tensors may arrive in another dtype
// than the model's (an fp32 learner pushing to a bf16 worker): each is then gathered in its wire
// dtype and cast once complete.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <torch/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lm/generate/generator.h"
#include "rpc/weight_manifest.h"
#include "rpc/weight_wire.h"
#include "rpc/wire_tensor.h"

namespace lm {
class CausalLM;
class PackedWeight;
}  // namespace lm

namespace rollout {

// The first weight version a worker refuses (INVALID_ARGUMENT at and above it): versions are in
// [0, 2^53). Versions only grow and count the learner's updates, which records them as doubles
// (exact up to 2^53) and resumes from the served version + 1, so the successor of every accepted
// version is still exact. A version near INT64_MAX would make every later push stale (a worker
// serving INT64_MAX could never be updated again) and overflow the learner's count; 2^53 itself
// was once accepted and then nothing after it could be.
inline constexpr int64_t kMaxWeightVersion = int64_t{1} << 53;

// What the store hands to a generation: the serving model, its version, its packed LM head and
// the lease that keeps an update from overwriting the weights while the generation runs.
using Snapshot = lm::ModelSnapshot;

// A tensor, or a chunk of one, as it travels (rpc/wire_tensor.h): chunks are views into the
// message; a manifest's entries are checked torch-free (rpc/weight_manifest.h).
using opd::rpc::WireDtype;
using opd::rpc::WireTensor;

// What a WeightStore shares with its updates and its snapshots' leases (weights.cc).
struct StoreState;

// An update being filled chunk by chunk. Not thread-safe (one update stream owns it).
class StagedWeights {
 public:
  ~StagedWeights();  // an in-place update dropped unfinished leaves the store damaged

  // INVALID_ARGUMENT naming the tensor when the name is unknown (or not announced), the shape or
  // dtype differ from the model's (or the announcement's), the tensor was already complete, the
  // chunk is not the next bytes of the tensor, another tensor was left incomplete, or, once it is
  // complete, it holds a NaN or an infinity (in the model's dtype); DATA_LOSS naming the tensor
  // when its bytes do not match the announced checksum. Host bytes: a host-staged update, or an
  // in-place one of a model on the CPU.
  absl::Status Add(const WireTensor& chunk);
  // In-place updates: bytes [offset, offset + bytes.numel()) of tensor `name`'s wire bytes, from
  // `bytes` (uint8 on the model's device, e.g. a slice of a received bucket). Copied on the
  // current stream without a synchronisation; the finiteness of every tensor is checked once, by
  // CheckComplete (one synchronisation for the whole update). The errors of Add.
  absl::Status AddDeviceBytes(std::string_view name, int64_t offset, const torch::Tensor& bytes);
  // INVALID_ARGUMENT listing (the first few) tensors not (fully) received, or naming those whose
  // values are not finite (in-place updates check them here).
  absl::Status CheckComplete();

  int64_t version() const { return version_; }
  bool in_place() const { return in_place_; }
  int64_t tensors_received() const { return complete_; }
  int64_t bytes_received() const { return bytes_; }
  // The wire bytes every expected tensor adds up to (announced updates; -1 for full ones, whose
  // wire dtype is only known as the tensors arrive).
  int64_t expected_bytes() const { return expected_bytes_; }
  // Host memory the staged tensors take (0 for in-place updates).
  int64_t staged_host_bytes() const { return host_bytes_; }

 private:
  friend class WeightStore;
  struct Target {
    torch::Tensor param;   // the serving parameter (contiguous)
    torch::Tensor dst;     // where the bytes go: a host copy (staged) or `param` (in place)
    bool expected = true;  // announced updates expect only the announced tensors
    std::optional<uint64_t> checksum;
    std::optional<WireDtype> wire_dtype;  // announced, or set by the tensor's first chunk
    int64_t total = 0;                    // wire bytes
    int64_t filled = 0;                   // bytes received
    bool started = false;                 // a chunk arrived (zero-byte tensors count too)
    bool done = false;                    // every byte arrived
    torch::Tensor buffer;  // the wire bytes, where they cannot go straight into `dst`
    opd::rpc::Xxh64 hash;
  };
  StagedWeights(std::shared_ptr<StoreState> store, int64_t version, int64_t base_version,
                bool in_place);
  absl::Status Begin(const std::string& name, Target& t, WireDtype dtype,
                     const std::vector<int64_t>& shape, bool device_bytes);
  absl::Status Next(std::string_view name, const std::vector<int64_t>& shape, WireDtype dtype,
                    int64_t offset, int64_t bytes, bool device_bytes, Target** target);
  absl::Status Finish(const std::string& name, Target& t);
  static absl::Status CheckFinite(const std::string& name, const Target& t);
  absl::Status CheckDeviceFinite() const;
  // Copies every staged tensor into its parameter (host staging; nothing for in-place updates).
  void CopyIntoPlace();
  bool TouchesLmHead() const;  // whether the packed LM head must be packed again

  std::shared_ptr<StoreState> store_;
  int64_t version_;
  int64_t base_version_;  // announced updates: the serving version they start from; else -1
  bool in_place_;
  bool full_ = false;     // every parameter expected (the only kind a damaged store takes)
  bool settled_ = false;  // committed (or, in place, handed back): the destructor does nothing
  int64_t expected_bytes_ = -1;
  int64_t host_bytes_ = 0;
  std::map<std::string, Target, std::less<>> targets_;
  std::string current_;  // tensor whose chunks are arriving
  int64_t complete_ = 0;
  int64_t bytes_ = 0;
};

struct WeightStoreOptions {
  // kAfterReaders: a commit waits for the requests sampling with the serving version (see the top
  //   of the file). kAtOnce: the caller makes sure nothing computes with the weights while it
  //   commits, and copes with snapshots taken before (the expert-parallel group: commands run one
  //   at a time on every rank, and a request whose version was replaced while it waited is
  //   ABORTED, rollout/ep_rollout.h); there is never a pending update.
  enum class Commit { kAfterReaders, kAtOnce };
  Commit commit = Commit::kAfterReaders;
  // How long a new update waits for an in-place one being written before it is UNAVAILABLE (an
  // in-place receive whose group broke ends within the group's timeout; the learner's gRPC
  // fallback may arrive before it has).
  absl::Duration writer_wait = absl::Minutes(2);
};

// What an update that was accepted is doing.
enum class CommitState { kServing, kPending };

class WeightStore {
 public:
  explicit WeightStore(std::shared_ptr<lm::CausalLM> model, int64_t version = 0,
                       WeightStoreOptions options = {});
  ~WeightStore();  // a pending update is dropped
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  // The serving snapshot, at once (waits only while a commit's copy runs). For bookkeeping and
  // expert-parallel commands; generations call Acquire.
  Snapshot Current() const;
  // What a generation takes: the serving snapshot once no update is being written into the
  // weights or waits to be (a pending update is applied first). UNAVAILABLE when `deadline`
  // passes first; FAILED_PRECONDITION naming the failed version while the store is damaged.
  absl::StatusOr<Snapshot> Acquire(absl::Time deadline) const;
  // The newest version accepted (serving, or pending), which a push must exceed.
  int64_t accepted_version() const;

  // A full update of version `version` (every parameter), staged in host memory;
  // FAILED_PRECONDITION unless `version` is above the accepted version; INVALID_ARGUMENT from
  // kMaxWeightVersion on; UNAVAILABLE while another update is pending.
  absl::StatusOr<std::unique_ptr<StagedWeights>> Stage(int64_t version) const;
  // An update of only the tensors `manifest` announces, staged in host memory (nothing staged when
  // nothing is announced). The errors of Stage, and FAILED_PRECONDITION when the manifest's base
  // version is set and is not the serving one (or the store is damaged and not every tensor is
  // announced); INVALID_ARGUMENT naming the tensor when one is unknown, repeated, of another shape,
  // or of an unknown dtype (rpc/weight_manifest.h ReadManifest).
  absl::StatusOr<std::unique_ptr<StagedWeights>> StageAnnounced(
      int64_t version, const opd::v1::WeightManifest& manifest) const;
  // The same update written straight into the serving parameters, when no request holds them;
  // until it is committed (or dropped: the store is then damaged) Acquire waits.
  // FAILED_PRECONDITION "in use" when a lease of the serving weights is alive (stage it in host
  // memory instead), and the errors of StageAnnounced. Announced tensors must travel in the model's
  // dtype.
  absl::StatusOr<std::unique_ptr<StagedWeights>> StageInPlace(
      int64_t version, const opd::v1::WeightManifest& manifest) const;

  // Checks completeness (and, in place, finiteness), then commits: at once when no request holds
  // the serving weights (or under Commit::kAtOnce), else as the pending update. FAILED_PRECONDITION
  // when a version at least as new was accepted meanwhile, or when an announced update's base
  // version is no longer the serving one (its unsent tensors would be stale); UNAVAILABLE while
  // another update is pending. An in-place update that fails here leaves the store damaged.
  // `state` (optional) says which.
  absl::Status Commit(std::unique_ptr<StagedWeights> staged, CommitState* state = nullptr);

  // Test and log hooks: whether the store is damaged (the reason), and waiting until the pending
  // update (if any) has been applied.
  absl::Status damage() const;
  bool AwaitNoPending(absl::Duration timeout) const;

 private:
  // `manifest`: null for a full update.
  absl::StatusOr<std::unique_ptr<StagedWeights>> StageUpdate(
      int64_t version, const opd::v1::WeightManifest* manifest, bool in_place) const;
  // Copies `staged` into place and publishes its version; the caller set the state's `writing`.
  absl::Status Apply(StagedWeights& staged);
  void CommitLoop();

  const std::shared_ptr<StoreState> state_;
  std::thread committer_;  // applies the pending update (Commit::kAfterReaders)
};

}  // namespace rollout
