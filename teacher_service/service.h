// opd.v1.Teacher over gRPC: converts messages, checks the secret, and hands work to the Scorer.
// Nothing here computes; the reactors finish when the Scorer calls back, so no gRPC thread
// blocks while a forward runs.
//
// ScoreStream replies in chunks of whole sequences (ScoreLimits::max_chunk_bytes): each chunk is
// scored as a job of its own, submitted when the previous chunk has been written, so the server
// holds about one chunk's scores per stream whatever the request's size, and other requests'
// sequences are packed between a stream's chunks.
//
// Clients that stop reading (teacher_service/call_registry.h): a reply waiting to be written holds
// one of the scorer's admission slots (new requests are refused while max_queue are held or
// queued), ScoreStream calls are capped per connection and in total, and a reply left unread for
// StreamLimits::write_timeout cancels its call, which frees its request and reply.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/notification.h"
#include "opd/v1/teacher.grpc.pb.h"
#include "rpc/auth.h"
#include "teacher_service/call_registry.h"
#include "teacher_service/scorer.h"

namespace teacher {

class ScoreStreamReactor;  // service.cc
class ScoreReactor;        // service.cc

class TeacherService final : public opd::v1::Teacher::CallbackService {
 public:
  // `scorer` and `auth` are not owned and must outlive the service. Without `clock`, a thread
  // cancels the calls whose reply stays unread past the write timeout (checking every tenth of
  // it, at most every second); with one (tests), nothing runs by itself: call CancelStalledWrites.
  TeacherService(Scorer* scorer, const opd::rpc::Authenticator* auth, ScoreLimits limits,
                 opd::v1::ServiceInfo info, StreamLimits streams = {},
                 std::function<absl::Time()> clock = nullptr);
  ~TeacherService() override;

  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx,
                                  const opd::v1::ScoreRequest* req,
                                  opd::v1::ScoreResponse* resp) override;
  grpc::ServerWriteReactor<opd::v1::ScoreChunk>* ScoreStream(
      grpc::CallbackServerContext* ctx, const opd::v1::ScoreRequest* req) override;
  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx, const opd::v1::InfoRequest* req,
                                 opd::v1::ServiceInfo* resp) override;

  // ScoreStream's counters, for tests: chunks written, streams finished OK, and the largest
  // chunk written (its serialised bytes). Each is updated before the call it belongs to ends.
  int64_t chunks_sent() const { return chunks_sent_.load(); }
  int64_t streams_finished() const { return streams_finished_.load(); }
  int64_t largest_chunk_bytes() const { return largest_chunk_bytes_.load(); }
  // Calls in progress: ScoreStreams, replies waiting for their clients to read them, and the
  // bytes the calls' reactors hold (requests' tokens and replies' messages).
  int64_t streams_in_progress() const { return calls_.streams(); }
  int64_t replies_waiting() const { return calls_.writes_waiting(); }
  int64_t held_bytes() const { return held_bytes_.load(); }

  // Cancels the calls whose reply has waited StreamLimits::write_timeout or longer to be written;
  // returns how many.
  int CancelStalledWrites();

  // Tests only, set before serving: called on a gRPC thread just before a stream submits its
  // chunk `index` (1, 2, ...; never the first, which is admitted like a Score request), so that a
  // test can put the scorer in a given state between two chunks without relying on timing.
  void SetBeforeChunkHookForTests(std::function<void(int64_t index)> hook) {
    before_chunk_ = std::move(hook);
  }

 private:
  friend class ScoreStreamReactor;
  friend class ScoreReactor;

  absl::Time Now() const { return clock_ ? clock_() : absl::Now(); }

  Scorer* scorer_;
  const opd::rpc::Authenticator* auth_;
  ScoreLimits limits_;
  opd::v1::ServiceInfo info_;
  CallRegistry calls_;
  std::function<absl::Time()> clock_;
  std::atomic<int64_t> held_bytes_{0};
  absl::Notification stopping_;
  std::thread watchdog_;  // runs CancelStalledWrites (real clock only)
  std::function<void(int64_t)> before_chunk_;
  std::atomic<int64_t> chunks_sent_{0};
  std::atomic<int64_t> streams_finished_{0};
  std::atomic<int64_t> largest_chunk_bytes_{0};
};

}  // namespace teacher
