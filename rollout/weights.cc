#include "rollout/weights.h"

#include <cstring>
#include <set>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lm/generate/sampler.h"
#include "lm/model/model.h"
#include "lm/util/status.h"
#include "rpc/tensor_codec.h"

namespace rollout {
namespace {

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape.vec(), ", "), "]");
}

}  // namespace

StagedWeights::StagedWeights(std::shared_ptr<lm::CausalLM> model, int64_t version,
                             int64_t base_version)
    : model_(std::move(model)), version_(version), base_version_(base_version) {}

StagedWeights::~StagedWeights() = default;

// The first chunk of a tensor fixes its wire dtype (announced updates: the announced one).
absl::Status StagedWeights::Begin(const std::string& name, Target& t, const ChunkView& chunk) {
  if (chunk.shape != t.tensor.sizes().vec()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': shape ",
                                                   ShapeString(chunk.shape), ", the model's is ",
                                                   ShapeString(t.tensor.sizes())));
  }
  if (!t.wire_dtype.empty() && chunk.dtype != t.wire_dtype) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': dtype ",
                                                   std::string(chunk.dtype),
                                                   ", the manifest announced ", t.wire_dtype));
  }
  auto wire = opd::rpc::DtypeFromName(std::string(chunk.dtype));
  if (!wire.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': ", wire.status().message()));
  t.wire_dtype = std::string(chunk.dtype);
  t.wire = *wire;
  t.total = t.tensor.numel() * static_cast<int64_t>(c10::elementSize(t.wire));
  // Bytes go straight into the parameter when they are its own dtype on the host; otherwise
  // they gather in a buffer that is cast (and moved to the device) once complete.
  if (t.wire != t.tensor.scalar_type() || !t.tensor.device().is_cpu())
    t.buffer = torch::empty({t.total}, torch::kUInt8);
  t.started = true;
  return absl::OkStatus();
}

absl::Status StagedWeights::Finish(const std::string& name, Target& t) {
  ++complete_;
  t.done = true;
  if (t.checksum.has_value()) {
    const uint64_t got = t.hash.Digest();
    if (got != *t.checksum) {
      return absl::DataLossError(absl::StrFormat(
          "tensor '%s': its %d bytes have checksum %016x, the manifest announced %016x", name,
          t.total, got, *t.checksum));
    }
  }
  if (t.buffer.defined()) {
    torch::NoGradGuard no_grad;
    t.tensor.copy_(t.buffer.view(t.wire).view(t.tensor.sizes()));
    t.buffer = torch::Tensor();
  }
  return CheckFinite(name, t);
}

// Weights with a NaN or an infinity make every log-prob sampled from them NaN: such an update is
// refused whole. Checked in the model's dtype, so that a wire value the cast overflows (an fp32
// 1e5 into float16) counts too; one device sync per tensor.
absl::Status StagedWeights::CheckFinite(const std::string& name, const Target& t) {
  torch::NoGradGuard no_grad;
  if (!t.tensor.is_floating_point() || torch::isfinite(t.tensor).all().item<bool>())
    return absl::OkStatus();
  const int64_t bad = torch::isfinite(t.tensor).logical_not().sum().item<int64_t>();
  const std::string model_dtype = opd::rpc::DtypeName(t.tensor.scalar_type());
  return absl::InvalidArgumentError(
      absl::StrCat("tensor '", name, "': ", bad, " of its ", t.tensor.numel(),
                   " values are not finite (NaN or infinity)",
                   t.wire_dtype == model_dtype
                       ? ""
                       : absl::StrCat(" after the cast from ", t.wire_dtype, " to ", model_dtype),
                   "; the update is refused and the serving weights stay"));
}

absl::Status StagedWeights::Add(const ChunkView& chunk) {
  auto it = targets_.find(chunk.name);
  if (it == targets_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", std::string(chunk.name), "' is not a parameter of the model"));
  }
  const std::string& name = it->first;
  Target& t = it->second;
  if (!t.expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' is not in the update's manifest"));
  }
  if (name != current_) {
    if (!current_.empty()) {
      const Target& prev = targets_.find(current_)->second;
      if (prev.filled != prev.total) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", current_, "' ended after ",
                                                       prev.filled, " of ", prev.total, " bytes"));
      }
    }
    if (t.started) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' was sent twice"));
    }
    current_ = name;
    RETURN_IF_ERROR(Begin(name, t, chunk));
  } else if (chunk.shape != t.tensor.sizes().vec() || chunk.dtype != t.wire_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': a chunk with shape ", ShapeString(chunk.shape),
                     " and dtype ", std::string(chunk.dtype), " after chunks with ",
                     ShapeString(t.tensor.sizes()), " and ", t.wire_dtype));
  }
  if (t.done) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' was already complete"));
  }
  if (chunk.offset != t.filled) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': chunk at byte ",
                                                   chunk.offset, ", expected byte ", t.filled));
  }
  if (t.filled + static_cast<int64_t>(chunk.data.size()) > t.total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': ", t.filled + chunk.data.size(), " bytes, more than its ", t.total));
  }
  if (!chunk.data.empty()) {
    char* dst = static_cast<char*>(t.buffer.defined() ? t.buffer.data_ptr() : t.tensor.data_ptr());
    std::memcpy(dst + t.filled, chunk.data.data(), chunk.data.size());
    if (t.checksum.has_value()) t.hash.Update(chunk.data.data(), chunk.data.size());
  }
  t.filled += static_cast<int64_t>(chunk.data.size());
  bytes_ += static_cast<int64_t>(chunk.data.size());
  if (t.filled == t.total) return Finish(name, t);
  return absl::OkStatus();
}

