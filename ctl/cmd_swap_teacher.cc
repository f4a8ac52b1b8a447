// opd-ctl swap-teacher --learner ADDR --stage NAME --endpoints A,B [--secret-file F] [--timeout S]
//                      [--tls-ca F [--tls-cert F --tls-key F] [--tls-server-name N]]
// Asks a running OPD learner to use other teacher replicas for a stage. The learner connects and
// checks them (tokenizer fingerprint, vocabulary) at its next step boundary and answers then, so
// the call lasts up to a step; giving up before (--timeout) withdraws the swap.
#include <iostream>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "ctl/client_args.h"
#include "ctl/command.h"
#include "opd/v1/learner.grpc.pb.h"
#include "rpc/client.h"

namespace ctl {

int RunSwapTeacher(const std::vector<std::string>& words) {
  const std::string usage =
      "usage: opd-ctl swap-teacher --learner HOST:PORT --stage NAME --endpoints A,B [--secret-file "
      "F] [--timeout S]\n"
      "  --learner HOST:PORT     the learner's admin service (admin.listen)\n"
      "  --stage NAME            the stage whose teachers change\n"
      "  --endpoints A,B         the new teacher replicas (host:port)\n"
      "  --secret-file F         shared secret (mode 0600); default $OPD_SECRET\n"
      "  --tls-ca F              verify the learner with this CA (enables TLS)\n"
      "  --tls-cert F --tls-key F  client certificate (mutual TLS; needs --tls-ca)\n"
      "  --tls-server-name N     name to expect in the learner's certificate\n"
      "  --timeout S             deadline in seconds, at least a training step (default 1800)\n";
  Args args;
  const FlagSpec spec =
      WithClientFlags({{"stage", Kind::kString}, {"endpoints", Kind::kString}}, "learner");
  if (int rc = ParseCommandArgs("swap-teacher", words, spec, {"learner", "stage", "endpoints"},
                                usage, &args);
      rc >= 0)
    return rc;
  opd::rpc::ClientOptions opts;
  if (int rc = ClientOptionsFrom("swap-teacher", args, &opts, "learner", 1800); rc >= 0) return rc;
  auto channel = opd::rpc::MakeChannel(opts);
  if (!channel.ok()) {
    std::cerr << "opd-ctl swap-teacher: " << channel.status().message() << "\n";
    return 1;
  }
  auto stub = opd::v1::Learner::NewStub(*channel);
  opd::v1::SwapTeacherRequest req;
  req.set_stage(args.Get("stage"));
  for (const std::string& e :
       std::vector<std::string>(absl::StrSplit(args.Get("endpoints"), ',', absl::SkipEmpty())))
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
