#include "rpc/tls.h"

#include "absl/strings/str_cat.h"
#include "lm/util/file.h"
#include "lm/util/status.h"

namespace opd::rpc {

absl::Status CheckServerTls(const TlsServerOptions& tls, const TlsServerNames& names) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        names.cert, " and ", names.key, " go together: TLS needs the certificate and its key"));
  }
  if (!tls.client_ca_file.empty() && tls.cert_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        names.client_ca, " needs ", names.cert, " and ", names.key,
        ": client certificates are only checked over TLS, and without a server certificate the "
        "server would listen in plaintext"));
  }
  return absl::OkStatus();
}

absl::Status CheckClientTls(const TlsClientOptions& tls, const TlsClientNames& names) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        names.cert, " and ", names.key, " go together: a client certificate needs its key"));
  }
  if (tls.ca_file.empty() && !tls.cert_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a client certificate (", names.cert, ", ", names.key, ") needs ", names.ca,
                     ": without a CA to verify the server the connection would be plaintext"));
  }
  if (tls.ca_file.empty() && !tls.server_name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(names.server_name, " needs ", names.ca,
                                                   " (it names the certificate to expect)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsServerOptions& tls) {
  RETURN_IF_ERROR(CheckServerTls(tls));
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions opts;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, lm::ReadFile(tls.cert_file));
  ASSIGN_OR_RETURN(pair.private_key, lm::ReadFile(tls.key_file));
  opts.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls.client_ca_file.empty()) {
    ASSIGN_OR_RETURN(opts.pem_root_certs, lm::ReadFile(tls.client_ca_file));
    opts.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(opts);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsClientOptions& tls) {
  RETURN_IF_ERROR(CheckClientTls(tls));
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions opts;
  ASSIGN_OR_RETURN(opts.pem_root_certs, lm::ReadFile(tls.ca_file));
  if (!tls.cert_file.empty()) {
    ASSIGN_OR_RETURN(opts.pem_cert_chain, lm::ReadFile(tls.cert_file));
    ASSIGN_OR_RETURN(opts.pem_private_key, lm::ReadFile(tls.key_file));
  }
  return grpc::SslCredentials(opts);
}

}  // namespace opd::rpc
