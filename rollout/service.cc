#include "rollout/service.h"

#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "lm/model/model.h"
#include "lm/model/placement.h"
#include "lm/util/status.h"
#include "lm/util/threads.h"
#include "rollout/ep_rollout.h"
#include "rollout/generate_request.h"
#include "rpc/codec.h"
#include "rpc/status.h"

namespace rollout {

using lm::FinishReason;
using lm::Sample;
using lm::SamplingParams;
namespace {

opd::v1::Sample ToProto(const Sample& s, int64_t version) {
  opd::v1::Sample m;
  m.set_prompt_index(static_cast<int32_t>(s.prompt_index));
  m.set_sample_index(static_cast<int32_t>(s.sample_index));
  const auto response = s.response();  // the client holds the prompt
  m.mutable_tokens()->Add(response.begin(), response.end());
  opd::rpc::PackArray(s.logprobs.data(), s.logprobs.size(), m.mutable_logprobs());
  m.set_finish_reason(s.finish == FinishReason::kStop ? opd::v1::FINISH_REASON_STOP
                                                      : opd::v1::FINISH_REASON_LENGTH);
  m.set_weight_version(version);
  if (!s.routed_experts.empty()) {
    opd::rpc::PackArray(s.routed_experts.data(), s.routed_experts.size(),
                        m.mutable_routed_experts());
    m.set_routing_layers(static_cast<int32_t>(s.routing_layers));
    m.set_routing_top_k(static_cast<int32_t>(s.routing_top_k));
  }
  return m;
}

// Streams the samples of one Generate call. The sampler runs on a thread of its own and queues
// samples; gRPC allows one write in flight, so the next one starts from OnWriteDone. The reactor
// deletes itself in OnDone, after joining the sampler thread.
class GenerateReactor final : public grpc::ServerWriteReactor<opd::v1::Sample> {
 public:
  GenerateReactor(grpc::CallbackServerContext* ctx, std::atomic<int>* running,
                  lm::Generator* generator)
      : ctx_(ctx), running_(running), generator_(generator) {}

  // Starts sampling on a thread of its own; the caller has taken a generation slot for it. The
  // weights are taken there: a weight update being written or waiting to be is waited for (within
  // the call's deadline), so the request samples with the newest accepted version.
  void Start(const WeightStore* store, std::vector<std::vector<int32_t>> prompts,
             SamplingParams params) {
    holds_slot_ = true;
    const auto deadline = ctx_->deadline();
    const absl::Time until = deadline == std::chrono::system_clock::time_point::max()
                                 ? absl::InfiniteFuture()
                                 : absl::FromChrono(deadline);
    thread_ = std::thread([this, store, until, prompts = std::move(prompts), params] {
      absl::StatusOr<Snapshot> snapshot = store->Acquire(until);
      if (!snapshot.ok()) return SamplerDone(snapshot.status());
      lm::BindThreadToDevice(snapshot->model->LmHeadWeight().device());  // per thread in CUDA
      SamplerDone(RunSampler(*snapshot, prompts, params));
    });
  }

  void Refuse(const grpc::Status& why) { Finish(why); }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    writing_ = false;
    // A failed write means the client is gone: stop writing, and the sampler stops too.
    if (!ok) broken_ = true;
    WriteOrFinishLocked();
  }

  void OnDone() override {
    if (thread_.joinable()) thread_.join();
    if (holds_slot_) running_->fetch_sub(1);
    delete this;
  }

 private:
  absl::Status RunSampler(const Snapshot& snapshot,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const SamplingParams& params) {
    try {
      if (params.return_routing && !generator_->RecordsRouting())
        return absl::UnimplementedError(absl::StrCat("return_routing: this worker's generator (",
                                                     generator_->name(),
                                                     ") does not record routing"));
      return generator_->Generate(
          snapshot, prompts, params, [&](Sample s) { Queue(ToProto(s, snapshot.version)); },
          [this] { return broken_.load() || ctx_->IsCancelled(); });
    } catch (const std::exception& e) {  // LibTorch reports failures (e.g. OOM) by throwing
      return absl::InternalError(absl::StrCat("sampling failed: ", e.what()));
    }
  }

