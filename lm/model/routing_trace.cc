#include "lm/model/routing_trace.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace lm {

RoutingTrace::RoutingTrace(const ModelConfig& config)
    : top_k_(config.num_experts_per_tok), num_experts_(config.num_experts) {
  moe_index_.assign(config.num_hidden_layers, -1);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    if (!config.IsMoeLayer(i)) continue;
    moe_index_[i] = layers();
    moe_layers_.push_back(i);
  }
}

int64_t RoutingTrace::MoeIndex(int64_t layer) const {
  return layer >= 0 && layer < static_cast<int64_t>(moe_index_.size()) ? moe_index_[layer] : -1;
}

absl::Span<const int32_t> RoutingTrace::Positions(int64_t first, int64_t count) const {
  return absl::MakeConstSpan(ids_).subspan(first * per_position(), count * per_position());
}

absl::Status RoutingTrace::Append(absl::Span<const int32_t> ids) {
  if (per_position() == 0 || ids.size() % per_position() != 0)
    return absl::InvalidArgumentError(absl::StrCat("routing: ", ids.size(),
                                                   " ids are not whole positions of ", layers(),
                                                   " MoE layers x top_k ", top_k_));
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  return absl::OkStatus();
}

void RoutingTrace::AppendUnrouted(int64_t count) {
  ids_.insert(ids_.end(), count * per_position(), -1);
}

absl::Status RoutingTrace::Check(absl::string_view what, absl::Span<const int32_t> ids,
                                 int64_t layers, int64_t top_k, int64_t positions) const {
  if (layers != this->layers() || top_k != top_k_ ||
      static_cast<int64_t>(ids.size()) != positions * per_position())
    return absl::InvalidArgumentError(absl::StrCat(
        what, " holds ", ids.size(), " ids as [", layers, " layers, top_k ", top_k, "], expected ",
        positions, " positions x ", this->layers(), " MoE layers x top_k ", top_k_,
        " (was it recorded by a model of another architecture?)"));
  for (int32_t e : ids)
    if (e < 0 || e >= num_experts_)
      return absl::InvalidArgumentError(
          absl::StrCat(what, " names expert ", e, " of ", num_experts_));
  return absl::OkStatus();
}

absl::Status RoutingTrace::AppendRecorded(const std::vector<at::Tensor>& seen, int64_t rows) {
  if (static_cast<int64_t>(seen.size()) != layers())
    return absl::InternalError(absl::StrCat("return_routing: recorded ", seen.size(),
                                            " MoE layers in a forward, expected ", layers()));
  if (seen.empty()) return absl::OkStatus();
  const auto t = torch::stack(seen, 1).to(torch::kCPU, torch::kInt32).contiguous();
  if (t.size(0) != rows || t.size(2) != top_k_)
    return absl::InternalError(
        absl::StrCat("return_routing: recorded routing of shape [", t.size(0), ", ", t.size(1),
                     ", ", t.size(2), "], expected [", rows, ", ", layers(), ", ", top_k_, "]"));
  const int32_t* d = t.data_ptr<int32_t>();
  ids_.insert(ids_.end(), d, d + t.numel());
  return absl::OkStatus();
}

at::Tensor RoutingTrace::ToTensor() const {
  return torch::tensor(ids_, torch::kInt32).view({positions(), layers(), top_k_});
}

std::vector<at::Tensor> RoutingTrace::PerLayer() const {
  const auto t = ToTensor();
  std::vector<at::Tensor> out;
  for (int64_t j = 0; j < layers(); ++j) out.push_back(t.select(1, j));
  return out;
}

absl::Status RoutingTrace::CheckReplay(const at::Tensor& replay, int64_t tokens) const {
  if (replay.dim() == 3 && replay.size(0) == tokens && replay.size(1) == layers() &&
      replay.size(2) == top_k_)
    return absl::OkStatus();
  std::vector<int64_t> got(replay.sizes().begin(), replay.sizes().end());
  std::string shape;
  for (size_t i = 0; i < got.size(); ++i) absl::StrAppend(&shape, i ? ", " : "", got[i]);
  return absl::InvalidArgumentError(absl::StrCat("replay_experts must be [tokens=", tokens,
                                                 ", moe_layers=", layers(), ", top_k=", top_k_,
                                                 "], got [", shape, "]"));
}

at::Tensor RoutingTrace::LayerIds(const at::Tensor& replay, int64_t layer) const {
  const int64_t j = MoeIndex(layer);
  if (!replay.defined() || j < 0) return {};
  return replay.select(1, j);
}

}  // namespace lm
