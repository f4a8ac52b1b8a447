// The learner's optimizer over one or several ranks (data parallel): ZeRO stage 1 or 2.
//
// Every rank holds the whole model and runs its share of a step's micro-batches. Then:
//
//   one rank:  AdamW (trainer/common/optim.h) as before, moments per parameter name.
//   N ranks:   the parameters live in one flat buffer (each parameter a view of it), split into
//              buckets of about `bucket_elements` (BucketSharding,
//              trainer/common/optimizer_state.h) of which each rank owns one 1/N piece. The
//              gradients are summed over the ranks into each rank's pieces (its slice) by
//              reduce-scatters issued from the backward (trainer/common/gradient_reducer.h: stage 1
//              keeps a full fp32 gradient buffer and reduces it once per step, stage 2 keeps only
//              the slice and reduces every backward). The slice is scaled and clipped by the global
//              norm (the ranks' sums of squares, all-reduced), each rank updates its slice with
//              AdamW, keeping AdamW's moments for it alone, and per-bucket all-gathers give every
//              rank the updated weights.
//
// The flat space (FlatLayout) holds the parameters in reverse model order, the order in which the
// backward produces their gradients, so the first buckets are ready first (buckets go out in
// index order on every rank, as the collectives must match). Checkpoints store the moments as
// ranges of that space:
//
//   optimizer.safetensors                 one rank: exp_avg.<name>, exp_avg_sq.<name>
//   optimizer-RRRRR-of-NNNNN.safetensors  N ranks: exp_avg, exp_avg_sq of the rank's ranges
//
// and either form loads on any world size and bucket size: each rank reads just the ranges it
// owns, and refuses moments no AdamW could have made (NaN, infinite, a negative second moment).
//
// bf16-mixed (trainer/common/mixed_precision.h) always takes the flat path, one rank included:
// the matrices become bf16 views of one flat bf16 buffer (the weights' all-gather target), the
// fp32 parameters (norms, routers) views of a small fp32 buffer, and the fp32 master weights
// exist only as this rank's slice, next to its AdamW moments. The gradients are accumulated in
// fp32 (stage 1: every parameter's .grad, a bf16 one's included, is an fp32 view of the full
// buffer; stage 2: each arriving gradient is added into an fp32 staging bucket). After the update
// the masters' pieces are all-gathered in bf16 into the compute copies (bf16 is what the forward
// reads, so no precision is lost by gathering in it) and the fp32 parameters are summed exactly
// from their owners' pieces. Checkpoints save the fp32 masters (WithMasterWeights).
//
// The loss normaliser stays the step's global token count (the jobs know it on every rank), or
// the caller passes it late as ReduceAndClip's grad_scale, so the summed gradient is the
// one-process gradient and N ranks reproduce one rank's updates up to the order of floating-point
// additions. A parameter without a gradient in a step gets a zero one (AdamW on one rank skips
// it instead; the architectures here use every parameter in every step).
//
// Expert parallelism (experts sharded by rank rather than by slice) is the next step; see
// docs/distributed.md for how it would sit beside this.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "trainer/common/gradient_reducer.h"
#include "trainer/common/learner_group.h"
#include "trainer/common/mixed_precision.h"
#include "trainer/common/optimizer_state.h"
#include "trainer/common/sections.h"

#include "lm/dist/process_group.h"

