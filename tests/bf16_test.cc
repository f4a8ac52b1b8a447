// bf16 end to end (issue #16, serving side):
//   - --device/--dtype resolution (lm/model/placement.h) and its errors;
//   - parity of our bf16 CPU forward with transformers' bf16 forward for Qwen3-MoE and
//     Qwen3-Next (tests/python/make_bf16_fixtures.py), and that the fp32-only CPU fast paths are
//     not what runs for bf16;
//   - peak host memory of loading a sharded bf16 checkpoint, measured in a child process
//     (tests/load_rss_probe.cc) against the checkpoint's sizes;
//   - a bf16 opd-teacher serving Score over gRPC (full build only: OPD_BF16_SERVING);
//   - on a CUDA device: loading to it in bf16, scoring there, and the host memory of that load
//     (skip without a device, fail under OPD_REQUIRE_GPU).
//
// Tolerances. transformers' own bf16 tests (test_eager_matches_sdpa_inference, comparing two
// implementations of one model in bf16) accept |a - b| <= atol + rtol |b| with atol = rtol = 1e-2
// on CPU (rtol 3e-2 on CUDA): bf16 keeps 8 bits of mantissa, so two correct implementations that
// round at different points differ by a few units of 2^-8. We apply that rule per element to the
// log-probs and require it of every token but a few (kRowsWithin, below: top-k routing flips on
// near ties). Our routers and LM head compute in fp32 where transformers' bf16 run rounds them
// to bf16 (issue #25: the rollout must route and score as the learner does), so its near-ties
// go the other way in ours and the final hidden states and logits are reported, not held to
// the rule (measured: 76% / 87% / 29% of tokens' hidden states within it; log-probs 100% /
// 100% / 99.2%). The worst log-prob must stay within the model's own bf16 rounding error
// (transformers bf16 against the same weights in fp32, recorded by the fixture), and our own
// distance from fp32 within 1.1x transformers' (measured: at most equal).
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/cpu/cpu_inference.h"
#include "lm/io/hf_model_dir.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/placement.h"
#include "nlohmann/json.hpp"

#ifdef OPD_BF16_SERVING
#include "child_process.h"
#include "rpc/client.h"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#endif

using testing_util::TempDir;

