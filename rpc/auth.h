// Shared-secret authentication for the OPD services.
//
// The secret reaches a process from a file (--secret-file, mode 0600) or the OPD_SECRET
// environment variable, never from a command-line flag: flags are visible to every user in `ps`.
// Clients send it as gRPC metadata `authorization: Bearer <secret>`; servers compare in constant
// time. The health service is exempt (load balancers and orchestrators probe it without
// credentials); server reflection is exempt too, since it only describes the public schema.
#pragma once

#include <string>
#include <string_view>

#include <grpcpp/server_context.h>

#include "absl/status/statusor.h"

namespace opd::rpc {

inline constexpr const char* kSecretEnv = "OPD_SECRET";
inline constexpr const char* kAuthMetadataKey = "authorization";

// The secret from `secret_file` when non-empty, else from $OPD_SECRET, else "" (none). A file
// readable by group or others is refused; trailing whitespace (a final newline) is dropped.
absl::StatusOr<std::string> LoadSecret(const std::string& secret_file);

// The metadata value a client sends: "Bearer <secret>".
std::string BearerValue(std::string_view secret);

// Equality whose running time depends only on the lengths, not on where the inputs differ.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

class Authenticator {
 public:
  explicit Authenticator(std::string secret) : secret_(std::move(secret)) {}

  bool configured() const { return !secret_.empty(); }

  // OK when the call carries the right bearer secret. Without a configured secret every call is
  // let through, except when `always_required` (weight updates): those are then refused.
  grpc::Status Check(const grpc::ServerContextBase& ctx, bool always_required = false) const;

 private:
  std::string secret_;
};

}  // namespace opd::rpc