namespace trainer {

class AdamW;
class DistributedOptimizer;

// The learner's optimizer for `params`, as the `dist` section says (bucket size, the all-gather's
// dtype, which in bf16-mixed is bf16 for the compute copies whatever it says) and in `precision`,
// sharding the gradients as `stage` says (dist.zero_stage resolved: one or two).
absl::StatusOr<std::unique_ptr<DistributedOptimizer>> MakeLearnerOptimizer(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, const OptimConfig& optim,
    const DistConfig& dist, lm::dist::ProcessGroup* group, Precision precision = Precision::kFp32,
    ZeroStage stage = ZeroStage::kOne, const std::vector<std::string>& order = {},
    std::optional<torch::Device> device = std::nullopt);

// dist.allgather_dtype under train.precision `precision`:
// auto follows the precision, float32 for fp32 (an fp32 run keeps fp32 weights on every rank,
// on CUDA too) and bfloat16 for bf16-mixed (whose compute copies are bf16 in any case); an
// explicit float32 or bfloat16 is kept.
torch::ScalarType ResolveAllGatherDtype(AllGatherDtype setting, Precision precision);
class DistributedOptimizer {
 public:
  // `group` must outlive the optimizer. With one rank this is AdamW over the parameters as they
  // are (bf16-mixed: the flat path); with several the parameters are moved into the flat buffer
  // (their values unchanged) and the gradients are reduced as `stage` says (one rank: stage 1).
  //
  // `gather_dtype` is the dtype of the weights' all-gather. With bf16 each rank sends its updated
  // slice rounded to bf16 (half the bytes) and keeps its own slice in fp32: the fp32 master
  // weights stay sharded, the other ranks' slices hold their bf16 values, which is what a bf16
  // autocast matmul reads anyway. SyncMasters() gives every rank the exact fp32 weights again
  // (checkpoints call it).
  //
  // `order` lays the flat space out (FlatLayout::Of): the backward's arrival order
  // (trainer/common/gradient_order.h), the same on every rank; checkpoints load whatever order
  // wrote them.
  //
  // `device` is where the flat path's buffers live (default: the parameters' device). Parameters
  // given on the host move onto it one at a time, so the device never holds the fp32 model and
  // the flat buffers at once (bf16-mixed: 2P bytes of compute copies instead of 6P at start-up).
  static absl::StatusOr<std::unique_ptr<DistributedOptimizer>> Create(
      const std::vector<std::pair<std::string, torch::Tensor>>& params, const OptimConfig& config,
      lm::dist::ProcessGroup* group, int64_t bucket_elements = 8 << 20,
      torch::ScalarType gather_dtype = torch::kFloat32, Precision precision = Precision::kFp32,
      ZeroStage stage = ZeroStage::kOne, const std::vector<std::string>& order = {},
      std::optional<torch::Device> device = std::nullopt);
  ~DistributedOptimizer();

  // A step's backwards, on every rank:
  //
  //   ExpectBackwards(n)          collective, before the first: this rank runs n backwards (0 ok)
  //   Backward(loss)  x n         each: loss.backward() with its gradients reduced as they arrive
  //   ReduceAndClip(max_norm)     collective: the rest of the reduction, the norm, the clip
  //   Step(lr), ZeroGrad()
  //
  // The older protocol (ExpectLastBackward() before the last of the rank's own loss.backward()
  // calls) still works; in stage 2 it keeps the full gradients until that last backward.
  //
  // Gradients to zero (stage 1) or undefined (stage 2, one rank), before a step's first backward.
  void ZeroGrad();
  absl::Status ExpectBackwards(int64_t backwards);
  absl::Status Backward(const torch::Tensor& loss);
  // The next backward is this rank's last of the step: reduce buckets as they become ready.
  void ExpectLastBackward();
  // Collective: sums the gradients over ranks, multiplies them by `grad_scale` (one multiply per
  // element, after the sum: a loss normaliser known only at the end of the step), clips them to
  // `max_norm` by their global L2 norm (as ClipGradNorm; with several ranks only this rank's slice
  // is scaled, the part its AdamW reads) and returns the norm before clipping.
  absl::StatusOr<double> ReduceAndClip(double max_norm, double grad_scale = 1.0);
  // Collective: one AdamW update at `lr`, then every rank has the updated weights.
  absl::Status Step(double lr);

