// Qwen3-Next (the stage-2 teacher) beyond its parity with transformers (tests/parity_test.cc), on
// the tiny random models that tests/python/make_next_fixtures.py builds. Tolerances (fp32, CPU):
//   chunked delta rule vs the per-token recurrence: max abs diff <= 1e-5;
//   decode (prefill + one token at a time through the cache) vs the full forward and vs
//   transformers: max abs diff <= 1e-4 x the reference's largest |logit|.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "child_process.h"
#include "kernels/cpu/cpu_inference.h"
#include "lm/generate/sampler.h"
#include "lm/io/hf_model_dir.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/qwen3_next.h"
#include "nlohmann/json.hpp"
#include "rollout/engine.h"
#include "rpc/client.h"
#include "tests/fixture_names.h"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"

using testing_util::MaxAbsDiff;
using testing_util::ResponseIds;
using testing_util::TempDir;

namespace lm {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = OPD_NEXT_FIXTURES_DIR;

// The fixtures tests/python/make_next_fixtures.py writes (parity with transformers over them:
// tests/parity_test.cc).
std::vector<std::string> FixtureNames() {
  return testing_util::NextFixtureNames();
}

// A greedy continuation by transformers' generate (its own cache).
struct GenerateCase {
  std::vector<int64_t> prompt, tokens;
};

struct Fixture {
  std::string dir;
  std::vector<std::vector<int64_t>> seqs;
  int64_t mtp_tensors = 0;
  std::vector<GenerateCase> generate;
  std::map<std::string, torch::Tensor> ref;
};

Fixture LoadFixture(const std::string& name) {
  Fixture f;
  f.dir = kFixtures + "/" + name;
  std::ifstream in(f.dir + "/inputs.json");
  auto j = nlohmann::json::parse(in);
  f.seqs = j["sequences"].get<std::vector<std::vector<int64_t>>>();
  f.mtp_tensors = j["mtp_tensors"].get<int64_t>();
  for (const auto& c : j["generate"]) {
    f.generate.push_back(
        {c["prompt"].get<std::vector<int64_t>>(), c["tokens"].get<std::vector<int64_t>>()});
  }
  auto file = SafetensorsFile::Open(f.dir + "/ref.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  for (const auto& [n, view] : (*file)->tensors()) f.ref[n] = TensorFromView(view, *file).clone();
  return f;
}

std::shared_ptr<CausalLM> MustLoad(const std::string& dir) {
  auto m = LoadModel(dir);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : nullptr;
}

// ---- the delta rule ----

struct RuleInputs {
  torch::Tensor q, k, v, g, beta;
};

// Random inputs as the layer produces them: unit q/k (q scaled), decays from A in [0.01, max_A].
RuleInputs RandomRule(int64_t T, int64_t H, int64_t dk, int64_t dv, double max_A, uint64_t seed) {
  torch::manual_seed(seed);
  auto unit = [](const torch::Tensor& x) { return x / x.norm(2, -1, true); };
  RuleInputs in;
  in.q = unit(torch::randn({T, H, dk})) / std::sqrt(static_cast<double>(dk));
  in.k = unit(torch::randn({T, H, dk}));
  in.v = torch::randn({T, H, dv});
  auto A = torch::empty({H}).uniform_(std::log(0.01), std::log(max_A)).exp();
  in.g = -A * torch::nn::functional::softplus(torch::randn({T, H}));
  in.beta = torch::sigmoid(torch::randn({T, H}));
  return in;
}

std::vector<int64_t> CuSeqlens(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

TEST(DeltaRule, LayoutIsStepMajorWithDocumentsByChunkCount) {
  // Lengths 5, 130, 64, 65 -> 1, 3, 1, 2 chunks; order by count: 130, 65, then 5, 64 (stable).
  auto layout = DeltaRuleLayout::Make(CuSeqlens({5, 130, 64, 65}), torch::kCPU);
  EXPECT_EQ(layout.step_offsets, (std::vector<int64_t>{0, 4, 6, 7}));
  EXPECT_EQ(layout.gather.size(0), 7 * 64);
  EXPECT_EQ(layout.gather[0].item<int64_t>(), 5);     // step 0 starts with the 130-token document
  EXPECT_EQ(layout.gather[64].item<int64_t>(), 199);  // then the 65-token one
  EXPECT_EQ(layout.gather[128 + 5].item<int64_t>(), 264);  // the 5-token one, padded after 5 slots
  EXPECT_EQ(layout.scatter[0].item<int64_t>(), 128);
  EXPECT_EQ(layout.doc_pos[135].item<int64_t>(), 0);
  EXPECT_EQ(layout.doc_pos[134].item<int64_t>(), 129);
  // Every token sits in exactly one slot and comes back through scatter.
  auto back = layout.gather.index_select(0, layout.scatter);
  EXPECT_TRUE(torch::equal(back, torch::arange(264, torch::kInt64)));
}

TEST(DeltaRule, ChunkedEqualsRecurrent) {
  const std::vector<int64_t> lengths{1, 63, 64, 65, 130, 7, 300};
  const auto cu = CuSeqlens(lengths);
  const int64_t T = cu.back();
  for (double max_A : {0.05, 16.0}) {  // long memory / fast forgetting
    for (auto [dk, dv] : {std::pair<int64_t, int64_t>{16, 8}, {8, 24}}) {
      auto in = RandomRule(T, 3, dk, dv, max_A, 11);
      auto ref = GatedDeltaRuleRecurrent(in.q, in.k, in.v, in.g, in.beta, cu);
      auto got = GatedDeltaRuleChunked(in.q, in.k, in.v, in.g, in.beta,
                                       DeltaRuleLayout::Make(cu, torch::kCPU));
      const double d = MaxAbsDiff(got, ref);
      EXPECT_LE(d, 1e-5) << "max_A " << max_A << " dk " << dk << " dv " << dv;
      std::printf("chunked vs recurrent (max_A %g, dk %lld, dv %lld): %.3g\n", max_A,
                  static_cast<long long>(dk), static_cast<long long>(dv), d);
    }
  }
}

TEST(DeltaRule, ChunkedGradientsEqualRecurrent) {
  const auto cu = CuSeqlens({70, 3, 129});
  auto in = RandomRule(cu.back(), 2, 8, 8, 2.0, 5);
  std::vector<torch::Tensor> xs{in.q, in.k, in.v, in.g, in.beta};
  for (auto& x : xs) x.requires_grad_(true);
  auto upstream = torch::randn({cu.back(), 2, 8});
  auto ref = GatedDeltaRuleRecurrent(xs[0], xs[1], xs[2], xs[3], xs[4], cu);
  auto got = GatedDeltaRuleChunked(xs[0], xs[1], xs[2], xs[3], xs[4],
                                   DeltaRuleLayout::Make(cu, torch::kCPU));
  auto gr = torch::autograd::grad({ref}, xs, {upstream});
  auto gc = torch::autograd::grad({got}, xs, {upstream});
  for (size_t i = 0; i < xs.size(); ++i) EXPECT_LE(MaxAbsDiff(gc[i], gr[i]), 1e-4) << "input " << i;
}

// The state starts at zero at every document start: packed equals one call per document.
TEST(DeltaRule, PackedDocumentsDoNotLeak) {
  const std::vector<int64_t> lengths{100, 1, 64, 33};
  const auto cu = CuSeqlens(lengths);
  auto in = RandomRule(cu.back(), 4, 8, 8, 1.0, 3);
  auto packed = GatedDeltaRuleChunked(in.q, in.k, in.v, in.g, in.beta,
                                      DeltaRuleLayout::Make(cu, torch::kCPU));
  for (size_t b = 0; b < lengths.size(); ++b) {
    auto part = [&](const torch::Tensor& x) { return x.narrow(0, cu[b], lengths[b]); };
    const std::vector<int64_t> one{0, lengths[b]};
    auto alone = GatedDeltaRuleChunked(part(in.q), part(in.k), part(in.v), part(in.g),
                                       part(in.beta), DeltaRuleLayout::Make(one, torch::kCPU));
    EXPECT_LE(MaxAbsDiff(part(packed), alone), 1e-6) << "document " << b;
  }
}

// A document split in two: the second part from the first's final state (initial_state, as a
// chunked prefill continues from a state slot) gives the whole document's outputs and final
// state, for splits inside and on chunk boundaries, several documents at once (one of them with
// no tokens, which keeps its initial state).
TEST(DeltaRule, ChunkedContinuesFromAnInitialState) {
  const std::vector<int64_t> lengths{150, 40, 64, 9}, splits{70, 1, 64, 9};
  const auto cu = CuSeqlens(lengths);
  auto in = RandomRule(cu.back(), 2, 8, 12, 2.0, 17);
  torch::Tensor whole_state;
  auto whole = GatedDeltaRuleChunked(in.q, in.k, in.v, in.g, in.beta,
                                     DeltaRuleLayout::Make(cu, torch::kCPU), &whole_state);
  std::vector<int64_t> first_rows, second_rows, first_len, second_len;
  for (size_t b = 0; b < lengths.size(); ++b) {
    for (int64_t t = 0; t < lengths[b]; ++t)
      (t < splits[b] ? first_rows : second_rows).push_back(cu[b] + t);
    first_len.push_back(splits[b]);
    second_len.push_back(lengths[b] - splits[b]);
  }
  auto pick = [](const torch::Tensor& x, const std::vector<int64_t>& rows) {
    return x.index_select(0, torch::tensor(rows, torch::kInt64));
  };
  auto run = [&](const std::vector<int64_t>& rows, const std::vector<int64_t>& lens,
                 torch::Tensor* final_state, const torch::Tensor* initial) {
    return GatedDeltaRuleChunked(
        pick(in.q, rows), pick(in.k, rows), pick(in.v, rows), pick(in.g, rows), pick(in.beta, rows),
        DeltaRuleLayout::Make(CuSeqlens(lens), torch::kCPU), final_state, initial);
  };
  torch::Tensor mid, end;
  auto a = run(first_rows, first_len, &mid, nullptr);
  auto b = run(second_rows, second_len, &end, &mid);
  EXPECT_LE(MaxAbsDiff(a, pick(whole, first_rows)), 1e-5);
  EXPECT_LE(MaxAbsDiff(b, pick(whole, second_rows)), 1e-5);
  EXPECT_LE(MaxAbsDiff(end, whole_state), 1e-5);
  EXPECT_TRUE(torch::equal(end[3], mid[3]));  // no tokens after the split: the state as given
}

// The inference path (kernels/cpu/cpu_inference.h: one task per document and head, chunks in order,
// a short last chunk at its length) against the per-token reference, with grouped key heads read
// in place (3 value heads per key head), on lengths around the chunk size, for 1 and 2 threads.
TEST(DeltaRule, InferencePathEqualsRecurrent) {
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> lengths{1, 63, 64, 65, 130, 7, 300};
  const auto cu = CuSeqlens(lengths);
  const int64_t T = cu.back(), Hk = 2, r = 3;
  const int threads = torch::get_num_threads();
  for (double max_A : {0.05, 16.0}) {
    for (auto [dk, dv] : {std::pair<int64_t, int64_t>{16, 8}, {8, 24}}) {
      auto in = RandomRule(T, Hk * r, dk, dv, max_A, 13);
      // Value heads h and h' with h / r == h' / r share their key head.
      auto qk = in.q.narrow(1, 0, Hk).contiguous(), kk = in.k.narrow(1, 0, Hk).contiguous();
      ASSERT_TRUE(UseCpuInferenceDeltaRule(qk, kk, in.v, in.g, in.beta));
      auto ref = GatedDeltaRuleRecurrent(qk.repeat_interleave(r, 1), kk.repeat_interleave(r, 1),
                                         in.v, in.g, in.beta, cu);
      torch::set_num_threads(1);
      auto one = GatedDeltaRuleInferenceCpu(qk, kk, in.v, in.g, in.beta, cu);
      torch::set_num_threads(std::max(2, threads));
      auto many = GatedDeltaRuleInferenceCpu(qk, kk, in.v, in.g, in.beta, cu);
      EXPECT_LE(MaxAbsDiff(one, ref), 1e-5) << "max_A " << max_A << " dk " << dk << " dv " << dv;
      EXPECT_TRUE(torch::equal(one, many)) << "depends on the thread count";
    }
  }
  torch::set_num_threads(threads);
  // Gradients keep the library path; a bad shape is refused with the shapes named.
  auto in = RandomRule(10, 2, 8, 8, 1.0, 1);
  {
    torch::AutoGradMode grad(true);
    EXPECT_FALSE(UseCpuInferenceDeltaRule(in.q.requires_grad_(), in.k, in.v, in.g, in.beta));
  }
  try {
    GatedDeltaRuleInferenceCpu(in.q.detach(), in.k, in.v, in.g.narrow(0, 0, 9), in.beta, {0, 10});
    ADD_FAILURE() << "mismatched g accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[9, 2]"), std::string::npos) << e.what();
  }
}

// The decode step (transformers' recurrent rule, one token, grouped key heads) run over each
// document from a zero state gives the per-token reference's outputs, and its final state is the
// one the prefill paths (library and CPU inference) hand to a cache.
TEST(DeltaRule, StepAndPrefillFinalStatesAgree) {
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> lengths{1, 3, 64, 65, 130};
  const auto cu = CuSeqlens(lengths);
  const int64_t Hk = 2, r = 2, H = Hk * r, dk = 8, dv = 12;
  const int64_t B = static_cast<int64_t>(lengths.size());
  auto in = RandomRule(cu.back(), H, dk, dv, 2.0, 21);
  auto qk = in.q.narrow(1, 0, Hk).contiguous(), kk = in.k.narrow(1, 0, Hk).contiguous();
  auto qr = qk.repeat_interleave(r, 1), kr = kk.repeat_interleave(r, 1);
  auto ref = GatedDeltaRuleRecurrent(qr, kr, in.v, in.g, in.beta, cu);
  torch::Tensor chunked_state, cpu_state;
  GatedDeltaRuleChunked(qr, kr, in.v, in.g, in.beta, DeltaRuleLayout::Make(cu, torch::kCPU),
                        &chunked_state);
  GatedDeltaRuleInferenceCpu(qk, kk, in.v, in.g, in.beta, cu, 64, &cpu_state);
  ASSERT_EQ(chunked_state.sizes(), (c10::IntArrayRef{B, H, dk, dv}));
  ASSERT_EQ(cpu_state.sizes(), chunked_state.sizes());
  for (int64_t b = 0; b < B; ++b) {
    auto S = torch::zeros({1, H, dk, dv});
    std::vector<torch::Tensor> outs;
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
      auto row = [t](const torch::Tensor& x) { return x.narrow(0, t, 1); };
      outs.push_back(GatedDeltaRuleStep(row(qk), row(kk), row(in.v), row(in.g), row(in.beta), S));
    }
    EXPECT_LE(MaxAbsDiff(torch::cat(outs), ref.narrow(0, cu[b], lengths[b])), 1e-5) << b;
    EXPECT_LE(MaxAbsDiff(chunked_state[b], S[0]), 1e-5) << "document " << b;
    EXPECT_LE(MaxAbsDiff(cpu_state[b], S[0]), 1e-5) << "document " << b;
  }
}

