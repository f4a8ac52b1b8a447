#include "trainer/common/zero1.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "lm/dist/process_group.h"
#include "lm/io/safetensors.h"
#include "lm/model/precision.h"
#include "lm/util/status.h"
#include "trainer/common/optim.h"

namespace trainer {

torch::ScalarType ResolveAllGatherDtype(AllGatherDtype setting, Precision precision) {
  if (setting == AllGatherDtype::kBfloat16) return torch::kBFloat16;
  if (setting == AllGatherDtype::kFloat32) return torch::kFloat32;
  // auto: the old rule (bf16 on any CUDA device) gathered an fp32 run's weights in bf16 too.
  return precision == Precision::kBf16Mixed ? torch::kBFloat16 : torch::kFloat32;
}

absl::StatusOr<std::unique_ptr<DistributedOptimizer>> MakeLearnerOptimizer(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, const OptimConfig& optim,
    const DistConfig& dist, lm::dist::ProcessGroup* group, Precision precision) {
  return DistributedOptimizer::Create(
      params, optim, group, static_cast<int64_t>(dist.bucket_mb * (1 << 20) / sizeof(float)),
      ResolveAllGatherDtype(dist.allgather_dtype, precision), precision);
}

DistributedOptimizer::~DistributedOptimizer() {
  if (adamw_) return;
  // The hooks point at this object; the parameters may outlive it.
  for (size_t i = 0; i < layout_.entries.size(); ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(ParamOf(i), nullptr);
}

torch::Tensor& DistributedOptimizer::ParamOf(size_t entry) {
  return params_[entry_param_[entry]];
}

absl::StatusOr<std::unique_ptr<DistributedOptimizer>> DistributedOptimizer::Create(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, const OptimConfig& config,
    lm::dist::ProcessGroup* group, int64_t bucket_elements, torch::ScalarType gather_dtype,
    Precision precision) {
  auto o = std::unique_ptr<DistributedOptimizer>(new DistributedOptimizer());
  o->group_ = group;
  o->config_ = config;
  o->mixed_ = precision == Precision::kBf16Mixed;
  o->bucket_elements_ = std::max<int64_t>(bucket_elements, 1);
  if (gather_dtype != torch::kFloat32 && gather_dtype != torch::kBFloat16)
    return absl::InvalidArgumentError(absl::StrCat(
        "the weights' all-gather is float32 or bfloat16, not ", c10::toString(gather_dtype)));
  o->gather_dtype_ = gather_dtype;
  o->layout_ = FlatLayout::Of(params);
  for (const auto& [name, p] : params) {
    o->names_.push_back(name);
    o->params_.push_back(p);
  }
  for (const auto& e : o->layout_.entries)
    o->entry_param_.push_back(static_cast<size_t>(
        std::find(o->names_.begin(), o->names_.end(), e.name) - o->names_.begin()));
  if (group->size() == 1 && !o->mixed_) {
    o->adamw_ = std::make_unique<AdamW>(params, config);
    return o;
  }
  if (params.empty()) return absl::InvalidArgumentError("the model has no parameters");
  const torch::TensorOptions opts = params.front().second.options();
  for (const auto& [name, p] : params) {
    if (p.scalar_type() != torch::kFloat32 || p.device() != opts.device())
      return absl::InvalidArgumentError(
          absl::StrCat("data-parallel training keeps fp32 weights on one device; parameter ", name,
                       " is ", c10::toString(p.scalar_type()), " on ", p.device().str()));
  }
  RETURN_IF_ERROR(CheckSameOnEveryRank(*group, o->layout_.ToJson().dump(),
                                       "model's parameter layout (names and sizes)"));
  torch::NoGradGuard no_grad;
  o->shard_ = Shard::Of(o->layout_.total, group->size(), group->rank());
  const int64_t padded = o->shard_.chunk * group->size();
  std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
  if (o->mixed_) {
    // Before the gradients are allocated: the fp32 weights are released as they move.
    o->MoveIntoMixedBuffers(by_name, opts);
  } else {
    o->flat_params_ = torch::zeros({padded}, opts);
    for (const auto& e : o->layout_.entries) {
      torch::Tensor& p = by_name[e.name];
      torch::Tensor view = o->flat_params_.narrow(0, e.offset, e.numel);
      view.copy_(p.reshape(-1));
      // The parameter keeps its identity (the model and autograd hold it); only its storage
      // moves.
      p.set_data(view.view(p.sizes()));
    }
  }
  o->flat_grads_ = torch::zeros({padded}, opts);
  const int64_t mine = o->shard_.end - o->shard_.begin;
  o->exp_avg_ = torch::zeros({mine}, opts);
  o->exp_avg_sq_ = torch::zeros({mine}, opts);
  for (size_t i = 0; i < o->layout_.entries.size(); ++i)
    o->entry_steps_.push_back(torch::zeros({}, opts));
  // Buckets of whole parameters, about bucket_elements each; the last one takes the padding.
  bucket_elements = o->bucket_elements_;
  for (size_t i = 0; i < o->layout_.entries.size(); ++i) {
    const auto& e = o->layout_.entries[i];
    if (o->buckets_.empty() || o->buckets_.back().end - o->buckets_.back().begin >= bucket_elements)
      o->buckets_.push_back({e.offset, e.offset});
    o->buckets_.back().end = e.offset + e.numel;
    o->bucket_of_entry_.push_back(o->buckets_.size() - 1);
  }
  o->buckets_.back().end = padded;
  for (Bucket& b : o->buckets_) b.tensors = {o->flat_grads_.narrow(0, b.begin, b.end - b.begin)};
  o->ZeroGrad();
  o->InstallHooks();
  return o;
}

namespace {
// Tells the optimizer that a parameter's gradient for this backward is complete.
class GradReadyHook : public torch::autograd::PostAccumulateGradHook {
 public:
  GradReadyHook(std::function<void()> ready) : ready_(std::move(ready)) {}
  void operator()(const torch::autograd::Variable&) override { ready_(); }

 private:
  std::function<void()> ready_;
};
}  // namespace

void DistributedOptimizer::InstallHooks() {
  for (size_t i = 0; i < layout_.entries.size(); ++i) {
    const torch::Tensor& p = ParamOf(i);
    torch::autograd::impl::set_post_acc_grad_hooks(
        p, std::make_unique<GradReadyHook>([this, i] { GradReady(i); }));
  }
}

void DistributedOptimizer::ExpectLastBackward() {
  if (adamw_) return;
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
  for (Bucket& b : buckets_) b.waiting = 0;
  for (size_t b : bucket_of_entry_) ++buckets_[b].waiting;
}

void DistributedOptimizer::GradReady(size_t entry) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) return;
  --buckets_[bucket_of_entry_[entry]].waiting;
  LaunchReadyBuckets();
}

