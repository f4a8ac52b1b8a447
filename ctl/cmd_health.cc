// opd-ctl health --addr HOST:PORT [--service NAME]
// The standard gRPC health check (no secret needed). Prints one JSON line and exits 0 when the
// service is SERVING, 1 otherwise.
#include <iostream>

#include "ctl/client_args.h"
#include "ctl/command.h"
#include "nlohmann/json.hpp"

namespace ctl {

int RunHealth(const std::vector<std::string>& words) {
  auto args = Args::Parse(words, WithClientFlags({"service"}));
  if (!args.ok()) {
    std::cerr << args.status().message()
              << "\nusage: opd-ctl health --addr HOST:PORT [--service NAME]\n"
              << kClientUsage;
    return 2;
  }
  auto opts = ClientOptionsFrom(*args);
  if (!opts.ok()) return Fail("health", opts.status());
  const std::string service = args->Get("service");
  auto status = opd::rpc::CheckHealth(*opts, service);
  if (!status.ok()) return Fail("health", status.status());
  const std::string name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status);
  std::cout
      << nlohmann::json{{"address", opts->address}, {"service", service}, {"status", name}}.dump()
      << "\n";
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace ctl
