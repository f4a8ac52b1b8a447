// The learner's optimizer over one or several ranks (data parallel): ZeRO-1.
//
// Every rank holds the whole model and runs its share of a step's micro-batches. Then:
//
//   one rank:  AdamW (trainer/common/optim.h) as before, moments per parameter name.
//   N ranks:   ZeRO-1. The parameters live in one flat buffer (each parameter a view of it) and
//              so do their gradients, which the backward accumulates in place. The gradients are
//              summed over ranks in buckets of about `bucket_elements`: during a rank's last
//              backward of the step (ExpectLastBackward), a bucket is all-reduced as soon as
//              every parameter in it has its gradient, overlapping the rest of the backward;
//              what is left goes out in ReduceAndClip. The sums are clipped by their global norm,
//              and each rank updates only its own contiguous 1/N slice of the flat space with
//              AdamW, keeping AdamW's moments for that slice alone; an all-gather then gives every
//              rank the updated weights.
//
// The flat space (FlatLayout) holds the parameters in reverse model order, the order in which the
// backward produces their gradients, so the first buckets are ready first (buckets go out in
// index order on every rank, as the collectives must match). Checkpoints store the moments as
// ranges of that space:
//
//   optimizer.safetensors                 one rank: exp_avg.<name>, exp_avg_sq.<name>
//   optimizer-RRRRR-of-NNNNN.safetensors  N ranks: exp_avg, exp_avg_sq of [begin, end)
//
// and either form loads on any world size: each rank reads just the ranges it owns.
//
// bf16-mixed (trainer/common/mixed_precision.h) always takes the flat path, one rank included:
// the matrices become bf16 views of one flat bf16 buffer (the weights' all-gather target), the
// fp32 parameters (norms, routers) views of a small fp32 buffer, and the fp32 master weights
// exist only as this rank's slice [begin, end) of the flat space, next to its AdamW moments. The
// gradients stay one fp32 flat buffer: every parameter's .grad, a bf16 one's included, is its
// fp32 view, so micro-batches and ranks accumulate in fp32. After the update the masters' slices
// are all-gathered in bf16 into the compute copies (bf16 is what the forward reads, so no
// precision is lost by gathering in it) and the fp32 parameters are summed exactly from their
// owners' slices. Checkpoints save the fp32 masters (WithMasterWeights).
//
// The loss normaliser stays the step's global token count (the jobs know it on every rank), so
// the summed gradient is the one-process gradient and N ranks reproduce one rank's updates up to
// the order of floating-point additions. Every parameter must take part in every step (true of
// the architectures here: fused experts, every layer used); AdamW on one rank skips a parameter
// without a gradient, the sharded one would not.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "trainer/common/learner_group.h"
#include "trainer/common/mixed_precision.h"
#include "trainer/common/optimizer_state.h"
#include "trainer/common/sections.h"

#include "lm/dist/process_group.h"

namespace trainer {

class AdamW;
class DistributedOptimizer;

// The learner's optimizer for `params`, as the `dist` section says (bucket size, the all-gather's
// dtype, which in bf16-mixed is bf16 for the compute copies whatever it says) and in `precision`.
absl::StatusOr<std::unique_ptr<DistributedOptimizer>> MakeLearnerOptimizer(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, const OptimConfig& optim,
    const DistConfig& dist, lm::dist::ProcessGroup* group, Precision precision = Precision::kFp32);

// dist.allgather_dtype under train.precision `precision`:
// auto follows the precision, float32 for fp32 (an fp32 run keeps fp32 weights on every rank,
// on CUDA too) and bfloat16 for bf16-mixed (whose compute copies are bf16 in any case); an
// explicit float32 or bfloat16 is kept.
torch::ScalarType ResolveAllGatherDtype(AllGatherDtype setting, Precision precision);
class DistributedOptimizer {
 public:
  // `group` must outlive the optimizer. With one rank this is AdamW over the parameters as they
  // are; with several the parameters are moved into the flat buffer (their values unchanged).
  //
  // `gather_dtype` is the dtype of the weights' all-gather. With bf16 each rank sends its updated
  // slice rounded to bf16 (half the bytes) and keeps its own slice in fp32: the fp32 master
  // weights stay sharded, the other ranks' slices hold their bf16 values, which is what a bf16
  // autocast matmul reads anyway. SyncMasters() gives every rank the exact fp32 weights again
  // (checkpoints call it).
  static absl::StatusOr<std::unique_ptr<DistributedOptimizer>> Create(
      const std::vector<std::pair<std::string, torch::Tensor>>& params, const OptimConfig& config,
      lm::dist::ProcessGroup* group, int64_t bucket_elements = 8 << 20,
      torch::ScalarType gather_dtype = torch::kFloat32, Precision precision = Precision::kFp32);
  ~DistributedOptimizer();

