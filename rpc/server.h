// Starting and stopping an OPD gRPC server: listening socket, optional TLS, the standard health
// service and server reflection (so that `grpcurl` works), and signal-driven shutdown.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/tls.h"

namespace opd::rpc {

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; port 0 picks a free one
  TlsServerOptions tls;
  int max_message_bytes = 64 << 20;  // largest request accepted (bigger ones: RESOURCE_EXHAUSTED)
  std::string port_file;  // when set, the bound port is written here once serving (tests, scripts)
};

struct RunningServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  // Marks the named services (and the server as a whole) SERVING or NOT_SERVING in the health
  // service.
  void SetServing(const std::vector<std::string>& services, bool serving);
};

// Builds and starts a server for `services` (not owned; they must outlive it), with health and
// reflection, and marks the services SERVING.
absl::StatusOr<RunningServer> StartServer(const ServerOptions& opts,
                                          const std::vector<grpc::Service*>& services,
                                          const std::vector<std::string>& service_names);

// Call first thing in main, before any thread starts: SIGINT and SIGTERM are then delivered only
// to WaitForShutdownSignal, not to an arbitrary thread.
void BlockShutdownSignals();
// Blocks until SIGINT or SIGTERM; returns the signal number.
int WaitForShutdownSignal();

// absl::ParseCommandLine, also accepting the hyphenated spelling of flag names
// (--max-batch-tokens for --max_batch_tokens), which is what the rest of the project's tools use.
void ParseFlags(int argc, char** argv, const char* usage);

// The version string of this build (git revision when known).
const char* BuildVersion();

}  // namespace opd::rpc
