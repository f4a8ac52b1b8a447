#include "rollout/weights.h"

#include <cstring>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lm/model/cpu_inference.h"
#include "lm/model/model.h"
#include "lm/util/status.h"
#include "rpc/tensor_codec.h"

namespace rollout {
namespace {

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape.vec(), ", "), "]");
}

}  // namespace

StagedWeights::StagedWeights(std::shared_ptr<lm::CausalLM> model, int64_t version)
    : model_(std::move(model)), version_(version) {
  for (const auto& p : model_->named_parameters()) targets_[p.key()] = Target{p.value(), 0, false};
}

StagedWeights::~StagedWeights() = default;

absl::Status StagedWeights::Add(const ChunkView& chunk) {
  const std::string name(chunk.name);
  auto it = targets_.find(name);
  if (it == targets_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' is not a parameter of the model"));
  }
  Target& t = it->second;
  if (name != current_) {
    if (!current_.empty()) {
      const Target& prev = targets_.at(current_);
      if (prev.filled != static_cast<int64_t>(prev.tensor.nbytes())) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", current_, "' ended after ",
                                                       prev.filled, " of ", prev.tensor.nbytes(),
                                                       " bytes"));
      }
    }
    if (t.started) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' was sent twice"));
    }
    current_ = name;
    t.started = true;
  }
  if (chunk.shape != t.tensor.sizes().vec()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': shape ",
                                                   ShapeString(chunk.shape), ", the model's is ",
                                                   ShapeString(t.tensor.sizes())));
  }
  const std::string want = opd::rpc::DtypeName(t.tensor.scalar_type());
  if (chunk.dtype != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': dtype ", std::string(chunk.dtype), ", the model's is ", want));
  }
  const int64_t total = static_cast<int64_t>(t.tensor.nbytes());
  if (chunk.offset != t.filled) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': chunk at byte ",
                                                   chunk.offset, ", expected byte ", t.filled));
  }
  if (t.filled + static_cast<int64_t>(chunk.data.size()) > total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': ", t.filled + chunk.data.size(), " bytes, more than its ", total));
  }
  if (!chunk.data.empty()) {
    std::memcpy(static_cast<char*>(t.tensor.data_ptr()) + t.filled, chunk.data.data(),
                chunk.data.size());
  }
  t.filled += static_cast<int64_t>(chunk.data.size());
  bytes_ += static_cast<int64_t>(chunk.data.size());
  if (t.filled == total) ++complete_;
  return absl::OkStatus();
}

absl::Status StagedWeights::CheckComplete() const {
  std::vector<std::string> missing;
  for (const auto& [name, t] : targets_) {
    if (!t.started || t.filled != static_cast<int64_t>(t.tensor.nbytes())) missing.push_back(name);
  }
  if (missing.empty()) return absl::OkStatus();
  const size_t shown = std::min<size_t>(missing.size(), 5);
  return absl::InvalidArgumentError(
      absl::StrCat(missing.size(), " of ", targets_.size(), " tensors missing or incomplete: ",
                   absl::StrJoin(missing.begin(), missing.begin() + shown, ", "),
                   missing.size() > shown ? ", ..." : ""));
}

namespace {

std::shared_ptr<const lm::PackedLinear> PackLmHead(lm::CausalLM& model) {
  torch::NoGradGuard no_grad;
  auto packed = lm::PackedLinear::Pack(model.LmHeadWeight());
  if (!packed) return nullptr;
  return std::make_shared<const lm::PackedLinear>(std::move(*packed));
}

}  // namespace

WeightStore::WeightStore(std::shared_ptr<lm::CausalLM> model, int64_t version)
    : model_(std::move(model)), lm_head_(PackLmHead(*model_)), version_(version) {}

Snapshot WeightStore::Current() const {
  absl::MutexLock lock(&mu_);
  return Snapshot{model_, version_, lm_head_};
}

absl::StatusOr<std::unique_ptr<StagedWeights>> WeightStore::Stage(int64_t version) const {
  Snapshot cur = Current();
  if (version <= cur.version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "weight version ", version, " is not above the serving version ", cur.version));
  }
  // A new, uninitialised model of the same architecture, dtype and device: every parameter is
  // then overwritten by the stream (CheckComplete makes sure).
  ASSIGN_OR_RETURN(auto fresh, lm::CreateModel(cur.model->config()));
  const auto ref = cur.model->LmHeadWeight();
  fresh->to(ref.device(), ref.scalar_type());
  fresh->eval();
  for (auto& p : fresh->parameters()) p.set_requires_grad(false);
  return std::make_unique<StagedWeights>(std::move(fresh), version);
}

absl::Status WeightStore::Commit(std::unique_ptr<StagedWeights> staged) {
  RETURN_IF_ERROR(staged->CheckComplete());
  // Packed before taking the lock: generations keep running on the old version meanwhile.
  std::shared_ptr<const lm::PackedLinear> lm_head = PackLmHead(*staged->model_);
  std::shared_ptr<lm::CausalLM> old;  // released outside the lock
  std::shared_ptr<const lm::PackedLinear> old_head;
  absl::MutexLock lock(&mu_);
  if (staged->version() <= version_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "weight version ", staged->version(), " is not above the serving version ", version_));
  }
  old = std::move(model_);
  old_head = std::move(lm_head_);
  model_ = std::move(staged->model_);
  lm_head_ = std::move(lm_head);
  version_ = staged->version();
  return absl::OkStatus();
}

}  // namespace rollout
