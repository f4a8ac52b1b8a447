#include "rpc/server.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
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

// The host part of "host:port", "[v6]:port" or "host" (brackets kept off).
std::string ListenHost(const std::string& listen) {
  if (!listen.empty() && listen[0] == '[') {
    const size_t close = listen.find(']');
    return close == std::string::npos ? listen : listen.substr(1, close - 1);
  }
  const size_t colon = listen.rfind(':');
  // More than one colon without brackets: a bare IPv6 address.
  if (colon != std::string::npos && listen.find(':') == colon) return listen.substr(0, colon);
  return listen;
}

// The port part of "host:port" or "[v6]:port" (possibly empty: "host:"); nullopt when there is
// none (a bare host, a bare IPv6 address).
std::optional<std::string> ListenPort(const std::string& listen) {
  size_t colon = std::string::npos;
  if (!listen.empty() && listen[0] == '[') {
    const size_t close = listen.find(']');
    if (close != std::string::npos && close + 1 < listen.size() && listen[close + 1] == ':')
      colon = close + 1;
  } else if (listen.find(':') == listen.rfind(':')) {
    colon = listen.find(':');
  }
  if (colon == std::string::npos) return std::nullopt;
  return listen.substr(colon + 1);
}

// Abseil's own flags (--flagfile, --fromenv, --helpfull, ...) live in absl/flags/: not ours to
// list or accept.
bool OwnFlag(const absl::CommandLineFlag& f) {
  return !f.IsRetired() && !absl::StrContains(f.Filename(), "absl/flags/");
}

std::string Hyphenated(absl::string_view name) {
  return absl::StrReplaceAll(name, {{"_", "-"}});
}

void PrintFlagsHelp(const char* usage) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (OwnFlag(*flag)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::cout << usage << "\n\nflags:\n";
  for (const auto* f : flags) {
    // Before parsing the current value is the effective default (a main may have set one).
    const std::string def = f->CurrentValue();
    std::cout << "  --" << Hyphenated(f->Name()) << " (default: " << (def.empty() ? "\"\"" : def)
              << ")\n      " << f->Help() << "\n";
  }
}

// Sets the flag that `word` ("--name[=value]") names; `next` is the following word (a value for
// "--name value"), and `*used_next` says whether it was taken.
absl::Status ApplyFlag(const std::string& word, const std::string* next, bool* used_next) {
  std::string name = word.substr(2), value;
  const size_t eq = name.find('=');
  const bool has_eq = eq != std::string::npos;
  if (has_eq) {
    value = name.substr(eq + 1);
    name = name.substr(0, eq);
  }
  const std::string shown = "--" + Hyphenated(name);
  name = absl::StrReplaceAll(name, {{"-", "_"}});
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if ((!flag || !OwnFlag(*flag)) && !has_eq && absl::StartsWith(name, "no")) {
    // --noinsecure: a boolean flag set to false.
    absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
    if (negated && OwnFlag(*negated) && negated->IsOfType<bool>()) {
      std::string error;
      negated->ParseFrom("false", &error);
      return absl::OkStatus();
    }
  }
  if (!flag || !OwnFlag(*flag)) return absl::InvalidArgumentError("unknown flag " + shown);
  if (flag->IsOfType<bool>()) {
    if (!has_eq) value = "true";
  } else if (!has_eq) {
    if (!next) return absl::InvalidArgumentError(shown + " needs a value");
    value = *next;
    *used_next = true;
  }
  std::string error;
  if (!flag->ParseFrom(value, &error)) {
    return absl::InvalidArgumentError(
        absl::StrCat(shown, ": invalid value '", value, "' (", error, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsLoopbackListen(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) return true;
  const std::string host = ListenHost(listen);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::Status CheckListenPort(const std::string& listen, const std::string& flag) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:"))
    return absl::OkStatus();
  const std::optional<std::string> port = ListenPort(listen);
  int value = -1;
  if (!port || (absl::SimpleAtoi(*port, &value) && value >= 0 && value <= 65535))
    return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, "=", listen, ": the port '", *port, "' is not a number in [0, 65535]"));
}

absl::Status CheckListenAuth(const ServerOptions& opts) {
  if (opts.has_secret || opts.insecure || IsLoopbackListen(opts.listen)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to listen on ", opts.listen,
      " without a shared secret: any host that reaches it could call it. Configure a secret (",
      opts.secret_source,
      "), listen on loopback (127.0.0.1), or accept unauthenticated calls "
      "with ",
      opts.insecure_option));
}

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
  RETURN_IF_ERROR(CheckListenAuth(opts));
  ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(opts.tls));

  RunningServer running;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(opts.listen, creds, &running.port);
  builder.SetMaxReceiveMessageSize(opts.max_message_bytes);
  builder.SetMaxSendMessageSize(opts.max_send_bytes);
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

int ParseFlagsOrExitCode(int argc, char** argv, const char* usage) {
  absl::SetProgramUsageMessage(usage);
  const std::string program = argc > 0 ? std::filesystem::path(argv[0]).filename().string() : "";
  const std::vector<std::string> words(argv + std::min(argc, 1), argv + argc);
  for (const auto& w : words) {
    if (w == "--help" || w == "-h" || w == "--helpfull") {
      PrintFlagsHelp(usage);
      return 0;
    }
  }
  for (size_t i = 0; i < words.size(); ++i) {
    absl::Status st;
    bool used_next = false;
    if (!absl::StartsWith(words[i], "--") || words[i] == "--") {
      st = absl::InvalidArgumentError(absl::StrCat("unexpected argument '", words[i], "'"));
    } else {
      st = ApplyFlag(words[i], i + 1 < words.size() ? &words[i + 1] : nullptr, &used_next);
    }
    if (!st.ok()) {
      std::cerr << program << ": " << st.message() << "\nusage: " << usage << "\nrun '" << program
                << " --help' for the flags\n";
      return 2;
    }
    if (used_next) ++i;
  }
  return -1;
}

void ParseFlags(int argc, char** argv, const char* usage) {
  const int code = ParseFlagsOrExitCode(argc, argv, usage);
  if (code >= 0) std::exit(code);
}

const char* BuildVersion() {
  return OPD_BUILD_VERSION;
}

}  // namespace opd::rpc
