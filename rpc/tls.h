// Optional TLS for the OPD services. With no files given everything is plaintext (loopback and
// trusted networks); the shared secret then travels in clear, which is why production
// deployments across hosts should set a certificate. A partial set of files (a key without its
// certificate, a client CA without a server certificate, ...) is an error naming the options,
// never a silent fallback to plaintext.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"

namespace opd::rpc {

struct TlsServerOptions {
  std::string cert_file;       // PEM certificate chain; with key_file enables TLS
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // when set, clients must present a certificate signed by it
  bool enabled() const {
    return !cert_file.empty() || !key_file.empty() || !client_ca_file.empty();
  }
};

struct TlsClientOptions {
  std::string ca_file;    // PEM roots that signed the server's certificate; enables TLS
  std::string cert_file;  // client certificate (mutual TLS), optional
  std::string key_file;
  std::string server_name;  // overrides the name checked against the certificate
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// How the options are spelled where they came from (flags, config keys), for error messages.
struct TlsServerNames {
  std::string cert = "--tls-cert";
  std::string key = "--tls-key";
  std::string client_ca = "--tls-client-ca";
};
struct TlsClientNames {
  std::string ca = "--tls-ca";
  std::string cert = "--tls-cert";
  std::string key = "--tls-key";
  std::string server_name = "--tls-server-name";
};

// INVALID_ARGUMENT naming the options when the set is inconsistent.
absl::Status CheckServerTls(const TlsServerOptions& tls, const TlsServerNames& names = {});
absl::Status CheckClientTls(const TlsClientOptions& tls, const TlsClientNames& names = {});

// Both check the options first (with the flag names).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsServerOptions& tls);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsClientOptions& tls);

}  // namespace opd::rpc
