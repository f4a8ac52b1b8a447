// The rollout worker's model, versioned, with atomic replacement.
//
// Requests take a Snapshot (a shared_ptr to the model and its version) and keep it for their
// whole duration. An update stages a complete new model next to the serving one, checks every
// tensor against the model (name, shape, dtype, each byte received exactly once) and only then
// swaps the pointer under the mutex. A request therefore sees the old or the new weights, never a
// mix, and an update that fails or is interrupted (its Staged object is dropped) changes nothing.
// Memory: an update holds a second copy of the model until the swap.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <torch/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace lm {
class CausalLM;
class PackedLinear;
}  // namespace lm

namespace rollout {

struct Snapshot {
  std::shared_ptr<lm::CausalLM> model;
  int64_t version = 0;
  // The model's LM head packed for the CPU decode kernel (lm/model/cpu_inference.h), built once per
  // version and shared by its generations; null where that kernel does not apply.
  std::shared_ptr<const lm::PackedLinear> lm_head;
};

// One chunk of one tensor, as it arrives (views into the message).
struct ChunkView {
  std::string_view name;
  std::vector<int64_t> shape;
  std::string_view dtype;  // "float32" | "bfloat16" | "float16"
  int64_t offset = 0;      // byte offset within the tensor
  std::string_view data;
};

// A new model being filled chunk by chunk. Not thread-safe (one update stream owns it).
class StagedWeights {
 public:
  StagedWeights(std::shared_ptr<lm::CausalLM> model, int64_t version);
  ~StagedWeights();

  // INVALID_ARGUMENT naming the tensor when the name is unknown, the shape or dtype differ from
  // the model's, the tensor was already complete, the chunk is not the next bytes of the tensor,
  // or another tensor was left incomplete.
  absl::Status Add(const ChunkView& chunk);
  // INVALID_ARGUMENT listing (the first few) tensors not (fully) received.
  absl::Status CheckComplete() const;

  int64_t version() const { return version_; }
  int64_t tensors_received() const { return complete_; }
  int64_t bytes_received() const { return bytes_; }

 private:
  friend class WeightStore;
  struct Target {
    torch::Tensor tensor;  // the staged model's parameter (contiguous)
    int64_t filled = 0;    // bytes received
    bool started = false;  // a chunk arrived (zero-byte tensors count too)
  };

  std::shared_ptr<lm::CausalLM> model_;
  int64_t version_;
  std::map<std::string, Target, std::less<>> targets_;
  std::string current_;  // tensor whose chunks are arriving
  int64_t complete_ = 0;
  int64_t bytes_ = 0;
};

class WeightStore {
 public:
  explicit WeightStore(std::shared_ptr<lm::CausalLM> model, int64_t version = 0);

  Snapshot Current() const;

  // A fresh copy of the serving architecture to fill with version `version`; FAILED_PRECONDITION
  // unless `version` is above the serving version.
  absl::StatusOr<std::unique_ptr<StagedWeights>> Stage(int64_t version) const;

  // Checks completeness, then swaps the staged model in. FAILED_PRECONDITION when a version at
  // least as new was committed meanwhile.
  absl::Status Commit(std::unique_ptr<StagedWeights> staged);

 private:
  mutable absl::Mutex mu_;
  std::shared_ptr<lm::CausalLM> model_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const lm::PackedLinear> lm_head_ ABSL_GUARDED_BY(mu_);
  int64_t version_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rollout
