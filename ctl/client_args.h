// Flags every opd-ctl command that talks to a running service shares, turned into
// opd::rpc::ClientOptions. The secret is read from --secret-file or $OPD_SECRET, never taken as a
// flag value (`ps` would show it).
#pragma once

#include <iostream>
#include <set>
#include <string>

#include "absl/time/time.h"
#include "ctl/args.h"
#include "rpc/auth.h"
#include "rpc/client.h"

namespace ctl {

inline const std::set<std::string> kClientFlags = {
    "addr", "secret-file", "tls-ca", "tls-cert", "tls-key", "tls-server-name", "timeout"};

inline constexpr const char* kClientUsage =
    "  --addr HOST:PORT        the service\n"
    "  --secret-file F         shared secret (mode 0600); default $OPD_SECRET\n"
    "  --tls-ca F              verify the server with this CA (enables TLS)\n"
    "  --tls-cert F --tls-key F  client certificate (mutual TLS)\n"
    "  --tls-server-name N     name to expect in the server certificate\n"
    "  --timeout S             deadline of each call in seconds (default 120)\n";

// `known` plus the client flags.
inline std::set<std::string> WithClientFlags(std::set<std::string> known) {
  known.insert(kClientFlags.begin(), kClientFlags.end());
  return known;
}

inline absl::StatusOr<opd::rpc::ClientOptions> ClientOptionsFrom(const Args& args) {
  opd::rpc::ClientOptions o;
  o.address = args.Get("addr");
  if (o.address.empty()) return absl::InvalidArgumentError("--addr is required");
  auto secret = opd::rpc::LoadSecret(args.Get("secret-file"));
  if (!secret.ok()) return secret.status();
  o.secret = *secret;
  o.tls.ca_file = args.Get("tls-ca");
  o.tls.cert_file = args.Get("tls-cert");
  o.tls.key_file = args.Get("tls-key");
  o.tls.server_name = args.Get("tls-server-name");
  o.timeout = absl::Seconds(std::stod(args.Get("timeout", "120")));
  return o;
}

// Prints "opd-ctl <command>: <status>" (the status names the address and the gRPC code).
inline int Fail(const char* command, const absl::Status& st) {
  std::cerr << "opd-ctl " << command << ": " << st << "\n";
  return 1;
}

}  // namespace ctl
