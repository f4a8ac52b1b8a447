#include "teacher_service/service.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "rpc/codec.h"
#include "rpc/status.h"

namespace teacher {
namespace {

// The job a call asks for, bound to the call: its deadline, and a cancellation flag the scorer
// polls (`ctx` outlives the job: a reactor finishes only once the scorer has called back).
ScoreJob CallJob(const opd::v1::ScoreRequest& req, grpc::CallbackServerContext* ctx) {
  ScoreJob job = JobFromRequest(req);
  job.deadline = absl::FromChrono(ctx->deadline());
  job.cancelled = [ctx] { return ctx->IsCancelled(); };
  return job;
}

// Packs `scores` into `reply`'s sequences (ScoreResponse or ScoreChunk). Takes the scores by
// value so that they are freed as soon as they are packed: the server then holds one copy.
template <class Reply>
void FillSequences(std::vector<SequenceScore> scores, int64_t top_k, Reply* reply) {
  reply->set_top_k(static_cast<int32_t>(top_k));
  for (auto& s : scores) {
    auto* m = reply->add_sequences();
    opd::rpc::PackArray(s.logprobs.data(), s.logprobs.size(), m->mutable_logprobs());
    if (top_k > 0) {
      opd::rpc::PackArray(s.topk_ids.data(), s.topk_ids.size(), m->mutable_topk_ids());
      opd::rpc::PackArray(s.topk_logprobs.data(), s.topk_logprobs.size(),
                          m->mutable_topk_logprobs());
    }
    s = SequenceScore();
  }
}

// The last guard before gRPC serialises a reply: protobuf cannot serialise 2 GiB, and gRPC aborts
// the process on a message it cannot serialise. ReplyBytes is an upper bound, so this only fails
// if that bound is wrong; the call then fails instead of the process.
absl::Status CheckSendable(size_t bytes, const ScoreLimits& limits) {
  if (static_cast<int64_t>(bytes) <= limits.max_reply_bytes) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("the reply came to ", bytes,
                                          " bytes, over the server's limit of ",
                                          limits.max_reply_bytes, " bytes (--max-reply-mb)"));
}

}  // namespace

