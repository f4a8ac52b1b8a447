// Weight pushes from a learner to an opd-rollout worker, over gRPC streaming or collective sync
// (trainer/opd/weight_push.h), timed. scripts/bench/weight_sync.py drives it.
//
//   bench_weight_sync make-model --out DIR [--experts 76]
//       writes a Qwen3-MoE checkpoint with Qwen3-30B-A3B's shapes (hidden 2048, 32/4 heads of
//       128, experts of 768, vocab 151936, untied) and --layers decoder layers: 1 layer and 76
//       experts is 1.0B parameters.
//   bench_weight_sync push --addr HOST:PORT --secret-file F --model DIR --sync grpc|collective
//       [--repeat N] [--bucket-mb 64] [--die-after-buckets K]
//       loads DIR (fp32), connects, and pushes N versions above the worker's, every parameter
//       changed before each push (as after an optimizer step); prints one JSON line per push.
//       --die-after-buckets: SIGKILL itself once K buckets went out (tests of a learner that dies
//       mid-broadcast).
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "lm/model/config.h"
#include "lm/model/model.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "rpc/auth.h"
#include "rpc/client.h"
#include "rpc/weight_wire.h"
#include "trainer/opd/weight_push.h"

ABSL_FLAG(std::string, out, "", "make-model: the checkpoint directory to write");
ABSL_FLAG(int, layers, 1, "make-model: decoder layers");
ABSL_FLAG(int, experts, 76, "make-model: experts per layer");
ABSL_FLAG(std::string, addr, "", "push: the rollout worker");
ABSL_FLAG(std::string, secret_file, "", "push: the shared secret");
ABSL_FLAG(std::string, model, "", "push: the model directory whose weights are pushed");
ABSL_FLAG(std::string, sync, "grpc", "push: grpc | collective");
ABSL_FLAG(int, repeat, 1, "push: pushes");
ABSL_FLAG(double, bucket_mb, 64, "push: cast and broadcast bucket, MiB");
ABSL_FLAG(int, die_after_buckets, 0, "push: SIGKILL itself after this many buckets (0: never)");
ABSL_FLAG(int, threads, 0, "compute threads (0: LibTorch's default)");

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

absl::Status MakeModel() {
  const int e = absl::GetFlag(FLAGS_experts);
  nlohmann::json cfg = {{"architectures", {"Qwen3MoeForCausalLM"}},
                        {"model_type", "qwen3_moe"},
                        {"hidden_size", 2048},
                        {"num_hidden_layers", absl::GetFlag(FLAGS_layers)},
                        {"num_attention_heads", 32},
                        {"num_key_value_heads", 4},
                        {"head_dim", 128},
                        {"intermediate_size", 6144},
                        {"moe_intermediate_size", 768},
                        {"num_experts", e},
                        {"num_experts_per_tok", std::min(8, e)},
                        {"norm_topk_prob", true},
                        {"decoder_sparse_step", 1},
                        {"mlp_only_layers", nlohmann::json::array()},
                        {"vocab_size", 151936},
                        {"max_position_embeddings", 4096},
                        {"rms_norm_eps", 1e-6},
                        {"rope_theta", 1e7},
                        {"tie_word_embeddings", false},
                        {"hidden_act", "silu"},
                        {"attention_bias", false},
                        {"dtype", "bfloat16"}};
  const std::string dir = absl::GetFlag(FLAGS_out);
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  ASSIGN_OR_RETURN(lm::ModelConfig config, lm::LoadModelConfig(dir));
  ASSIGN_OR_RETURN(auto model,
                   lm::CreateModel(config, lm::LoadOptions{torch::kBFloat16, torch::kCPU}));
  model->InitWeights(0.02, 1);
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  std::printf("{\"parameters\": %lld}\n", static_cast<long long>(n));
  lm::SaveOptions so;
  so.dtype = torch::kBFloat16;
  return lm::SaveModel(*model, dir, so);
}

absl::Status Push() {
  ASSIGN_OR_RETURN(auto model, lm::LoadModel(absl::GetFlag(FLAGS_model)));
  torch::NoGradGuard no_grad;
  opd::rpc::ClientOptions co;
  co.address = absl::GetFlag(FLAGS_addr);
  ASSIGN_OR_RETURN(co.secret, opd::rpc::LoadSecret(absl::GetFlag(FLAGS_secret_file)));
  co.timeout = absl::Seconds(600);
  co.max_message_bytes = 64 << 20;
  ASSIGN_OR_RETURN(auto client, opd::rpc::RolloutClient::Create(co));
  ASSIGN_OR_RETURN(auto info, client->Info());
  trainer::WeightPushOptions po;
  ASSIGN_OR_RETURN(po.mode, lm::ParseChoice<trainer::WeightSyncMode>(absl::GetFlag(FLAGS_sync)));
  po.bucket_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_bucket_mb) * (1 << 20)) / 8 * 8;
  if (const int k = absl::GetFlag(FLAGS_die_after_buckets); k > 0)
    po.on_bucket = [k](int64_t b) {
      if (b + 1 >= k) raise(SIGKILL);
    };
  const auto t_connect = Clock::now();
  ASSIGN_OR_RETURN(auto pusher, trainer::WeightPusher::Connect(co, info, po, torch::kCPU));
  const double connect_s = Since(t_connect);
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : model->named_parameters()) params.emplace_back(p.key(), p.value());
  torch::Tensor staging = torch::empty({int64_t{16} << 20}, torch::kUInt8);
  int64_t version = info.weight_version();
  for (int i = 0; i < absl::GetFlag(FLAGS_repeat); ++i) {
    // Every parameter moves, as after an optimizer step (by more than a bf16 ulp somewhere).
    for (auto& [name, t] : params) t.mul_(1.0f + 1.0f / 64);
    const auto t0 = Clock::now();
    auto wire = opd::rpc::OutgoingTensorsOf(params, pusher->wire_dtype());
    opd::rpc::ComputeChecksums(&wire, staging);
    const double checksum_s = Since(t0);
    const auto t1 = Clock::now();
    ASSIGN_OR_RETURN(trainer::PushReport r, pusher->Push(wire, ++version));
    const double push_s = Since(t1);
    nlohmann::json line = {{"sync", absl::GetFlag(FLAGS_sync)},
                           {"collective", r.collective},
                           {"version", version},
                           {"tensors", r.tensors},
                           {"bytes", r.bytes},
                           {"connect_s", connect_s},
                           {"checksum_s", checksum_s},
                           {"push_s", push_s},
                           {"total_s", checksum_s + push_s}};
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_threads) > 0) torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  const std::string cmd = args.size() > 1 ? args[1] : "";
  absl::Status st =
      cmd == "make-model" ? MakeModel()
      : cmd == "push"
          ? Push()
          : absl::InvalidArgumentError("usage: bench_weight_sync make-model|push [flags]");
  if (!st.ok()) {
    std::fprintf(stderr, "bench_weight_sync: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  return 0;
}
