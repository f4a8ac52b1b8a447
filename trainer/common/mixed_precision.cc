#include "trainer/common/mixed_precision.h"

#include <algorithm>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"
#include "trainer/common/zero1.h"

namespace trainer {

Precision ResolvePrecision(PrecisionSetting setting, torch::Device device) {
  if (setting == PrecisionSetting::kBf16Mixed ||
      (setting == PrecisionSetting::kAuto && device.is_cuda()))
    return Precision::kBf16Mixed;
  return Precision::kFp32;
}

const char* PrecisionName(Precision p) {
  return p == Precision::kBf16Mixed ? "bf16-mixed" : "fp32";
}

// ---------------------------------------------------------------------------------------------
// The bf16-mixed part of DistributedOptimizer (trainer/common/zero1.h): its buffers, the
// refresh of the compute copies after an update, and the fp32 masters for checkpoints.

void DistributedOptimizer::MoveIntoMixedBuffers(std::map<std::string, torch::Tensor>& by_name,
                                                const torch::TensorOptions& opts) {
  torch::NoGradGuard no_grad;
  master_ = torch::zeros({sharding_.slice}, opts);
  flat_compute_ = torch::zeros({sharding_.padded_total}, opts.dtype(torch::kBFloat16));
  int64_t exact_total = 0;
  for (const auto& e : layout_.entries) {
    const bool bf16 = lm::HoldsBf16ComputeCopy(e.name, by_name[e.name]);
    exact_offset_.push_back(bf16 ? -1 : exact_total);
    if (!bf16) exact_total += e.numel;
  }
  exact_ = torch::zeros({exact_total}, opts);
  for (size_t i = 0; i < layout_.entries.size(); ++i) {
    const auto& e = layout_.entries[i];
    torch::Tensor& p = by_name[e.name];
    const torch::Tensor values = p.reshape(-1);
    const auto [first, last] = sharding_.BucketsOf(e.offset, e.offset + e.numel);
    for (size_t b = first; b <= last && e.numel > 0; ++b) {
      const auto& bucket = sharding_.buckets[b];
      const int64_t lo = std::max(bucket.own_begin, e.offset);
      const int64_t hi = std::min(bucket.own_end, e.offset + e.numel);
      if (lo < hi)
        master_.narrow(0, sharding_.SliceOffset(b, lo), hi - lo)
            .copy_(values.narrow(0, lo - e.offset, hi - lo));
    }
    torch::Tensor view = exact_offset_[i] < 0 ? flat_compute_.narrow(0, e.offset, e.numel)
                                              : exact_.narrow(0, exact_offset_[i], e.numel);
    view.copy_(values);  // rounds to bf16 for a compute copy
    // The parameter keeps its identity (the model and autograd hold it); its storage and, for a
    // compute copy, its dtype change. Its fp32 values live on only in the masters.
    p.set_data(view.view(p.sizes()));
  }
}

absl::Status DistributedOptimizer::RefreshComputeCopies() {
  torch::NoGradGuard no_grad;
  // The masters rounded to bf16 are the compute copies; every rank rounds its own pieces, so all
  // ranks hold the same copies as one rank would.
  const int world = group_->size();
  for (const auto& b : sharding_.buckets) {
    torch::Tensor out = flat_compute_.narrow(0, b.begin, b.padded_length(world));
    RETURN_IF_ERROR(
        group_->AllGather(out, master_.narrow(0, b.slice_begin, b.piece).to(torch::kBFloat16)));
  }
  if (exact_.numel() == 0) return absl::OkStatus();
  // The fp32 parameters exactly: each rank contributes the elements it owns, zeros elsewhere, and
  // the sum (x + 0 + ... + 0 = x) is every master bit for bit.
  exact_.zero_();
  for (const Piece& p : pieces_) {
    const auto& e = layout_.entries[p.entry];
    if (exact_offset_[p.entry] < 0) continue;
    exact_.narrow(0, exact_offset_[p.entry] + (p.begin - e.offset), p.length)
        .copy_(master_.narrow(0, p.slice, p.length));
  }
  std::vector<torch::Tensor> t{exact_};
  return group_->AllReduce(t);
}

absl::StatusOr<torch::Tensor> DistributedOptimizer::GatherMasters() {
  torch::NoGradGuard no_grad;
  if (!mixed_) {
    RETURN_IF_ERROR(SyncMasters());
    if (!group_->is_root()) return torch::Tensor();
    if (adamw_) {
      std::vector<torch::Tensor> flat;
      for (size_t i = 0; i < layout_.entries.size(); ++i)
        flat.push_back(ParamOf(i).detach().reshape(-1).to(torch::kCPU));
      return torch::cat(flat);
    }
    return flat_params_.narrow(0, 0, layout_.total).to(torch::kCPU);
  }
  // A bucket at a time: the device holds one gathered bucket beyond the masters.
  torch::Tensor host;
  if (group_->is_root()) host = torch::empty({layout_.total}, torch::kFloat32);
  for (const auto& b : sharding_.buckets) {
    torch::Tensor out = torch::empty({b.padded_length(group_->size())}, master_.options());
    RETURN_IF_ERROR(group_->AllGather(out, master_.narrow(0, b.slice_begin, b.piece)));
    if (host.defined())
      host.narrow(0, b.begin, b.end - b.begin).copy_(out.narrow(0, 0, b.end - b.begin));
  }
  return host;
}

absl::Status DistributedOptimizer::WithMasterWeights(const std::function<absl::Status()>& fn) {
  if (!mixed_) {
    RETURN_IF_ERROR(SyncMasters());
    return fn();
  }
  ASSIGN_OR_RETURN(torch::Tensor host, GatherMasters());
  if (!host.defined()) return fn();
  // Rank 0's parameters point at the gathered masters for `fn`, and back at their compute
  // copies after it (also when it fails or throws).
  struct Restore {
    DistributedOptimizer* o;
    std::vector<torch::Tensor> copies;
    ~Restore() {
      for (size_t i = 0; i < copies.size(); ++i) o->ParamOf(i).set_data(copies[i]);
    }
  } restore{this, {}};
  for (size_t i = 0; i < layout_.entries.size(); ++i) {
    const auto& e = layout_.entries[i];
    torch::Tensor& p = ParamOf(i);
    restore.copies.push_back(p.data());
    p.set_data(host.narrow(0, e.offset, e.numel).view(p.sizes()));
  }
  return fn();
}

LearnerMemory DistributedOptimizer::memory() const {
  LearnerMemory m;
  if (adamw_) {
    m.adamw = state_bytes();
    for (const auto& p : params_) m.weights += p.numel() * p.element_size();
    m.gradients = m.weights;  // one fp32 gradient per parameter after a backward
    return m;
  }
  m.adamw = (exp_avg_.numel() + exp_avg_sq_.numel()) * 4;
  m.gradients = reducer_->gradient_bytes();
  m.gradient_buckets = reducer_->bucket_bytes();
  if (!mixed_) {
    m.weights = flat_params_.numel() * flat_params_.element_size();
    return m;
  }
  m.weights =
      flat_compute_.numel() * flat_compute_.element_size() + exact_.numel() * exact_.element_size();
  m.masters = master_.numel() * master_.element_size();
  return m;
}

}  // namespace trainer
