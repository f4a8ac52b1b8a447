// absl::Status <-> grpc::Status. The two code spaces are numerically identical (both follow
// google.rpc.Code), so conversions keep the code and the message.
#pragma once

#include <string>
#include <string_view>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace opd::rpc {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// A client-side error: the gRPC code, with the peer's address in front of the message so that
// whoever reads it knows which of several servers failed.
inline absl::Status FromGrpc(const grpc::Status& s, std::string_view address) {
  if (s.ok()) return absl::OkStatus();
  std::string msg(address);
  msg += ": ";
  msg += s.error_message();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), msg);
}

}  // namespace opd::rpc
