#include "trainer/common/zero1.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>

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
    const DistConfig& dist, lm::dist::ProcessGroup* group, Precision precision, ZeroStage stage,
    const std::vector<std::string>& order, std::optional<torch::Device> device) {
  return DistributedOptimizer::Create(
      params, optim, group, static_cast<int64_t>(dist.bucket_mb * (1 << 20) / sizeof(float)),
      ResolveAllGatherDtype(dist.allgather_dtype, precision), precision, stage, order, device);
}

namespace {

// Create's settings that no caller should pass.
absl::Status CheckSettings(torch::ScalarType gather_dtype, ZeroStage stage) {
  if (gather_dtype != torch::kFloat32 && gather_dtype != torch::kBFloat16)
    return absl::InvalidArgumentError(absl::StrCat(
        "the weights' all-gather is float32 or bfloat16, not ", c10::toString(gather_dtype)));
  if (stage == ZeroStage::kAuto)
    return absl::InvalidArgumentError("dist.zero_stage auto must be resolved to 1 or 2 first");
  return absl::OkStatus();
}

// One fp32 rank's AdamW has no flat buffers to move the parameters into.
absl::Status CheckUpdateInPlace(const torch::Device& from, std::optional<torch::Device> device) {
  if (device && *device != from)
    return absl::InvalidArgumentError(
        absl::StrCat("one fp32 rank updates the parameters where they are (", from.str(),
                     "), not on ", device->str()));
  return absl::OkStatus();
}

// The flat buffers are fp32 on one device, so every parameter must be fp32 on `from`.
absl::Status CheckFlatParams(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                             const torch::Device& from) {
  for (const auto& [name, p] : params) {
    if (p.scalar_type() != torch::kFloat32 || p.device() != from)
      return absl::InvalidArgumentError(
          absl::StrCat("data-parallel training keeps fp32 weights on one device; parameter ", name,
                       " is ", c10::toString(p.scalar_type()), " on ", p.device().str()));
  }
  return absl::OkStatus();
}

}  // namespace

DistributedOptimizer::~DistributedOptimizer() = default;

torch::Tensor& DistributedOptimizer::ParamOf(size_t entry) {
  return params_[entry_param_[entry]];
}

absl::StatusOr<std::unique_ptr<DistributedOptimizer>> DistributedOptimizer::Create(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, const OptimConfig& config,
    lm::dist::ProcessGroup* group, int64_t bucket_elements, torch::ScalarType gather_dtype,
    Precision precision, ZeroStage stage, const std::vector<std::string>& order,
    std::optional<torch::Device> device) {
  auto o = std::unique_ptr<DistributedOptimizer>(new DistributedOptimizer());
  o->group_ = group;
  o->config_ = config;
  o->mixed_ = precision == Precision::kBf16Mixed;
  RETURN_IF_ERROR(CheckSettings(gather_dtype, stage));
  o->gather_dtype_ = gather_dtype;
  o->IndexParams(params, order);
  if (params.empty()) return absl::InvalidArgumentError("the model has no parameters");
  const torch::Device from = params.front().second.device();
  if (group->size() == 1 && !o->mixed_) {
    RETURN_IF_ERROR(CheckUpdateInPlace(from, device));
    o->adamw_ = std::make_unique<AdamW>(params, config);
    return o;
  }
  const torch::TensorOptions opts = params.front().second.options().device(device.value_or(from));
  RETURN_IF_ERROR(CheckFlatParams(params, from));
  RETURN_IF_ERROR(CheckSameOnEveryRank(*group, o->layout_.ToJson().dump(),
                                       "model's parameter layout (names and sizes)"));
  torch::NoGradGuard no_grad;
  o->stage_ = group->size() == 1 ? ZeroStage::kOne : stage;
  o->sharding_ =
      BucketSharding::Of(o->layout_.total, bucket_elements, group->size(), group->rank());
  o->MoveIntoFlatBuffers(params, opts);
  o->FindPieces();
  o->AllocateSliceState(opts);
  return o;
}

// The flat space's layout, and the parameters by name in the caller's order.
void DistributedOptimizer::IndexParams(
    const std::vector<std::pair<std::string, torch::Tensor>>& params,
    const std::vector<std::string>& order) {
  layout_ = FlatLayout::Of(params, order);
  for (const auto& [name, p] : params) {
    names_.push_back(name);
    params_.push_back(p);
  }
  for (const auto& e : layout_.entries)
    entry_param_.push_back(
        static_cast<size_t>(std::find(names_.begin(), names_.end(), e.name) - names_.begin()));
}

