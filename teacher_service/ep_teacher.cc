#include "teacher_service/ep_teacher.h"

#include <cstring>
#include <stdexcept>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/model/expert_parallel.h"

namespace teacher {
namespace {

void Append(std::string& out, const int64_t* data, size_t n) {
  out.append(reinterpret_cast<const char*>(data), n * sizeof(int64_t));
}

}  // namespace

std::string EncodeBatch(const lm::PackedBatch& batch) {
  const auto ids = batch.input_ids.to(torch::kCPU).contiguous();
  const auto pos = batch.position_ids.to(torch::kCPU).contiguous();
  const int64_t header[2] = {ids.numel(), static_cast<int64_t>(batch.cu_seqlens.size())};
  std::string out;
  out.reserve(sizeof(header) + (2 * header[0] + header[1]) * sizeof(int64_t));
  Append(out, header, 2);
  Append(out, ids.data_ptr<int64_t>(), ids.numel());
  Append(out, pos.data_ptr<int64_t>(), pos.numel());
  Append(out, batch.cu_seqlens.data(), batch.cu_seqlens.size());
  return out;
}

absl::StatusOr<lm::PackedBatch> DecodeBatch(const std::string& bytes) {
  int64_t header[2];
  if (bytes.size() < sizeof(header)) return absl::InvalidArgumentError("truncated batch");
  std::memcpy(header, bytes.data(), sizeof(header));
  const int64_t tokens = header[0], bounds = header[1];
  if (tokens < 0 || bounds < 1 ||
      bytes.size() != sizeof(header) + (2 * tokens + bounds) * sizeof(int64_t))
    return absl::InvalidArgumentError("malformed batch");
  const char* p = bytes.data() + sizeof(header);
  lm::PackedBatch b;
  b.input_ids = torch::empty({tokens}, torch::kInt64);
  b.position_ids = torch::empty({tokens}, torch::kInt64);
  std::memcpy(b.input_ids.data_ptr(), p, tokens * sizeof(int64_t));
  std::memcpy(b.position_ids.data_ptr(), p + tokens * sizeof(int64_t), tokens * sizeof(int64_t));
  b.cu_seqlens.resize(bounds);
  std::memcpy(b.cu_seqlens.data(), p + 2 * tokens * sizeof(int64_t), bounds * sizeof(int64_t));
  return b;
}

EpLeaderModel::EpLeaderModel(std::shared_ptr<lm::CausalLM> model, opd::rpc::EpGroup* group)
    : lm::CausalLM(model->config()), model_(std::move(model)), group_(group) {}

torch::Tensor EpLeaderModel::Forward(const lm::PackedBatch& batch, const lm::ForwardOptions& opts) {
  torch::Tensor hidden;
  absl::Status st = group_->Run(EncodeBatch(batch), [&](const std::string&) {
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
    absl::StatusOr<lm::PackedBatch> batch = DecodeBatch(command);
    if (!batch.ok()) throw std::runtime_error(std::string(batch.status().message()));
    torch::NoGradGuard no_grad;  // as the Scorer's workers
    const torch::Device device = model->LmHeadWeight().device();
    batch->input_ids = batch->input_ids.to(device);
    batch->position_ids = batch->position_ids.to(device);
    model->Forward(*batch);
    return absl::OkStatus();
  };
}

}  // namespace teacher
