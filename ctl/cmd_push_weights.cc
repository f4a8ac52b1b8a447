// opd-ctl push-weights --addr HOST:PORT --from DIR --version V [--chunk-mb N]
// Loads the model in DIR (any checkpoint layout LoadModel reads) and streams every parameter to a
// rollout worker as weight version V; the worker swaps them in atomically or keeps its old ones.
#include <iostream>

#include <torch/torch.h>

#include "ctl/client_args.h"
#include "ctl/command.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "rpc/tensor_codec.h"

namespace ctl {

int RunPushWeights(const std::vector<std::string>& words) {
  auto args = Args::Parse(words, WithClientFlags({"from", "version", "chunk-mb", "dtype"}));
  if (!args.ok() || !args->Has("from") || !args->Has("version")) {
    std::cerr
        << (args.ok() ? "" : std::string(args.status().message()) + "\n")
        << "usage: opd-ctl push-weights --addr HOST:PORT --from DIR --version V [--chunk-mb N] "
           "[--dtype float32|bfloat16]\n"
        << kClientUsage;
    return 2;
  }
  auto opts = ClientOptionsFrom(*args);
  if (!opts.ok()) return Fail("push-weights", opts.status());
  lm::LoadOptions load;
  auto dtype = opd::rpc::DtypeFromName(args->Get("dtype", "float32"));
  if (!dtype.ok()) return Fail("push-weights", dtype.status());
  load.dtype = *dtype;
  auto model = lm::LoadModel(args->Get("from"), load);
  if (!model.ok()) return Fail("push-weights", model.status());
  auto client = opd::rpc::RolloutClient::Create(*opts);
  if (!client.ok()) return Fail("push-weights", client.status());
  const auto weights = opd::rpc::WeightsOf(**model);
  const size_t chunk = static_cast<size_t>(std::stod(args->Get("chunk-mb", "4")) * (1 << 20));
  auto resp = (*client)->UpdateWeights(std::stoll(args->Get("version")), weights.views,
                                       std::max<size_t>(chunk, 1));
  if (!resp.ok()) return Fail("push-weights", resp.status());
  std::cout << nlohmann::json{{"version", resp->version()},
                              {"tensors", resp->tensors()},
                              {"bytes", resp->bytes()}}
                   .dump()
            << "\n";
  return 0;
}

}  // namespace ctl
