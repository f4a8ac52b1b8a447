#include "rpc/server.h"

#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"

#ifndef OPD_BUILD_VERSION
#define OPD_BUILD_VERSION "unknown"
#endif

namespace opd::rpc {
namespace {

// Written to a temporary name and renamed, so a reader polling for the file never sees it
// half-written.
absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
  return absl::OkStatus();
}

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

}  // namespace

void RunningServer::SetServing(const std::vector<std::string>& services, bool serving) {
  auto* health = server->GetHealthCheckService();
  if (!health) return;
  health->SetServingStatus(serving);
  for (const auto& name : services) health->SetServingStatus(name, serving);
}

absl::StatusOr<RunningServer> StartServer(const ServerOptions& opts,
                                          const std::vector<grpc::Service*>& services,
                                          const std::vector<std::string>& service_names) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(opts.tls));

  RunningServer running;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(opts.listen, creds, &running.port);
  builder.SetMaxReceiveMessageSize(opts.max_message_bytes);
  builder.SetMaxSendMessageSize(-1);
  for (auto* s : services) builder.RegisterService(s);
  running.server = builder.BuildAndStart();
  if (!running.server || running.port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", opts.listen));
  }
  running.SetServing(service_names, true);
  if (!opts.port_file.empty()) RETURN_IF_ERROR(WritePortFile(opts.port_file, running.port));
  return running;
}

void BlockShutdownSignals() {
  sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForShutdownSignal() {
  sigset_t set = ShutdownSignals();
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

void ParseFlags(int argc, char** argv, const char* usage) {
  // Rewrite "--a-b=x" to "--a_b=x" (name part only); the strings must outlive parsing.
  std::vector<std::string> words(argv, argv + argc);
  std::vector<char*> ptrs;
  for (auto& w : words) {
    if (w.rfind("--", 0) == 0) {
      const size_t end = std::min(w.find('='), w.size());
      for (size_t i = 2; i < end; ++i) {
        if (w[i] == '-') w[i] = '_';
      }
    }
    ptrs.push_back(w.data());
  }
  absl::SetProgramUsageMessage(usage);
  absl::ParseCommandLine(static_cast<int>(ptrs.size()), ptrs.data());
}

const char* BuildVersion() {
  return OPD_BUILD_VERSION;
}

}  // namespace opd::rpc