// Every parameter becomes a view of the flat buffers (bf16-mixed: of the compute buffers).
void DistributedOptimizer::MoveIntoFlatBuffers(
    const std::vector<std::pair<std::string, torch::Tensor>>& params,
    const torch::TensorOptions& opts) {
  std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
  if (mixed_) {
    // Before the gradients are allocated: the fp32 weights are released as they move.
    MoveIntoMixedBuffers(by_name, opts);
    return;
  }
  flat_params_ = torch::zeros({sharding_.padded_total}, opts);
  for (const auto& e : layout_.entries) {
    torch::Tensor& p = by_name[e.name];
    torch::Tensor view = flat_params_.narrow(0, e.offset, e.numel);
    view.copy_(p.reshape(-1));
    // The parameter keeps its identity (the model and autograd hold it); only its storage
    // moves.
    p.set_data(view.view(p.sizes()));
  }
}

// This rank's pieces of every parameter, in slice order.
void DistributedOptimizer::FindPieces() {
  for (size_t b = 0; b < sharding_.buckets.size(); ++b) {
    const auto& bucket = sharding_.buckets[b];
    for (size_t i = 0; i < layout_.entries.size(); ++i) {
      const auto& e = layout_.entries[i];
      const int64_t lo = std::max(bucket.own_begin, e.offset);
      const int64_t hi = std::min(bucket.own_end, e.offset + e.numel);
      if (lo < hi) pieces_.push_back({i, lo, hi - lo, sharding_.SliceOffset(b, lo)});
    }
  }
}

// AdamW's state for this rank's slice, and the reducer that fills its gradients.
void DistributedOptimizer::AllocateSliceState(const torch::TensorOptions& opts) {
  piece_steps_ = torch::zeros({static_cast<int64_t>(pieces_.size())}, opts);
  exp_avg_ = torch::zeros({sharding_.slice}, opts);
  exp_avg_sq_ = torch::zeros({sharding_.slice}, opts);
  std::vector<torch::Tensor> by_entry;
  for (size_t i = 0; i < layout_.entries.size(); ++i) by_entry.push_back(ParamOf(i));
  reducer_ = std::make_unique<GradientReducer>(std::move(by_entry), layout_, sharding_, stage_,
                                               group_, opts);
}

void DistributedOptimizer::ZeroGrad() {
  if (adamw_) return adamw_->ZeroGrad();
  reducer_->ZeroGrad();
}

absl::Status DistributedOptimizer::ExpectBackwards(int64_t backwards) {
  if (adamw_) return absl::OkStatus();
  return reducer_->ExpectBackwards(backwards);
}

absl::Status DistributedOptimizer::Backward(const torch::Tensor& loss) {
  if (adamw_) {
    loss.backward();
    return absl::OkStatus();
  }
  return reducer_->Backward(loss);
}

void DistributedOptimizer::ExpectLastBackward() {
  if (!adamw_) reducer_->ExpectLastBackward();
}

