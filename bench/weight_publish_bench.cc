// One learner rank of a weight push to opd-rollout workers, timed: the parallel push of every rank
// (trainer/opd/weight_push.h WeightPublisher) or rank 0's star (a WeightPusher per worker: one
// two-rank group or gRPC stream each, the checksums of the whole model on one thread).
// scripts/bench/weight_publish.py runs both side by side; tests/weight_publish_test.cc runs it as
// the learner ranks of its multi-process tests.
//
//   bench_weight_publish make-model --out DIR [--preset demo|nano_layer]
//       a random Qwen3-MoE checkpoint: demo = the demo's student (scripts/demo/make_task.py:
//       hidden 64, 2 layers, 16 experts of 32, vocabulary 320); nano_layer = one Marco-Nano layer
//       (hidden 1024, 16/8 heads of 128, 232 experts of 384) with its tied 151,936-row
//       embedding (0.43B parameters: real tensor shapes at a size a small machine holds twice).
//   bench_weight_publish push --rank R --world L --master_port P --workers A,B,... --model DIR
//       --secret_file F [--how parallel|star] [--sync collective|auto|grpc] [--steps N]
//       [--versions 1,2,...] [--bucket_mb 64] [--gate_dir D] [--kill_pid PID --kill_step S
//       --kill_after_buckets K] [--timeout_s 60] [--threads N]
//       every rank loads DIR (fp32) and, each step, scales every parameter by 1 + 1/64 (as an
//       optimizer step changes them all) and pushes it as the step's version (--versions, else
//       the workers' highest version + 1, + 2, ...); prints one JSON line per step (the report,
//       the same on every rank). --gate_dir: after step s, rank 0 writes D/done_s and every rank
//       waits for D/go_s (tests inspect the workers in between). --kill_pid: rank 0 SIGKILLs that
//       process once it has sent K buckets of step S (a worker that dies mid-push).
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <thread>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "lm/dist/process_group.h"
#include "lm/model/config.h"
#include "lm/model/model.h"
#include "lm/util/config.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "rpc/auth.h"
#include "rpc/client.h"
#include "rpc/tensor_codec.h"
#include "rpc/weight_wire.h"
#include "trainer/opd/weight_push.h"

ABSL_FLAG(std::string, out, "", "make-model: the checkpoint directory to write");
ABSL_FLAG(std::string, preset, "demo", "make-model: demo | nano_layer");
ABSL_FLAG(int, rank, 0, "push: this learner rank");
ABSL_FLAG(int, world, 1, "push: learner ranks");
ABSL_FLAG(std::string, master_addr, "127.0.0.1", "push: the learner group's rendezvous host");
ABSL_FLAG(int, master_port, 0, "push: the learner group's rendezvous port");
ABSL_FLAG(std::string, workers, "", "push: the rollout workers, comma-separated");
ABSL_FLAG(std::string, secret_file, "", "push: the shared secret");
ABSL_FLAG(std::string, model, "", "push: the model directory whose weights are pushed");
ABSL_FLAG(std::string, how, "parallel", "push: parallel (every rank) | star (rank 0)");
ABSL_FLAG(std::string, sync, "collective", "push: collective | auto | grpc");
ABSL_FLAG(int, steps, 1, "push: pushes");
ABSL_FLAG(std::string, versions, "", "push: the versions pushed, comma-separated");
ABSL_FLAG(double, bucket_mb, 64, "push: bucket, MiB");
ABSL_FLAG(std::string, gate_dir, "", "push: done_s / go_s files between steps");
ABSL_FLAG(int, kill_pid, 0, "push: a process rank 0 SIGKILLs mid-push");
ABSL_FLAG(int, kill_step, 0, "push: the step of --kill_pid");
ABSL_FLAG(int, kill_after_buckets, 1, "push: buckets rank 0 sends before --kill_pid");
ABSL_FLAG(double, timeout_s, 60, "push: the groups' timeout, seconds");
ABSL_FLAG(int, threads, 0, "compute threads (0: LibTorch's default)");

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

