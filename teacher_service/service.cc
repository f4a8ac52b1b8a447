#include "teacher_service/service.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "lm/util/log.h"
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
void FillSequences(std::vector<lm::SequenceScore> scores, int64_t top_k, Reply* reply) {
  reply->set_top_k(static_cast<int32_t>(top_k));
  for (auto& s : scores) {
    auto* m = reply->add_sequences();
    opd::rpc::PackArray(s.logprobs.data(), s.logprobs.size(), m->mutable_logprobs());
    if (top_k > 0) {
      opd::rpc::PackArray(s.topk_ids.data(), s.topk_ids.size(), m->mutable_topk_ids());
      opd::rpc::PackArray(s.topk_logprobs.data(), s.topk_logprobs.size(),
                          m->mutable_topk_logprobs());
    }
    s = lm::SequenceScore();
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

// The bytes a job's sequences hold (their tokens), for the service's held_bytes count.
int64_t JobBytes(const ScoreJob& job) {
  int64_t bytes = 0;
  for (const auto& s : job.sequences) bytes += static_cast<int64_t>(s.tokens.size() * 4);
  return bytes;
}

}  // namespace

// One ScoreStream call. At any moment it has at most one operation outstanding: a chunk's job in
// the scorer or a chunk's write. Finish is called only when neither is, so the scorer never calls
// back into a finished (deleted) reactor. Cancellation and the deadline end whichever is
// outstanding (the job's cancelled() polls the context; a write completes not ok), and that
// completion finishes the call; OnCancel therefore needs nothing of its own. A chunk waiting to be
// written holds a scorer slot, and its write's start is registered, so that an unread stream is
// cancelled after the write timeout (CallRegistry) and frees everything here in OnDone.
class ScoreStreamReactor final : public grpc::ServerWriteReactor<opd::v1::ScoreChunk> {
 public:
  ScoreStreamReactor(TeacherService* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {}

  // Checks the caps and `req`, and submits the first chunk, or finishes with the reason not to.
  void Start(const opd::v1::ScoreRequest& req) {
    absl::StatusOr<std::shared_ptr<CallRegistry::Call>> call = service_->calls_.AddStream(ctx_);
    if (!call.ok()) {
      Finish(opd::rpc::ToGrpc(call.status()));
      return;
    }
    call_ = std::move(*call);
    job_ = CallJob(req, ctx_);
    Hold(JobBytes(job_), &job_bytes_);
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
    WriteOver();
    if (!ok) {  // the client cancelled, the deadline passed or the connection broke
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream ended before its last chunk"));
      return;
    }
    service_->chunks_sent_.fetch_add(1);
    int64_t largest = service_->largest_chunk_bytes_.load();
    while (chunk_bytes_ > largest &&
           !service_->largest_chunk_bytes_.compare_exchange_weak(largest, chunk_bytes_)) {
    }
    if (next_ == chunks_.size()) {
      service_->streams_finished_.fetch_add(1);
      Finish(grpc::Status::OK);
      return;
    }
    if (service_->before_chunk_) service_->before_chunk_(static_cast<int64_t>(next_));
    SubmitNext();
  }

  void OnDone() override {
    WriteOver();
    if (call_) call_->Done();
    Hold(0, &job_bytes_);
    delete this;
  }

 private:
  // Sets what this call holds in `*held` to `bytes`, keeping the service's count.
  void Hold(int64_t bytes, int64_t* held) {
    service_->held_bytes_.fetch_add(bytes - *held);
    *held = bytes;
  }

  // The chunk's write is over (done, failed or never to be): its memory and slot go now.
  void WriteOver() {
    if (call_) call_->WriteDone();
    slot_ = Scorer::Slot();
    // Move-assignment swaps, so the sent chunk's memory goes now (Clear() would keep it).
    chunk_ = opd::v1::ScoreChunk();
    Hold(0, &chunk_held_);
  }

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
        [this](absl::StatusOr<std::vector<lm::SequenceScore>> r) { OnScored(std::move(r)); });
    // Once queued, the scorer's callback may already have finished (and deleted) this reactor.
    if (!queued.ok()) Finish(opd::rpc::ToGrpc(queued));
  }

  // On a scorer thread: writes the chunk, or finishes with the job's error.
  void OnScored(absl::StatusOr<std::vector<lm::SequenceScore>> r) {
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
    // The message and gRPC's serialised copy of it, until the write is over.
    Hold(2 * chunk_bytes_, &chunk_held_);
    slot_ = service_->scorer_->HoldSlot();
    call_->WriteStarted(service_->Now());
    StartWrite(&chunk_);  // OnWriteDone may run (and finish the call) before this returns
  }

  TeacherService* const service_;
  grpc::CallbackServerContext* const ctx_;
  std::shared_ptr<CallRegistry::Call> call_;  // null when refused by a cap
  ScoreJob job_;  // the whole request; each chunk's job moves its sequences out
  std::vector<std::pair<int64_t, int64_t>> chunks_;
  size_t next_ = 0;                         // the chunk to submit next
  opd::v1::ScoreChunk chunk_;               // the chunk being written
  int64_t chunk_bytes_ = 0;                 // its serialised size
  Scorer::Slot slot_;                       // held while the chunk waits to be written
  int64_t job_bytes_ = 0, chunk_held_ = 0;  // this call's share of held_bytes_
};