  void Queue(opd::v1::Sample m) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(m));
    WriteOrFinishLocked();
  }

  void SamplerDone(const absl::Status& st) {
    absl::MutexLock lock(&mu_);
    sampler_done_ = true;
    status_ = opd::rpc::ToGrpc(st);
    WriteOrFinishLocked();
  }

  void WriteOrFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_) return;
    if (!queue_.empty() && status_.ok() && !broken_) {
      writing_ = true;
      StartWrite(&queue_.front());
    } else if (sampler_done_) {
      finished_ = true;
      Finish(broken_ ? grpc::Status(grpc::StatusCode::CANCELLED, "the client went away") : status_);
    }
  }

  grpc::CallbackServerContext* ctx_;
  std::atomic<int>* running_;
  lm::Generator* generator_;
  std::thread thread_;
  bool holds_slot_ = false;
  std::atomic<bool> broken_{false};  // a write failed
  absl::Mutex mu_;
  std::deque<opd::v1::Sample> queue_ ABSL_GUARDED_BY(mu_);  // front is being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool sampler_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// Receives the chunks of one UpdateWeights call into a StagedWeights and commits at the end.
class UpdateReactor final : public grpc::ServerReadReactor<opd::v1::WeightChunk> {
 public:
  UpdateReactor(grpc::CallbackServerContext* ctx, WeightStore* store,
                opd::v1::UpdateWeightsResponse* resp, EpRollout* ep = nullptr)
      : ctx_(ctx), store_(store), resp_(resp), ep_(ep) {}

  void Begin() { StartRead(&chunk_); }
  void Refuse(const grpc::Status& why) { Finish(why); }

  void OnReadDone(bool ok) override {
    // A gRPC thread: tensor copies here run single-threaded so that it never keeps an OpenMP
    // pool that would slow the sampling threads down (lm/util/threads.h).
    lm::SetThreadsForThisThread(1);
    if (!ok) return EndOfStream();
    absl::Status st = Apply();
    if (!st.ok()) return Finish(opd::rpc::ToGrpc(st));  // the staged copy is dropped with us
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Apply() {
    if (ep_) return ApplyExpertParallel();
    if (!staged_) {
      // A manifest in the first chunk: only the tensors it names come (onto the serving weights).
      auto staged = chunk_.has_manifest()
                        ? store_->StageAnnounced(chunk_.version(), chunk_.manifest())
                        : store_->Stage(chunk_.version());
      if (!staged.ok()) return staged.status();
      staged_ = std::move(*staged);
      if (chunk_.has_manifest() && chunk_.name().empty()) return absl::OkStatus();
    } else if (chunk_.has_manifest()) {
      return absl::InvalidArgumentError(absl::StrCat("chunk of tensor '", chunk_.name(),
                                                     "' carries a manifest; only the first may"));
    } else if (chunk_.version() != staged_->version()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk of tensor '", chunk_.name(), "' has version ", chunk_.version(),
                       " in a stream of version ", staged_->version()));
    }
    ASSIGN_OR_RETURN(const WireTensor piece, opd::rpc::FromProto(chunk_));
    return staged_->Add(piece);
  }

  // Expert parallelism: every chunk goes to every rank, each keeps its own experts' bytes.
  absl::Status ApplyExpertParallel() {
    if (chunk_.has_manifest())
      return absl::FailedPreconditionError(
          "an expert-parallel rollout takes full updates only (no manifest): send every tensor");
    if (!ep_update_) {
      auto update = ep_->BeginUpdate(chunk_.version());
      if (!update.ok()) return update.status();
      ep_update_ = std::move(*update);
    } else if (chunk_.version() != ep_update_->version()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk of tensor '", chunk_.name(), "' has version ", chunk_.version(),
                       " in a stream of version ", ep_update_->version()));
    }
    ASSIGN_OR_RETURN(const WireTensor piece, opd::rpc::FromProto(chunk_));
    return ep_update_->Add(piece);
  }

  // Reads end at the client's half-close, or because the call broke: only the first commits.
  void EndOfStream() {
    if (ctx_->IsCancelled())
      return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "update interrupted"));
    if (ep_update_) {
      absl::Status st = ep_update_->Commit();
      if (st.ok()) {
        resp_->set_version(ep_update_->version());
        resp_->set_tensors(ep_update_->tensors());
        resp_->set_bytes(ep_update_->bytes());
      }
      ep_update_.reset();
      return Finish(opd::rpc::ToGrpc(st));
    }
    if (!staged_)
      return Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty update: no chunks"));
    const int64_t version = staged_->version(), tensors = staged_->tensors_received(),
                  bytes = staged_->bytes_received();
    absl::Status st = store_->Commit(std::move(staged_));
    if (st.ok()) {
      resp_->set_version(version);
      resp_->set_tensors(tensors);
      resp_->set_bytes(bytes);
    }
    Finish(opd::rpc::ToGrpc(st));
  }

  grpc::CallbackServerContext* ctx_;
  WeightStore* store_;
  opd::v1::UpdateWeightsResponse* resp_;
  opd::v1::WeightChunk chunk_;
  std::unique_ptr<StagedWeights> staged_;
  EpRollout* ep_;
  std::unique_ptr<EpRollout::Update> ep_update_;  // dropped unfinished: every rank drops its copy
};

}  // namespace

