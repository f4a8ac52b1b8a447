#include "trainer/learner_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lm/util/log.h"
#include "rpc/status.h"

namespace trainer {

absl::StatusOr<std::unique_ptr<LearnerServer>> LearnerServer::Start(LearnerServerOptions opts) {
  auto server = std::make_unique<LearnerServer>(std::move(opts));
  opd::rpc::ServerOptions so;
  so.listen = server->opts_.listen;
  so.port_file = server->opts_.port_file;
  so.tls = server->opts_.tls;
  so.has_secret = !server->opts_.secret.empty();
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
  if (server_.server) server_.server->Shutdown();
}

std::optional<PendingSwap> LearnerServer::TakePendingSwap() {
  absl::MutexLock lock(&mu_);
  std::optional<PendingSwap> out = std::move(pending_);
  pending_.reset();
  return out;
}

void LearnerServer::SetStatus(LearnerStatusSnapshot s) {
  absl::MutexLock lock(&mu_);
  status_ = std::move(s);
}

absl::Status LearnerServer::Swap(const opd::v1::SwapTeacherRequest& req) {
  if (std::find(opts_.stages.begin(), opts_.stages.end(), req.stage()) == opts_.stages.end()) {
    return absl::NotFoundError(absl::StrCat("no stage named '", req.stage(),
                                            "' (stages: ", absl::StrJoin(opts_.stages, ", "), ")"));
  }
  if (req.endpoints().empty()) return absl::InvalidArgumentError("no endpoints given");
  std::vector<std::string> endpoints(req.endpoints().begin(), req.endpoints().end());
  opd::TeacherPoolOptions po;
  po.client = opts_.client;
  auto pool = opd::TeacherPool::Connect(req.stage(), endpoints, opts_.requirements, po);
  if (!pool.ok()) return pool.status();
  absl::MutexLock lock(&mu_);
  pending_ = PendingSwap{req.stage(), std::move(endpoints), std::move(*pool)};
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* LearnerServer::SwapTeacher(grpc::CallbackServerContext* ctx,
                                                     const opd::v1::SwapTeacherRequest* req,
                                                     opd::v1::SwapTeacherResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (grpc::Status auth = auth_.Check(*ctx, /*always_required=*/true); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  const absl::Status s = Swap(*req);
  if (s.ok()) {
    resp->set_stage(req->stage());
    *resp->mutable_endpoints() = req->endpoints();
    resp->set_message("accepted: takes effect at the next step boundary");
    lm::log::Info(absl::StrCat("swap-teacher accepted for stage '", req->stage(),
                               "': ", absl::StrJoin(req->endpoints(), ", ")));
  } else {
    lm::log::Warn(absl::StrCat("swap-teacher refused: ", s.message()));
  }
  reactor->Finish(opd::rpc::ToGrpc(s));
  return reactor;
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
