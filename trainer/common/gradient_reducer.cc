#include "trainer/common/gradient_reducer.h"

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <utility>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "lm/util/log.h"
#include "lm/util/status.h"

namespace trainer {
namespace {

// Tells the reducer that a parameter's gradient of this backward has been accumulated.
class GradientHook : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit GradientHook(std::function<void()> arrived) : arrived_(std::move(arrived)) {}
  void operator()(const torch::autograd::Variable&) override { arrived_(); }

 private:
  std::function<void()> arrived_;
};

}  // namespace

GradientReducer::GradientReducer(std::vector<torch::Tensor> params, FlatLayout layout,
                                 BucketSharding sharding, ZeroStage stage,
                                 lm::dist::ProcessGroup* group, const torch::TensorOptions& opts)
    : params_(std::move(params)),
      layout_(std::move(layout)),
      sharding_(std::move(sharding)),
      stage_(stage == ZeroStage::kTwo ? ZeroStage::kTwo : ZeroStage::kOne),
      group_(group),
      opts_(opts.dtype(torch::kFloat32)) {
  const size_t buckets = sharding_.buckets.size();
  entries_of_bucket_.resize(buckets);
  for (size_t i = 0; i < layout_.entries.size(); ++i) {
    const auto& e = layout_.entries[i];
    if (e.numel == 0) continue;
    const auto [first, last] = sharding_.BucketsOf(e.offset, e.offset + e.numel);
    for (size_t b = first; b <= last; ++b) entries_of_bucket_[b].push_back(i);
  }
  for (const auto& entries : entries_of_bucket_)
    entries_in_bucket_.push_back(static_cast<int64_t>(entries.size()));
  waiting_.assign(buckets, 0);
  arrived_.assign(layout_.entries.size(), 0);
  if (stage_ == ZeroStage::kOne) {
    flat_ = torch::zeros({sharding_.padded_total}, opts_);
    slice_ = group_->size() == 1 ? flat_ : torch::zeros({sharding_.slice}, opts_);
  } else {
    slice_ = torch::zeros({sharding_.slice}, opts_);
    pending_.resize(layout_.entries.size());
    absorbed_.assign(layout_.entries.size(), 0);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        params_[i], std::make_unique<GradientHook>([this, i] { OnGradient(i); }));
  }
  ZeroGrad();
}

GradientReducer::~GradientReducer() {
  // The hooks point at this object; the parameters may outlive it.
  for (torch::Tensor& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

void GradientReducer::ZeroGrad() {
  std::lock_guard<std::mutex> lock(mu_);
  torch::NoGradGuard no_grad;
  // An abandoned step's collectives are dropped, not waited for (the group may be broken); their
  // staging buffers go with them.
  in_flight_.clear();
  armed_ = announced_ = false;
  backwards_ = backwards_announced_ = rounds_done_ = overlapped_ = 0;
  rounds_ = 1;
  next_launch_ = 0;
  error_ = absl::OkStatus();
  slice_.zero_();
  if (stage_ == ZeroStage::kTwo) {
    for (torch::Tensor& g : pending_) g = torch::Tensor();
    for (torch::Tensor& p : params_) p.mutable_grad() = torch::Tensor();
    if (current_.defined()) free_.push_back(std::move(current_));
    current_ = torch::Tensor();
    return;
  }
  flat_.zero_();
  // The backward accumulates into these views in place; re-point them in case anything replaced
  // a gradient tensor.
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    torch::Tensor& p = params_[i];
    torch::Tensor view = flat_.narrow(0, e.offset, e.numel).view(p.sizes());
    if (!p.grad().defined() || p.grad().data_ptr() != view.data_ptr()) p.mutable_grad() = view;
  }
}

absl::Status GradientReducer::ExpectBackwards(int64_t backwards) {
  if (backwards < 0)
    return absl::InvalidArgumentError(absl::StrCat("ExpectBackwards(", backwards, ")"));
  if (announced_ || rounds_done_ > 0 || armed_)
    return absl::FailedPreconditionError(
        "ExpectBackwards comes once per step, before the step's first backward");
  ASSIGN_OR_RETURN(
      std::vector<double> most,
      group_->AllReduceDoubles({static_cast<double>(backwards)}, lm::dist::ReduceOp::kMax));
  std::lock_guard<std::mutex> lock(mu_);
  announced_ = true;
  backwards_announced_ = backwards;
  backwards_ = 0;
  rounds_ = stage_ == ZeroStage::kTwo ? static_cast<int64_t>(most[0]) : 1;
  return absl::OkStatus();
}

void GradientReducer::Arm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
  waiting_ = entries_in_bucket_;
  std::fill(arrived_.begin(), arrived_.end(), 0);
}