// ---- checkpoints ----

const std::string kMtpFixture = "next_interval4";

TEST(NextCheckpoint, MtpTensorsAreIgnoredAndCounted) {
  Fixture f = LoadFixture(kMtpFixture);
  ASSERT_GT(f.mtp_tensors, 0);
  auto config = LoadModelConfig(f.dir + "/model");
  ASSERT_TRUE(config.ok()) << config.status();
  auto model = CreateModel(*config);
  ASSERT_TRUE(model.ok()) << model.status();
  auto files = OpenCheckpointFiles(f.dir + "/model");
  ASSERT_TRUE(files.ok()) << files.status();
  std::map<std::string, torch::Tensor> params;
  for (auto& p : (*model)->named_parameters()) params[p.key()] = p.value();
  auto report = LoadParameters(*files, params, {}, {"mtp."});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->tensors_ignored, f.mtp_tensors);
  EXPECT_EQ(report->tensors_loaded + report->tensors_ignored,
            static_cast<int64_t>((*files)[0]->tensors().size()));
  EXPECT_TRUE(MustLoad(f.dir + "/model"));  // and LoadModel skips them for qwen3_next
}

// Rewrites the fixture checkpoint with one edit and returns the load error.
absl::Status LoadEdited(
    const std::string& tag,
    const std::function<void(std::vector<std::pair<std::string, torch::Tensor>>&)>& edit) {
  const std::string fixture = kFixtures + "/" + kMtpFixture + "/model";
  auto file = SafetensorsFile::Open(fixture + "/model.safetensors");
  EXPECT_TRUE(file.ok());
  std::vector<std::pair<std::string, torch::Tensor>> ts;
  for (const auto& [n, v] : (*file)->tensors())
    ts.emplace_back(n, TensorFromView(v, *file).clone());
  edit(ts);
  auto dir = TempDir(tag);
  fs::copy_file(fixture + "/config.json", dir / "config.json");
  std::vector<TensorToWrite> out;
  for (auto& [n, t] : ts)
    out.push_back({n, DType::kF32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.nbytes())});
  EXPECT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), out).ok());
  auto m = LoadModel(dir.string());
  fs::remove_all(dir);
  return m.status();
}