  // Gradients to zero (several ranks) or undefined (one rank), before a step's first backward.
  void ZeroGrad();
  // The next backward is this rank's last of the step: reduce buckets as they become ready.
  void ExpectLastBackward();
  // Collective: sums the gradients over ranks, clips them to `max_norm` by their global L2 norm
  // (as ClipGradNorm; with several ranks only this rank's slice is scaled, the part its AdamW
  // reads) and returns the norm before clipping.
  // The reduced gradients are first multiplied by `grad_scale` (a loss normaliser known only
  // once every rank has learned its micro-batches).
  absl::StatusOr<double> ReduceAndClip(double max_norm, double grad_scale = 1.0);
  // Collective: one AdamW update at `lr`, then every rank has the updated weights.
  absl::Status Step(double lr);

  int64_t steps() const;
  // Of the last ReduceAndClip's buckets, how many went out during the backward.
  int64_t overlapped_buckets() const { return overlapped_; }
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Bytes of AdamW state this rank holds (the two moments of its slice).
  int64_t state_bytes() const;
  // Bytes of weights, gradients, masters and AdamW state this rank holds (the buffers as
  // allocated, padding included).
  LearnerMemory memory() const;
  Precision precision() const { return mixed_ ? Precision::kBf16Mixed : Precision::kFp32; }
  const std::vector<torch::Tensor>& params() const { return params_; }
  size_t num_decay() const;
  size_t num_no_decay() const;

  // Collective: every rank's weights become the exact fp32 masters (a no-op unless the all-gather
  // is in bf16 and a step has run since the last sync; in bf16-mixed too, see WithMasterWeights).
  absl::Status SyncMasters();

  // Collective: runs `fn` while rank 0's parameters are the exact fp32 master weights (checkpoints
  // save the model inside it). fp32: SyncMasters, then fn. bf16-mixed: the masters' slices are
  // gathered to rank 0's host memory in pieces of about a bucket (device memory grows by one
  // piece per rank, not by the model), its parameters point at them during `fn` and at their bf16
  // compute copies again after; the other ranks run `fn` as they are.
  absl::Status WithMasterWeights(const std::function<absl::Status()>& fn);
  // Collective: the fp32 master weights, the flat space [0, total) on the host, on rank 0
  // (undefined elsewhere). fp32 precision: the weights themselves.
  absl::StatusOr<torch::Tensor> GatherMasters();

  // Writes this rank's moments into checkpoint directory `dir` (every rank calls it).
  absl::Status SaveState(const std::string& dir) const;
  // Restores the moments from a checkpoint written by any world size, after `steps` updates.
  absl::Status LoadState(const std::string& checkpoint_dir, int64_t steps);

 private:
  DistributedOptimizer() = default;
  absl::Status ShardedStep(double lr);
  // bf16-mixed (defined in trainer/common/mixed_precision.cc): the parameters into the compute
  // buffers, this rank's masters from their fp32 values.
  void MoveIntoMixedBuffers(std::map<std::string, torch::Tensor>& by_name,
                            const torch::TensorOptions& opts);
  torch::Tensor MasterRange(int64_t begin, int64_t n);  // [begin, begin + n) of this rank's masters
  absl::Status RefreshComputeCopies();                  // bf16-mixed, after an update
  void InstallHooks();
  torch::Tensor& ParamOf(size_t entry);
  void GradReady(size_t entry);  // from the autograd engine, after an accumulation
  void LaunchReadyBuckets();     // under mu_

  struct Bucket {
    int64_t begin = 0, end = 0;  // range of the flat (padded) buffer
    int64_t waiting = 0;         // parameters whose gradient has not arrived yet
    std::vector<torch::Tensor> tensors;
    std::unique_ptr<lm::dist::PendingCollective> pending;
  };

  lm::dist::ProcessGroup* group_ = nullptr;
  OptimConfig config_;
  FlatLayout layout_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<size_t> entry_param_;  // layout entry -> index into params_
  std::unique_ptr<AdamW> adamw_;     // one rank

  // Several ranks.
  Shard shard_;
  torch::Tensor flat_params_, flat_grads_;  // padded to world * chunk
  torch::Tensor exp_avg_, exp_avg_sq_;      // this rank's slice
  std::vector<torch::Tensor> entry_steps_;  // AdamW step count per entry (as fused AdamW wants)
  torch::ScalarType gather_dtype_ = torch::kFloat32;
  bool masters_synced_ = true;  // every rank's weights are the fp32 masters
  int64_t bucket_elements_ = 0;

  // bf16-mixed.
  bool mixed_ = false;
  torch::Tensor master_;               // fp32 [chunk]: this rank's slice of the flat space
  torch::Tensor flat_compute_;         // bf16 [world * chunk]: the compute copies' storage
  torch::Tensor exact_;                // fp32: the parameters kept in fp32, concatenated
  std::vector<int64_t> exact_offset_;  // per entry: its offset in exact_, or -1 (bf16)
  int64_t steps_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_entry_;
  std::mutex mu_;
  bool armed_ = false;      // in the last backward of a step
  size_t next_launch_ = 0;  // buckets [0, next_launch_) are in flight
  int64_t overlapped_ = 0;
};

}  // namespace trainer