absl::Status MakeModel() {
  const std::string preset = absl::GetFlag(FLAGS_preset);
  const bool demo = preset == "demo";
  if (!demo && preset != "nano_layer")
    return absl::InvalidArgumentError("--preset is neither demo nor nano_layer");
  const int64_t hidden = demo ? 64 : 1024, heads = demo ? 4 : 16, kv = demo ? 2 : 8;
  nlohmann::json cfg = {{"architectures", {"Qwen3MoeForCausalLM"}},
                        {"model_type", "qwen3_moe"},
                        {"hidden_size", hidden},
                        {"num_hidden_layers", demo ? 2 : 1},
                        {"num_attention_heads", heads},
                        {"num_key_value_heads", kv},
                        {"head_dim", demo ? hidden / heads : 128},
                        {"intermediate_size", demo ? 4 * hidden : 3072},
                        {"moe_intermediate_size", demo ? 32 : 384},
                        {"num_experts", demo ? 16 : 232},
                        {"num_experts_per_tok", demo ? 2 : 8},
                        {"norm_topk_prob", true},
                        {"decoder_sparse_step", 1},
                        {"mlp_only_layers", nlohmann::json::array()},
                        {"vocab_size", demo ? 320 : 151936},
                        {"max_position_embeddings", demo ? 512 : 4096},
                        {"rms_norm_eps", 1e-6},
                        {"rope_theta", demo ? 1e4 : 1e6},
                        {"tie_word_embeddings", true},
                        {"hidden_act", "silu"},
                        {"attention_bias", false},
                        {"dtype", "bfloat16"}};
  const std::string dir = absl::GetFlag(FLAGS_out);
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  ASSIGN_OR_RETURN(lm::ModelConfig config, lm::LoadModelConfig(dir));
  ASSIGN_OR_RETURN(auto model,
                   lm::CreateModel(config, lm::LoadOptions{torch::kFloat32, torch::kCPU}));
  model->InitWeights(0.02, 1);
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  std::printf("{\"parameters\": %lld}\n", static_cast<long long>(n));
  return lm::SaveModel(*model, dir);
}