  int64_t steps() const;
  ZeroStage stage() const { return reducer_ ? stage_ : ZeroStage::kOne; }
  // Of the last ReduceAndClip's buckets, how many went out during a backward.
  int64_t overlapped_buckets() const { return reducer_ ? reducer_->overlapped() : 0; }
  int64_t num_buckets() const { return reducer_ ? reducer_->num_buckets() : 0; }
  // This rank's reduced (and clipped) gradients after ReduceAndClip, its pieces in bucket order
  // (sharding()); undefined with one fp32 rank (the parameters' .grad hold them).
  torch::Tensor grad_slice() const { return reducer_ ? reducer_->slice() : torch::Tensor(); }
  const BucketSharding& sharding() const { return sharding_; }
  const FlatLayout& layout() const { return layout_; }
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
  // save the model inside it). fp32: SyncMasters, then fn. bf16-mixed: the masters' pieces are
  // gathered to rank 0's host memory a bucket at a time (device memory grows by one bucket, not
  // by the model), its parameters point at them during `fn` and at their bf16 compute copies
  // again after; the other ranks run `fn` as they are.
  absl::Status WithMasterWeights(const std::function<absl::Status()>& fn);
  // Collective: the fp32 master weights, the flat space [0, total) on the host, on rank 0
  // (undefined elsewhere). fp32 precision: the weights themselves.
  absl::StatusOr<torch::Tensor> GatherMasters();
  // Collective: OK when every master weight is finite; else FAILED_PRECONDITION on every rank
  // naming a parameter that is not (each rank checks its own slice).
  absl::Status CheckFinite();

  // Writes this rank's moments into checkpoint directory `dir` (every rank calls it).
  absl::Status SaveState(const std::string& dir) const;
  // Collective: restores the moments from a checkpoint written by any world size, after `steps`
  // updates. Moments that fail OptimizerStateReader's checks on any rank fail it on every rank,
  // naming the file and tensor.
  absl::Status LoadState(const std::string& checkpoint_dir, int64_t steps);

 private:
  // This rank's part of one parameter within one bucket: flat [begin, begin + length), at
  // `slice` in the slice.
  struct Piece {
    size_t entry = 0;
    int64_t begin = 0, length = 0, slice = 0;
  };

  DistributedOptimizer() = default;
  // Create's steps, in the order it runs them.
  void IndexParams(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                   const std::vector<std::string>& order);
  void MoveIntoFlatBuffers(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                           const torch::TensorOptions& opts);
  void FindPieces();
  void AllocateSliceState(const torch::TensorOptions& opts);
  absl::Status LoadOwnState(const std::string& checkpoint_dir, int64_t steps);
  absl::Status ShardedStep(double lr);
  absl::Status GatherWeights();  // fp32 precision, after an update: per-bucket all-gathers
  // bf16-mixed (defined in trainer/common/mixed_precision.cc): the parameters into the compute
  // buffers, this rank's masters from their fp32 values.
  void MoveIntoMixedBuffers(std::map<std::string, torch::Tensor>& by_name,
                            const torch::TensorOptions& opts);
  torch::Tensor MasterOf(const Piece& p);  // the piece's fp32 master weights
  absl::Status RefreshComputeCopies();     // bf16-mixed, after an update
  torch::Tensor& ParamOf(size_t entry);

  lm::dist::ProcessGroup* group_ = nullptr;
  OptimConfig config_;
  FlatLayout layout_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<size_t> entry_param_;  // layout entry -> index into params_
  std::unique_ptr<AdamW> adamw_;     // one rank

  // The flat path.
  BucketSharding sharding_;
  ZeroStage stage_ = ZeroStage::kOne;
  std::unique_ptr<GradientReducer> reducer_;
  std::vector<Piece> pieces_;           // this rank's, in slice order
  torch::Tensor flat_params_;           // fp32 precision: [padded_total]
  torch::Tensor exp_avg_, exp_avg_sq_;  // [slice]
  torch::Tensor piece_steps_;           // AdamW's step count per piece (as fused AdamW wants)
  torch::ScalarType gather_dtype_ = torch::kFloat32;
  bool masters_synced_ = true;  // every rank's weights are the fp32 masters
  int64_t steps_ = 0;

  // bf16-mixed.
  bool mixed_ = false;
  torch::Tensor master_;               // fp32 [slice]: this rank's masters
  torch::Tensor flat_compute_;         // bf16 [padded_total]: the compute copies' storage
  torch::Tensor exact_;                // fp32: the parameters kept in fp32, concatenated
  std::vector<int64_t> exact_offset_;  // per entry: its offset in exact_, or -1 (bf16)
};

}  // namespace trainer
