// opd-ctl swap-teacher --learner ADDR --stage NAME --endpoints A,B [--secret-file F] [--timeout S]
// Asks a running OPD learner to use other teacher replicas for a stage. The learner checks them
// (tokenizer fingerprint, vocabulary) before accepting; the swap takes effect at the next step.
#include <iostream>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "ctl/args.h"
#include "ctl/command.h"
#include "opd/v1/learner.grpc.pb.h"
#include "rpc/auth.h"
#include "rpc/client.h"

namespace ctl {

int RunSwapTeacher(const std::vector<std::string>& words) {
  constexpr const char* kUsage =
      "usage: opd-ctl swap-teacher --learner HOST:PORT --stage NAME --endpoints A,B [--secret-file "
      "F] [--timeout S]\n"
      "  the secret comes from --secret-file or $OPD_SECRET\n";
  auto args = Args::Parse(words, {"learner", "stage", "endpoints", "secret-file", "timeout"});
  if (!args.ok() || !args->Has("learner") || !args->Has("stage") || !args->Has("endpoints")) {
    std::cerr << (args.ok() ? "" : std::string(args.status().message()) + "\n") << kUsage;
    return 2;
  }
  auto secret = opd::rpc::LoadSecret(args->Get("secret-file"));
  if (!secret.ok()) {
    std::cerr << "opd-ctl swap-teacher: " << secret.status().message() << "\n";
    return 2;
  }
  opd::rpc::ClientOptions opts;
  opts.address = args->Get("learner");
  opts.secret = *secret;
  opts.timeout = absl::Seconds(std::stod(args->Get("timeout", "60")));
  auto channel = opd::rpc::MakeChannel(opts);
  if (!channel.ok()) {
    std::cerr << "opd-ctl swap-teacher: " << channel.status().message() << "\n";
    return 1;
  }
  auto stub = opd::v1::Learner::NewStub(*channel);
  opd::v1::SwapTeacherRequest req;
  req.set_stage(args->Get("stage"));
  for (const std::string& e :
       std::vector<std::string>(absl::StrSplit(args->Get("endpoints"), ',', absl::SkipEmpty())))
    req.add_endpoints(e);
  opd::v1::SwapTeacherResponse resp;
  grpc::ClientContext ctx;
  opd::rpc::PrepareContext(opts, &ctx);
  grpc::Status s = stub->SwapTeacher(&ctx, req, &resp);
  if (!s.ok()) {
    std::cerr << "opd-ctl swap-teacher: " << opts.address << ": " << s.error_code() << " "
              << s.error_message() << "\n";
    return 1;
  }
  std::cout << "stage '" << resp.stage() << "': " << resp.message() << "\n";
  return 0;
}

}  // namespace ctl
