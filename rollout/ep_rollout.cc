#include "rollout/ep_rollout.h"

#include <cstring>
#include <stdexcept>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/model.h"
#include "lm/util/bytes.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "rpc/tensor_codec.h"

namespace rollout {

using lm::FinishReason;
using lm::Sample;
using lm::SamplingParams;
namespace {

// Command kinds (the first byte).
constexpr char kGenerate = 'G', kBegin = 'B', kChunk = 'A', kCommit = 'C', kAbort = 'X';

// A command: its kind, then the update's id, then its fields (lm/util/bytes.h).
lm::ByteWriter Header(char kind, uint64_t id) {
  lm::ByteWriter out;
  out.Put(kind);
  out.Put(id);
  return out;
}

bool IsFusedExperts(std::string_view name) {
  auto ends = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
  };
  return ends(".experts.gate_up_proj") || ends(".experts.down_proj");
}

}  // namespace

EpRollout::EpRollout(opd::rpc::EpGroup* group, WeightStore* store, int64_t max_batch_kv_bytes)
    : group_(group), store_(store), max_batch_kv_bytes_(max_batch_kv_bytes) {}
EpRollout::~EpRollout() = default;

// ---- Generate ----

absl::Status EpRollout::SampleLocal(const std::string& command, const Snapshot* leader_snapshot,
                                    const std::function<void(Sample)>& on_sample,
                                    const std::function<bool()>& cancelled) {
  const nlohmann::json j = nlohmann::json::parse(command.substr(1));
  const auto prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  SamplingParams p;
  p.samples_per_prompt = j.at("samples_per_prompt").get<int64_t>();
  p.temperature = j.at("temperature").get<double>();
  p.top_k = j.at("top_k").get<int64_t>();
  p.top_p = j.at("top_p").get<double>();
  p.max_new_tokens = j.at("max_new_tokens").get<int64_t>();
  p.stop_ids = j.at("stop_ids").get<std::vector<int32_t>>();
  p.seed = j.at("seed").get<int64_t>();
  p.seed_indices = j.at("seed_indices").get<std::vector<int64_t>>();
  const int64_t version = j.at("version").get<int64_t>();
  const int64_t batch_kv_bytes = j.at("batch_kv_bytes").get<int64_t>();
  const Snapshot snapshot = leader_snapshot ? *leader_snapshot : store_->Current();
  // Every rank must sample with the same weights: the followers have only the serving ones.
  if (group_->AnyRank(store_->Current().version != version))
    return absl::AbortedError(absl::StrCat("weight version ", version,
                                           " was replaced while this request waited for the "
                                           "expert-parallel group; retry"));
  return lm::SampleResponses(
             *snapshot.model, prompts, p, on_sample,
             [&] { return group_->AnyRank(cancelled && cancelled()); }, snapshot.lm_head.get(),
             batch_kv_bytes)
      .status();
}

absl::Status EpRollout::Generate(const Snapshot& snapshot,
                                 const std::vector<std::vector<int32_t>>& prompts,
                                 const SamplingParams& params,
                                 const std::function<void(Sample)>& on_sample,
                                 const std::function<bool()>& cancelled) {
  if (params.return_routing)
    return absl::UnimplementedError(
        "return_routing: this worker's sampler (expert-parallel) does not record routing");
  // Requests are small (token ids); JSON keeps the format obvious. Doubles round-trip exactly.
  const nlohmann::json j = {{"prompts", prompts},
                            {"samples_per_prompt", params.samples_per_prompt},
                            {"temperature", params.temperature},
                            {"top_k", params.top_k},
                            {"top_p", params.top_p},
                            {"max_new_tokens", params.max_new_tokens},
                            {"stop_ids", params.stop_ids},
                            {"seed", params.seed},
                            {"seed_indices", params.seed_indices},
                            {"version", snapshot.version},
                            {"batch_kv_bytes", max_batch_kv_bytes_}};
  return group_->Run(std::string(1, kGenerate) + j.dump(), [&](const std::string& command) {
    return SampleLocal(command, &snapshot, on_sample, cancelled);
  });
}

opd::rpc::EpGroup::Work EpRollout::FollowerWork() {
  return [this](const std::string& command) -> absl::Status {
    if (command.empty()) throw std::runtime_error("empty expert-parallel command");
    if (command[0] == kGenerate)
      return SampleLocal(
          command, nullptr, [](Sample) {}, nullptr);
    return Apply(command);
  };
}

// ---- weight pushes ----

absl::Status EpRollout::Apply(const std::string& command) {
  lm::ByteReader r(command);
  const auto truncated = [&] {
    return absl::DataLossError(
        absl::StrCat("truncated expert-parallel command (", command.size(), " bytes)"));
  };
  char kind = 0;
  uint64_t id = 0;
  if (!r.Get(&kind) || !r.Get(&id)) return truncated();
  switch (kind) {
    case kBegin: {
      int64_t version = 0;
      if (!r.Get(&version)) return truncated();
      auto staged = store_->Stage(version);  // this rank's shapes: its experts only
      if (!staged.ok()) return staged.status();
      staging_[id].staged = std::move(*staged);
      return absl::OkStatus();
    }
    case kChunk: {
      WireTensor v;
      std::string_view name;
      int32_t dtype = 0;
      if (!r.GetString(&name) || !r.GetVector(&v.shape) || !r.Get(&dtype) || !r.Get(&v.offset) ||
          !r.GetString(&v.data) || !r.done())
        return truncated();
      if (dtype < 0 || dtype > static_cast<int32_t>(WireDtype::kFloat16))
        return absl::InternalError(absl::StrCat("expert-parallel chunk of dtype ", dtype));
      v.name = std::string(name);
      v.dtype = static_cast<WireDtype>(dtype);
      return AddLocal(id, v);
    }
    case kCommit:
      return CommitLocal(id);
    case kAbort:
      staging_.erase(id);
      return absl::OkStatus();
  }
  throw std::runtime_error(absl::StrCat("unknown expert-parallel command ", int{kind}));
}

absl::Status EpRollout::AddLocal(uint64_t id, const WireTensor& chunk) {
  auto it = staging_.find(id);
  if (it == staging_.end()) return absl::FailedPreconditionError("no such update");
  Staging& s = it->second;
  // The whole tensor's byte order is checked here, on every rank, so that a rank that keeps
  // none of a chunk still refuses what the others refuse.
  if (chunk.name != s.name) {
    s.name = chunk.name;
    s.expected = 0;
  }
  if (chunk.offset != s.expected)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", s.name, "': chunk at byte ",
                                                   chunk.offset, ", expected byte ", s.expected));
  s.expected += static_cast<int64_t>(chunk.data.size());
  const lm::ModelConfig& c = store_->Current().model->config();
  const bool sharded = c.local_experts > 0 && c.local_experts != c.num_experts;
  absl::Status st;
  if (!sharded || !IsFusedExperts(chunk.name) || chunk.shape.empty()) {
    st = s.staged->Add(chunk);
  } else if (chunk.shape[0] != c.num_experts) {
    st = absl::InvalidArgumentError(absl::StrCat("tensor '", chunk.name, "': ", chunk.shape[0],
                                                 " experts, the model has ", c.num_experts));
  } else {
    // This rank's rows [first, first + count) of the [E, ...] tensor, in wire bytes.
    int64_t row = opd::rpc::WireDtypeSize(chunk.dtype);
    for (size_t d = 1; d < chunk.shape.size(); ++d) row *= chunk.shape[d];
    const int64_t lo = c.expert_first * row, hi = (c.expert_first + c.local_experts) * row;
    const int64_t begin = std::max(lo, chunk.offset),
                  end = std::min(hi, chunk.offset + static_cast<int64_t>(chunk.data.size()));
    if (begin >= end) return absl::OkStatus();  // none of it is this rank's
    WireTensor mine = chunk;
    mine.shape[0] = c.local_experts;
    mine.offset = begin - lo;
    mine.data = chunk.data.substr(begin - chunk.offset, end - begin);
    st = s.staged->Add(mine);
  }
  if (!st.ok() && s.error.ok()) s.error = st;
  return st;
}

absl::Status EpRollout::CommitLocal(uint64_t id) {
  auto it = staging_.find(id);
  absl::Status mine = it == staging_.end()     ? absl::FailedPreconditionError("no such update")
                      : !it->second.error.ok() ? it->second.error
                                               : it->second.staged->CheckComplete();
  std::unique_ptr<StagedWeights> staged;
  if (it != staging_.end()) {
    staged = std::move(it->second.staged);
    staging_.erase(it);
  }
  // All ranks swap, or none: a copy incomplete anywhere keeps every rank on the old weights.
  if (group_->AnyRank(!mine.ok())) {
    if (!mine.ok()) return mine;
    return absl::InvalidArgumentError(
        "another rank's copy of the update is incomplete; no rank swapped (see its log)");
  }
  // The new model's MoE layers run on the group like the old one's (inside this command: no
  // sampling sees the new weights before they do).
  auto ep = lm::ExpertParallelOf(*store_->Current().model);
  RETURN_IF_ERROR(store_->Commit(std::move(staged)));
  lm::AttachExpertParallel(*store_->Current().model, std::move(ep));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<EpRollout::Update>> EpRollout::BeginUpdate(int64_t version) {
  const uint64_t id = next_id_++;
  lm::ByteWriter command = Header(kBegin, id);
  command.Put(version);
  std::unique_ptr<Update> update(new Update(this, id, version));
  absl::Status st =
      group_->Run(command.Take(), [this](const std::string& cmd) { return Apply(cmd); });
  if (!st.ok()) {
    update->open_ = false;  // staging failed the same way on every rank: nothing to drop
    return st;
  }
  return update;
}

absl::Status EpRollout::Update::Add(const WireTensor& chunk) {
  lm::ByteWriter command = Header(kChunk, id_);
  command.PutString(chunk.name);
  command.PutVector(chunk.shape);
  command.Put(static_cast<int32_t>(chunk.dtype));
  command.Put(chunk.offset);
  command.PutString(chunk.data);
  if (chunk.name != last_name_) {
    last_name_ = chunk.name;
    ++tensors_;
  }
  bytes_ += static_cast<int64_t>(chunk.data.size());
  return ep_->group_->Run(command.Take(),
                          [this](const std::string& cmd) { return ep_->Apply(cmd); });
}

absl::Status EpRollout::Update::Commit() {
  open_ = false;
  return ep_->group_->Run(Header(kCommit, id_).Take(),
                          [this](const std::string& cmd) { return ep_->Apply(cmd); });
}

EpRollout::Update::~Update() {
  if (!open_) return;
  // An update that failed or was interrupted: every rank drops its staged copy.
  ep_->group_
      ->Run(Header(kAbort, id_).Take(), [this](const std::string& cmd) { return ep_->Apply(cmd); })
      .IgnoreError();
}

}  // namespace rollout
