// opd.v1.Teacher over gRPC: converts messages, checks the secret, and hands work to the Scorer.
// Nothing here computes; the reactors finish when the Scorer calls back, so no gRPC thread
// blocks while a forward runs.
//
// ScoreStream replies in chunks of whole sequences (ScoreLimits::max_chunk_bytes): each chunk is
// scored as a job of its own, submitted when the previous chunk has been written, so the server
// holds about one chunk's scores per stream whatever the request's size, and other requests'
// sequences are packed between a stream's chunks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include <grpcpp/grpcpp.h>

#include "opd/v1/teacher.grpc.pb.h"
#include "rpc/auth.h"
#include "teacher_service/scorer.h"

namespace teacher {

class ScoreStreamReactor;  // service.cc

class TeacherService final : public opd::v1::Teacher::CallbackService {
 public:
  // `scorer` and `auth` are not owned and must outlive the service.
  TeacherService(Scorer* scorer, const opd::rpc::Authenticator* auth, ScoreLimits limits,
                 opd::v1::ServiceInfo info)
      : scorer_(scorer), auth_(auth), limits_(limits), info_(std::move(info)) {}

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

  // Tests only, set before serving: called on a gRPC thread just before a stream submits its
  // chunk `index` (1, 2, ...; never the first, which is admitted like a Score request), so that a
  // test can put the scorer in a given state between two chunks without relying on timing.
  void SetBeforeChunkHookForTests(std::function<void(int64_t index)> hook) {
    before_chunk_ = std::move(hook);
  }

 private:
  friend class ScoreStreamReactor;

  Scorer* scorer_;
  const opd::rpc::Authenticator* auth_;
  ScoreLimits limits_;
  opd::v1::ServiceInfo info_;
  std::function<void(int64_t)> before_chunk_;
  std::atomic<int64_t> chunks_sent_{0};
  std::atomic<int64_t> streams_finished_{0};
  std::atomic<int64_t> largest_chunk_bytes_{0};
};

}  // namespace teacher
