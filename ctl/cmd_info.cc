// opd-ctl info --addr HOST:PORT [--service auto|teacher|rollout]
// Prints the service's Info as one JSON line (model, architecture, vocabulary, tokenizer
// fingerprint, limits, build, and for a rollout worker the weight version).
#include <iostream>

#include <google/protobuf/util/json_util.h>

#include "ctl/client_args.h"
#include "ctl/command.h"

namespace ctl {
namespace {

const std::string kUsage =
    std::string(
        "usage: opd-ctl info --addr HOST:PORT [--service auto|teacher|rollout]\n"
        "  --service S             which service to ask (auto: teacher, then rollout)\n") +
    kClientUsage;

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
  Args args;
  if (int rc = ParseCommandArgs("info", words, WithClientFlags({{"service", Kind::kString}}), {},
                                kUsage, &args);
      rc >= 0)
    return rc;
  const std::string service = args.Get("service", "auto");
  if (service != "auto" && service != "teacher" && service != "rollout") {
    std::cerr << "opd-ctl info: --service: auto, teacher or rollout, got '" << service << "'\n"
              << kUsage;
    return 2;
  }
  opd::rpc::ClientOptions opts;
  if (int rc = ClientOptionsFrom("info", args, &opts); rc >= 0) return rc;
  auto info = FetchInfo(opts, service);
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
