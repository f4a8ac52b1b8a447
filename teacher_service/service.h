// opd.v1.Teacher over gRPC: converts messages, checks the secret, and hands work to the Scorer.
// Nothing here computes; the reactor finishes when the Scorer calls back, so no gRPC thread
// blocks while a forward runs.
#pragma once

#include <grpcpp/grpcpp.h>

#include "opd/v1/teacher.grpc.pb.h"
#include "rpc/auth.h"
#include "teacher_service/scorer.h"

namespace teacher {

class TeacherService final : public opd::v1::Teacher::CallbackService {
 public:
  // `scorer` and `auth` are not owned and must outlive the service.
  TeacherService(Scorer* scorer, const opd::rpc::Authenticator* auth, ScoreLimits limits,
                 opd::v1::ServiceInfo info)
      : scorer_(scorer), auth_(auth), limits_(limits), info_(std::move(info)) {}

  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx,
                                  const opd::v1::ScoreRequest* req,
                                  opd::v1::ScoreResponse* resp) override;
  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx, const opd::v1::InfoRequest* req,
                                 opd::v1::ServiceInfo* resp) override;

 private:
  Scorer* scorer_;
  const opd::rpc::Authenticator* auth_;
  ScoreLimits limits_;
  opd::v1::ServiceInfo info_;
};

}  // namespace teacher
