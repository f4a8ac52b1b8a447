// The learner's admin endpoint (opd.v1.Learner): swap a stage's teachers while the job runs.
//
// A SwapTeacher call is authenticated (always), then the new endpoints are connected and checked
// against the student (tokenizer fingerprint, vocabulary) on the gRPC thread; only a swap that
// passes is queued. The training loop takes it at the next step boundary (TakePendingSwap), so a
// step never mixes two teacher sets.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "opd/v1/learner.grpc.pb.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "trainer/teacher_pool.h"

namespace trainer {

struct PendingSwap {
  std::string stage;
  std::vector<std::string> endpoints;
  std::unique_ptr<opd::TeacherPool> pool;  // connected and checked
};

struct LearnerServerOptions {
  std::string listen;              // host:port (port 0: any free port)
  std::string port_file;           // the bound port is written here when set
  std::string secret;              // required for every call; empty refuses every call
  opd::rpc::TlsServerOptions tls;  // the admin service's certificate (none: plaintext)
  bool insecure = false;           // allow a non-loopback listen without a secret
  opd::rpc::ClientOptions client;  // how to reach teachers (secret, TLS, deadline)
  opd::TeacherRequirements requirements;
  std::vector<std::string> stages;  // known stage names
};

struct LearnerStatusSnapshot {
  std::string stage;
  int64_t step = 0;
  std::vector<std::string> teachers;
  int64_t weight_version = 0;
};

class LearnerServer final : public opd::v1::Learner::CallbackService {
 public:
  explicit LearnerServer(LearnerServerOptions opts) : opts_(std::move(opts)), auth_(opts_.secret) {}
  ~LearnerServer() override;
  static absl::StatusOr<std::unique_ptr<LearnerServer>> Start(LearnerServerOptions opts);

  std::optional<PendingSwap> TakePendingSwap();
  void SetStatus(LearnerStatusSnapshot s);
  int port() const { return server_.port; }

  grpc::ServerUnaryReactor* SwapTeacher(grpc::CallbackServerContext* ctx,
                                        const opd::v1::SwapTeacherRequest* req,
                                        opd::v1::SwapTeacherResponse* resp) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const opd::v1::LearnerStatusRequest* req,
                                      opd::v1::LearnerStatus* resp) override;

 private:
  absl::Status Swap(const opd::v1::SwapTeacherRequest& req);

  LearnerServerOptions opts_;
  opd::rpc::Authenticator auth_;
  opd::rpc::RunningServer server_;
  absl::Mutex mu_;
  std::optional<PendingSwap> pending_ ABSL_GUARDED_BY(mu_);
  LearnerStatusSnapshot status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainer
