// Qwen3-Next (the stage-2 teacher) against Hugging Face transformers' PyTorch implementation, on
// the tiny random models that tests/python/make_next_fixtures.py builds. Tolerances (fp32, CPU):
//   logits and log-probs vs transformers: max abs diff <= 1e-4;
//   chunked delta rule vs the per-token recurrence: max abs diff <= 1e-5;
//   a packed batch vs each sequence alone: max abs diff <= 1e-5;
//   gradients: max abs diff <= 1e-4 x max(the tensor's largest reference entry, 1e-4).
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/io/checkpoint.h"
#include "lm/model/cpu_inference.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/qwen3_next.h"
#include "nlohmann/json.hpp"

namespace lm {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = OPD_NEXT_FIXTURES_DIR;

std::vector<std::string> FixtureNames() {
  std::ifstream in(kFixtures + "/index.json");
  return nlohmann::json::parse(in)["configs"].get<std::vector<std::string>>();
}

struct Fixture {
  std::string dir;
  std::vector<std::vector<int64_t>> seqs;
  int64_t mtp_tensors = 0;
  std::map<std::string, torch::Tensor> ref;
};

Fixture LoadFixture(const std::string& name) {
  Fixture f;
  f.dir = kFixtures + "/" + name;
  std::ifstream in(f.dir + "/inputs.json");
  auto j = nlohmann::json::parse(in);
  f.seqs = j["sequences"].get<std::vector<std::vector<int64_t>>>();
  f.mtp_tensors = j["mtp_tensors"].get<int64_t>();
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

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.numel() == 0) return 0;
  return (a - b).abs().max().item<double>();
}

fs::path TempDir(const std::string& tag) {
  auto d = fs::temp_directory_path() / ("lm_next_test_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// ---- parity with transformers ----

class NextParity : public ::testing::TestWithParam<std::string> {};

// Each sequence alone (lengths 1, 5, 64, 100, 130) against transformers' logits.
TEST_P(NextParity, LogitsOfEachSequenceAlone) {
  torch::NoGradGuard no_grad;
  Fixture f = LoadFixture(GetParam());
  auto model = MustLoad(f.dir + "/model");
  ASSERT_TRUE(model);
  int64_t row = 0;
  double worst = 0;
  for (const auto& s : f.seqs) {
    auto logits = model->Logits(model->Forward(PackedBatch::FromSequences({s})));
    const int64_t n = static_cast<int64_t>(s.size());
    const double d = MaxAbsDiff(logits, f.ref["logits"].narrow(0, row, n));
    EXPECT_LE(d, 1e-4) << "sequence of length " << n;
    worst = std::max(worst, d);
    row += n;
  }
  std::printf("[%s] max |logits diff| over lengths 1..130 = %.3g\n", GetParam().c_str(), worst);
}

// All sequences packed into one batch: no state crosses a document boundary, so every row equals
// both transformers' logits and our own forward of that sequence alone.
TEST_P(NextParity, PackedBatchEqualsSeparateForwards) {
  torch::NoGradGuard no_grad;
  Fixture f = LoadFixture(GetParam());
  auto model = MustLoad(f.dir + "/model");
  ASSERT_TRUE(model);
  // Lengths 1, 5, 64, 100, 130: documents of one, two and three chunks side by side.
  auto packed = model->Logits(model->Forward(PackedBatch::FromSequences(f.seqs)));
  EXPECT_LE(MaxAbsDiff(packed, f.ref["logits"]), 1e-4);
  std::vector<torch::Tensor> alone;
  for (const auto& s : f.seqs)
    alone.push_back(model->Logits(model->Forward(PackedBatch::FromSequences({s}))));
  const double packing_diff = MaxAbsDiff(packed, torch::cat(alone));
  EXPECT_LE(packing_diff, 1e-5);
  std::printf("[%s] max |packed - alone| = %.3g\n", GetParam().c_str(), packing_diff);
  // Reversed order: a different chunk layout, the same rows.
  std::vector<std::vector<int64_t>> reversed(f.seqs.rbegin(), f.seqs.rend());
  auto rev = model->Logits(model->Forward(PackedBatch::FromSequences(reversed)));
  std::vector<torch::Tensor> rev_ref(alone.rbegin(), alone.rend());
  EXPECT_LE(MaxAbsDiff(rev, torch::cat(rev_ref)), 1e-5);
}

// Log-probs through the chunked LM head, and gradients of the mean next-token loss (the teacher
// does not need them, but nothing in the forward should block autograd).
TEST_P(NextParity, LogprobsAndGradients) {
  Fixture f = LoadFixture(GetParam());
  auto model = MustLoad(f.dir + "/model");
  ASSERT_TRUE(model);
  auto batch = PackedBatch::FromSequences(f.seqs);
  auto hidden = model->Forward(batch);
  auto [rows, targets] = NextTokenRows(batch);
  auto lp = TokenLogprobs(hidden.index_select(0, rows), model->LmHeadWeight(), targets);
  EXPECT_LE(MaxAbsDiff(lp, f.ref["logprobs"]), 1e-4);
  auto loss = -lp.mean();
  EXPECT_NEAR(loss.item<double>(), f.ref["loss"].item<double>(), 1e-5);
  loss.backward();
  int64_t checked = 0;
  for (const auto& p : model->named_parameters()) {
    auto it = f.ref.find("grad." + p.key());
    ASSERT_NE(it, f.ref.end()) << "no reference gradient for " << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << "no gradient reached " << p.key();
    // The floor covers gradients that are zero but for rounding (top-1 routing renormalised to 1
    // gives the router none), where a relative comparison would compare noise.
    const double scale = std::max(it->second.abs().max().item<double>(), 1e-4);
    EXPECT_LE(MaxAbsDiff(p.value().grad(), it->second) / scale, 1e-4) << "gradient of " << p.key();
    ++checked;
  }
  EXPECT_GT(checked, 20);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, NextParity, ::testing::ValuesIn(FixtureNames()));

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

// The inference path (lm/model/cpu_inference.h: one task per document and head, chunks in order,
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

TEST(NextModel, ScoringOnlyNoKVCache) {
  auto model = MustLoad(kFixtures + "/" + kMtpFixture + "/model");
  ASSERT_TRUE(model);
  EXPECT_FALSE(model->SupportsKVCache());
  EXPECT_THROW(model->NewKVCache(1, 8), c10::Error);
  KVCache cache;
  EXPECT_THROW(model->Decode(torch::tensor({1}, torch::kInt64), cache), c10::Error);
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
  EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
  const double d = MaxAbsDiff(logits.to(torch::kFloat32), f.ref["logits"]);
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

// A Qwen3-Next student cannot be sampled yet (no recurrent-state cache): opd-rollout refuses it
// at start-up, naming the model type, instead of failing every Generate.
TEST(NextRollout, RefusedAtStartUp) {
  const std::string dir = std::string(OPD_NEXT_FIXTURES_DIR) + "/next_interval4/model";
  const std::string log = (fs::temp_directory_path() / "next_rollout.log").string();
  const std::string cmd = std::string(OPD_BINARY_DIR) + "/rollout/opd-rollout --model " + dir +
                          " --listen 127.0.0.1:0 > " + log + " 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << cmd;
  EXPECT_EQ(WEXITSTATUS(status), 1) << cmd;
  std::ifstream in(log);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(out.find("is a qwen3_next model, which this rollout worker cannot sample"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace lm