void GradientReducer::ExpectLastBackward() {
  if (announced_) return;
  if (stage_ == ZeroStage::kTwo && !warned_legacy_) {
    warned_legacy_ = true;
    lm::log::Warn(
        "dist.zero_stage 2 driven by ExpectLastBackward: a rank's earlier backwards keep their "
        "gradients until its last one (full size); ExpectBackwards(n) and Backward(loss) reduce "
        "each backward's");
  }
  Arm();
}

absl::Status GradientReducer::Backward(const torch::Tensor& loss) {
  if (!announced_) {
    loss.backward();
    return absl::OkStatus();
  }
  if (backwards_ >= backwards_announced_)
    return absl::FailedPreconditionError(absl::StrCat(
        "a backward beyond the ", backwards_announced_, " this rank announced (ExpectBackwards)"));
  ++backwards_;
  const bool reduce = stage_ == ZeroStage::kTwo || backwards_ == backwards_announced_;
  if (reduce) Arm();
  loss.backward();
  if (reduce) {
    std::lock_guard<std::mutex> lock(mu_);
    LaunchRound();
  }
  return absl::OkStatus();
}

void GradientReducer::OnGradient(size_t entry) {
  std::lock_guard<std::mutex> lock(mu_);
  torch::NoGradGuard no_grad;
  const auto& e = layout_.entries[entry];
  const auto [first, last] = sharding_.BucketsOf(e.offset, e.offset + e.numel);
  const bool counts = armed_ && !arrived_[entry];
  // Accumulated twice in one backward (a parameter used inside and outside a recomputed block):
  // harmless until a part of it has gone into a bucket (stage 1: a reduced one; stage 2: one being
  // summed), after which the second addition would miss that part.
  const bool taken = stage_ == ZeroStage::kOne
                         ? first < next_launch_
                         : pending_[entry].defined() && absorbed_[entry] > first;
  if (armed_ && !counts && taken) {
    Fail(absl::FailedPreconditionError(
        absl::StrCat("parameter ", e.name,
                     " received a second gradient in one backward after a bucket took the first")));
    return;
  }
  if (armed_) arrived_[entry] = 1;
  if (stage_ == ZeroStage::kTwo) TakeGradient(entry);
  if (!counts) return;
  for (size_t b = first; b <= last && e.numel > 0; ++b) --waiting_[b];
  if (stage_ == ZeroStage::kTwo) Absorb(next_launch_, /*all=*/false);
  LaunchReady();
}

void GradientReducer::TakeGradient(size_t entry) {
  torch::Tensor& grad = params_[entry].mutable_grad();
  if (!grad.defined()) return;
  // Autograd's own tensor, as it came (bf16 for a compute copy): its parts are added into the
  // fp32 staging of each bucket when that bucket is the one being filled, and it is released with
  // its last part. A second one before any part was taken (no reduction between) is summed in
  // fp32, as stage 1's fp32 views sum it.
  torch::Tensor& held = pending_[entry];
  if (!held.defined()) {
    held = std::move(grad);
    const auto& e = layout_.entries[entry];
    absorbed_[entry] = sharding_.BucketsOf(e.offset, e.offset + e.numel).first;
  } else {
    if (held.scalar_type() != torch::kFloat32) held = held.to(torch::kFloat32);
    held.add_(grad);
  }
  grad = torch::Tensor();
}

void GradientReducer::Absorb(size_t bucket, bool all) {
  if (bucket >= sharding_.buckets.size()) return;
  const auto& b = sharding_.buckets[bucket];
  for (size_t i : entries_of_bucket_[bucket]) {
    // Before its bucket goes out, only a gradient complete for the round: one held from an
    // earlier backward of the older protocol still takes this backward's part.
    if (!pending_[i].defined() || absorbed_[i] != bucket || (!all && !arrived_[i])) continue;
    const auto& e = layout_.entries[i];
    const int64_t lo = std::max(b.begin, e.offset), hi = std::min(b.end, e.offset + e.numel);
    if (!current_.defined()) current_ = Staging(b.padded_length(sharding_.world));
    // fp32 += the gradient's dtype: the fp32 accumulation stage 1 gets from its fp32 views.
    current_.narrow(0, lo - b.begin, hi - lo)
        .add_(pending_[i].reshape(-1).narrow(0, lo - e.offset, hi - lo));
    absorbed_[i] = bucket + 1;
    if (hi == e.offset + e.numel) pending_[i] = torch::Tensor();  // its last part
  }
}

