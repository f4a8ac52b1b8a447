// opd-ctl info --addr ENDPOINT [--service auto|teacher|rollout]
// Prints the service's Info as one JSON line (model, architecture, vocabulary, tokenizer
// fingerprint, limits, build, and for a rollout worker the weight version). ENDPOINT may also be
// an external teacher (sglang://, vllm:// and their +https variants): then what the server
// reports (model name, architecture "sglang" or "vllm", max_seq_len from its context length).
#include <iostream>

#include <google/protobuf/util/json_util.h>

#include "ctl/client_args.h"
#include "ctl/command.h"
#include "rpc/http_teacher.h"

namespace ctl {
namespace {

const std::string kUsage =
    std::string(
        "usage: opd-ctl info --addr ENDPOINT [--service auto|teacher|rollout]\n"
        "  ENDPOINT                HOST:PORT, or a teacher at sglang://HOST:PORT or "
        "vllm://HOST:PORT\n"
        "                          (sglang+https://, vllm+https:// with --tls-ca)\n"
        "  --service S             which service to ask (auto: teacher, then rollout)\n") +
    kClientUsage;

absl::StatusOr<opd::v1::ServiceInfo> FetchInfo(const opd::rpc::ClientOptions& opts,
                                               const std::string& service) {
  if (service != "rollout") {
    auto client = opd::rpc::CreateTeacherEndpoint(opts);
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
  if (service == "rollout" && opd::rpc::IsHttpTeacherEndpoint(opts.address)) {
    std::cerr << "opd-ctl info: " << opts.address
              << " is a teacher endpoint, not a rollout worker\n";
    return 2;
  }
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