// One Score call: the reply, once scored, holds a scorer slot and is registered as a write until
// the call is done, as a stream's chunk is.
class ScoreReactor final : public grpc::ServerUnaryReactor {
 public:
  ScoreReactor(TeacherService* service, grpc::CallbackServerContext* ctx,
               opd::v1::ScoreResponse* resp)
      : service_(service), ctx_(ctx), resp_(resp), call_(service->calls_.AddUnary(ctx)) {}

  void Start(const opd::v1::ScoreRequest& req) {
    if (grpc::Status auth = service_->auth_->Check(*ctx_); !auth.ok()) {
      Finish(auth);
      return;
    }
    ScoreJob job = CallJob(req, ctx_);
    if (absl::Status st = Validate(job, service_->limits_); !st.ok()) {
      Finish(opd::rpc::ToGrpc(st));
      return;
    }
    const int64_t top_k = job.top_k;
    // The callback runs on a scorer thread; ctx, resp and this reactor stay valid until OnDone.
    absl::Status queued = service_->scorer_->Submit(
        std::move(job), [this, top_k](absl::StatusOr<std::vector<lm::SequenceScore>> r) {
          if (!r.ok()) {
            Finish(opd::rpc::ToGrpc(r.status()));
            return;
          }
          FillSequences(std::move(*r), top_k, resp_);
          const int64_t bytes = static_cast<int64_t>(resp_->ByteSizeLong());
          held_ = 2 * bytes;  // the message and gRPC's serialised copy
          service_->held_bytes_.fetch_add(held_);
          slot_ = service_->scorer_->HoldSlot();
          call_->WriteStarted(service_->Now());
          Finish(opd::rpc::ToGrpc(CheckSendable(bytes, service_->limits_)));
        });
    if (!queued.ok()) Finish(opd::rpc::ToGrpc(queued));
  }

  void OnDone() override {
    call_->Done();
    service_->held_bytes_.fetch_sub(held_);
    delete this;
  }

 private:
  TeacherService* const service_;
  grpc::CallbackServerContext* const ctx_;
  opd::v1::ScoreResponse* const resp_;
  const std::shared_ptr<CallRegistry::Call> call_;
  Scorer::Slot slot_;
  int64_t held_ = 0;
};

TeacherService::TeacherService(Scorer* scorer, const opd::rpc::Authenticator* auth,
                               ScoreLimits limits, opd::v1::ServiceInfo info, StreamLimits streams,
                               std::function<absl::Time()> clock)
    : scorer_(scorer),
      auth_(auth),
      limits_(limits),
      info_(std::move(info)),
      calls_(streams),
      clock_(std::move(clock)) {
  if (clock_ || streams.write_timeout == absl::InfiniteDuration()) return;
  const absl::Duration period = std::min(absl::Seconds(1), streams.write_timeout / 10);
  watchdog_ = std::thread([this, period] {
    while (!stopping_.WaitForNotificationWithTimeout(period)) CancelStalledWrites();
  });
}

TeacherService::~TeacherService() {
  stopping_.Notify();
  if (watchdog_.joinable()) watchdog_.join();
}

int TeacherService::CancelStalledWrites() {
  const int n = calls_.CancelStalled(Now());
  if (n > 0)
    lm::log::Warn(absl::StrCat("cancelled ", n, " call(s) whose client left a reply unread for ",
                               absl::FormatDuration(calls_.limits().write_timeout),
                               " (--stream-write-timeout-s)"));
  return n;
}

grpc::ServerUnaryReactor* TeacherService::Score(grpc::CallbackServerContext* ctx,
                                                const opd::v1::ScoreRequest* req,
                                                opd::v1::ScoreResponse* resp) {
  // Owned by gRPC from here: it deletes itself in OnDone.
  auto* reactor = new ScoreReactor(this, ctx, resp);
  reactor->Start(*req);
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
