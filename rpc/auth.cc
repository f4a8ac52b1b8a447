#include "rpc/auth.h"

#include <sys/stat.h>

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/util/file.h"

namespace opd::rpc {

absl::StatusOr<std::string> LoadSecret(const std::string& secret_file) {
  if (secret_file.empty()) {
    const char* env = std::getenv(kSecretEnv);
    return std::string(env ? env : "");
  }
  struct stat st {};
  if (::stat(secret_file.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("secret file ", secret_file, " does not exist"));
  }
  if (st.st_mode & 077) {
    return absl::PermissionDeniedError(
        absl::StrFormat("secret file %s is readable by group or others (mode %04o): chmod 600 it",
                        secret_file, st.st_mode & 07777));
  }
  absl::StatusOr<std::string> text = lm::ReadFile(secret_file);
  if (!text.ok())
    return absl::PermissionDeniedError(
        absl::StrCat("cannot read secret file ", secret_file, ": ", text.status().message()));
  std::string secret(absl::StripTrailingAsciiWhitespace(*text));
  if (secret.empty())
    return absl::InvalidArgumentError(absl::StrCat("secret file ", secret_file, " is empty"));
  return secret;
}

std::string BearerValue(std::string_view secret) {
  return "Bearer " + std::string(secret);
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Compare every byte of the longer input (reading the shorter one cyclically) so that the time
  // reveals neither the position of the first difference nor, beyond the lengths, anything else.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = a.empty() ? 0 : static_cast<unsigned char>(a[i % a.size()]);
    const unsigned char y = b.empty() ? 0 : static_cast<unsigned char>(b[i % b.size()]);
    diff |= x ^ y;
  }
  return diff == 0;
}

grpc::Status Authenticator::Check(const grpc::ServerContextBase& ctx, bool always_required) const {
  if (!configured()) {
    if (!always_required) return grpc::Status::OK;
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        "this server has no shared secret configured (--secret-file or OPD_SECRET), "
        "so this method is disabled");
  }
  const auto& md = ctx.client_metadata();
  auto it = md.find(kAuthMetadataKey);
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing 'authorization: Bearer <secret>' metadata");
  }
  const std::string_view got(it->second.data(), it->second.size());
  if (!ConstantTimeEquals(got, BearerValue(secret_))) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong shared secret");
  }
  return grpc::Status::OK;
}

}  // namespace opd::rpc
