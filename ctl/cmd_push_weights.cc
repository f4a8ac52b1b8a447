// opd-ctl push-weights --addr HOST:PORT --from DIR --version V [--chunk-mb N]
// Loads the model in DIR (any checkpoint layout LoadModel reads) and streams every parameter to a
// rollout worker as weight version V; the worker swaps them in atomically or keeps its old ones.
#include <iostream>

#include <torch/torch.h>

#include "ctl/client_args.h"
#include "ctl/command.h"
#include "ctl/flag_ranges.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "rpc/tensor_codec.h"
#include "rpc/weight_stream.h"

namespace ctl {

int RunPushWeights(const std::vector<std::string>& words) {
  const std::string usage =
      std::string(
          "usage: opd-ctl push-weights --addr HOST:PORT --from DIR --version V [--chunk-mb N] "
          "[--dtype float32|bfloat16]\n"
          "  --from DIR              model directory whose weights are sent\n"
          "  --version V             weight version the worker will serve\n"
          "  --chunk-mb N            size of each streamed chunk, MiB (4)\n"
          "  --dtype D               float32 | bfloat16 (float32)\n") +
      kClientUsage;
  Args args;
  const FlagSpec spec = WithClientFlags({{"from", Kind::kString},
                                         {"version", Kind::kInt64},
                                         {"chunk-mb", Kind::kNumber},
                                         {"dtype", Kind::kString}});
  if (int rc = ParseCommandArgs("push-weights", words, spec, {"from", "version"}, usage, &args);
      rc >= 0)
    return rc;
  // A worker serves version 0 or later and takes only a version above the one it serves; a chunk
  // is one message, and protobuf cannot send 2 GiB.
  const double chunk_mb = args.Number("chunk-mb", 4);
  const absl::Status ranges = FirstError({
      CheckFlagRange("--version", args.Int64("version", 0), 1, INT64_MAX),
      CheckFlagPositive("--chunk-mb", chunk_mb, 2047),
  });
  if (int rc = RangeExitCode("push-weights", ranges, usage); rc >= 0) return rc;
  opd::rpc::ClientOptions opts;
  if (int rc = ClientOptionsFrom("push-weights", args, &opts); rc >= 0) return rc;
  lm::LoadOptions load;
  auto dtype = opd::rpc::WireDtypeFromName(args.Get("dtype", "float32"));
  if (!dtype.ok()) return Fail("push-weights", dtype.status());
  load.dtype = opd::rpc::TorchDtype(*dtype);
  auto model = lm::LoadModel(args.Get("from"), load);
  if (!model.ok()) return Fail("push-weights", model.status());
  torch::NoGradGuard no_grad;
  opd::rpc::StreamOptions stream;
  stream.chunk_bytes = std::max<size_t>(static_cast<size_t>(chunk_mb * (1 << 20)), 1);
  auto pushed = opd::rpc::StreamWeights(
      opts, args.Int64("version", 0),
      opd::rpc::OutgoingTensorsOf(opd::rpc::NamedParameters(**model), *dtype), stream);
  if (!pushed.ok()) return Fail("push-weights", pushed.status());
  const opd::v1::UpdateWeightsResponse& resp = pushed->applied;
  std::cout << nlohmann::json{{"version", resp.version()},
                              {"tensors", resp.tensors()},
                              {"bytes", resp.bytes()}}
                   .dump()
            << "\n";
  return 0;
}

}  // namespace ctl
