// The rollout worker's model, versioned, with atomic replacement.
//
// Requests take a Snapshot (a shared_ptr to the model and its version) and keep it for their
// whole duration. An update stages a complete new model next to the serving one, checks every
// tensor against the model (name, shape, dtype, each byte received exactly once, the announced
// checksum when there is one, and finite values) and only then swaps the pointer under the
// mutex. A request therefore sees the old or the new weights, never a mix, and an update that
// fails or is interrupted (its Staged object is dropped) changes nothing.
//
// Two kinds of update: a full one (every parameter sent; the staged model starts empty) and an
// announced one (a manifest names exactly the tensors that come, with their checksums; the staged
// model starts as a copy of the serving one, and the update commits only onto the version it was
// staged from). Tensors may arrive in another dtype than the model's (an fp32 learner pushing to a
// bf16 worker): each is then gathered in its wire dtype and cast once complete.
// Memory: an update holds a second copy of the model until the swap (plus, while a tensor in
// another dtype arrives, that one tensor's wire bytes).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <torch/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "lm/generate/generator.h"
#include "rpc/weight_manifest.h"
#include "rpc/weight_wire.h"

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

// What the store hands to a generation: the serving model, its version and its packed LM head.
using Snapshot = lm::ModelSnapshot;

// One chunk of one tensor, as it arrives (views into the message).
struct ChunkView {
  std::string_view name;
  std::vector<int64_t> shape;
  std::string_view dtype;  // the wire dtype: "float32" | "bfloat16" | "float16"
  int64_t offset = 0;      // byte offset within the tensor's wire bytes
  std::string_view data;
};

// One tensor of an announced update, as the control plane named it (checked torch-free:
// rpc/weight_manifest.h).
using AnnouncedTensor = opd::rpc::AnnouncedTensor;

// A new model being filled chunk by chunk. Not thread-safe (one update stream owns it).
class StagedWeights {
 public:
  ~StagedWeights();

  // INVALID_ARGUMENT naming the tensor when the name is unknown (or not announced), the shape or
  // dtype differ from the model's (or the announcement's), the tensor was already complete, the
  // chunk is not the next bytes of the tensor, another tensor was left incomplete, or, once it is
  // complete, it holds a NaN or an infinity (in the model's dtype); DATA_LOSS naming the tensor
  // when its bytes do not match the announced checksum.
  absl::Status Add(const ChunkView& chunk);
  // INVALID_ARGUMENT listing (the first few) tensors not (fully) received.
  absl::Status CheckComplete() const;

  int64_t version() const { return version_; }
  int64_t tensors_received() const { return complete_; }
  int64_t bytes_received() const { return bytes_; }
  // The wire bytes every expected tensor adds up to (announced updates; -1 for full ones, whose
  // wire dtype is only known as the tensors arrive).
  int64_t expected_bytes() const { return expected_bytes_; }

 private:
  friend class WeightStore;
  struct Target {
    torch::Tensor tensor;  // the staged model's parameter (contiguous)
    bool expected = true;  // announced updates expect only the announced tensors
    std::optional<uint64_t> checksum;
    std::string wire_dtype;  // announced, or set by the tensor's first chunk
    torch::Dtype wire = torch::kFloat32;
    int64_t total = 0;     // wire bytes
    int64_t filled = 0;    // bytes received
    bool started = false;  // a chunk arrived (zero-byte tensors count too)
    bool done = false;     // every byte arrived
    torch::Tensor buffer;  // the wire bytes, where they cannot go straight into `tensor`
    opd::rpc::Xxh64 hash;
  };
  StagedWeights(std::shared_ptr<lm::CausalLM> model, int64_t version, int64_t base_version);
  absl::Status Begin(const std::string& name, Target& t, const ChunkView& chunk);
  absl::Status Finish(const std::string& name, Target& t);
  static absl::Status CheckFinite(const std::string& name, const Target& t);

  std::shared_ptr<lm::CausalLM> model_;
  int64_t version_;
  int64_t base_version_;  // announced updates: the serving version they start from; else -1
  int64_t expected_bytes_ = -1;
  std::map<std::string, Target, std::less<>> targets_;
  std::string current_;  // tensor whose chunks are arriving
  int64_t complete_ = 0;
  int64_t bytes_ = 0;
};

class WeightStore {
 public:
  explicit WeightStore(std::shared_ptr<lm::CausalLM> model, int64_t version = 0);

  Snapshot Current() const;

  // A fresh copy of the serving architecture to fill with version `version` (every parameter);
  // FAILED_PRECONDITION unless `version` is above the serving version; INVALID_ARGUMENT from
  // kMaxWeightVersion on.
  absl::StatusOr<std::unique_ptr<StagedWeights>> Stage(int64_t version) const;
  // An update of only the `announced` tensors onto a copy of the serving weights (no copy at all
  // when nothing is announced). FAILED_PRECONDITION for a stale version or when `base_version`
  // is given and is not the serving one; INVALID_ARGUMENT naming the tensor when one is unknown,
  // repeated, of another shape, or of an unknown dtype.
  absl::StatusOr<std::unique_ptr<StagedWeights>> StageAnnounced(
      int64_t version, const std::vector<AnnouncedTensor>& announced,
      std::optional<int64_t> base_version = std::nullopt) const;

  // Checks completeness, then swaps the staged model in. FAILED_PRECONDITION when a version at
  // least as new was committed meanwhile, or when an announced update's base version is no
  // longer the one serving (its unsent tensors would be stale).
  absl::Status Commit(std::unique_ptr<StagedWeights> staged);

 private:
  mutable absl::Mutex mu_;
  std::shared_ptr<lm::CausalLM> model_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const lm::PackedWeight> lm_head_ ABSL_GUARDED_BY(mu_);
  int64_t version_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rollout
