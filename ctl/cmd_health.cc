// opd-ctl health --addr HOST:PORT [--service NAME]
// The standard gRPC health check (no secret needed). Prints one JSON line and exits 0 when the
// service is SERVING, 1 otherwise.
#include <iostream>

#include "ctl/client_args.h"
#include "ctl/command.h"
#include "nlohmann/json.hpp"

namespace ctl {

int RunHealth(const std::vector<std::string>& words) {
  const std::string usage =
      std::string(
          "usage: opd-ctl health --addr HOST:PORT [--service NAME]\n"
          "  --service NAME          the service to check (default: the whole server)\n") +
      kClientUsage;
  Args args;
  if (int rc = ParseCommandArgs("health", words, WithClientFlags({{"service", Kind::kString}}), {},
                                usage, &args);
      rc >= 0)
    return rc;
  opd::rpc::ClientOptions opts;
  if (int rc = ClientOptionsFrom("health", args, &opts); rc >= 0) return rc;
  const std::string service = args.Get("service");
  auto status = opd::rpc::CheckHealth(opts, service);
  if (!status.ok()) return Fail("health", status.status());
  const std::string name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status);
  std::cout
      << nlohmann::json{{"address", opts.address}, {"service", service}, {"status", name}}.dump()
      << "\n";
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace ctl
