// opd-ctl swap-teacher --learner ADDR --stage NAME [--domain D] --endpoints A,B [--secret-file F]
//                      [--timeout S] [--tls-ca F [--tls-cert F --tls-key F] [--tls-server-name N]]
// Asks a running OPD learner to use other teacher replicas for a stage (its default pool, or one
// data domain's pool with --domain; the other pools stay as they are). The learner connects and
// checks them (tokenizer fingerprint, vocabulary) at its next step boundary and answers then, so
// the call lasts up to a step; giving up before (--timeout) withdraws the swap.
#include <iostream>
#include <set>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "ctl/client_args.h"
#include "ctl/command.h"
#include "opd/v1/learner.grpc.pb.h"
#include "rpc/client.h"

namespace ctl {
namespace {

// The replicas of --endpoints A,B (blanks around each trimmed): at least one, none given twice. A
// replica listed twice would be connected and checked twice and get two shares of every step; the
// learner refuses such a list too (INVALID_ARGUMENT), this says so before any connection.
absl::StatusOr<std::vector<std::string>> ParseEndpoints(const std::string& flag) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (absl::string_view e : absl::StrSplit(flag, ',', absl::SkipWhitespace())) {
    const std::string endpoint(absl::StripAsciiWhitespace(e));
    if (!seen.insert(endpoint).second)
      return absl::InvalidArgumentError("--endpoints: '" + endpoint + "' is given twice");
    out.push_back(endpoint);
  }
  if (out.empty()) return absl::InvalidArgumentError("--endpoints: no endpoint given");
  return out;
}

}  // namespace

int RunSwapTeacher(const std::vector<std::string>& words) {
  const std::string usage =
      "usage: opd-ctl swap-teacher --learner HOST:PORT --stage NAME [--domain D] --endpoints A,B "
      "[--secret-file F] [--timeout S]\n"
      "  --learner HOST:PORT     the learner's admin service (admin.listen)\n"
      "  --stage NAME            the stage whose teachers change\n"
      "  --domain D              only this data domain's pool (stages[].domains); default: the "
      "stage's default pool\n"
      "  --endpoints A,B         the new teacher replicas (host:port, each once)\n"
      "  --secret-file F         shared secret (mode 0600); default $OPD_SECRET\n"
      "  --tls-ca F              verify the learner with this CA (enables TLS)\n"
      "  --tls-cert F --tls-key F  client certificate (mutual TLS; needs --tls-ca)\n"
      "  --tls-server-name N     name to expect in the learner's certificate\n"
      "  --timeout S             deadline in seconds, at least a training step (default 1800)\n";
  Args args;
  const FlagSpec spec = WithClientFlags(
      {{"stage", Kind::kString}, {"domain", Kind::kString}, {"endpoints", Kind::kString}},
      "learner");
  if (int rc = ParseCommandArgs("swap-teacher", words, spec, {"learner", "stage", "endpoints"},
                                usage, &args);
      rc >= 0)
    return rc;
  absl::StatusOr<std::vector<std::string>> endpoints = ParseEndpoints(args.Get("endpoints"));
  if (!endpoints.ok()) {
    std::cerr << "opd-ctl swap-teacher: " << endpoints.status().message() << "\n";
    return 2;
  }
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
  req.set_domain(args.Get("domain"));
  for (const std::string& e : *endpoints) req.add_endpoints(e);
  opd::v1::SwapTeacherResponse resp;
  grpc::ClientContext ctx;
  opd::rpc::PrepareContext(opts, &ctx);
  grpc::Status s = stub->SwapTeacher(&ctx, req, &resp);
  if (!s.ok()) {
    std::cerr << "opd-ctl swap-teacher: " << opts.address << ": " << s.error_code() << " "
              << s.error_message() << "\n";
    return 1;
  }
  std::cout << "stage '" << resp.stage() << "'"
            << (resp.domain().empty() ? "" : " domain '" + resp.domain() + "'") << ": "
            << resp.message() << "\n";
  return 0;
}

}  // namespace ctl