// One ScoreStream call. At any moment it has at most one operation outstanding: a chunk's job in
// the scorer or a chunk's write. Finish is called only when neither is, so the scorer never calls
// back into a finished (deleted) reactor. Cancellation and the deadline end whichever is
// outstanding (the job's cancelled() polls the context; a write completes not ok), and that
// completion finishes the call; OnCancel therefore needs nothing of its own.
class ScoreStreamReactor final : public grpc::ServerWriteReactor<opd::v1::ScoreChunk> {
 public:
  ScoreStreamReactor(TeacherService* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {}

  // Checks `req` and submits its first chunk, or finishes with the reason not to.
  void Start(const opd::v1::ScoreRequest& req) {
    job_ = CallJob(req, ctx_);
    if (absl::Status st = Validate(job_, service_->limits_, ReplyMode::kStream); !st.ok()) {
      Finish(opd::rpc::ToGrpc(st));
      return;
    }
    // A chunk is one message, so the reply budget bounds it too (as opd-teacher clamps its flag).
    const ScoreLimits& limits = service_->limits_;
    chunks_ = ChunkRanges(job_, std::min(limits.max_chunk_bytes, limits.max_reply_bytes));
    SubmitNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {  // the client cancelled, the deadline passed or the connection broke
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream ended before its last chunk"));
      return;
    }
    service_->chunks_sent_.fetch_add(1);
    int64_t largest = service_->largest_chunk_bytes_.load();
    while (chunk_bytes_ > largest &&
           !service_->largest_chunk_bytes_.compare_exchange_weak(largest, chunk_bytes_)) {
    }
    // Move-assignment swaps, so the sent chunk's memory goes now (Clear() would keep it).
    chunk_ = opd::v1::ScoreChunk();
    if (next_ == chunks_.size()) {
      service_->streams_finished_.fetch_add(1);
      Finish(grpc::Status::OK);
      return;
    }
    if (service_->before_chunk_) service_->before_chunk_(static_cast<int64_t>(next_));
    SubmitNext();
  }

  void OnDone() override { delete this; }

 private:
  // Submits chunk next_ as a job of its own. Only the first is subject to the queue bound: the
  // call was admitted then, and failing it half-way for a full queue would waste its chunks.
  void SubmitNext() {
    const auto [begin, end] = chunks_[next_];
    ScoreJob slice;
    for (int64_t i = begin; i < end; ++i) {
      slice.sequences.push_back(std::move(job_.sequences[i]));  // scored once: moved, not copied
    }
    slice.temperature = job_.temperature;
    slice.top_k = job_.top_k;
    slice.deadline = job_.deadline;
    slice.cancelled = job_.cancelled;
    slice.admitted = next_ > 0;
    ++next_;
    absl::Status queued = service_->scorer_->Submit(
        std::move(slice),
        [this](absl::StatusOr<std::vector<SequenceScore>> r) { OnScored(std::move(r)); });
    // Once queued, the scorer's callback may already have finished (and deleted) this reactor.
    if (!queued.ok()) Finish(opd::rpc::ToGrpc(queued));
  }

  // On a scorer thread: writes the chunk, or finishes with the job's error.
  void OnScored(absl::StatusOr<std::vector<SequenceScore>> r) {
    if (!r.ok()) {
      Finish(opd::rpc::ToGrpc(r.status()));
      return;
    }
    chunk_.set_first_sequence(static_cast<int32_t>(chunks_[next_ - 1].first));
    FillSequences(std::move(*r), job_.top_k, &chunk_);
    chunk_bytes_ = static_cast<int64_t>(chunk_.ByteSizeLong());
    if (absl::Status st = CheckSendable(chunk_bytes_, service_->limits_); !st.ok()) {
      Finish(opd::rpc::ToGrpc(st));
      return;
    }
    StartWrite(&chunk_);  // OnWriteDone may run (and finish the call) before this returns
  }

  TeacherService* const service_;
  grpc::CallbackServerContext* const ctx_;
  ScoreJob job_;  // the whole request; each chunk's job moves its sequences out
  std::vector<std::pair<int64_t, int64_t>> chunks_;
  size_t next_ = 0;            // the chunk to submit next
  opd::v1::ScoreChunk chunk_;  // the chunk being written
  int64_t chunk_bytes_ = 0;    // its serialised size
};

grpc::ServerUnaryReactor* TeacherService::Score(grpc::CallbackServerContext* ctx,
                                                const opd::v1::ScoreRequest* req,
                                                opd::v1::ScoreResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (grpc::Status auth = auth_->Check(*ctx); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  ScoreJob job = CallJob(*req, ctx);
  if (absl::Status st = Validate(job, limits_); !st.ok()) {
    reactor->Finish(opd::rpc::ToGrpc(st));
    return reactor;
  }
  const int64_t top_k = job.top_k;
  // The callback runs on a scorer thread; ctx, resp and reactor stay valid until Finish.
  absl::Status queued = scorer_->Submit(
      std::move(job), [this, reactor, resp, top_k](absl::StatusOr<std::vector<SequenceScore>> r) {
        if (!r.ok()) {
          reactor->Finish(opd::rpc::ToGrpc(r.status()));
          return;
        }
        FillSequences(std::move(*r), top_k, resp);
        reactor->Finish(opd::rpc::ToGrpc(CheckSendable(resp->ByteSizeLong(), limits_)));
      });
  if (!queued.ok()) reactor->Finish(opd::rpc::ToGrpc(queued));
  return reactor;
}

grpc::ServerWriteReactor<opd::v1::ScoreChunk>* TeacherService::ScoreStream(
    grpc::CallbackServerContext* ctx, const opd::v1::ScoreRequest* req) {
  // Owned by gRPC from here: it deletes itself in OnDone.
  auto* reactor = new ScoreStreamReactor(this, ctx);
  if (grpc::Status auth = auth_->Check(*ctx); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  reactor->Start(*req);
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
