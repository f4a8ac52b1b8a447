#include "teacher_service/service.h"

#include "absl/time/clock.h"
#include "rpc/codec.h"
#include "rpc/status.h"

namespace teacher {
namespace {

ScoreJob ToJob(const opd::v1::ScoreRequest& req, grpc::CallbackServerContext* ctx) {
  ScoreJob job;
  job.sequences.reserve(req.sequences_size());
  for (const auto& s : req.sequences()) {
    job.sequences.emplace_back(s.tokens().begin(), s.tokens().end());
    job.response_starts.push_back(s.response_start());
  }
  job.temperature = req.has_temperature() ? req.temperature() : 1.0;
  job.top_k = req.top_k();
  job.deadline = absl::FromChrono(ctx->deadline());
  job.cancelled = [ctx] { return ctx->IsCancelled(); };
  return job;
}

void FillResponse(std::vector<SequenceScore> scores, int64_t top_k, opd::v1::ScoreResponse* resp) {
  resp->set_top_k(static_cast<int32_t>(top_k));
  for (auto& s : scores) {
    auto* m = resp->add_sequences();
    opd::rpc::PackArray(s.logprobs.data(), s.logprobs.size(), m->mutable_logprobs());
    if (top_k > 0) {
      opd::rpc::PackArray(s.topk_ids.data(), s.topk_ids.size(), m->mutable_topk_ids());
      opd::rpc::PackArray(s.topk_logprobs.data(), s.topk_logprobs.size(),
                          m->mutable_topk_logprobs());
    }
  }
}

}  // namespace

grpc::ServerUnaryReactor* TeacherService::Score(grpc::CallbackServerContext* ctx,
                                                const opd::v1::ScoreRequest* req,
                                                opd::v1::ScoreResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (grpc::Status auth = auth_->Check(*ctx); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  ScoreJob job = ToJob(*req, ctx);
  if (absl::Status st = Validate(job, limits_); !st.ok()) {
    reactor->Finish(opd::rpc::ToGrpc(st));
    return reactor;
  }
  const int64_t top_k = job.top_k;
  // The callback runs on a scorer thread; ctx, resp and reactor stay valid until Finish.
  absl::Status queued = scorer_->Submit(
      std::move(job), [reactor, resp, top_k](absl::StatusOr<std::vector<SequenceScore>> r) {
        if (r.ok()) FillResponse(std::move(*r), top_k, resp);
        reactor->Finish(opd::rpc::ToGrpc(r.status()));
      });
  if (!queued.ok()) reactor->Finish(opd::rpc::ToGrpc(queued));
  return reactor;
}

grpc::ServerUnaryReactor* TeacherService::Info(grpc::CallbackServerContext* ctx,
                                               const opd::v1::InfoRequest*,
                                               opd::v1::ServiceInfo* resp) {
  auto* reactor = ctx->DefaultReactor();
  grpc::Status auth = auth_->Check(*ctx);
  if (auth.ok()) *resp = info_;
  reactor->Finish(auth);
  return reactor;
}

}  // namespace teacher
