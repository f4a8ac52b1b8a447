// Flags every opd-ctl command that talks to a running service shares, turned into
// opd::rpc::ClientOptions. The secret is read from --secret-file or $OPD_SECRET, never taken as a
// flag value (`ps` would show it).
#pragma once

#include <iostream>
#include <string>

#include "absl/time/time.h"
#include "ctl/args.h"
#include "ctl/flag_ranges.h"
#include "rpc/auth.h"
#include "rpc/client.h"

namespace ctl {

inline constexpr const char* kClientUsage =
    "  --addr HOST:PORT        the service\n"
    "  --secret-file F         shared secret (mode 0600); default $OPD_SECRET\n"
    "  --tls-ca F              verify the server with this CA (enables TLS)\n"
    "  --tls-cert F --tls-key F  client certificate (mutual TLS; needs --tls-ca)\n"
    "  --tls-server-name N     name to expect in the server certificate\n"
    "  --timeout S             deadline of each call in seconds (default 120)\n";

// `spec` plus the client flags; the service's address is `address_flag`.
inline FlagSpec WithClientFlags(FlagSpec spec, const std::string& address_flag = "addr") {
  for (const char* name : {"secret-file", "tls-ca", "tls-cert", "tls-key", "tls-server-name"})
    spec[name] = Kind::kString;
  spec[address_flag] = Kind::kString;
  spec["timeout"] = Kind::kNumber;
  return spec;
}

// The longest --timeout: a week. Far above any call (a weight push of a big model, a teacher swap
// waiting for a step boundary), so only a typo reaches it.
inline constexpr double kMaxTimeoutSeconds = 7 * 24 * 3600;

// Fills `*out` from the client flags. Returns -1 to go on, else 2 after printing the error: flags
// that do not fit together (no address, a partial TLS set), a timeout outside (0, a week], or a
// secret file that cannot be used (missing, empty, readable by others: a bad value, as in every
// process).
inline int ClientOptionsFrom(const char* command, const Args& args, opd::rpc::ClientOptions* out,
                             const std::string& address_flag = "addr",
                             double default_timeout_s = 120) {
  opd::rpc::ClientOptions o;
  o.address = args.Get(address_flag);
  o.tls.ca_file = args.Get("tls-ca");
  o.tls.cert_file = args.Get("tls-cert");
  o.tls.key_file = args.Get("tls-key");
  o.tls.server_name = args.Get("tls-server-name");
  const double timeout = args.Number("timeout", default_timeout_s);
  absl::Status st = opd::rpc::CheckClientTls(o.tls);
  if (o.address.empty()) st = absl::InvalidArgumentError("--" + address_flag + " is required");
  if (st.ok()) st = CheckFlagPositive("--timeout", timeout, kMaxTimeoutSeconds);
  if (!st.ok()) {
    std::cerr << "opd-ctl " << command << ": " << st.message() << "\n";
    return 2;
  }
  o.timeout = absl::Seconds(timeout);
  auto secret = opd::rpc::LoadSecret(args.Get("secret-file"));
  if (!secret.ok()) {
    std::cerr << "opd-ctl " << command << ": " << secret.status().message() << "\n";
    return 2;
  }
  o.secret = *secret;
  *out = std::move(o);
  return -1;
}

// Prints "opd-ctl <command>: <status>" (the status names the address and the gRPC code).
inline int Fail(const char* command, const absl::Status& st) {
  std::cerr << "opd-ctl " << command << ": " << st << "\n";
  return 1;
}

}  // namespace ctl
