#include "teacher_service/ep_teacher.h"

#include <stdexcept>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/model/batch_invariant.h"
#include "lm/model/expert_parallel.h"
#include "lm/util/bytes.h"

namespace teacher {
// The batch as the byte codec's three arrays (lm/util/bytes.h): ids, positions, bounds; then the
// mode.
std::string EncodeBatch(const EpForward& forward) {
  const lm::PackedBatch& batch = forward.batch;
  const auto ids = batch.input_ids.to(torch::kCPU).contiguous();
  const auto pos = batch.position_ids.to(torch::kCPU).contiguous();
  lm::ByteWriter out;
  out.PutArray(ids.data_ptr<int64_t>(), static_cast<size_t>(ids.numel()));
  out.PutArray(pos.data_ptr<int64_t>(), static_cast<size_t>(pos.numel()));
  out.PutVector(batch.cu_seqlens);
  out.Put<uint8_t>(forward.batch_invariant ? 1 : 0);
  return out.Take();
}

absl::StatusOr<EpForward> DecodeBatch(const std::string& bytes) {
  lm::ByteReader in(bytes);
  std::vector<int64_t> ids, pos;
  EpForward f;
  lm::PackedBatch& b = f.batch;
  uint8_t mode = 0;
  if (!in.GetVector(&ids) || !in.GetVector(&pos) || !in.GetVector(&b.cu_seqlens) ||
      !in.Get(&mode) || !in.done())
    return absl::InvalidArgumentError(absl::StrCat("truncated batch (", bytes.size(), " bytes)"));
  if (ids.size() != pos.size() || b.cu_seqlens.empty() ||
      b.cu_seqlens.back() != static_cast<int64_t>(ids.size()) || mode > 1)
    return absl::InvalidArgumentError(absl::StrCat("malformed batch: ", ids.size(), " ids, ",
                                                   pos.size(), " positions, ", b.cu_seqlens.size(),
                                                   " bounds, mode ", mode));
  const auto n = static_cast<int64_t>(ids.size());
  b.input_ids = torch::from_blob(ids.data(), {n}, torch::kInt64).clone();
  b.position_ids = torch::from_blob(pos.data(), {n}, torch::kInt64).clone();
  f.batch_invariant = mode == 1;
  return f;
}

EpLeaderModel::EpLeaderModel(std::shared_ptr<lm::CausalLM> model, opd::rpc::EpGroup* group)
    : lm::CausalLM(model->config()), model_(std::move(model)), group_(group) {}

torch::Tensor EpLeaderModel::Forward(const lm::PackedBatch& batch, const lm::ForwardOptions& opts) {
  torch::Tensor hidden;
  absl::Status st =
      group_->Run(EncodeBatch({batch, lm::BatchInvariant()}), [&](const std::string&) {
        hidden = model_->Forward(batch, opts);
        return absl::OkStatus();
      });
  if (!st.ok()) throw lm::CollectiveError(st);
  return hidden;
}

torch::Tensor EpLeaderModel::Decode(const torch::Tensor&, lm::KVCache&) {
  throw std::logic_error("the expert-parallel teacher only scores (no decode)");
}

lm::KVCache EpLeaderModel::NewKVCache(int64_t, int64_t) const {
  throw std::logic_error("the expert-parallel teacher only scores (no KV cache)");
}

opd::rpc::EpGroup::Work FollowerForwards(std::shared_ptr<lm::CausalLM> model) {
  return [model](const std::string& command) -> absl::Status {
    absl::StatusOr<EpForward> forward = DecodeBatch(command);
    if (!forward.ok()) throw std::runtime_error(std::string(forward.status().message()));
    torch::NoGradGuard no_grad;  // as the Scorer's workers
    lm::ScopedBatchInvariant invariant(forward->batch_invariant);
    lm::PackedBatch& batch = forward->batch;
    const torch::Device device = model->LmHeadWeight().device();
    batch.input_ids = batch.input_ids.to(device);
    batch.position_ids = batch.position_ids.to(device);
    model->Forward(batch);
    return absl::OkStatus();
  };
}

}  // namespace teacher