void DistributedOptimizer::LaunchReadyBuckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].waiting == 0) {
    Bucket& b = buckets_[next_launch_++];
    b.pending = group_->AllReduceAsync(b.tensors);
    ++overlapped_;
  }
}

void DistributedOptimizer::ZeroGrad() {
  if (adamw_) return adamw_->ZeroGrad();
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
    next_launch_ = 0;
    overlapped_ = 0;
    for (Bucket& b : buckets_) b.pending.reset();
  }
  flat_grads_.zero_();
  // The backward accumulates into these views in place; re-point them in case anything replaced
  // a gradient tensor.
  for (size_t i = 0; i < layout_.entries.size(); ++i) {
    const auto& e = layout_.entries[i];
    torch::Tensor& p = ParamOf(i);
    torch::Tensor view = flat_grads_.narrow(0, e.offset, e.numel).view(p.sizes());
    if (!p.grad().defined() || p.grad().data_ptr() != view.data_ptr()) p.mutable_grad() = view;
  }
}

absl::StatusOr<double> DistributedOptimizer::ReduceAndClip(double max_norm, double grad_scale) {
  torch::NoGradGuard no_grad;
  if (adamw_) {
    if (grad_scale != 1.0)
      for (auto& p : params_)
        if (p.grad().defined()) p.grad().mul_(grad_scale);
    return ClipGradNorm(params_, max_norm);
  }
  {
    // What the backward did not send (all of it on a rank that ran no micro-batch) goes now, in
    // the same bucket order on every rank.
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
    while (next_launch_ < buckets_.size()) {
      Bucket& b = buckets_[next_launch_++];
      b.pending = group_->AllReduceAsync(b.tensors);
    }
  }
  absl::Status first = absl::OkStatus();
  for (Bucket& b : buckets_) {
    absl::Status s = b.pending->Wait();
    b.pending.reset();
    if (first.ok() && !s.ok()) first = s;
  }
  RETURN_IF_ERROR(first);
  // The global norm from each rank's squared norm of its own slice (the only gradients its AdamW
  // reads), and only that slice is clipped: 1/N of the work on each rank. NaN and inf propagate
  // through the sum, so every rank sees the same non-finite norm and skips the step.
  torch::Tensor own = flat_grads_.narrow(0, shard_.begin, shard_.end - shard_.begin);
  if (grad_scale != 1.0) own.mul_(grad_scale);
  const double own_norm =
      own.numel() > 0 ? torch::linalg_vector_norm(own, 2, {}, false, torch::kFloat64).item<double>()
                      : 0.0;
  ASSIGN_OR_RETURN(std::vector<double> squares, group_->AllReduceDoubles({own_norm * own_norm}));
  const double norm = std::sqrt(squares[0]);
  if (max_norm > 0 && std::isfinite(norm)) own.mul_(std::min(1.0, max_norm / (norm + 1e-6)));
  return norm;
}