namespace lm {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = OPD_BF16_FIXTURES_DIR;

// ---------------------------------------------------------------------------------------------
// --device / --dtype

TEST(Placement, DevicesAndLocalRank) {
  EXPECT_EQ(*ResolveDevice("", -1, 0), torch::Device(torch::kCPU));
  EXPECT_EQ(*ResolveDevice("cpu", 3, 0), torch::Device(torch::kCPU));
  EXPECT_EQ(*ResolveDevice("cuda", -1, 2), torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(*ResolveDevice("cuda", 5, 8), torch::Device(torch::kCUDA, 5));    // LOCAL_RANK
  EXPECT_EQ(*ResolveDevice("cuda:1", 5, 8), torch::Device(torch::kCUDA, 1));  // explicit wins
}

TEST(Placement, ErrorsNameTheFlag) {
  auto expect = [](const absl::Status& st, absl::StatusCode code,
                   const std::vector<std::string>& words) {
    EXPECT_EQ(st.code(), code) << st;
    for (const auto& w : words) EXPECT_NE(st.message().find(w), std::string::npos) << st;
  };
  expect(ResolveDevice("cuda", -1, 0).status(), absl::StatusCode::kFailedPrecondition,
         {"--device", "no CUDA device"});
  expect(ResolveDevice("cuda:2", -1, 2).status(), absl::StatusCode::kInvalidArgument,
         {"--device", "index 2", "out of range", "2 CUDA device"});
  expect(ResolveDevice("cuda", 4, 2).status(), absl::StatusCode::kInvalidArgument,
         {"--device", "LOCAL_RANK=4", "out of range"});
  expect(ResolveDevice("cuda:-1", -1, 2).status(), absl::StatusCode::kInvalidArgument,
         {"--device", "non-negative integer"});
  expect(ResolveDevice("tpu", -1, 2).status(), absl::StatusCode::kInvalidArgument,
         {"--device", "'tpu'"});
  expect(ResolveDevice("cuda", -1, 0, "train.device").status(),
         absl::StatusCode::kFailedPrecondition, {"train.device"});
  expect(ResolveDtype("float16", torch::kCPU).status(), absl::StatusCode::kInvalidArgument,
         {"--dtype", "'float16'", "not supported"});
  expect(ResolveDtype("int8", torch::Device(torch::kCUDA, 0), "--x").status(),
         absl::StatusCode::kInvalidArgument, {"--x", "'int8'"});
}

// A thread starts on CUDA device 0 whatever its parent chose: BindThreadToDevice makes the
// given device current for the calling thread only. On the CPU it does nothing.
TEST(Placement, BindThreadToDeviceIsPerThread) {
  lm::BindThreadToDevice(torch::Device(torch::kCPU));  // no CUDA call, so no error here
  SKIP_WITHOUT_CUDA();
  auto* guard = c10::impl::getDeviceGuardImpl(torch::kCUDA);
  const auto last = static_cast<c10::DeviceIndex>(torch::cuda::device_count() - 1);
  c10::DeviceIndex in_thread = -1, fresh_thread = -1;
  std::thread([&] {
    lm::BindThreadToDevice(torch::Device(torch::kCUDA, last));
    in_thread = guard->getDevice().index();
  }).join();
  std::thread([&] { fresh_thread = guard->getDevice().index(); }).join();
  EXPECT_EQ(in_thread, last);
  EXPECT_EQ(fresh_thread, 0);  // another thread did not inherit it
}

TEST(Placement, DtypeDefaultsToBf16OnCudaOnly) {
  EXPECT_EQ(*ResolveDtype("", torch::kCPU), torch::kFloat32);
  EXPECT_EQ(*ResolveDtype("", torch::Device(torch::kCUDA, 0)), torch::kBFloat16);
  EXPECT_EQ(*ResolveDtype("float32", torch::Device(torch::kCUDA, 0)), torch::kFloat32);
  EXPECT_EQ(*ResolveDtype("bfloat16", torch::kCPU), torch::kBFloat16);
}

TEST(Placement, LocalRankFromTheEnvironment) {
  ::setenv("LOCAL_RANK", "3", 1);
  EXPECT_EQ(*LocalRankFromEnv(), 3);
  ::setenv("LOCAL_RANK", "x", 1);
  EXPECT_NE(LocalRankFromEnv().status().message().find("LOCAL_RANK"), std::string::npos);
  ::unsetenv("LOCAL_RANK");
  EXPECT_EQ(*LocalRankFromEnv(), -1);
}

// ---------------------------------------------------------------------------------------------
// Parity with transformers in bf16

struct Bf16Fixture {
  std::string dir;
  std::vector<std::vector<int64_t>> seqs;
  std::map<std::string, torch::Tensor> ref;
};

Bf16Fixture LoadBf16Fixture(const std::string& name) {
  Bf16Fixture f;
  f.dir = kFixtures + "/" + name;
  std::ifstream in(f.dir + "/inputs.json");
  EXPECT_TRUE(in) << f.dir << ": no fixture (run `ctest -R make_bf16_fixtures`)";
  if (!in) return f;
  f.seqs = nlohmann::json::parse(in)["sequences"].get<std::vector<std::vector<int64_t>>>();
  auto file = SafetensorsFile::Open(f.dir + "/ref.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (file.ok())
    for (const auto& [n, v] : (*file)->tensors()) f.ref[n] = TensorFromView(v, *file).clone();
  return f;
}

std::vector<std::string> Bf16FixtureNames() {
  std::ifstream in(kFixtures + "/index.json");
  if (!in) return {"missing_fixtures"};
  return nlohmann::json::parse(in)["configs"].get<std::vector<std::string>>();
}

// Per token (row), whether every element passes transformers' bf16 rule
// |a - b| <= atol + rtol |b|; and the worst element's |a - b| / (atol + rtol |b|).
struct Agreement {
  double rows_within = 0;  // fraction of rows
  double worst = 0;
};

Agreement Agree(const torch::Tensor& a, const torch::Tensor& b, double atol, double rtol) {
  EXPECT_EQ(a.sizes(), b.sizes());
  auto af = a.to(torch::kFloat32), bf = b.to(torch::kFloat32);
  auto ratio = (af - bf).abs() / (atol + rtol * bf.abs());
  auto row_ok = std::get<0>(ratio.max(1)) <= 1.0;
  return {row_ok.to(torch::kFloat64).mean().item<double>(), ratio.max().item<double>()};
}

// Top-k routing is discrete: where two experts' router probabilities nearly tie, any rounding
// difference (our fp32 delta rule sums in another order than transformers', and its bf16 output
// then rounds the other way in a few elements) picks the other expert, and that token's state
// differs from then on. Such tokens are few; every other token must pass the elementwise rule.
constexpr double kRowsWithin = 0.9;

// Our outputs for the fixture's sequences, each run alone as the reference was.
struct Outputs {
  torch::Tensor hidden, logits, logprobs;
};

Outputs RunAlone(CausalLM& model, const std::vector<std::vector<int64_t>>& seqs) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> hidden, logits, lps;
  for (const auto& s : seqs) {
    auto batch = PackedBatch::FromSequences({s});
    const torch::Device device = model.LmHeadWeight().device();
    batch.input_ids = batch.input_ids.to(device);
    batch.position_ids = batch.position_ids.to(device);
    auto h = model.Forward(batch);
    hidden.push_back(h.to(torch::kCPU, torch::kFloat32));
    // The LM head in the model's dtype, as transformers computes it.
    logits.push_back(model.Logits(h).to(torch::kCPU, torch::kFloat32));
    if (s.size() > 1) {
      auto [rows, targets] = NextTokenRows(batch);
      lps.push_back(
          TokenLogprobs(h.index_select(0, rows), model.LmHeadWeight(), targets).to(torch::kCPU));
    }
  }
  return {torch::cat(hidden), torch::cat(logits), torch::cat(lps)};
}

class Bf16Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Bf16Parity, HiddenLogitsAndLogprobsMatchTransformersBf16) {
  Bf16Fixture f = LoadBf16Fixture(GetParam());
  ASSERT_FALSE(f.ref.empty());
  LoadOptions opts;
  opts.dtype = torch::kBFloat16;
  auto model = LoadModel(f.dir + "/model", opts);
  ASSERT_TRUE(model.ok()) << model.status();
  (*model)->eval();
  for (const auto& p : (*model)->named_parameters())
    ASSERT_EQ(p.value().scalar_type(), torch::kBFloat16) << p.key();
  const Outputs ours = RunAlone(**model, f.seqs);