torch::Tensor GradientReducer::Staging(int64_t length) {
  if (free_.empty()) {
    free_.push_back(
        torch::empty({sharding_.buckets.front().padded_length(sharding_.world)}, opts_));
    ++staging_allocated_;
  }
  torch::Tensor s = std::move(free_.back());
  free_.pop_back();
  s.narrow(0, 0, length).zero_();
  return s;
}

void GradientReducer::LaunchReady() {
  while (next_launch_ < waiting_.size() && waiting_[next_launch_] == 0) {
    Launch(next_launch_++);
    ++overlapped_;
    // The next bucket starts filling from what has arrived for it, releasing what it completes.
    if (stage_ == ZeroStage::kTwo) Absorb(next_launch_, /*all=*/false);
  }
}

void GradientReducer::Launch(size_t bucket) {
  const auto& b = sharding_.buckets[bucket];
  const int64_t length = b.padded_length(sharding_.world);
  InFlight f;
  f.bucket = bucket;
  torch::Tensor out = slice_.narrow(0, b.slice_begin, b.piece);
  if (stage_ == ZeroStage::kOne) {
    if (group_->size() == 1) return;  // the slice is the buffer
    f.pending = group_->ReduceScatterSumAsync(out, flat_.narrow(0, b.begin, length));
    in_flight_.push_back(std::move(f));
    return;
  }
  // Every gradient held for the bucket goes into its staging (one that reached .grad without its
  // hook, set by hand, joins them now); a bucket nobody contributed to reduces zeros.
  for (size_t i : entries_of_bucket_[bucket]) TakeGradient(i);
  Absorb(bucket, /*all=*/true);
  torch::Tensor in;
  if (current_.defined()) {
    in = current_.narrow(0, 0, length);
    f.staging = std::move(current_);
    current_ = torch::Tensor();
  } else {
    if (!zeros_.defined())
      zeros_ = torch::zeros({sharding_.buckets.front().padded_length(sharding_.world)}, opts_);
    in = zeros_.narrow(0, 0, length);
  }
  // The first round writes the slice (zero until then); later rounds add into it once done.
  if (rounds_done_ > 0) out = f.out = torch::empty({b.piece}, opts_);
  while (in_flight_.size() >= kMaxInFlight) CompleteOldest();
  f.pending = group_->ReduceScatterSumAsync(out, in);
  in_flight_.push_back(std::move(f));
}

void GradientReducer::LaunchRound() {
  for (; next_launch_ < sharding_.buckets.size(); ++next_launch_) Launch(next_launch_);
  next_launch_ = 0;
  ++rounds_done_;
  armed_ = false;
}

void GradientReducer::CompleteOldest() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  absl::Status s = f.pending->Wait();
  if (!s.ok()) {
    Fail(s);
  } else if (f.out.defined()) {
    const auto& b = sharding_.buckets[f.bucket];
    slice_.narrow(0, b.slice_begin, b.piece).add_(f.out);
  }
  if (f.staging.defined()) free_.push_back(std::move(f.staging));
}

void GradientReducer::Fail(absl::Status s) {
  if (error_.ok()) error_ = std::move(s);
}

absl::Status GradientReducer::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  torch::NoGradGuard no_grad;
  // What the backwards did not send (all of it on a rank that ran none) goes now, then the rounds
  // of zeros this rank owes the ranks that ran more backwards: the same buckets in the same order
  // on every rank.
  const int64_t rounds = announced_ ? rounds_ : 1;
  while (rounds_done_ < rounds) LaunchRound();
  while (!in_flight_.empty()) CompleteOldest();
  if (error_.ok()) Fail(CheckNothingLeft());
  return error_;
}

absl::Status GradientReducer::CheckNothingLeft() const {
  if (stage_ == ZeroStage::kOne) return absl::OkStatus();
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (!pending_[i].defined() && !params_[i].grad().defined()) continue;
    return absl::FailedPreconditionError(absl::StrCat("the gradient of ", layout_.entries[i].name,
                                                      " arrived after the step's last reduction: a "
                                                      "backward beyond the ",
                                                      backwards_announced_,
                                                      " announced (ExpectBackwards)"));
  }
  return absl::OkStatus();
}

int64_t GradientReducer::gradient_bytes() const {
  int64_t bytes = slice_.numel() * 4;
  if (stage_ == ZeroStage::kOne && group_->size() > 1) bytes += flat_.numel() * 4;
  return bytes;
}

int64_t GradientReducer::bucket_bytes() const {
  const int64_t length =
      sharding_.buckets.empty() ? 0 : sharding_.buckets.front().padded_length(sharding_.world);
  return (staging_allocated_ + (zeros_.defined() ? 1 : 0)) * length * 4;
}

}  // namespace trainer