absl::Status DistributedOptimizer::Step(double lr) {
  if (adamw_) {
    adamw_->Step(lr);
    return absl::OkStatus();
  }
  return ShardedStep(lr);
}

absl::Status DistributedOptimizer::ShardedStep(double lr) {
  torch::NoGradGuard no_grad;
  // This rank's slice of each parameter it meets, one fused AdamW call per decay group.
  for (bool decay : {true, false}) {
    std::vector<torch::Tensor> p, g, m, v, t;
    for (size_t i = 0; i < layout_.entries.size(); ++i) {
      const auto& e = layout_.entries[i];
      const int64_t b = std::max(shard_.begin, e.offset);
      const int64_t end = std::min(shard_.end, e.offset + e.numel);
      if (e.decay != decay || b >= end) continue;
      p.push_back(MasterRange(b, end - b));
      g.push_back(flat_grads_.narrow(0, b, end - b));
      m.push_back(exp_avg_.narrow(0, b - shard_.begin, end - b));
      v.push_back(exp_avg_sq_.narrow(0, b - shard_.begin, end - b));
      t.push_back(entry_steps_[i]);
    }
    if (p.empty()) continue;
    at::_foreach_add_(t, 1);
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, t, lr, config_.beta1, config_.beta2,
                      decay ? config_.weight_decay : 0.0, config_.eps, /*amsgrad=*/false,
                      /*maximize=*/false);
  }
  ++steps_;
  if (mixed_) return RefreshComputeCopies();
  const int64_t chunk = shard_.chunk;
  torch::Tensor own = flat_params_.narrow(0, chunk * group_->rank(), chunk);
  if (gather_dtype_ == torch::kFloat32) return group_->AllGather(flat_params_, own.clone());
  torch::Tensor master = own.clone();
  torch::Tensor gathered = torch::empty({flat_params_.numel()}, own.options().dtype(gather_dtype_));
  RETURN_IF_ERROR(group_->AllGather(gathered, own.to(gather_dtype_)));
  flat_params_.copy_(gathered);
  own.copy_(master);  // this rank's slice stays the fp32 master
  masters_synced_ = false;
  return absl::OkStatus();
}

absl::Status DistributedOptimizer::SyncMasters() {
  if (adamw_ || masters_synced_ || mixed_) return absl::OkStatus();
  torch::NoGradGuard no_grad;
  const int64_t chunk = shard_.chunk;
  torch::Tensor own = flat_params_.narrow(0, chunk * group_->rank(), chunk).clone();
  RETURN_IF_ERROR(group_->AllGather(flat_params_, own));
  masters_synced_ = true;
  return absl::OkStatus();
}

