#include "rpc/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"

namespace opd::rpc {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsServerOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and a key file");
  }
  grpc::SslServerCredentialsOptions opts;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadFile(tls.cert_file));
  ASSIGN_OR_RETURN(pair.private_key, ReadFile(tls.key_file));
  opts.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls.client_ca_file.empty()) {
    ASSIGN_OR_RETURN(opts.pem_root_certs, ReadFile(tls.client_ca_file));
    opts.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(opts);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsClientOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions opts;
  ASSIGN_OR_RETURN(opts.pem_root_certs, ReadFile(tls.ca_file));
  if (!tls.cert_file.empty()) {
    ASSIGN_OR_RETURN(opts.pem_cert_chain, ReadFile(tls.cert_file));
    ASSIGN_OR_RETURN(opts.pem_private_key, ReadFile(tls.key_file));
  }
  return grpc::SslCredentials(opts);
}

}  // namespace opd::rpc