auto Erase(const std::string& name) {
  return [name](std::vector<std::pair<std::string, torch::Tensor>>& ts) {
    ts.erase(std::remove_if(ts.begin(), ts.end(), [&](auto& p) { return p.first == name; }),
             ts.end());
  };
}

TEST(NextCheckpoint, MissingTensorsAreNamed) {
  for (const std::string name :
       {"model.layers.0.linear_attn.A_log", "model.layers.1.linear_attn.conv1d.weight",
        "model.layers.3.self_attn.q_norm.weight", "model.layers.2.mlp.shared_expert_gate.weight",
        "model.layers.0.linear_attn.norm.weight"}) {
    auto st = LoadEdited("missing", Erase(name));
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << name;
    EXPECT_NE(st.message().find(name), std::string::npos) << st;
  }
  auto st = LoadEdited("missing_expert", Erase("model.layers.1.mlp.experts.5.down_proj.weight"));
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(st.message().find("model.layers.1.mlp.experts.down_proj"), std::string::npos) << st;
}

TEST(NextCheckpoint, WrongShapeIsNamed) {
  auto st = LoadEdited("shape", [](auto& ts) {
    for (auto& [n, t] : ts) {
      if (n == "model.layers.2.linear_attn.in_proj_qkvz.weight") t = torch::zeros({3, 5});
    }
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.layers.2.linear_attn.in_proj_qkvz.weight"), std::string::npos)
      << st;
  EXPECT_NE(st.message().find("[3, 5]"), std::string::npos) << st;
  EXPECT_NE(st.message().find("[96, 32]"), std::string::npos) << st;  // what the config implies
}

TEST(NextCheckpoint, UnexpectedTensorIsNamed) {
  auto st = LoadEdited("unexpected", [](auto& ts) {
    ts.emplace_back("model.layers.0.linear_attn.mystery", torch::zeros({2}));
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.layers.0.linear_attn.mystery"), std::string::npos) << st;
  // Only the mtp. prefix is skipped: a tensor merely containing "mtp" is still unexpected.
  st = LoadEdited("unexpected_mtp",
                  [](auto& ts) { ts.emplace_back("model.mtp.fc.weight", torch::zeros({2})); });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.mtp.fc.weight"), std::string::npos) << st;
}

// C++ saves (sharded), transformers loads and reproduces the reference logits; we reload it too.
TEST(NextCheckpoint, CppSavesTransformersLoads) {
  for (const std::string name : {"next_interval4", "next_interval2_tied"}) {
    const std::string fixture = kFixtures + "/" + name;
    auto model = MustLoad(fixture + "/model");
    ASSERT_TRUE(model);
    auto dir = TempDir(name);
    SaveOptions so;
    so.max_shard_bytes = 64 * 1024;
    ASSERT_TRUE(SaveModel(*model, dir.string(), so).ok());
    const std::string cmd = std::string(OPD_PYTHON) + " " + OPD_SOURCE_DIR +
                            "/tests/python/check_model.py --model " + dir.string() + " --fixture " +
                            fixture;
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    auto again = MustLoad(dir.string());
    ASSERT_TRUE(again);
    auto a = model->named_parameters(), b = again->named_parameters();
    for (const auto& p : a) EXPECT_TRUE(torch::equal(p.value(), b[p.key()])) << p.key();
    fs::remove_all(dir);
  }
}

// ---- the model's contract ----

// The cache holds keys/values for the full-attention layers only and the conv and delta-rule
// state (fp32) for the linear-attention ones; a cache that does not fit is refused.
TEST(NextModel, KVCacheLayout) {
  auto model = MustLoad(kFixtures + "/next_full_first_ratio4/model");  // full, linear, linear
  ASSERT_TRUE(model);
  EXPECT_TRUE(model->SupportsKVCache());
  KVCache cache = model->NewKVCache(3, 20);
  ASSERT_EQ(cache.k.size(), 1u);
  EXPECT_EQ(cache.k[0].sizes(), (c10::IntArrayRef{3, 20, 4, 8}));
  ASSERT_EQ(cache.conv.size(), 2u);
  EXPECT_EQ(cache.conv[1].sizes(), (c10::IntArrayRef{3, 2, 48}));  // kernel 3, 12 + 12 + 24
  ASSERT_EQ(cache.recurrent.size(), 2u);
  EXPECT_EQ(cache.recurrent[0].sizes(), (c10::IntArrayRef{3, 4, 12, 6}));
  EXPECT_EQ(cache.recurrent[0].scalar_type(), torch::kFloat32);
  EXPECT_EQ(cache.capacity(), 20);
  auto picked = cache.RepeatInterleave(2).Select({5, 0});
  EXPECT_EQ(picked.batch(), 2);
  EXPECT_EQ(picked.conv[0].size(0), 2);
  EXPECT_EQ(picked.recurrent[1].size(0), 2);
  torch::NoGradGuard no_grad;
  EXPECT_THROW(model->Decode(torch::tensor({1, 2}, torch::kInt64), cache), c10::Error);
  ForwardOptions opts;
  opts.cache = &cache;
  EXPECT_THROW(model->Forward(PackedBatch::FromSequences({{1, 2}}), opts), c10::Error);
}

// The teacher may be served in bf16: the delta rule still runs in fp32 and the logits stay close
// to the fp32 reference (bf16 keeps ~3 significant digits, hence the loose bound).
TEST(NextModel, Bf16ForwardStaysClose) {
  torch::NoGradGuard no_grad;
  Fixture f = LoadFixture("next_sparse2_ratio3");
  LoadOptions bf16;
  bf16.dtype = torch::kBFloat16;
  auto model = LoadModel(f.dir + "/model", bf16);
  ASSERT_TRUE(model.ok()) << model.status();
  auto logits = (*model)->Logits((*model)->Forward(PackedBatch::FromSequences(f.seqs)));
  // A bf16 model's LM head still gives fp32 logits (fp32 accumulate and output: lm::LogitsFp32).
  EXPECT_EQ(logits.scalar_type(), torch::kFloat32);
  const double d = MaxAbsDiff(logits, f.ref["logits"]);
  std::printf("bf16 max |logits diff| = %.3g (max |logit| %.3g)\n", d,
              f.ref["logits"].abs().max().item<double>());
  EXPECT_LE(d, 0.25);
}

TEST(NextModel, ParameterNamesAreTheCheckpoints) {
  auto model = MustLoad(kFixtures + "/next_full_first_ratio4/model");
  ASSERT_TRUE(model);
  auto params = model->named_parameters();
  for (const char* name :
       {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.linear_attn.in_proj_qkvz.weight",
        "model.layers.1.linear_attn.in_proj_ba.weight", "model.layers.1.linear_attn.conv1d.weight",
        "model.layers.1.linear_attn.A_log", "model.layers.1.linear_attn.dt_bias",
        "model.layers.1.mlp.gate_proj.weight", "model.layers.2.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.shared_expert.down_proj.weight",
        "model.layers.2.mlp.shared_expert_gate.weight", "lm_head.weight"}) {
    EXPECT_TRUE(params.contains(name)) << name;
  }
  // kernel 3, conv over q, k, v: 1*12 + 1*12 + 4*6 channels
  EXPECT_EQ(params["model.layers.1.linear_attn.conv1d.weight"].sizes(),
            (c10::IntArrayRef{48, 1, 3}));
}

TEST(NextConfig, DefaultsAndSparseLayers) {
  auto j = nlohmann::json::parse(R"({"model_type": "qwen3_next", "vocab_size": 10, "hidden_size": 8,
    "intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
    "linear_value_head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
    "decoder_sparse_step": 2, "mlp_only_layers": [3], "full_attention_interval": 2})");
  auto c = ParseModelConfig(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 256);    // Qwen3NextConfig's default, not hidden/heads
  EXPECT_EQ(c->RotaryDim(), 64);  // partial_rotary_factor defaults to 0.25
  EXPECT_EQ(c->shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_FALSE(c->IsMoeLayer(0));
  EXPECT_TRUE(c->IsMoeLayer(1));
  EXPECT_FALSE(c->IsMoeLayer(3));  // mlp_only_layers
  EXPECT_FALSE(c->IsFullAttentionLayer(0));
  EXPECT_TRUE(c->IsFullAttentionLayer(1));
}

// opd-ctl logprobs on a Qwen3-Next checkpoint (with mtp.* tensors) prints transformers' log-probs.
TEST(NextOpdCtl, LogprobsMatchesReference) {
  Fixture f = LoadFixture(kMtpFixture);
  auto dir = TempDir("ctl");
  {
    std::ofstream in(dir / "in.jsonl");
    for (auto& s : f.seqs) in << nlohmann::json{{"tokens", s}}.dump() << "\n";
  }
  const std::string cmd = std::string(OPD_BINARY_DIR) + "/ctl/opd-ctl logprobs --model " + f.dir +
                          "/model --input " + (dir / "in.jsonl").string() + " > " +
                          (dir / "out.jsonl").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream out(dir / "out.jsonl");
  std::vector<float> got;
  std::string line;
  size_t lines = 0;
  while (std::getline(out, line)) {
    auto v = nlohmann::json::parse(line)["logprobs"].get<std::vector<float>>();
    EXPECT_EQ(v.size(), f.seqs[lines].size() - 1);
    got.insert(got.end(), v.begin(), v.end());
    ++lines;
  }
  EXPECT_EQ(lines, f.seqs.size());
  EXPECT_LE(MaxAbsDiff(torch::tensor(got), f.ref["logprobs"]), 1e-4);
  fs::remove_all(dir);
}

// ---- incremental decoding (the rollout student) ----

// max |a - ref| relative to the reference's largest entry.
double RelDiff(const torch::Tensor& a, const torch::Tensor& ref) {
  return MaxAbsDiff(a, ref) / std::max(ref.abs().max().item<double>(), 1e-6);
}

std::vector<int64_t> Lengths(const std::vector<std::vector<int64_t>>& seqs) {
  std::vector<int64_t> n;
  for (const auto& s : seqs) n.push_back(static_cast<int64_t>(s.size()));
  return n;
}

// Teacher-forced decoding: the first prefix[b] tokens of every sequence are prefilled into one
// cache, which is repeated `copies` times (slot b -> b * copies + c); then every slot decodes the
// rest of its sequence one token per Decode step, leaving the batch (KVCache::Select) when its
// sequence ends. Returns each slot's logits at every position [L_b, V], prefill rows included.
std::vector<torch::Tensor> DecodeAll(CausalLM& model, const std::vector<std::vector<int64_t>>& seqs,
                                     const std::vector<int64_t>& prefix, int64_t copies = 1) {
  torch::NoGradGuard no_grad;
  std::vector<std::vector<int64_t>> prompts;
  int64_t longest = 0;
  for (size_t b = 0; b < seqs.size(); ++b) {
    prompts.emplace_back(seqs[b].begin(), seqs[b].begin() + prefix[b]);
    longest = std::max<int64_t>(longest, static_cast<int64_t>(seqs[b].size()));
  }
  auto batch = PackedBatch::FromSequences(prompts);
  const auto device = model.LmHeadWeight().device();
  batch.input_ids = batch.input_ids.to(device);
  batch.position_ids = batch.position_ids.to(device);
  KVCache cache = model.NewKVCache(batch.num_sequences(), longest);
  ForwardOptions fo;
  fo.cache = &cache;
  const auto prefill = model.Logits(model.Forward(batch, fo));
  EXPECT_EQ(cache.lengths, prefix);
  cache = cache.RepeatInterleave(copies);
  std::vector<std::vector<torch::Tensor>> rows(seqs.size() * copies);
  std::vector<int64_t> live, seq_of;  // slots still decoding; the sequence of each slot
  for (size_t b = 0; b < seqs.size(); ++b) {
    for (int64_t c = 0; c < copies; ++c) {
      rows[b * copies + c].push_back(prefill.narrow(0, batch.cu_seqlens[b], prefix[b]));
      seq_of.push_back(static_cast<int64_t>(b));
    }
  }
  for (int64_t i = 0; i < cache.batch(); ++i) live.push_back(i);
  while (true) {
    std::vector<int64_t> keep, next;
    for (size_t j = 0; j < live.size(); ++j) {
      const auto& s = seqs[seq_of[live[j]]];
      if (cache.lengths[j] < static_cast<int64_t>(s.size())) {
        keep.push_back(static_cast<int64_t>(j));
        next.push_back(s[cache.lengths[j]]);
      }
    }
    if (keep.empty()) break;
    if (keep.size() < live.size()) {
      cache = cache.Select(keep);
      std::vector<int64_t> still;
      for (int64_t j : keep) still.push_back(live[j]);
      live = std::move(still);
    }
    const auto logits =
        model.Logits(model.Decode(torch::tensor(next, torch::kInt64).to(device), cache));
    for (size_t j = 0; j < live.size(); ++j) rows[live[j]].push_back(logits.narrow(0, j, 1));
  }
  std::vector<torch::Tensor> out;
  for (auto& r : rows) out.push_back(torch::cat(r, 0));
  return out;
}

class NextDecode : public ::testing::TestWithParam<std::string> {};

// Every position's logits through the cache equal the full forward's and transformers', for
// prefills of one token (everything else decoded), of fewer tokens than the conv window (2, 3),
// of a chunk less one, exactly one and one more (63, 64, 65), and of all but the last token; the
// repeated cache's copies decode alike.
TEST_P(NextDecode, DecodeEqualsForwardAtEveryPosition) {
  Fixture f = LoadFixture(GetParam());
  auto model = MustLoad(f.dir + "/model");
  ASSERT_TRUE(model);
  torch::NoGradGuard no_grad;
  ASSERT_EQ(Lengths(f.seqs), (std::vector<int64_t>{1, 5, 64, 100, 130}));
  std::vector<torch::Tensor> ref, own;  // per sequence: transformers' and our forward's logits
  int64_t row = 0;
  for (const auto& s : f.seqs) {
    const int64_t n = static_cast<int64_t>(s.size());
    ref.push_back(f.ref["logits"].narrow(0, row, n));
    own.push_back(model->Logits(model->Forward(PackedBatch::FromSequences({s}))));
    row += n;
  }
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> plans = {
      {{1, 1, 1, 1, 1}, 1}, {{1, 2, 63, 64, 65}, 2}, {{1, 3, 1, 99, 129}, 1}};
  double worst_ref = 0, worst_own = 0;
  for (const auto& [prefix, copies] : plans) {
    auto got = DecodeAll(*model, f.seqs, prefix, copies);
    ASSERT_EQ(got.size(), f.seqs.size() * copies);
    for (size_t b = 0; b < f.seqs.size(); ++b) {
      for (int64_t c = 0; c < copies; ++c) {
        const auto& g = got[b * copies + c];
        const double dr = RelDiff(g, ref[b]), d_own = RelDiff(g, own[b]);
        EXPECT_LE(dr, 1e-4) << "sequence " << b << " prefilled " << prefix[b];
        EXPECT_LE(d_own, 1e-4) << "sequence " << b << " prefilled " << prefix[b];
        // Copies sit in other rows of the batch, which may round differently in the GEMMs.
        if (c > 0) {
          EXPECT_LE(RelDiff(g, got[b * copies]), 1e-5) << "copies differ";
        }
        worst_ref = std::max(worst_ref, dr);
        worst_own = std::max(worst_own, d_own);
      }
    }
  }
  std::printf("[%s] decode vs transformers %.3g, vs own forward %.3g (relative)\n",
              GetParam().c_str(), worst_ref, worst_own);
}

// lm::SampleResponses (prefill, repeated cache, decode, finished samples leaving) greedy
// equals transformers' generate, tokens and logits, every prompt in one batch.
TEST_P(NextDecode, GreedyEqualsTransformersGenerate) {
  Fixture f = LoadFixture(GetParam());
  auto model = MustLoad(f.dir + "/model");
  ASSERT_TRUE(model);
  ASSERT_EQ(f.generate.size(), 3u);
  std::vector<std::vector<int64_t>> prompts, full;
  std::vector<int64_t> prefix;
  for (const auto& c : f.generate) {
    prompts.push_back(c.prompt);
    full.push_back(c.prompt);
    full.back().insert(full.back().end(), c.tokens.begin(), c.tokens.end());
    prefix.push_back(static_cast<int64_t>(c.prompt.size()));
  }
  lm::SamplingParams p;
  p.temperature = 0;
  p.samples_per_prompt = 2;
  p.max_new_tokens = static_cast<int64_t>(f.generate[0].tokens.size());
  std::vector<lm::Sample> out;
  auto st = lm::SampleResponses(*model, testing_util::HostIds(prompts), p,
                                [&](lm::Sample s) { out.push_back(std::move(s)); });
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(out.size(), 6u);
  for (const auto& s : out) {
    EXPECT_EQ(ResponseIds(s), f.generate[s.prompt_index].tokens) << "prompt " << s.prompt_index;
  }
  // The logits each token was chosen from, through prefill + decode.
  auto got = DecodeAll(*model, full, prefix);
  std::vector<torch::Tensor> chosen;
  for (size_t b = 0; b < full.size(); ++b)
    chosen.push_back(got[b].narrow(0, prefix[b] - 1, p.max_new_tokens));
  const double d = RelDiff(torch::cat(chosen), f.ref["generate_logits"]);
  EXPECT_LE(d, 1e-4);
  std::printf("[%s] decode logits vs transformers' generate: %.3g (relative)\n", GetParam().c_str(),
              d);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, NextDecode, ::testing::ValuesIn(FixtureNames()));

// The sampler's draw, re-derived: sample s of prompt p draws one uniform per token from
// mt19937_64(SampleSeed(seed, p, s)) (the top 53 bits) and takes the first token whose cumulative
// probability under softmax(logits / T) exceeds u * total.
int64_t InverseCdf(const torch::Tensor& probs, double u) {
  const auto p = probs.to(torch::kFloat64).contiguous();
  const double* x = p.data_ptr<double>();
  double total = 0;
  for (int64_t i = 0; i < p.numel(); ++i) total += x[i];
  double acc = 0;
  for (int64_t i = 0; i < p.numel(); ++i) {
    acc += x[i];
    if (x[i] > 0 && acc > u * total) return i;
  }
  return p.numel() - 1;
}

// Every sample of SampleResponses (greedy and sampled, 2 samples per prompt) equals a reference
// that runs the full forward over prompt + response so far for every token, with the same seeds.
TEST(NextSampler, SamplesEqualStepByStepForward) {
  for (const std::string name : {"next_interval4", "next_full_first_ratio4"}) {
    Fixture f = LoadFixture(name);
    auto model = MustLoad(f.dir + "/model");
    ASSERT_TRUE(model);
    torch::NoGradGuard no_grad;
    const std::vector<std::vector<int64_t>> prompts = {
        {f.seqs[1][0], f.seqs[1][1]}, f.seqs[1], {f.seqs[3].begin(), f.seqs[3].begin() + 70}};
    for (double temperature : {0.0, 1.0, 0.7}) {
      lm::SamplingParams p;
      p.samples_per_prompt = 2;
      p.max_new_tokens = 12;
      p.temperature = temperature;
      p.seed = 1234;
      std::vector<lm::Sample> out;
      auto st = lm::SampleResponses(*model, testing_util::HostIds(prompts), p,
                                    [&](lm::Sample s) { out.push_back(std::move(s)); });
      ASSERT_TRUE(st.ok()) << st.status();
      ASSERT_EQ(out.size(), 6u);
      int64_t differ = 0;
      for (const auto& s : out) {
        std::mt19937_64 rng(lm::SampleSeed(p.seed, s.prompt_index, s.sample_index));
        std::vector<int64_t> seq = prompts[s.prompt_index], tokens;
        std::vector<float> logprobs;
        for (int64_t t = 0; t < p.max_new_tokens; ++t) {
          auto h = model->Forward(PackedBatch::FromSequences({seq}));
          auto logits = model->Logits(h[h.size(0) - 1]).to(torch::kFloat32);
          int64_t next;
          if (temperature == 0) {
            next = logits.argmax().item<int64_t>();
            logprobs.push_back(0.0f);
          } else {
            auto probs = torch::softmax(logits / temperature, -1);
            next = InverseCdf(probs, static_cast<double>(rng() >> 11) * 0x1.0p-53);
            logprobs.push_back(std::log(probs[next].item<float>()));
          }
          tokens.push_back(next);
          seq.push_back(next);
        }
        EXPECT_EQ(ResponseIds(s), tokens) << name << " T " << temperature << " prompt "
                                          << s.prompt_index << " sample " << s.sample_index;
        ASSERT_EQ(s.logprobs.size(), logprobs.size());
        for (size_t i = 0; i < logprobs.size(); ++i)
          EXPECT_NEAR(s.logprobs[i], logprobs[i], 1e-4) << name << " token " << i;
        differ += s.sample_index == 1 && s.tokens != out[0].tokens;
      }
      if (temperature > 0) {
        EXPECT_GT(differ, 0) << "every sample the same: not sampling";
      }
    }
  }
}

// ---- the paged cache of the rollout engine ----

class NextPaged : public ::testing::TestWithParam<std::string> {};

// The engine's steps by hand: prefills and then `chunk` tokens a step (1: decodes; more: the
// chunks of a long prompt or a recompute continuing from the slots) through block tables of
// scattered blocks (4 tokens each) and state slots, one sequence joining with its prefill while
// the others go on (a mixed step). Returns the logits of every checked position (the last of
// each step's tokens; fp32, on the CPU) and transformers' logits there, row for row.
struct PagedRun {
  torch::Tensor got, ref;
  std::vector<std::vector<int32_t>> tables;
};

PagedRun RunPagedSteps(CausalLM& model, Fixture& f, PagedKVCache& cache, int64_t chunk = 1) {
  torch::NoGradGuard no_grad;
  const auto device = model.LmHeadWeight().device();
  const int64_t block = 4, B = static_cast<int64_t>(f.seqs.size());
  PagedRun run;
  // Blocks handed out round-robin over the sequences (never contiguous), block 0 stays null.
  run.tables.resize(B);
  int32_t next_block = 1;
  for (int64_t j = 0; j * block < 130; ++j) {
    for (int64_t b = 0; b < B; ++b) {
      if (j * block < static_cast<int64_t>(f.seqs[b].size())) run.tables[b].push_back(next_block++);
    }
  }
  cache = model.NewPagedKVCache(next_block, block, /*num_state_slots=*/8);
  const std::vector<int64_t> slots{7, 2, 5, 0, 3};
  const std::vector<int64_t> prefix{1, 2, 63, 64, 65};
  const int64_t late = 4, joins_at = 3;         // sequence 4 is prefilled with the 3rd decode step
  std::vector<int64_t> done(B, 0), ref_row(B);  // tokens each sequence has run; its first ref row
  for (int64_t b = 1; b < B; ++b)
    ref_row[b] = ref_row[b - 1] + static_cast<int64_t>(f.seqs[b - 1].size());
  std::vector<torch::Tensor> got, ref;
  for (int64_t it = 0;; ++it) {
    PagedStep step;
    std::vector<int64_t> ids, members;
    step.cu_seqlens.push_back(0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = static_cast<int64_t>(f.seqs[b].size());
      if (done[b] == len || (b == late && it < joins_at)) continue;
      const int64_t n = done[b] == 0 ? prefix[b] : std::min(chunk, len - done[b]);
      ids.insert(ids.end(), f.seqs[b].begin() + done[b], f.seqs[b].begin() + done[b] + n);
      step.cu_seqlens.push_back(static_cast<int64_t>(ids.size()));
      step.context_lens.push_back(done[b]);
      step.block_tables.push_back(run.tables[b]);
      step.state_slots.push_back(slots[b]);
      members.push_back(b);
    }
    if (members.empty()) break;
    step.input_ids = torch::tensor(ids, torch::kInt64).to(device);
    auto logits = model.Logits(model.PagedForward(step, cache)).to(torch::kCPU, torch::kFloat32);
    EXPECT_EQ(logits.size(0), static_cast<int64_t>(members.size()));
    for (size_t i = 0; i < members.size(); ++i) {
      const int64_t b = members[i];
      done[b] += step.cu_seqlens[i + 1] - step.cu_seqlens[i];
      got.push_back(logits[i]);
      ref.push_back(f.ref["logits"][ref_row[b] + done[b] - 1]);
    }
  }
  run.got = torch::stack(got);
  run.ref = torch::stack(ref);
  return run;
}

TEST_P(NextPaged, PagedStepsEqualForward) {
  Fixture f = LoadFixture(GetParam());
  auto model = MustLoad(f.dir + "/model");
  ASSERT_TRUE(model);
  ASSERT_TRUE(model->SupportsPagedKV());
  PagedKVCache cache;
  PagedRun run = RunPagedSteps(*model, f, cache);
  // The prefills' last rows, then one per decode step.
  ASSERT_EQ(run.got.size(0), 1 + 4 + 2 + 37 + 66);
  const double d = RelDiff(run.got, run.ref);
  EXPECT_LE(d, 1e-4);
  std::printf("[%s] paged steps vs transformers %.3g (relative)\n", GetParam().c_str(), d);
  // Several new tokens after a context (a long prompt's later chunks, a recompute's): chunks of
  // 9 continuing from the slots (the conv over its window, the chunked rule from the state) give
  // transformers' logits at every chunk's end, as closely.
  PagedKVCache chunked;
  PagedRun c = RunPagedSteps(*model, f, chunked, /*chunk=*/9);
  ASSERT_GT(c.got.size(0), 5);
  EXPECT_LE(RelDiff(c.got, c.ref), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, NextPaged, ::testing::ValuesIn(FixtureNames()));

std::vector<lm::Sample> Sorted(std::vector<lm::Sample> out) {
  std::sort(out.begin(), out.end(), [](const lm::Sample& a, const lm::Sample& b) {
    return std::tie(a.prompt_index, a.sample_index) < std::tie(b.prompt_index, b.sample_index);
  });
  return out;
}

// The continuous-batching engine serves a Qwen3-Next student: its samples (greedy and sampled, 2
// per prompt, forked by copying the prompt's state slot) equal the static sampler's, also when a
// pool of 12 blocks forces preemption (recompute from the prompt and the tokens so far) and when
// prompts and recomputes are prefilled 5 tokens a step (continuing from the state slots).
TEST(NextPaged, EngineEqualsStaticSampler) {
  Fixture f = LoadFixture("next_interval4");
  std::shared_ptr<CausalLM> model = MustLoad(f.dir + "/model");
  ASSERT_TRUE(model);
  const std::vector<std::vector<int64_t>> prompts = {
      {f.seqs[1][0], f.seqs[1][1]}, f.seqs[1], {f.seqs[3].begin(), f.seqs[3].begin() + 20}};
  const std::vector<std::pair<int64_t, int64_t>> configs = {{0, 8192}, {12, 8192}, {0, 5}, {12, 5}};
  for (auto [num_blocks, chunk] : configs) {
    rollout::EngineOptions eo;
    eo.block_size = 4;
    eo.num_blocks = num_blocks;
    eo.kv_cache_bytes = 1 << 20;
    eo.max_running = 8;
    eo.max_prefill_tokens = chunk;  // 5: every prompt and recompute but the shortest in chunks
    auto engine = rollout::Engine::Create(*model, eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (double temperature : {0.0, 1.0}) {
      lm::SamplingParams p;
      p.samples_per_prompt = 2;
      p.max_new_tokens = 16;
      p.temperature = temperature;
      p.seed = 99;
      std::vector<lm::Sample> want, got;
      ASSERT_TRUE(lm::SampleResponses(*model, testing_util::HostIds(prompts), p, [&](lm::Sample s) {
                    want.push_back(std::move(s));
                  }).ok());
      absl::Status st = (*engine)->Generate(
          rollout::Snapshot{model, 0, nullptr}, testing_util::HostIds(prompts), p,
          [&](lm::Sample s) { got.push_back(std::move(s)); }, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      want = Sorted(want);
      got = Sorted(got);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].tokens, want[i].tokens) << "blocks " << num_blocks << " chunk " << chunk
                                                 << " T " << temperature << " sample " << i;
        ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
        for (size_t t = 0; t < want[i].logprobs.size(); ++t)
          EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-4);
      }
    }
    if (num_blocks > 0) {
      EXPECT_GT((*engine)->stats().preemptions, 0) << "no preemption";
    }
    if (chunk == 5) {
      EXPECT_GT((*engine)->stats().partial_prefills, 0) << "no chunked prefill";
      EXPECT_LE((*engine)->stats().largest_prefill_step, 5);
    }
  }
}

// bf16, the GPU serving dtype (conv windows in bf16, delta-rule states in fp32): decoding through
// the contiguous cache and through paged steps stays as close to the fp32 reference as the bf16
// forward does (NextModel.Bf16ForwardStaysClose's bound).
void Bf16DecodeStaysClose(torch::Device device) {
  Fixture f = LoadFixture("next_sparse2_ratio3");
  LoadOptions lo;
  lo.dtype = torch::kBFloat16;
  lo.device = device;
  auto loaded = LoadModel(f.dir + "/model", lo);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  CausalLM& model = **loaded;
  auto decoded = DecodeAll(model, f.seqs, {1, 2, 63, 64, 65});
  const double d_decode =
      MaxAbsDiff(torch::cat(decoded).to(torch::kCPU, torch::kFloat32), f.ref["logits"]);
  PagedKVCache cache;
  PagedRun run = RunPagedSteps(model, f, cache);
  const double d_paged = MaxAbsDiff(run.got, run.ref);
  std::printf("bf16 on %s: max |logits diff| decode %.3g, paged %.3g\n", device.str().c_str(),
              d_decode, d_paged);
  EXPECT_LE(d_decode, 0.25);
  EXPECT_LE(d_paged, 0.25);
}

TEST(NextModel, Bf16DecodeStaysCloseCpu) {
  Bf16DecodeStaysClose(torch::kCPU);
}

TEST(NextModel, Bf16DecodeStaysCloseCuda) {
  SKIP_WITHOUT_CUDA();
  Bf16DecodeStaysClose(torch::Device(torch::kCUDA, 0));
}

// A Qwen3-Next student rolls out through opd-rollout on either engine: it starts, and Generate
// over gRPC returns transformers' greedy continuations and the in-process sampler's seeded samples.
void RolloutOverGrpc(const std::string& engine) {
  Fixture f = LoadFixture(kMtpFixture);
  auto dir = TempDir("rollout_" + engine);
  const testing_util::Served rollout = testing_util::StartServed(
      dir, "rollout",
      {std::string(OPD_BINARY_DIR) + "/rollout/opd-rollout", "--model=" + f.dir + "/model",
       "--threads=1", "--engine=" + engine});
  ASSERT_FALSE(rollout.address.empty());
  testing_util::ChildProcess& child = *rollout.process;
  opd::rpc::ClientOptions o;
  o.address = rollout.address;
  o.timeout = absl::Seconds(60);
  ASSERT_TRUE(opd::rpc::WaitUntilServing(o, absl::Seconds(30)).ok()) << child.Log();
  auto client = opd::rpc::RolloutClient::Create(o);
  ASSERT_TRUE(client.ok()) << client.status();

  std::vector<std::vector<int32_t>> prompts;
  for (const auto& c : f.generate) prompts.emplace_back(c.prompt.begin(), c.prompt.end());
  lm::SamplingParams greedy;
  greedy.temperature = 0;
  greedy.max_new_tokens = static_cast<int64_t>(f.generate[0].tokens.size());
  auto out = (*client)->Generate(prompts, greedy);
  ASSERT_TRUE(out.ok()) << out.status() << "\n" << child.Log();
  ASSERT_EQ(out->size(), f.generate.size());
  for (const auto& s : *out) {
    const auto& want = f.generate[s.prompt_index].tokens;
    EXPECT_EQ(ResponseIds(s), want);
  }

  lm::SamplingParams sampled;
  sampled.samples_per_prompt = 2;
  sampled.max_new_tokens = 10;
  sampled.seed = 77;
  out = (*client)->Generate(prompts, sampled);
  ASSERT_TRUE(out.ok()) << out.status();
  auto model = MustLoad(f.dir + "/model");
  ASSERT_TRUE(model);
  lm::SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 10;
  p.seed = 77;
  std::map<std::pair<int64_t, int64_t>, lm::Sample> local;
  ASSERT_TRUE(lm::SampleResponses(*model, prompts, p, [&](lm::Sample s) {
                local[{s.prompt_index, s.sample_index}] = s;
              }).ok());
  ASSERT_EQ(out->size(), 6u);
  for (const auto& s : *out) {
    const auto& want = local[{s.prompt_index, s.sample_index}];
    EXPECT_EQ(s.tokens, want.tokens);
    ASSERT_EQ(s.logprobs.size(), want.logprobs.size());
    for (size_t i = 0; i < want.logprobs.size(); ++i)
      EXPECT_NEAR(s.logprobs[i], want.logprobs[i], 1e-5);
  }
  child.Stop();
  fs::remove_all(dir);
}

TEST(NextRollout, PagedEngineGeneratesOverGrpc) {
  RolloutOverGrpc("paged");
}
TEST(NextRollout, StaticSamplerGeneratesOverGrpc) {
  RolloutOverGrpc("static");
}

}  // namespace
}  // namespace lm