int64_t DistributedOptimizer::steps() const {
  return adamw_ ? adamw_->steps() : steps_;
}

int64_t DistributedOptimizer::state_bytes() const {
  if (adamw_) return 2 * layout_.total * static_cast<int64_t>(sizeof(float));
  return (exp_avg_.numel() + exp_avg_sq_.numel()) * static_cast<int64_t>(sizeof(float));
}

size_t DistributedOptimizer::num_decay() const {
  return static_cast<size_t>(std::count_if(layout_.entries.begin(), layout_.entries.end(),
                                           [](const auto& e) { return e.decay; }));
}

size_t DistributedOptimizer::num_no_decay() const {
  return layout_.entries.size() - num_decay();
}

absl::Status DistributedOptimizer::SaveState(const std::string& dir) const {
  if (adamw_) {
    const std::map<std::string, torch::Tensor> tensors = adamw_->StateTensors();
    std::vector<lm::TensorToWrite> out;
    for (const auto& [name, t] : tensors) {
      out.push_back({name, lm::DType::kF32, t.sizes().vec(), t.data_ptr(),
                     static_cast<size_t>(t.numel() * t.element_size())});
    }
    return lm::WriteSafetensors(
        dir + "/" + kOptimizerNamedFile, out,
        {{"format", "opd-adamw"}, {"steps", std::to_string(adamw_->steps())}});
  }
  torch::Tensor m = exp_avg_.to(torch::kCPU).contiguous();
  torch::Tensor v = exp_avg_sq_.to(torch::kCPU).contiguous();
  const std::vector<int64_t> shape{m.numel()};
  const size_t bytes = static_cast<size_t>(m.numel()) * sizeof(float);
  return lm::WriteSafetensors(dir + "/" + OptimizerShardFileName(group_->rank(), group_->size()),
                              {{"exp_avg", lm::DType::kF32, shape, m.data_ptr(), bytes},
                               {"exp_avg_sq", lm::DType::kF32, shape, v.data_ptr(), bytes}},
                              {{"format", kOptimizerShardFormat},
                               {"begin", std::to_string(shard_.begin)},
                               {"end", std::to_string(shard_.end)},
                               {"total", std::to_string(layout_.total)},
                               {"world_size", std::to_string(group_->size())},
                               {"steps", std::to_string(steps_)},
                               {"layout", layout_.ToJson().dump()}});
}

absl::Status DistributedOptimizer::LoadState(const std::string& checkpoint_dir, int64_t steps) {
  ASSIGN_OR_RETURN(std::unique_ptr<OptimizerStateReader> reader,
                   OptimizerStateReader::Open(checkpoint_dir, layout_));
  torch::NoGradGuard no_grad;
  if (adamw_) {
    std::map<std::string, torch::Tensor> tensors;
    for (const auto& e : layout_.entries) {
      const torch::Tensor& p =
          params_[entry_param_[static_cast<size_t>(&e - layout_.entries.data())]];
      for (const char* m : kOptimizerMoments) {
        torch::Tensor t = torch::empty(p.sizes(), torch::kFloat32);
        RETURN_IF_ERROR(reader->Read(m, e.offset, e.offset + e.numel, t.data_ptr<float>()));
        tensors[absl::StrCat(m, ".", e.name)] = t;
      }
    }
    absl::Status s = adamw_->LoadState(tensors, steps);
    if (!s.ok()) return absl::DataLossError(absl::StrCat(checkpoint_dir, ": ", s.message()));
    return absl::OkStatus();
  }
  const int64_t n = shard_.end - shard_.begin;
  for (auto [m, dst] : {std::pair{kOptimizerMoments[0], &exp_avg_},
                        std::pair{kOptimizerMoments[1], &exp_avg_sq_}}) {
    torch::Tensor host = torch::empty({n}, torch::kFloat32);
    RETURN_IF_ERROR(reader->Read(m, shard_.begin, shard_.end, host.data_ptr<float>()));
    dst->copy_(host);
  }
  for (torch::Tensor& t : entry_steps_) t.fill_(static_cast<double>(steps));
  steps_ = steps;
  return absl::OkStatus();
}

}  // namespace trainer
