// opd-ctl info --addr HOST:PORT [--service auto|teacher|rollout]
// Prints the service's Info as one JSON line (model, architecture, vocabulary, tokenizer
// fingerprint, limits, build, and for a rollout worker the weight version).
#include <iostream>

#include <google/protobuf/util/json_util.h>

#include "ctl/client_args.h"
#include "ctl/command.h"

namespace ctl {
namespace {

constexpr const char* kUsage =
    "usage: opd-ctl info --addr HOST:PORT [--service auto|teacher|rollout]\n";

absl::StatusOr<opd::v1::ServiceInfo> FetchInfo(const opd::rpc::ClientOptions& opts,
                                               const std::string& service) {
  if (service != "rollout") {
    auto client = opd::rpc::TeacherClient::Create(opts);
    if (!client.ok()) return client.status();
    auto info = (*client)->Info();
    // "auto": a rollout worker answers the teacher's method with UNIMPLEMENTED.
    if (info.ok() || service == "teacher" ||
        info.status().code() != absl::StatusCode::kUnimplemented) {
      return info;
    }
  }
  auto client = opd::rpc::RolloutClient::Create(opts);
  if (!client.ok()) return client.status();
  return (*client)->Info();
}

}  // namespace

int RunInfo(const std::vector<std::string>& words) {
  auto args = Args::Parse(words, WithClientFlags({"service"}));
  const std::string service = args.ok() ? args->Get("service", "auto") : "";
  if (!args.ok() || (service != "auto" && service != "teacher" && service != "rollout")) {
    std::cerr << (args.ok() ? "" : std::string(args.status().message()) + "\n") << kUsage
              << kClientUsage;
    return 2;
  }
  auto opts = ClientOptionsFrom(*args);
  if (!opts.ok()) return Fail("info", opts.status());
  auto info = FetchInfo(*opts, service);
  if (!info.ok()) return Fail("info", info.status());
  google::protobuf::util::JsonPrintOptions jo;
  jo.always_print_primitive_fields = true;
  jo.preserve_proto_field_names = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(*info, &json, jo);
  std::cout << json << "\n";
  return 0;
}

}  // namespace ctl