  const Agreement hidden = Agree(ours.hidden, f.ref["hidden"], 1e-2, 1e-2);
  const Agreement logits = Agree(ours.logits, f.ref["logits"], 1e-2, 1e-2);
  const Agreement lp =
      Agree(ours.logprobs.unsqueeze(1), f.ref["logprobs"].unsqueeze(1), 1e-2, 1e-2);
  const double lp_diff = (ours.logprobs - f.ref["logprobs"]).abs().max().item<double>();
  const double theirs_fp32 =
      (f.ref["logprobs"] - f.ref["logprobs_fp32"]).abs().max().item<double>();
  const double ours_fp32 = (ours.logprobs - f.ref["logprobs_fp32"]).abs().max().item<double>();
  std::printf(
      "%s: tokens within transformers' bf16 tolerance: hidden %.1f%%, logits %.1f%%, log-probs "
      "%.1f%%; max |d logprob| %.4f vs transformers bf16; distance from fp32 arithmetic: "
      "transformers %.4f, ours %.4f\n",
      GetParam().c_str(), 100 * hidden.rows_within, 100 * logits.rows_within, 100 * lp.rows_within,
      lp_diff, theirs_fp32, ours_fp32);
  // Our routers and LM head run in fp32 (lm/model/precision.h LogitsFp32, moe.cc RouterLogits),
  // transformers' in bf16: where its bf16 router logits flip a near-tie the two pick different
  // experts and that token's hidden state (and, through attention, later ones) differs by more
  // than the elementwise rule. So the hidden states and logits are reported, not held to it; the
  // log-probs must pass it on almost every token, and our distance from fp32 arithmetic must
  // not exceed transformers' bf16 one (measured: 0.036 vs 0.045, 0.049 vs 0.051, 0.212 vs 0.212).
  EXPECT_GE(lp.rows_within, kRowsWithin) << "log-probs";
  // Where a routing choice flipped, at most the size of bf16 rounding itself for this model.
  EXPECT_LE(lp_diff, std::max(1e-2, theirs_fp32)) << "log-probs";
  EXPECT_LE(ours_fp32, std::max(1e-2, 1.1 * theirs_fp32)) << "our bf16 rounding error";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Bf16Parity, ::testing::ValuesIn(Bf16FixtureNames()),
                         [](const auto& info) { return info.param; });

// The fp32-only CPU fast paths must not see bf16 tensors: the library path (or one that reads
// bf16) runs, and the log-softmax accumulates in fp32 whatever the weights' dtype.
TEST(Bf16Cpu, Fp32FastPathsAreNotTaken) {
  torch::NoGradGuard no_grad;
  auto x = torch::randn({8, 64}).to(torch::kBFloat16);
  auto w = torch::randn({4, 64, 64}).to(torch::kBFloat16);
  auto weights = torch::rand({8, 2}).to(torch::kBFloat16);
  EXPECT_FALSE(UseCpuInferenceExperts(x, weights, w, w.transpose(1, 2).contiguous()));
  auto head = torch::randn({100, 64}).to(torch::kBFloat16);
  EXPECT_FALSE(UseCpuInferenceLogprobs(x, head));
  // Log-probs of bf16 inputs are fp32 and equal the fp32 log-softmax of the fp32 product of the
  // bf16 operands (fp32 logits, never rounded to bf16: lm/model/precision.h LogitsFp32).
  auto targets = torch::randint(0, 100, {8}, torch::kInt64);
  auto lp = TokenLogprobs(x, head, targets);
  EXPECT_EQ(lp.scalar_type(), torch::kFloat32);
  auto ref = torch::log_softmax(torch::mm(x.to(torch::kFloat32), head.to(torch::kFloat32).t()), -1)
                 .gather(1, targets.unsqueeze(1))
                 .squeeze(1);
  EXPECT_LE((lp - ref).abs().max().item<double>(), 1e-5);
}

// ---------------------------------------------------------------------------------------------
// Peak host memory of a load (child process)

// A Qwen3-MoE of ~330 MB in bf16 (3 layers of 32 experts, hidden 1024), saved by SaveModel in
// bf16 across shards of at most 64 MiB; its largest tensor (the embedding) is 16 MiB.
struct BigCheckpoint {
  fs::path dir;
  int64_t total_bytes = 0, max_shard_bytes = 0;
  ~BigCheckpoint() {  // at exit: the test leaves nothing behind
    std::error_code ec;
    if (!dir.empty()) fs::remove_all(dir, ec);
  }
};

const BigCheckpoint& MakeBigCheckpoint() {
  static const std::unique_ptr<BigCheckpoint> made = [] {
    auto c = std::make_unique<BigCheckpoint>();
    c->dir = TempDir("big");
    nlohmann::json cfg = {{"model_type", "qwen3_moe"},
                          {"vocab_size", 8192},
                          {"hidden_size", 1024},
                          {"intermediate_size", 2048},
                          {"num_hidden_layers", 3},
                          {"num_attention_heads", 8},
                          {"num_key_value_heads", 2},
                          {"head_dim", 128},
                          {"num_experts", 32},
                          {"num_experts_per_tok", 4},
                          {"moe_intermediate_size", 512},
                          {"norm_topk_prob", true},
                          {"tie_word_embeddings", false},
                          {"max_position_embeddings", 1024},
                          {"rms_norm_eps", 1e-6},
                          {"rope_theta", 10000.0}};
    auto config = ParseModelConfig(cfg);
    EXPECT_TRUE(config.ok()) << config.status();
    auto model = CreateModel(*config);
    EXPECT_TRUE(model.ok()) << model.status();
    (*model)->InitWeights(0.02, 7);
    SaveOptions so;
    so.dtype = torch::kBFloat16;
    so.max_shard_bytes = int64_t{64} << 20;
    const absl::Status st = SaveModel(**model, c->dir.string(), so);
    EXPECT_TRUE(st.ok()) << st;
    for (const auto& e : fs::directory_iterator(c->dir)) {
      if (e.path().extension() != ".safetensors") continue;
      const int64_t n = static_cast<int64_t>(fs::file_size(e.path()));
      c->total_bytes += n;
      c->max_shard_bytes = std::max(c->max_shard_bytes, n);
    }
    return c;
  }();
  return *made;
}

struct ProbeResult {
  bool ok = false;
  int64_t load_kb = 0;  // peak during the load less the baseline
  std::string output;
};

ProbeResult Probe(const std::string& args) {
  ProbeResult r;
  const std::string cmd = std::string(OPD_BINARY_DIR) + "/tests/load_rss_probe " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (fgets(buf, sizeof(buf), p)) r.output += buf;
  const int rc = pclose(p);
  if (rc != 0) return r;
  const auto line = r.output.substr(r.output.rfind('{'));
  auto j = nlohmann::json::parse(line);
  r.load_kb = j["peak_hwm_kb"].get<int64_t>() - j["baseline_rss_kb"].get<int64_t>();
  r.ok = true;
  return r;
}

TEST(LoadMemory, Bf16OnCpuHoldsAtMostTheCheckpointPlus20Percent) {
  const BigCheckpoint& c = MakeBigCheckpoint();
  ASSERT_GT(c.total_bytes, int64_t{300} << 20);
  ASSERT_LT(c.max_shard_bytes, c.total_bytes / 4) << "the checkpoint should have several shards";
  const ProbeResult r =
      Probe("--dir=" + c.dir.string() + " --mode=load --device=cpu --dtype=bfloat16");
  ASSERT_TRUE(r.ok) << r.output;
  const double limit_kb = 1.2 * c.total_bytes / 1024.0;
  std::printf("bf16 load to CPU: peak RSS +%lld kB for a %lld kB checkpoint (limit %.0f kB)\n",
              static_cast<long long>(r.load_kb), static_cast<long long>(c.total_bytes / 1024),
              limit_kb);
  EXPECT_LE(r.load_kb, limit_kb) << r.output;
}

TEST(LoadMemory, ReadingTheShardsHoldsAtMostOneShardPlus20Percent) {
  // What a load to a device costs the host: every tensor read and released in turn.
  const BigCheckpoint& c = MakeBigCheckpoint();
  const ProbeResult r = Probe("--dir=" + c.dir.string() + " --mode=walk --device=cpu");
  ASSERT_TRUE(r.ok) << r.output;
  const double limit_kb = 1.2 * c.max_shard_bytes / 1024.0;
  std::printf("reading every shard: peak RSS +%lld kB, largest shard %lld kB (limit %.0f kB)\n",
              static_cast<long long>(r.load_kb), static_cast<long long>(c.max_shard_bytes / 1024),
              limit_kb);
  EXPECT_LE(r.load_kb, limit_kb) << r.output;
}

// ---------------------------------------------------------------------------------------------
// GPU

TEST(Bf16Gpu, LoadsToTheDeviceInBf16AndScoresThere) {
  SKIP_WITHOUT_CUDA();
  const BigCheckpoint& c = MakeBigCheckpoint();
  LoadOptions cpu, gpu;
  cpu.dtype = gpu.dtype = torch::kBFloat16;
  gpu.device = torch::Device(torch::kCUDA, 0);
  auto on_cpu = LoadModel(c.dir.string(), cpu);
  auto on_gpu = LoadModel(c.dir.string(), gpu);
  ASSERT_TRUE(on_cpu.ok() && on_gpu.ok()) << on_cpu.status() << on_gpu.status();
  for (const auto& p : (*on_gpu)->named_parameters()) {
    ASSERT_TRUE(p.value().is_cuda()) << p.key();
    ASSERT_EQ(p.value().scalar_type(), torch::kBFloat16) << p.key();
  }
  // The same bf16 weights on both devices (the load converts nothing here: bf16 on disk).
  for (const auto& p : (*on_cpu)->named_parameters())
    ASSERT_TRUE(torch::equal(p.value(), (*on_gpu)->named_parameters()[p.key()].cpu())) << p.key();
  std::vector<std::vector<int64_t>> seqs;
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  for (int64_t n : {33, 7, 64}) {
    auto t = torch::randint(0, 8192, {n}, g, torch::kInt64).contiguous();
    seqs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  LoadOptions exact;  // the same (bf16-valued) weights in fp32: the reference both are held to
  exact.dtype = torch::kFloat32;
  auto in_fp32 = LoadModel(c.dir.string(), exact);
  ASSERT_TRUE(in_fp32.ok()) << in_fp32.status();
  (*on_cpu)->eval();
  (*on_gpu)->eval();
  (*in_fp32)->eval();
  const Outputs a = RunAlone(**on_cpu, seqs), b = RunAlone(**on_gpu, seqs),
                ref = RunAlone(**in_fp32, seqs);
  // The two bf16 bodies round at the same points with other kernels (oneDNN here, cuBLAS and
  // FlashAttention there), so they drift apart as far as each drifts from fp32 (an H200 measured
  // a worst element 16x over transformers' per-element bf16 rule between the two, through 3
  // random layers): the GPU's bf16 must be as close to the fp32 result as the CPU's, within 2x.
  auto dist = [](const torch::Tensor& x, const torch::Tensor& y) {
    return (x - y).abs().max().item<double>();
  };
  const double logits_cpu = dist(a.logits, ref.logits), logits_gpu = dist(b.logits, ref.logits);
  const double lp_cpu = dist(a.logprobs, ref.logprobs), lp_gpu = dist(b.logprobs, ref.logprobs);
  std::printf(
      "max distance from fp32: logits cpu bf16 %.3g, cuda bf16 %.3g; log-probs cpu bf16 "
      "%.3g, cuda bf16 %.3g\n",
      logits_cpu, logits_gpu, lp_cpu, lp_gpu);
  EXPECT_LE(logits_gpu, 2 * logits_cpu);
  EXPECT_LE(lp_gpu, 2 * lp_cpu);
}

TEST(Bf16Gpu, LoadToTheDeviceHoldsAtMostOneShardPlus20PercentOnTheHost) {
  SKIP_WITHOUT_CUDA();
  const BigCheckpoint& c = MakeBigCheckpoint();
  // The probe runs the load's kernels once before its baseline: CUDA loads each kernel's module
  // on first use, a cost paid once per process (with only the context warmed, an H200 measured
  // +96 MB against the 79 MB limit).
  const ProbeResult r = Probe("--dir=" + c.dir.string() + " --mode=load --device=cuda:0");
  ASSERT_TRUE(r.ok) << r.output;
  const double limit_kb = 1.2 * c.max_shard_bytes / 1024.0;
  std::printf("bf16 load to cuda:0: host peak RSS +%lld kB, largest shard %lld kB (limit %.0f)\n",
              static_cast<long long>(r.load_kb), static_cast<long long>(c.max_shard_bytes / 1024),
              limit_kb);
  EXPECT_LE(r.load_kb, limit_kb) << r.output;
}

// ---------------------------------------------------------------------------------------------
// A bf16 opd-teacher over gRPC

#ifdef OPD_BF16_SERVING

void ExpectServedBf16MatchesReference(const std::string& fixture,
                                      const std::vector<std::string>& extra) {
  Bf16Fixture f = LoadBf16Fixture(fixture);
  ASSERT_FALSE(f.ref.empty());
  std::vector<std::string> args = {"--model=" + f.dir + "/model"};
  args.insert(args.end(), extra.begin(), extra.end());
  args.insert(args.begin(), std::string(OPD_BINARY_DIR) + "/teacher_service/opd-teacher");
  args.push_back("--threads=1");
  const testing_util::Served t =
      testing_util::StartServed(testing_util::TestDir(), "teacher", args);
  ASSERT_FALSE(t.address.empty());
  opd::rpc::ClientOptions o;
  o.address = t.address;
  ASSERT_TRUE(opd::rpc::WaitUntilServing(o, absl::Seconds(30)).ok()) << t.process->Log();
  auto client = opd::rpc::TeacherClient::Create(o);
  ASSERT_TRUE(client.ok()) << client.status();
  auto info = (*client)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->dtype(), "bfloat16");
  std::vector<lm::Sample> in;
  for (const auto& s : f.seqs)
    in.push_back(lm::Sample::ToScore(std::vector<int32_t>(s.begin(), s.end()), 1));
  opd::rpc::ScoreOptions so;
  so.top_k = 3;
  auto scores = (*client)->Score(in, so);
  ASSERT_TRUE(scores.ok()) << scores.status();
  std::vector<float> served;
  for (const auto& s : *scores) {
    served.insert(served.end(), s.logprobs.begin(), s.logprobs.end());
    // Top-k in order and the scored token's log-prob no larger than the best.
    for (size_t r = 0; r < s.logprobs.size(); ++r) {
      EXPECT_GE(s.topk_logprobs[r * 3], s.topk_logprobs[r * 3 + 1]);
      EXPECT_LE(s.logprobs[r], s.topk_logprobs[r * 3] + 1e-6);
    }
  }
  const auto got = torch::tensor(served);
  const double diff = (got - f.ref["logprobs"]).abs().max().item<double>();
  const double yardstick = (f.ref["logprobs"] - f.ref["logprobs_fp32"]).abs().max().item<double>();
  std::printf("%s served in bf16: max |d logprob| %.4f vs transformers bf16 (bf16-vs-fp32 %.4f)\n",
              fixture.c_str(), diff, yardstick);
  // As in Bf16Parity: our fp32 routers and head take near-ties the other way from transformers'
  // bf16 ones, so the bound is the model's own bf16 rounding error, and the served log-probs
  // must be no farther from fp32 arithmetic than transformers' bf16 run (1.1x).
  EXPECT_LE(diff, std::max(1e-2, yardstick));
  const double to_fp32 = (got - f.ref["logprobs_fp32"]).abs().max().item<double>();
  EXPECT_LE(to_fp32, std::max(1e-2, 1.1 * yardstick));
}

TEST(Bf16Serving, TeacherScoresMatchTransformersBf16) {
  ExpectServedBf16MatchesReference("moe_tied_topk8", {"--dtype=bfloat16"});
  ExpectServedBf16MatchesReference("next_interval4", {"--dtype=bfloat16"});
}

TEST(Bf16Serving, TeacherOnCudaDefaultsToBf16AndMatches) {
  SKIP_WITHOUT_CUDA();
  ExpectServedBf16MatchesReference("moe_tied_topk8", {"--device=cuda"});
}

TEST(Bf16Serving, BadDeviceOrDtypeExitsTwoNamingTheFlag) {
  const std::string teacher = std::string(OPD_BINARY_DIR) + "/teacher_service/opd-teacher";
  const std::string model = kFixtures + "/moe_tied_topk8/model";
  auto run = [&](const std::string& flags) {
    const std::string cmd = teacher + " --model=" + model + " " + flags + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[1024];
    while (p && fgets(buf, sizeof(buf), p)) out += buf;
    const int rc = p ? pclose(p) : -1;
    return std::make_pair(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out);
  };
  auto [rc, out] = run("--dtype=float16");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--dtype"), std::string::npos) << out;
  std::tie(rc, out) = run("--device=cuda:99");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--device"), std::string::npos) << out;
  std::tie(rc, out) = run("--device=gpu");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--device 'gpu'"), std::string::npos) << out;
}

#endif  // OPD_BF16_SERVING

}  // namespace
}  // namespace lm
