#include "trainer/opd/learner_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lm/util/config.h"
#include "lm/util/log.h"
#include "rpc/status.h"

namespace trainer {

// A SwapTeacher call kept open until the step boundary answers it. gRPC owns it: it deletes
// itself once the call is done (the callback API's reactor life cycle).
class LearnerServer::SwapCall final : public grpc::ServerUnaryReactor {
 public:
  SwapCall(LearnerServer* server, opd::v1::SwapTeacherResponse* resp)
      : server_(server), resp_(resp) {}
  opd::v1::SwapTeacherResponse* resp() { return resp_; }
  void OnCancel() override { server_->Withdraw(this); }
  void OnDone() override { delete this; }

 private:
  LearnerServer* server_;
  opd::v1::SwapTeacherResponse* resp_;
};

absl::StatusOr<std::unique_ptr<LearnerServer>> LearnerServer::Start(LearnerServerOptions opts) {
  auto server = std::make_unique<LearnerServer>(std::move(opts));
  opd::rpc::ServerOptions so;
  so.listen = server->opts_.listen;
  so.port_file = server->opts_.port_file;
  so.has_secret = !server->opts_.secret.empty();
  so.tls = server->opts_.tls;
  so.insecure = server->opts_.insecure;
  so.secret_source = "auth.secret_file or $OPD_SECRET";
  so.insecure_option = "admin.insecure: true";
  auto running = opd::rpc::StartServer(so, {server.get()}, {"opd.v1.Learner"});
  if (!running.ok()) return running.status();
  server->server_ = std::move(*running);
  lm::log::Info(absl::StrCat("learner admin service on port ", server->server_.port, " (",
                             so.tls.enabled() ? "TLS" : "plaintext", ")"));
  return server;
}

LearnerServer::~LearnerServer() {
  std::optional<Pending> left;
  {
    absl::MutexLock lock(&mu_);
    left = std::move(pending_);
    pending_.reset();
  }
  if (left) {
    left->call->Finish(grpc::Status(
        grpc::StatusCode::ABORTED, "the job ended before the next step boundary; nothing changed"));
  }
  if (server_.server) server_.server->Shutdown();
}

std::unique_ptr<LearnerServer::TakenSwap> LearnerServer::TakeSwap() {
  absl::MutexLock lock(&mu_);
  if (!pending_) return nullptr;
  std::unique_ptr<TakenSwap> taken(
      new TakenSwap(std::move(pending_->request), pending_->call, status_.step));
  pending_.reset();
  return taken;
}

void LearnerServer::TakenSwap::Answer(const absl::Status& outcome) {
  if (!call_) return;
  const std::string endpoints = absl::StrJoin(request_.endpoints, ", ");
  if (outcome.ok()) {
    auto* resp = call_->resp();
    resp->set_stage(request_.stage);
    resp->set_domain(request_.domain);
    for (const auto& e : request_.endpoints) resp->add_endpoints(e);
    resp->set_message(absl::StrCat("applied at the step boundary after step ", step_));
    lm::log::Info(
        absl::StrCat("swap-teacher applied for stage '", request_.stage, "': ", endpoints));
  } else {
    lm::log::Warn(absl::StrCat("swap-teacher refused (stage '", request_.stage, "': ", endpoints,
                               "): ", outcome.message()));
  }
  std::exchange(call_, nullptr)->Finish(opd::rpc::ToGrpc(outcome));
}

LearnerServer::TakenSwap::~TakenSwap() {
  Answer(
      absl::AbortedError("the job ended at the step boundary before applying it; nothing changed"));
}

bool LearnerServer::ServePendingSwap(const std::function<absl::Status(const SwapRequest&)>& apply) {
  std::unique_ptr<TakenSwap> taken = TakeSwap();
  if (!taken) return false;
  taken->Answer(apply(taken->request()));
  return true;
}

bool LearnerServer::swap_pending() const {
  absl::MutexLock lock(&mu_);
  return pending_.has_value();
}

void LearnerServer::SetStatus(LearnerStatusSnapshot s) {
  absl::MutexLock lock(&mu_);
  status_ = std::move(s);
}

void LearnerServer::Withdraw(SwapCall* call) {
  {
    absl::MutexLock lock(&mu_);
    if (!pending_ || pending_->call != call) return;  // already taken: its taker finishes it
    pending_.reset();
  }
  lm::log::Warn("swap-teacher withdrawn: the caller gave up before the next step boundary");
  call->Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                            "withdrawn before the next step boundary; nothing changed"));
}