RolloutService::RolloutService(WeightStore* store, const opd::rpc::Authenticator* auth,
                               ServiceOptions opts, opd::v1::ServiceInfo info)
    : store_(store),
      auth_(auth),
      opts_(opts),
      static_sampler_(opts.static_batch_kv_bytes),
      info_(std::move(info)),
      sync_(std::make_unique<WeightSyncReceiver>(
          store, store->Current().model->LmHeadWeight().device())) {}

RolloutService::~RolloutService() = default;

grpc::ServerWriteReactor<opd::v1::Sample>* RolloutService::Generate(
    grpc::CallbackServerContext* ctx, const opd::v1::GenerateRequest* req) {
  auto* reactor =
      new GenerateReactor(ctx, &running_, opts_.generator ? opts_.generator : &static_sampler_);
  if (grpc::Status auth = auth_->Check(*ctx); !auth.ok()) {
    reactor->Refuse(auth);
    return reactor;
  }
  GenerateJob job = JobFromRequest(*req);
  if (absl::Status st = Validate(job.prompts, job.params, opts_.limits); !st.ok()) {
    reactor->Refuse(opd::rpc::ToGrpc(st));
    return reactor;
  }
  if (running_.fetch_add(1) >= opts_.max_concurrent) {
    running_.fetch_sub(1);
    reactor->Refuse(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat(opts_.max_concurrent, " generations running already; retry later")));
    return reactor;
  }
  reactor->Start(store_, std::move(job.prompts), job.params);
  return reactor;
}

grpc::ServerReadReactor<opd::v1::WeightChunk>* RolloutService::UpdateWeights(
    grpc::CallbackServerContext* ctx, opd::v1::UpdateWeightsResponse* resp) {
  auto* reactor = new UpdateReactor(ctx, store_, resp, opts_.expert_parallel);
  // Weight updates always need the secret, configured or not.
  if (grpc::Status auth = auth_->Check(*ctx, /*always_required=*/true); !auth.ok()) {
    reactor->Refuse(auth);
  } else {
    reactor->Begin();
  }
  return reactor;
}

grpc::ServerUnaryReactor* RolloutService::JoinWeightGroup(
    grpc::CallbackServerContext* ctx, const opd::v1::JoinWeightGroupRequest* req,
    opd::v1::JoinWeightGroupResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  // Weight updates always need the secret, configured or not.
  grpc::Status st = auth_->Check(*ctx, /*always_required=*/true);
  if (st.ok() && opts_.expert_parallel) {  // its ranks hold shards: rollout/ep_rollout.h
    st = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "an expert-parallel rollout takes weights over UpdateWeights only");
  } else if (st.ok()) {
    auto joined = sync_->Join(*req);
    if (joined.ok()) *resp = std::move(*joined);
    st = opd::rpc::ToGrpc(joined.status());
  }
  reactor->Finish(st);
  return reactor;
}

grpc::ServerUnaryReactor* RolloutService::SyncWeights(grpc::CallbackServerContext* ctx,
                                                      const opd::v1::SyncWeightsRequest* req,
                                                      opd::v1::SyncWeightsResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  grpc::Status st = auth_->Check(*ctx, /*always_required=*/true);
  if (st.ok()) {
    lm::SetThreadsForThisThread(1);  // staging copies on a gRPC thread (see OnReadDone)
    auto started = sync_->Start(*req);
    if (started.ok()) *resp = std::move(*started);
    st = opd::rpc::ToGrpc(started.status());
  }
  reactor->Finish(st);
  return reactor;
}

grpc::ServerUnaryReactor* RolloutService::Info(grpc::CallbackServerContext* ctx,
                                               const opd::v1::InfoRequest*,
                                               opd::v1::ServiceInfo* resp) {
  auto* reactor = ctx->DefaultReactor();
  grpc::Status auth = auth_->Check(*ctx);
  if (auth.ok()) {
    *resp = info_;
    resp->set_weight_version(store_->Current().version);
  }
  reactor->Finish(auth);
  return reactor;
}

}  // namespace rollout