void WaitForFile(const fs::path& p) {
  while (!fs::exists(p)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

nlohmann::json StatusJson(const absl::Status& st) {
  return {
      {"ok", st.ok()}, {"code", absl::StatusCodeToString(st.code())}, {"message", st.message()}};
}

// The workers' highest served version (rank 0 asks, every rank learns).
absl::StatusOr<int64_t> ServedVersion(lm::dist::ProcessGroup& learners,
                                      const std::vector<std::string>& workers,
                                      const opd::rpc::ClientOptions& base) {
  std::vector<double> v = {0};
  if (learners.is_root()) {
    for (const auto& w : workers) {
      auto o = base;
      o.address = w;
      ASSIGN_OR_RETURN(auto client, opd::rpc::RolloutClient::Create(o));
      ASSIGN_OR_RETURN(auto info, client->Info());
      v[0] = std::max<double>(v[0], static_cast<double>(info.weight_version()));
    }
  }
  ASSIGN_OR_RETURN(v, learners.AllReduceDoubles(v, lm::dist::ReduceOp::kMax));
  return static_cast<int64_t>(v[0]);
}

// Rank 0's star, the baseline the parallel push is measured against: one WeightPusher per worker
// (its two-rank group, or gRPC with --sync grpc), all pushed at once.
absl::StatusOr<std::vector<std::unique_ptr<trainer::WeightPusher>>> ConnectStar(
    const std::vector<std::string>& workers, const opd::rpc::ClientOptions& base,
    const trainer::WeightPushOptions& po) {
  std::vector<std::unique_ptr<trainer::WeightPusher>> out;
  for (const std::string& w : workers) {
    opd::rpc::ClientOptions o = base;
    o.address = w;
    ASSIGN_OR_RETURN(auto client, opd::rpc::RolloutClient::Create(o));
    ASSIGN_OR_RETURN(const opd::v1::ServiceInfo info, client->Info());
    ASSIGN_OR_RETURN(auto pusher, trainer::WeightPusher::Connect(o, info, po, torch::kCPU));
    out.push_back(std::move(pusher));
  }
  return out;
}

// The star's push of `model` as `version`: the wire form and its checksums once per worker dtype,
// then every worker at once. The first error, naming the worker; `bytes`: what went out.
absl::Status PushStar(std::vector<std::unique_ptr<trainer::WeightPusher>>& pushers,
                      const std::vector<std::string>& workers, torch::nn::Module& model,
                      int64_t version, int64_t* bytes) {
  const auto params = opd::rpc::NamedParameters(model);
  std::map<opd::rpc::WireDtype, std::vector<opd::rpc::OutgoingTensor>> wire;
  torch::Tensor staging = torch::empty({int64_t{16} << 20}, torch::kUInt8);
  for (const auto& p : pushers) {
    auto [it, added] = wire.try_emplace(p->wire_dtype());
    if (!added) continue;
    it->second = opd::rpc::OutgoingTensorsOf(params, p->wire_dtype());
    opd::rpc::ComputeChecksums(&it->second, staging);
  }
  std::vector<std::future<absl::StatusOr<trainer::PushReport>>> calls;
  for (auto& p : pushers) {
    const auto& tensors = wire.at(p->wire_dtype());
    calls.push_back(std::async(std::launch::async,
                               [&p, &tensors, version] { return p->Push(tensors, version); }));
  }
  absl::Status first;
  *bytes = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    auto r = calls[i].get();
    if (r.ok()) *bytes += r->bytes;
    if (!r.ok() && first.ok())
      first = absl::Status(r.status().code(),
                           absl::StrCat("weight push of version ", version, " to rollout worker ",
                                        workers[i], " failed: ", r.status().message()));
  }
  return first;
}

absl::Status Push() {
  const int rank = absl::GetFlag(FLAGS_rank), world = absl::GetFlag(FLAGS_world);
  lm::dist::GroupOptions go;
  go.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  ASSIGN_OR_RETURN(auto learners,
                   lm::dist::ProcessGroup::Create(
                       lm::dist::LaunchEnv{rank, world, 0, absl::GetFlag(FLAGS_master_addr),
                                           absl::GetFlag(FLAGS_master_port)},
                       torch::kCPU, go));
  ASSIGN_OR_RETURN(auto model, lm::LoadModel(absl::GetFlag(FLAGS_model)));
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  torch::NoGradGuard no_grad;
  opd::rpc::ClientOptions co;
  ASSIGN_OR_RETURN(co.secret, opd::rpc::LoadSecret(absl::GetFlag(FLAGS_secret_file)));
  co.timeout = absl::Seconds(600);
  co.max_message_bytes = 64 << 20;
  const std::vector<std::string> workers =
      absl::StrSplit(absl::GetFlag(FLAGS_workers), ',', absl::SkipEmpty());
  trainer::WeightPushOptions po;
  ASSIGN_OR_RETURN(po.mode, lm::ParseChoice<trainer::WeightSyncMode>(absl::GetFlag(FLAGS_sync)));
  po.bucket_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_bucket_mb) * (1 << 20)) / 8 * 8;
  po.group_timeout = go.timeout;
  int step = 0;
  if (const int pid = absl::GetFlag(FLAGS_kill_pid); pid > 0 && rank == 0)
    po.on_bucket = [pid, &step](int64_t b) {
      if (step == absl::GetFlag(FLAGS_kill_step) &&
          b + 1 == absl::GetFlag(FLAGS_kill_after_buckets))
        kill(pid, SIGKILL);
    };
  const bool star = absl::GetFlag(FLAGS_how) == "star";
  std::vector<std::unique_ptr<trainer::WeightPusher>> pushers;
  std::unique_ptr<trainer::WeightPublisher> publisher;
  if (star) {
    if (rank == 0) {
      ASSIGN_OR_RETURN(pushers, ConnectStar(workers, co, po));
    }
  } else {
    ASSIGN_OR_RETURN(
        publisher, trainer::WeightPublisher::Create(learners.get(), workers, co, po, torch::kCPU));
  }
  std::vector<int64_t> versions;
  for (absl::string_view v :
       absl::StrSplit(absl::GetFlag(FLAGS_versions), ',', absl::SkipEmpty())) {
    int64_t x = 0;
    if (!absl::SimpleAtoi(v, &x)) return absl::InvalidArgumentError("--versions: not integers");
    versions.push_back(x);
  }
  if (versions.empty()) {
    ASSIGN_OR_RETURN(const int64_t served, ServedVersion(*learners, workers, co));
    for (int s = 1; s <= absl::GetFlag(FLAGS_steps); ++s) versions.push_back(served + s);
  }
  const fs::path gate = absl::GetFlag(FLAGS_gate_dir);
  for (step = 1; step <= static_cast<int>(versions.size()); ++step) {
    for (auto& p : model->parameters()) p.mul_(1.0f + 1.0f / 64);
    const int64_t version = versions[static_cast<size_t>(step - 1)];
    nlohmann::json line = {
        {"step", step}, {"version", version}, {"how", star ? "star" : "parallel"}};
    const auto t0 = Clock::now();
    if (star) {
      int64_t bytes = 0;
      absl::Status st =
          rank == 0 ? PushStar(pushers, workers, *model, version, &bytes) : absl::OkStatus();
      RETURN_IF_ERROR(learners->Barrier());
      line["seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
      line["status"] = StatusJson(st);
      if (rank == 0) line["bytes"] = bytes;
    } else {
      ASSIGN_OR_RETURN(trainer::PublishReport r, publisher->Publish(*model, version));
      line["seconds"] = r.seconds;
      line["status"] = StatusJson(r.status);
      line["senders"] = r.senders;
      line["group_formed"] = r.group_formed;
      nlohmann::json ws = nlohmann::json::array();
      int64_t bytes = 0;
      for (const auto& w : r.workers) {
        ws.push_back({{"address", w.address},
                      {"status", StatusJson(w.status)},
                      {"collective", w.collective},
                      {"tensors", w.tensors},
                      {"bytes", w.bytes}});
        bytes += w.bytes;
      }
      line["workers"] = ws;
      line["bytes"] = bytes;
    }
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
    if (!gate.empty()) {
      if (rank == 0) {
        const fs::path tmp = gate / absl::StrCat("done_", step, ".tmp");
        std::ofstream(tmp) << line.dump() << "\n";
        fs::rename(tmp, gate / absl::StrCat("done_", step));
      }
      WaitForFile(gate / absl::StrCat("go_", step));
    }
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
          : absl::InvalidArgumentError("usage: bench_weight_publish make-model|push [flags]");
  if (!st.ok()) {
    std::fprintf(stderr, "bench_weight_publish: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  return 0;
}