absl::Status LearnerServer::Check(const opd::v1::SwapTeacherRequest& req) const {
  if (std::find(opts_.stages.begin(), opts_.stages.end(), req.stage()) == opts_.stages.end()) {
    return absl::NotFoundError(absl::StrCat("no stage named '", req.stage(),
                                            "' (stages: ", absl::StrJoin(opts_.stages, ", "), ")"));
  }
  if (!req.domain().empty()) {
    const auto it = opts_.stage_domains.find(req.stage());
    const std::vector<std::string> none;
    const std::vector<std::string>& domains = it == opts_.stage_domains.end() ? none : it->second;
    if (std::find(domains.begin(), domains.end(), req.domain()) == domains.end())
      return absl::NotFoundError(absl::StrCat(
          "stage '", req.stage(), "' has no pool for domain '", req.domain(),
          "' (its domains: ", domains.empty() ? "none" : absl::StrJoin(domains, ", "), ")"));
  }
  if (req.endpoints().empty()) return absl::InvalidArgumentError("no endpoints given");
  // A replica given twice would be connected and checked twice and get two shares of every step.
  return lm::validate::DistinctNonEmpty("endpoints",
                                        {req.endpoints().begin(), req.endpoints().end()});
}

grpc::ServerUnaryReactor* LearnerServer::SwapTeacher(grpc::CallbackServerContext* ctx,
                                                     const opd::v1::SwapTeacherRequest* req,
                                                     opd::v1::SwapTeacherResponse* resp) {
  auto* call = new SwapCall(this, resp);  // deletes itself in OnDone
  if (grpc::Status auth = auth_.Check(*ctx, /*always_required=*/true); !auth.ok()) {
    call->Finish(auth);
    return call;
  }
  absl::Status s = Check(*req);
  if (s.ok()) {
    absl::MutexLock lock(&mu_);
    if (pending_) {
      s = absl::FailedPreconditionError(absl::StrCat(
          "a swap for stage '", pending_->request.stage, "' (",
          absl::StrJoin(pending_->request.endpoints, ", "),
          ") is already queued for the next step boundary; send this one after it is answered"));
    } else {
      pending_ = Pending{
          {req->stage(), {req->endpoints().begin(), req->endpoints().end()}, req->domain()}, call};
      lm::log::Info(absl::StrCat("swap-teacher queued for stage '", req->stage(),
                                 "': ", absl::StrJoin(req->endpoints(), ", "),
                                 " (checked and applied at the next step boundary)"));
      return call;
    }
  }
  lm::log::Warn(absl::StrCat("swap-teacher refused: ", s.message()));
  call->Finish(opd::rpc::ToGrpc(s));
  return call;
}

grpc::ServerUnaryReactor* LearnerServer::GetStatus(grpc::CallbackServerContext* ctx,
                                                   const opd::v1::LearnerStatusRequest*,
                                                   opd::v1::LearnerStatus* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (grpc::Status auth = auth_.Check(*ctx, /*always_required=*/true); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  absl::MutexLock lock(&mu_);
  resp->set_stage(status_.stage);
  resp->set_step(status_.step);
  for (const auto& t : status_.teachers) resp->add_teachers(t);
  resp->set_weight_version(status_.weight_version);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace trainer
