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
  master_ = torch::zeros({shard_.chunk}, opts);
  flat_compute_ = torch::zeros({shard_.chunk * group_->size()}, opts.dtype(torch::kBFloat16));
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
    const int64_t b = std::max(shard_.begin, e.offset),
                  end = std::min(shard_.end, e.offset + e.numel);
    if (b < end)
      master_.narrow(0, b - shard_.begin, end - b).copy_(values.narrow(0, b - e.offset, end - b));
    torch::Tensor view = exact_offset_[i] < 0 ? flat_compute_.narrow(0, e.offset, e.numel)
                                              : exact_.narrow(0, exact_offset_[i], e.numel);
    view.copy_(values);  // rounds to bf16 for a compute copy
    // The parameter keeps its identity (the model and autograd hold it); its storage and, for a
    // compute copy, its dtype change. Its fp32 values live on only in the masters.
    p.set_data(view.view(p.sizes()));
  }
}

torch::Tensor DistributedOptimizer::MasterRange(int64_t begin, int64_t n) {
  return mixed_ ? master_.narrow(0, begin - shard_.begin, n) : flat_params_.narrow(0, begin, n);
}

absl::Status DistributedOptimizer::RefreshComputeCopies() {
  torch::NoGradGuard no_grad;
  // The masters rounded to bf16 are the compute copies; every rank rounds its own slice, so all
  // ranks hold the same copies as one rank would.
  RETURN_IF_ERROR(group_->AllGather(flat_compute_, master_.to(torch::kBFloat16)));
  if (exact_.numel() == 0) return absl::OkStatus();
  // The fp32 parameters exactly: each rank contributes the elements it owns, zeros elsewhere, and
  // the sum (x + 0 + ... + 0 = x) is every master bit for bit.
  exact_.zero_();
  for (size_t i = 0; i < layout_.entries.size(); ++i) {
    const auto& e = layout_.entries[i];
    const int64_t b = std::max(shard_.begin, e.offset),
                  end = std::min(shard_.end, e.offset + e.numel);
    if (exact_offset_[i] < 0 || b >= end) continue;
    exact_.narrow(0, exact_offset_[i] + (b - e.offset), end - b)
        .copy_(master_.narrow(0, b - shard_.begin, end - b));
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
  const int world = group_->size();
  const int64_t chunk = shard_.chunk;
  const int64_t piece = std::max<int64_t>(1, std::min(chunk, bucket_elements_));
  torch::Tensor host;
  if (group_->is_root()) host = torch::empty({chunk * world}, torch::kFloat32);
  for (int64_t j = 0; j < chunk; j += piece) {
    const int64_t len = std::min(piece, chunk - j);
    torch::Tensor out = torch::empty({len * world}, master_.options());
    RETURN_IF_ERROR(group_->AllGather(out, master_.narrow(0, j, len).contiguous()));
    if (!host.defined()) continue;
    torch::Tensor got = out.to(torch::kCPU);
    for (int r = 0; r < world; ++r)
      host.narrow(0, r * chunk + j, len).copy_(got.narrow(0, r * len, len));
  }
  return host.defined() ? host.narrow(0, 0, layout_.total) : host;
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
  m.adamw = state_bytes();
  if (adamw_) {
    for (const auto& p : params_) m.weights += p.numel() * p.element_size();
    m.gradients = m.weights;  // one fp32 gradient per parameter after a backward
    return m;
  }
  m.gradients = flat_grads_.numel() * flat_grads_.element_size();
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
