// Routing replay's record (R3): for every position fed to a MoE model, the top-k experts each of
// its MoE layers routed it to. The sampler and the rollout engine record it
// (ScopedRoutingRecorder, lm/model/moe.h), a sample carries it (lm::Sample::routed_experts,
// routing_layers, routing_top_k), the engine's recompute of a preempted sequence and the learner
// replay it (ScopedRoutingReplay, ForwardOptions::replay_experts). RoutingTrace is the one owner
// of its layout:
//
//   ids [positions, layers, top_k] int32, row-major; position p, MoE layer j, slot s at
//   (p * layers + j) * top_k + s; MoE layer j is the j-th decoder layer that is MoE
//   (ModelConfig::IsMoeLayer), in layer order; -1 marks a position not to replay (the router
//   takes its own top-k there).
//
// No tensors in this header: the functions that take or give them only name at::Tensor, and the
// files that call them include torch themselves.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "lm/model/config.h"

namespace at {
class Tensor;
}

namespace lm {

class RoutingTrace {
 public:
  RoutingTrace() = default;
  // No positions yet, in the layout of `config`'s model.
  explicit RoutingTrace(const ModelConfig& config);

  // ---- the layout
  int64_t layers() const { return static_cast<int64_t>(moe_layers_.size()); }  // MoE layers
  int64_t top_k() const { return top_k_; }
  int64_t num_experts() const { return num_experts_; }
  int64_t per_position() const { return layers() * top_k_; }  // ids of one position
  // Whether a model of this layout has routing to record (some MoE layer, top_k > 0).
  bool recordable() const { return per_position() > 0; }
  // Index of decoder layer `layer` among the MoE layers; -1 when it is dense.
  int64_t MoeIndex(int64_t layer) const;

  // ---- the record
  int64_t positions() const { return per_position() > 0 ? ids_.size() / per_position() : 0; }
  const std::vector<int32_t>& ids() const { return ids_; }
  // The ids of positions [first, first + count).
  absl::Span<const int32_t> Positions(int64_t first, int64_t count) const;
  // Appends whole positions (ids.size() a multiple of per_position()).
  absl::Status Append(absl::Span<const int32_t> ids);
  // Appends `count` positions of -1: not replayed.
  void AppendUnrouted(int64_t count);
  // Moves the ids out (the trace is then empty).
  std::vector<int32_t> TakeIds() { return std::move(ids_); }

  // A record as a sample carries it (its ids as [positions, layers, top_k]) checked against this
  // layout: INVALID_ARGUMENT naming what differs (the layers, top_k, the number of ids for
  // `positions` positions, an expert id out of [0, num_experts)). `what` starts the message.
  absl::Status Check(absl::string_view what, absl::Span<const int32_t> ids, int64_t layers,
                     int64_t top_k, int64_t positions) const;

  // ---- tensors
  // Appends `rows` positions from what a ScopedRoutingRecorder saw over one forward of `rows`
  // tokens (per MoE layer, in layer order, [rows, top_k] ids on any device). INTERNAL when it did
  // not see this layout's layers of top_k ids (a model whose routing bypasses SparseMoeBlock).
  absl::Status AppendRecorded(const std::vector<at::Tensor>& seen, int64_t rows);
  // The record as ForwardOptions::replay_experts: [positions, layers, top_k] int32 on the host.
  at::Tensor ToTensor() const;
  // The record per MoE layer, [positions, top_k] each: what ScopedRoutingReplay routes through.
  std::vector<at::Tensor> PerLayer() const;
  // Checks replay_experts [tokens, layers, top_k]; INVALID_ARGUMENT naming the shape it has and
  // the one it needs.
  absl::Status CheckReplay(const at::Tensor& replay, int64_t tokens) const;
  // Decoder layer `layer`'s ids [tokens, top_k] in replay_experts (checked by CheckReplay), or an
  // undefined tensor for a dense layer or an undefined replay.
  at::Tensor LayerIds(const at::Tensor& replay, int64_t layer) const;

 private:
  std::vector<int64_t> moe_index_;   // per decoder layer, -1 when dense
  std::vector<int64_t> moe_layers_;  // the decoder layer of each MoE layer
  int64_t top_k_ = 0, num_experts_ = 0;
  std::vector<int32_t> ids_;
};

}  // namespace lm