absl::Status StagedWeights::CheckComplete() const {
  std::vector<std::string> missing;
  size_t expected = 0;
  for (const auto& [name, t] : targets_) {
    if (!t.expected) continue;
    ++expected;
    if (!t.started || t.filled != t.total) missing.push_back(name);
  }
  if (missing.empty()) return absl::OkStatus();
  const size_t shown = std::min<size_t>(missing.size(), 5);
  return absl::InvalidArgumentError(
      absl::StrCat(missing.size(), " of ", expected, " tensors missing or incomplete: ",
                   absl::StrJoin(missing.begin(), missing.begin() + shown, ", "),
                   missing.size() > shown ? ", ..." : ""));
}

WeightStore::WeightStore(std::shared_ptr<lm::CausalLM> model, int64_t version)
    : model_(std::move(model)), lm_head_(lm::PackLmHead(*model_)), version_(version) {}

Snapshot WeightStore::Current() const {
  absl::MutexLock lock(&mu_);
  return Snapshot{model_, version_, lm_head_};
}

namespace {

absl::Status CheckVersion(int64_t version, int64_t serving) {
  if (version >= kMaxWeightVersion)
    return absl::InvalidArgumentError(
        absl::StrCat("weight version ", version, " is not below 2^53 = ", kMaxWeightVersion,
                     ", the first version refused (rollout/weights.h)"));
  if (version > serving) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("weight version ", version, " is not above the serving version ", serving));
}

// A new model of the serving architecture, dtype and device with uninitialised parameters.
absl::StatusOr<std::shared_ptr<lm::CausalLM>> FreshModel(lm::CausalLM& like) {
  const auto ref = like.LmHeadWeight();
  ASSIGN_OR_RETURN(
      auto fresh, lm::CreateModel(like.config(), lm::LoadOptions{ref.scalar_type(), ref.device()}));
  fresh->eval();
  for (auto& p : fresh->parameters()) p.set_requires_grad(false);
  return fresh;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StagedWeights>> WeightStore::Stage(int64_t version) const {
  Snapshot cur = Current();
  RETURN_IF_ERROR(CheckVersion(version, cur.version));
  // Every parameter is then overwritten by the stream (CheckComplete makes sure).
  ASSIGN_OR_RETURN(auto fresh, FreshModel(*cur.model));
  auto staged = std::unique_ptr<StagedWeights>(new StagedWeights(fresh, version, -1));
  for (const auto& p : fresh->named_parameters()) staged->targets_[p.key()].tensor = p.value();
  return staged;
}

absl::StatusOr<std::unique_ptr<StagedWeights>> WeightStore::StageAnnounced(
    int64_t version, const std::vector<AnnouncedTensor>& announced,
    std::optional<int64_t> base_version) const {
  Snapshot cur = Current();
  RETURN_IF_ERROR(CheckVersion(version, cur.version));
  if (base_version.has_value() && *base_version != cur.version)
    return absl::FailedPreconditionError(
        absl::StrCat("weight version ", version, " updates version ", *base_version,
                     ", but version ", cur.version, " is serving (send every tensor)"));
  // Everything is checked against the serving model before anything is copied.
  std::map<std::string, torch::Tensor> serving;
  opd::rpc::ParamShapes shapes;
  for (const auto& p : cur.model->named_parameters()) {
    serving[p.key()] = p.value();
    shapes[p.key()] = p.value().sizes().vec();
  }
  ASSIGN_OR_RETURN(const int64_t bytes, opd::rpc::CheckAnnounced(announced, shapes));
  std::set<std::string> seen;
  for (const AnnouncedTensor& a : announced) seen.insert(a.name);
  std::shared_ptr<lm::CausalLM> model = cur.model;  // nothing announced: the same weights
  if (!announced.empty()) {
    ASSIGN_OR_RETURN(model, FreshModel(*cur.model));
    torch::NoGradGuard no_grad;
    for (const auto& p : model->named_parameters())
      if (!seen.count(p.key())) p.value().copy_(serving.at(p.key()));
  }
  auto staged = std::unique_ptr<StagedWeights>(new StagedWeights(model, version, cur.version));
  staged->expected_bytes_ = bytes;
  for (const auto& p : model->named_parameters()) {
    StagedWeights::Target& t = staged->targets_[p.key()];
    t.tensor = p.value();
    t.expected = false;
  }
  for (const AnnouncedTensor& a : announced) {
    StagedWeights::Target& t = staged->targets_.at(a.name);
    t.expected = true;
    t.checksum = a.checksum;
    t.wire_dtype = a.dtype;
  }
  return staged;
}

absl::Status WeightStore::Commit(std::unique_ptr<StagedWeights> staged) {
  RETURN_IF_ERROR(staged->CheckComplete());
  std::shared_ptr<const lm::PackedWeight> lm_head;
  {
    absl::MutexLock lock(&mu_);
    if (staged->model_ == model_) lm_head = lm_head_;  // the same weights under a new version
  }
  // Packed before taking the lock: generations keep running on the old version meanwhile.
  if (!lm_head) lm_head = lm::PackLmHead(*staged->model_);
  std::shared_ptr<lm::CausalLM> old;  // released outside the lock
  std::shared_ptr<const lm::PackedWeight> old_head;
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckVersion(staged->version(), version_));
  if (staged->base_version_ >= 0 && staged->base_version_ != version_) {
    return absl::FailedPreconditionError(
        absl::StrCat("weight version ", staged->version(), " updates version ",
                     staged->base_version_, ", but version ", version_,
                     " was committed meanwhile (its unsent tensors would be stale)"));
  }
  old = std::move(model_);
  old_head = std::move(lm_head_);
  model_ = std::move(staged->model_);
  lm_head_ = std::move(lm_head);
  version_ = staged->version();
  return absl::OkStatus();
}

}  // namespace rollout