absl::StatusOr<double> DistributedOptimizer::ReduceAndClip(double max_norm, double grad_scale) {
  torch::NoGradGuard no_grad;
  if (adamw_) {
    if (grad_scale != 1.0) {
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().mul_(grad_scale);
    }
    return ClipGradNorm(params_, max_norm);
  }
  RETURN_IF_ERROR(reducer_->Finish());
  torch::Tensor& own = reducer_->slice();
  if (grad_scale != 1.0) own.mul_(grad_scale);
  // The global norm from each rank's squared norm of its own slice (the only gradients its AdamW
  // reads; the padding is zero), and only that slice is clipped: 1/N of the work on each rank.
  // NaN and inf propagate through the sum, so every rank sees the same non-finite norm and skips
  // the step.
  // A bucket's piece at a time: the fp64 sum of squares needs a copy of what it reads.
  torch::Tensor own_squares = torch::zeros({}, own.options().dtype(torch::kFloat64));
  for (const auto& b : sharding_.buckets)
    own_squares += torch::linalg_vector_norm(own.narrow(0, b.slice_begin, b.piece), 2, {}, false,
                                             torch::kFloat64)
                       .square();
  ASSIGN_OR_RETURN(std::vector<double> squares,
                   group_->AllReduceDoubles({own_squares.item<double>()}));
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

torch::Tensor DistributedOptimizer::MasterOf(const Piece& p) {
  return mixed_ ? master_.narrow(0, p.slice, p.length) : flat_params_.narrow(0, p.begin, p.length);
}

absl::Status DistributedOptimizer::ShardedStep(double lr) {
  torch::NoGradGuard no_grad;
  // The update's step count, one tensor per piece (a parameter may have several pieces), as
  // torch.optim.AdamW(fused=True) keeps them.
  piece_steps_.fill_(static_cast<double>(steps_ + 1));
  const torch::Tensor& grads = reducer_->slice();
  // This rank's pieces, one fused AdamW call per decay group.
  for (bool decay : {true, false}) {
    std::vector<torch::Tensor> p, g, m, v, t;
    for (size_t k = 0; k < pieces_.size(); ++k) {
      const Piece& piece = pieces_[k];
      if (layout_.entries[piece.entry].decay != decay) continue;
      p.push_back(MasterOf(piece));
      g.push_back(grads.narrow(0, piece.slice, piece.length));
      m.push_back(exp_avg_.narrow(0, piece.slice, piece.length));
      v.push_back(exp_avg_sq_.narrow(0, piece.slice, piece.length));
      t.push_back(piece_steps_[static_cast<int64_t>(k)]);
    }
    if (p.empty()) continue;
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, t, lr, config_.beta1, config_.beta2,
                      decay ? config_.weight_decay : 0.0, config_.eps, /*amsgrad=*/false,
                      /*maximize=*/false);
  }
  ++steps_;
  if (mixed_) return RefreshComputeCopies();
  return GatherWeights();
}

absl::Status DistributedOptimizer::GatherWeights() {
  const int world = group_->size(), rank = group_->rank();
  for (const auto& b : sharding_.buckets) {
    torch::Tensor out = flat_params_.narrow(0, b.begin, b.padded_length(world));
    torch::Tensor own = out.narrow(0, rank * b.piece, b.piece);
    if (gather_dtype_ == torch::kFloat32) {
      RETURN_IF_ERROR(group_->AllGather(out, own.clone()));
      continue;
    }
    torch::Tensor master = own.clone();
    torch::Tensor gathered = torch::empty({out.numel()}, own.options().dtype(gather_dtype_));
    RETURN_IF_ERROR(group_->AllGather(gathered, own.to(gather_dtype_)));
    out.copy_(gathered);
    own.copy_(master);  // this rank's piece stays the fp32 master
  }
  masters_synced_ = gather_dtype_ == torch::kFloat32;
  return absl::OkStatus();
}

absl::Status DistributedOptimizer::SyncMasters() {
  if (adamw_ || masters_synced_ || mixed_) return absl::OkStatus();
  torch::NoGradGuard no_grad;
  const int world = group_->size(), rank = group_->rank();
  for (const auto& b : sharding_.buckets) {
    torch::Tensor out = flat_params_.narrow(0, b.begin, b.padded_length(world));
    RETURN_IF_ERROR(group_->AllGather(out, out.narrow(0, rank * b.piece, b.piece).clone()));
  }
  masters_synced_ = true;
  return absl::OkStatus();
}

absl::Status DistributedOptimizer::CheckFinite() {
  torch::NoGradGuard no_grad;
  absl::Status mine = absl::OkStatus();
  // The first non-finite element of `t`, a run of flat elements from `flat_begin`.
  auto check = [&](const torch::Tensor& t, int64_t flat_begin) {
    if (!mine.ok() || t.numel() == 0 || torch::isfinite(t).all().item<bool>()) return;
    const int64_t at =
        torch::logical_not(torch::isfinite(t.reshape(-1))).nonzero()[0][0].item<int64_t>();
    const double value = t.reshape(-1)[at].item<double>();
    for (const auto& e : layout_.entries) {
      const int64_t x = flat_begin + at;
      if (x < e.offset || x >= e.offset + e.numel) continue;
      mine = absl::FailedPreconditionError(absl::StrCat("the weights are not finite: parameter ",
                                                        e.name, " element ", x - e.offset, " is ",
                                                        value, " on rank ", group_->rank()));
    }
  };
  if (adamw_) {
    for (size_t i = 0; i < layout_.entries.size(); ++i)
      check(ParamOf(i).detach().reshape(-1), layout_.entries[i].offset);
  } else {
    for (const Piece& p : pieces_) check(MasterOf(p), p.begin);
  }
  return AgreeOnStatus(*group_, mine);
}

