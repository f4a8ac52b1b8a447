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

// 2047 MiB: the largest message size in whole MiB below protobuf's 2 GiB.
inline constexpr int kMaxSendBytes = 2047 << 20;

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; port 0 picks a free one
  TlsServerOptions tls;
  // Whether the services check a shared secret. Without one only a loopback listen is allowed,
  // unless `insecure`; the refusal names `secret_source` and `insecure_option`.
  bool has_secret = false;
  bool insecure = false;
  std::string secret_source = "--secret-file or $OPD_SECRET";
  std::string insecure_option = "--insecure";
  int max_message_bytes = 64 << 20;  // largest request accepted (bigger ones: RESOURCE_EXHAUSTED)
  // Largest message sent; a bigger one fails its call with RESOURCE_EXHAUSTED instead of going
  // out. gRPC checks it after serialising, so it cannot stop a message protobuf cannot serialise
  // (2 GiB and up): the services bound what they build (opd-teacher: --max-reply-mb) and set this
  // to that bound; the default is the largest an int allows in whole MiB, just under 2 GiB.
  int max_send_bytes = kMaxSendBytes;
  std::string port_file;  // when set, the bound port is written here once serving (tests, scripts)
};

struct RunningServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  // Marks the named services (and the server as a whole) SERVING or NOT_SERVING in the health
  // service.
  void SetServing(const std::vector<std::string>& services, bool serving);
};

// True for 127.0.0.0/8, [::1], localhost and unix: sockets; false for anything another host may
// reach (0.0.0.0, [::], a host name, an empty host).
bool IsLoopbackListen(const std::string& listen);

// INVALID_ARGUMENT naming `flag` when `listen` has a port that is not a number in [0, 65535]
// ("host:99999", "host:http"), so that it is refused at start-up rather than after loading a model.
// A unix: address, or one without a port, is left to gRPC.
absl::Status CheckListenPort(const std::string& listen, const std::string& flag = "--listen");

// FAILED_PRECONDITION when the server would accept unauthenticated calls from other hosts: a
// non-loopback `listen` without a secret and without `insecure`. OK otherwise.
absl::Status CheckListenAuth(const ServerOptions& opts);

// Builds and starts a server for `services` (not owned; they must outlive it), with health and
// reflection, and marks the services SERVING. Checks the TLS options and CheckListenAuth first.
absl::StatusOr<RunningServer> StartServer(const ServerOptions& opts,
                                          const std::vector<grpc::Service*>& services,
                                          const std::vector<std::string>& service_names);

// Call first thing in main, before any thread starts: SIGINT and SIGTERM are then delivered only
// to WaitForShutdownSignal, not to an arbitrary thread.
void BlockShutdownSignals();
// Blocks until SIGINT or SIGTERM; returns the signal number.
int WaitForShutdownSignal();

// Parses the Abseil flags of a program: `--name=value`, `--name value`, `--bool-flag`,
// `--nobool-flag`, in the hyphenated spelling (--max-batch-tokens) as well as the declared one.
// Returns -1 to go on, 0 after printing the usage and every flag to stdout (--help, -h), or 2
// after printing to stderr an error that names the flag (unknown flag, missing or bad value, a
// positional argument). Flags declared by Abseil itself are neither listed nor accepted.
int ParseFlagsOrExitCode(int argc, char** argv, const char* usage);
// ParseFlagsOrExitCode that exits the process with its code (for mains without clean-up).
void ParseFlags(int argc, char** argv, const char* usage);

// The version string of this build (git revision when known).
const char* BuildVersion();

}  // namespace opd::rpc
