// The learner's gradients over N ranks: each backward's parameter gradients summed over the ranks
// into each rank's 1/N slice of the flat space (trainer/common/optimizer_state.h BucketSharding),
// bucket by bucket, by reduce-scatters issued from the backward itself (post-accumulate-grad
// hooks), so that communication overlaps the rest of the backward. The sharded optimizer
// (trainer/common/zero1.h) owns one and steps the slice.
//
//   stage 1  every parameter's .grad is an fp32 view of one full flat buffer: micro-batches
//            accumulate into it in place, and during the rank's last backward of the step each
//            bucket is reduce-scattered into the slice as soon as its gradients are complete
//            (one reduction per step). Gradient memory: 4P (the buffer) + 4P/N (the slice).
//   stage 2  there is no full buffer: a parameter's gradient, as autograd made it, is taken from
//            .grad when it arrives; its part in the bucket being filled (the next to go out) is
//            added at once (in fp32) into that bucket's staging buffer, its parts in later
//            buckets when they become the one being filled, and it is released with its last
//            part. A bucket whose parameters have all arrived is reduce-scattered into the slice
//            at once, every backward (a micro-batch's gradients are reduced before the next
//            micro-batch runs; the slice accumulates them in fp32). At most kMaxInFlight buckets
//            are in flight: when another is ready the oldest is waited for and its staging buffer
//            reused. So what stage 2 holds beyond the 4P/N slice is kMaxInFlight + 1 staging
//            buckets (one more of zeros on a rank that reduces a round without a backward) and,
//            in their own dtype, the gradients that arrived ahead of the bucket being filled:
//            with the flat space laid out in the backward's order (trainer/common/
//            gradient_order.h) about the one parameter whose buckets are under way.
//
// The collectives must match on every rank: every rank reduces every bucket in index order once
// per round, and the rounds of a step are agreed before it starts (ExpectBackwards: the most
// backwards any rank runs). A rank with fewer backwards (or none) adds rounds of zeros. Either
// stage sums the same terms as one process; only the order of the additions differs.
//
// With one rank there is nothing to reduce: stage 1's slice is its buffer.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "lm/dist/process_group.h"
#include "trainer/common/optimizer_state.h"
#include "trainer/common/sections.h"

namespace trainer {

class GradientReducer {
 public:
  // Buckets in flight at once in stage 2 (each holds a staging buffer until it completes).
  static constexpr size_t kMaxInFlight = 2;

  // `params` in the layout's (flat) order, fp32 or bf16 on one device; `stage` one or two; the
  // gradients are fp32 on that device. Installs the hooks (removed by the destructor). `group`
  // must outlive this object.
  GradientReducer(std::vector<torch::Tensor> params, FlatLayout layout, BucketSharding sharding,
                  ZeroStage stage, lm::dist::ProcessGroup* group, const torch::TensorOptions& opts);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // A new step: no gradients, no reduction in flight (one abandoned is dropped, not waited for).
  void ZeroGrad();
  // Collective, before the step's first backward on every rank: this rank will run `backwards`
  // backwards through Backward() (0: none). Fixes the step's rounds (stage 2: the most over the
  // ranks).
  absl::Status ExpectBackwards(int64_t backwards);
  // loss.backward(), its gradients reduced as the stage and ExpectBackwards say. Without
  // ExpectBackwards this step it is a plain backward (see ExpectLastBackward).
  absl::Status Backward(const torch::Tensor& loss);
  // The older protocol, for callers that run loss.backward() themselves: the next backward is
  // this rank's last of the step, and its buckets are reduced as they complete (one round per
  // step: in stage 2 the earlier backwards' gradients then wait in full-size staging).
  void ExpectLastBackward();
  // Collective: completes the step's rounds (the rest of the current one, then rounds of zeros up
  // to the agreed count) and waits for them. After it slice() holds this rank's reduced gradients.
  absl::Status Finish();

  // This rank's slice of the summed gradients (fp32, its pieces in bucket order).
  torch::Tensor& slice() { return slice_; }
  // Of the last step's buckets, how many went out from inside a backward.
  int64_t overlapped() const { return overlapped_; }
  int64_t num_buckets() const { return static_cast<int64_t>(sharding_.buckets.size()); }
  // Bytes held for gradients: the slice and stage 1's full buffer.
  int64_t gradient_bytes() const;
  // Bytes of stage 2's staging buffers at their peak so far (they are reused, never freed).
  int64_t bucket_bytes() const;

 private:
  struct InFlight {
    size_t bucket = 0;
    std::unique_ptr<lm::dist::PendingCollective> pending;
    torch::Tensor staging;  // stage 2: back to the pool once done
    torch::Tensor out;      // a round after the first: added into the slice once done
  };

  void OnGradient(size_t entry);  // from the autograd engine, after an accumulation
  void Arm();                     // the next backward's buckets go out as they complete
  // Under mu_:
  void TakeGradient(size_t entry);  // stage 2: .grad into pending_
  // Stage 2: pending_ parts for `bucket` into current_ (those of entries arrived in the armed
  // backward, or `all`).
  void Absorb(size_t bucket, bool all);
  torch::Tensor Staging(int64_t length);  // a staging buffer, its first `length` zero
  void LaunchReady();
  void Launch(size_t bucket);
  void LaunchRound();  // the current round's remaining buckets
  void CompleteOldest();
  void Fail(absl::Status s);
  absl::Status CheckNothingLeft() const;

  std::vector<torch::Tensor> params_;  // by layout entry
  FlatLayout layout_;
  BucketSharding sharding_;
  ZeroStage stage_;
  lm::dist::ProcessGroup* group_;
  torch::TensorOptions opts_;
  std::vector<std::vector<size_t>> entries_of_bucket_;
  std::vector<int64_t> entries_in_bucket_;

  torch::Tensor flat_;   // stage 1: the full buffer, every parameter's .grad a view of it
  torch::Tensor slice_;  // this rank's reduced gradients

  // Stage 2.
  std::vector<torch::Tensor> pending_;  // per entry: its gradient, until its last part is taken
  std::vector<size_t> absorbed_;        // per entry: the next bucket its pending part goes to
  torch::Tensor current_;               // the staging of bucket next_launch_, filling
  std::vector<torch::Tensor> free_;     // staging buffers to reuse
  int64_t staging_allocated_ = 0;
  torch::Tensor zeros_;  // the input of a bucket nobody contributed to

  std::mutex mu_;
  std::deque<InFlight> in_flight_;
  bool armed_ = false;
  std::vector<int64_t> waiting_;  // per bucket: entries yet to arrive in the armed backward
  std::vector<char> arrived_;     // per entry: arrived in the armed backward
  size_t next_launch_ = 0;        // the round's buckets [0, next_launch_) are out
  int64_t rounds_done_ = 0;
  bool announced_ = false;  // ExpectBackwards this step
  int64_t backwards_ = 0, backwards_announced_ = 0, rounds_ = 1;
  int64_t overlapped_ = 0;
  bool warned_legacy_ = false;
  absl::Status error_;
};

}  // namespace trainer
