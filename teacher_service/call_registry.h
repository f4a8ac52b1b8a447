// The calls a TeacherService has in progress, for the limits that keep clients who stop reading
// from growing the server's memory (issue #41 item 18: 136 unread ScoreStreams over 48
// connections took a teacher from 371 MB to 7.7 GB):
//   - ScoreStream calls are capped per client connection and in total; past a cap a new stream is
//     refused with RESOURCE_EXHAUSTED naming the flag (a stream holds its whole request).
//   - A reply waiting to be written (a stream's chunk, a unary reply) records when its write
//     began; CancelStalled cancels the calls whose write has waited longer than the timeout, and
//     the call's end (its reactor's OnDone) then frees the request and the reply. Whatever the
//     client's own deadline, an unread reply is held for at most the timeout.
// The admission slot each waiting reply holds is the Scorer's (teacher::Scorer::Slot).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace teacher {

struct StreamLimits {
  // ScoreStream calls in progress in total (--max-streams) and per client connection
  // (--max-streams-per-connection). The paper's job: up to 64 learner ranks, each with one
  // connection to a replica and at most two streams on it per pool (TeacherPool), so 128; a
  // stream holds its request (64 sequences of up to 10k tokens: ~2.5 MB), so 256 streams hold
  // ~640 MB at most.
  int64_t max_streams = 256;
  int64_t max_streams_per_connection = 8;
  // How long a reply may wait for its client to read it before its call is cancelled
  // (--stream-write-timeout-s): a reading client takes well under a second for a 32 MiB chunk.
  absl::Duration write_timeout = absl::Minutes(5);
};

class CallRegistry {
 public:
  // One call in progress, shared by its reactor and the registry.
  class Call {
   public:
    Call(CallRegistry* registry, grpc::CallbackServerContext* ctx, std::string peer, bool stream)
        : registry_(registry), ctx_(ctx), peer_(std::move(peer)), stream_(stream) {}
    // A reply of this call began (at `now`) or finished being written.
    void WriteStarted(absl::Time now);
    void WriteDone();
    // The call is over (its reactor's OnDone): unregisters it, and the registry never touches its
    // context again. May run inside Cancel's TryCancel, on the same thread.
    void Done();

   private:
    friend class CallRegistry;
    // Cancels the call if it is still in progress; returns whether it was.
    bool Cancel();

    CallRegistry* const registry_;
    absl::Mutex mu_;  // held while the context is used from outside the call's own reactions
    grpc::CallbackServerContext* ctx_ ABSL_GUARDED_BY(mu_);
    const std::string peer_;
    const bool stream_;
    // When the pending write began (absl::ToUnixNanos), or kNoWrite.
    static constexpr int64_t kNoWrite = INT64_MIN;
    std::atomic<int64_t> write_started_{kNoWrite};
    std::atomic<std::thread::id> canceller_{};  // the thread inside Cancel, if any
  };

  explicit CallRegistry(StreamLimits limits) : limits_(limits) {}

  // Registers a ScoreStream call, or RESOURCE_EXHAUSTED naming the cap's flag.
  absl::StatusOr<std::shared_ptr<Call>> AddStream(grpc::CallbackServerContext* ctx);
  // Registers a unary call (not capped: the scorer's queue bounds them).
  std::shared_ptr<Call> AddUnary(grpc::CallbackServerContext* ctx);

  // Cancels every call whose reply has waited to be written for the write timeout or longer at
  // `now`; returns how many.
  int CancelStalled(absl::Time now);

  int64_t streams() const;
  // Replies whose write began and has not finished.
  int64_t writes_waiting() const { return writes_waiting_.load(); }
  const StreamLimits& limits() const { return limits_; }

 private:
  void Remove(const Call* call);

  const StreamLimits limits_;
  mutable absl::Mutex mu_;
  std::map<const Call*, std::shared_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> streams_per_peer_ ABSL_GUARDED_BY(mu_);
  int64_t streams_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> writes_waiting_{0};
};

}  // namespace teacher