int64_t DistributedOptimizer::steps() const {
  return adamw_ ? adamw_->steps() : steps_;
}

int64_t DistributedOptimizer::state_bytes() const {
  if (adamw_) return 2 * layout_.total * static_cast<int64_t>(sizeof(float));
  int64_t own = 0;
  for (const auto& [b, e] : sharding_.OwnedRanges()) own += e - b;
  return 2 * own * static_cast<int64_t>(sizeof(float));
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
  // This rank's owned ranges, in order, and the moments of each concatenated.
  nlohmann::json ranges = nlohmann::json::array();
  std::vector<torch::Tensor> m_parts, v_parts;
  for (size_t b = 0; b < sharding_.buckets.size(); ++b) {
    const auto& bucket = sharding_.buckets[b];
    if (bucket.own_begin >= bucket.own_end) continue;
    ranges.push_back({bucket.own_begin, bucket.own_end});
    const int64_t at = sharding_.SliceOffset(b, bucket.own_begin);
    m_parts.push_back(exp_avg_.narrow(0, at, bucket.own_end - bucket.own_begin));
    v_parts.push_back(exp_avg_sq_.narrow(0, at, bucket.own_end - bucket.own_begin));
  }
  auto host = [](const std::vector<torch::Tensor>& parts) {
    return parts.empty() ? torch::zeros({0}) : torch::cat(parts).to(torch::kCPU).contiguous();
  };
  torch::Tensor m = host(m_parts), v = host(v_parts);
  const std::vector<int64_t> shape{m.numel()};
  const size_t bytes = static_cast<size_t>(m.numel()) * sizeof(float);
  return lm::WriteSafetensors(dir + "/" + OptimizerShardFileName(group_->rank(), group_->size()),
                              {{"exp_avg", lm::DType::kF32, shape, m.data_ptr(), bytes},
                               {"exp_avg_sq", lm::DType::kF32, shape, v.data_ptr(), bytes}},
                              {{"format", kOptimizerShardFormat},
                               {"ranges", ranges.dump()},
                               {"total", std::to_string(layout_.total)},
                               {"world_size", std::to_string(group_->size())},
                               {"steps", std::to_string(steps_)},
                               {"layout", layout_.ToJson().dump()}});
}

absl::Status DistributedOptimizer::LoadState(const std::string& checkpoint_dir, int64_t steps) {
  // Each rank reads (and checks) only its own ranges: what one finds wrong, all report.
  return AgreeOnStatus(*group_, LoadOwnState(checkpoint_dir, steps));
}

absl::Status DistributedOptimizer::LoadOwnState(const std::string& checkpoint_dir, int64_t steps) {
  ASSIGN_OR_RETURN(std::unique_ptr<OptimizerStateReader> reader,
                   OptimizerStateReader::Open(checkpoint_dir, layout_));
  torch::NoGradGuard no_grad;
  if (adamw_) {
    std::map<std::string, torch::Tensor> tensors;
    for (size_t i = 0; i < layout_.entries.size(); ++i) {
      const auto& e = layout_.entries[i];
      for (const char* m : kOptimizerMoments) {
        torch::Tensor t = torch::empty(ParamOf(i).sizes(), torch::kFloat32);
        RETURN_IF_ERROR(reader->Read(m, e.offset, e.offset + e.numel, t.data_ptr<float>()));
        tensors[absl::StrCat(m, ".", e.name)] = t;
      }
    }
    absl::Status s = adamw_->LoadState(tensors, steps);
    if (!s.ok()) return absl::DataLossError(absl::StrCat(checkpoint_dir, ": ", s.message()));
    return absl::OkStatus();
  }
  for (size_t b = 0; b < sharding_.buckets.size(); ++b) {
    const auto& bucket = sharding_.buckets[b];
    const int64_t n = bucket.own_end - bucket.own_begin;
    if (n <= 0) continue;
    const int64_t at = sharding_.SliceOffset(b, bucket.own_begin);
    for (auto [m, dst] : {std::pair{kOptimizerMoments[0], &exp_avg_},
                          std::pair{kOptimizerMoments[1], &exp_avg_sq_}}) {
      torch::Tensor host = torch::empty({n}, torch::kFloat32);
      RETURN_IF_ERROR(reader->Read(m, bucket.own_begin, bucket.own_end, host.data_ptr<float>()));
      dst->narrow(0, at, n).copy_(host);
    }
  }
  steps_ = steps;
  return absl::OkStatus();
}

}  // namespace trainer
