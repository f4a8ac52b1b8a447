// The learner's admin endpoint (opd.v1.Learner): swap a stage's teachers while the job runs.
//
// A SwapTeacher call is authenticated (always) and checked for what needs no network (a known
// stage, at least one endpoint, none empty or given twice: INVALID_ARGUMENT), then queued; the call
// stays open. The training loop serves it at the next step boundary, on its own thread: it takes
// the call (TakeSwap), connects to the new endpoints with the stage's own pool options (deadline,
// TLS, secret), checks them against the student (tokenizer fingerprint, vocabulary) and installs
// them, and answers the caller with that outcome (OK, or the error naming the endpoint). So a step
// never mixes two teacher sets, and no gRPC thread blocks on a connection.
//
// One swap at a time: a second SwapTeacher while one is queued is refused with
// FAILED_PRECONDITION (it would otherwise silently replace the first); send it again once the
// first has been answered. A caller that gives up (deadline, Ctrl-C) before the boundary
// withdraws its swap: nothing changes. A job that ends first answers ABORTED.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "opd/v1/learner.grpc.pb.h"
#include "rpc/auth.h"
#include "rpc/server.h"

namespace trainer {

struct SwapRequest {
  std::string stage;
  std::vector<std::string> endpoints;
  std::string domain;  // "": the stage's default pool
};

struct LearnerServerOptions {
  std::string listen;               // host:port (port 0: any free port)
  std::string port_file;            // the bound port is written here when set
  std::string secret;               // required for every call; empty refuses every call
  opd::rpc::TlsServerOptions tls;   // TLS of the admin port (unset: plaintext)
  bool insecure = false;            // allow a non-loopback listen without a secret
  std::vector<std::string> stages;  // known stage names
  // Each stage's data domains with a pool of their own (stages[].domains).
  std::map<std::string, std::vector<std::string>> stage_domains;
};

struct LearnerStatusSnapshot {
  std::string stage;
  int64_t step = 0;
  std::vector<std::string> teachers;
  int64_t weight_version = 0;
};

class LearnerServer final : public opd::v1::Learner::CallbackService {
 private:
  class SwapCall;

 public:
  // A queued swap taken off the queue: its request, and its caller, answered exactly once (by
  // Answer, or with ABORTED by the destructor of one dropped unanswered).
  class TakenSwap {
   public:
    ~TakenSwap();
    TakenSwap(const TakenSwap&) = delete;
    TakenSwap& operator=(const TakenSwap&) = delete;
    const SwapRequest& request() const { return request_; }
    void Answer(const absl::Status& outcome);

   private:
    friend class LearnerServer;
    TakenSwap(SwapRequest request, SwapCall* call, int64_t step)
        : request_(std::move(request)), call_(call), step_(step) {}
    SwapRequest request_;
    SwapCall* call_;  // null once answered
    int64_t step_;    // the step boundary it is answered at
  };

  explicit LearnerServer(LearnerServerOptions opts) : opts_(std::move(opts)), auth_(opts_.secret) {}
  ~LearnerServer() override;
  static absl::StatusOr<std::unique_ptr<LearnerServer>> Start(LearnerServerOptions opts);

  // At a step boundary, on the training thread: the queued swap, or null when there is none.
  std::unique_ptr<TakenSwap> TakeSwap();
  // TakeSwap, then runs `apply` on it (here) and answers its caller with apply's status. Returns
  // whether there was one.
  bool ServePendingSwap(const std::function<absl::Status(const SwapRequest&)>& apply);
  bool swap_pending() const;
  void SetStatus(LearnerStatusSnapshot s);
  int port() const { return server_.port; }

  grpc::ServerUnaryReactor* SwapTeacher(grpc::CallbackServerContext* ctx,
                                        const opd::v1::SwapTeacherRequest* req,
                                        opd::v1::SwapTeacherResponse* resp) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const opd::v1::LearnerStatusRequest* req,
                                      opd::v1::LearnerStatus* resp) override;

 private:
  struct Pending {
    SwapRequest request;
    SwapCall* call;  // owned by gRPC; finished exactly once, by whoever takes it from pending_
  };
  absl::Status Check(const opd::v1::SwapTeacherRequest& req) const;
  void Withdraw(SwapCall* call);  // the caller cancelled

  LearnerServerOptions opts_;
  opd::rpc::Authenticator auth_;
  opd::rpc::RunningServer server_;
  mutable absl::Mutex mu_;
  std::optional<Pending> pending_ ABSL_GUARDED_BY(mu_);
  LearnerStatusSnapshot status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainer
