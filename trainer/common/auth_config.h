// The `auth` section of the OPD learner's config: the shared secret and TLS for every link the
// learner has (its client links to teacher services and rollout workers, and its admin service).
//
//   auth:
//     secret_file: /etc/opd/secret   # mode 0600; else $OPD_SECRET
//     tls:
//       ca: ca.pem                   # verifies the teachers' and rollout workers' certificates
//       cert: learner.pem            # the admin service's certificate; also the learner's client
//       key: learner.key             #   certificate for services that require one (mutual TLS)
//       server_name: ""              # name to expect in the services' certificates (optional)
//
// TLS is all or nothing: with `ca` set every client link uses TLS, and the admin service (when
// admin.listen is set) must then have `cert` and `key`; a partial set is a config error naming
// the keys, never a fallback to plaintext.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "lm/util/config.h"
#include "rpc/tls.h"

namespace trainer {

struct OpdTlsConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(std::string, ca);
  OPD_FIELD(std::string, cert);
  OPD_FIELD(std::string, key);
  OPD_FIELD(std::string, server_name);
  bool enabled() const { return !ca.empty() || !cert.empty() || !key.empty(); }
  OPD_CONFIG_FIELDS_END;
};

struct OpdAuthConfig {
  OPD_CONFIG_FIELDS_BEGIN;
  // The services' shared secret: this file (mode 0600), else $OPD_SECRET; never a command-line
  // flag.
  OPD_FIELD(std::string, secret_file);
  OPD_FIELD(OpdTlsConfig, tls);
  OPD_CONFIG_FIELDS_END;
};

// How the learner reaches teachers and rollout workers.
inline opd::rpc::TlsClientOptions ClientTls(const OpdAuthConfig& a) {
  return {a.tls.ca, a.tls.cert, a.tls.key, a.tls.server_name};
}

// How the admin service listens.
inline opd::rpc::TlsServerOptions AdminTls(const OpdAuthConfig& a) {
  return {a.tls.cert, a.tls.key, ""};
}

// Errors name the config keys. `admin_listen`: admin.listen (empty: no admin service).
inline absl::Status ValidateAuthConfig(const OpdAuthConfig& a, const std::string& admin_listen) {
  absl::Status s = opd::rpc::CheckClientTls(
      ClientTls(a), {"auth.tls.ca", "auth.tls.cert", "auth.tls.key", "auth.tls.server_name"});
  if (!s.ok()) return s;
  if (!a.tls.ca.empty() && !admin_listen.empty() && a.tls.cert.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth.tls.ca turns on TLS for the learner's links, and the admin service "
                     "(admin.listen ",
                     admin_listen, ") then needs auth.tls.cert and auth.tls.key"));
  }
  return absl::OkStatus();
}

}  // namespace trainer
