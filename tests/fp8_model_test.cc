// Block-wise FP8 checkpoints in models (lm/io/fp8_checkpoint.h, lm/io/hf_model_dir.h,
// lm/model/fp8.h, lm/plan/fp8_weights.cc):
//   - the loader's named errors for malformed checkpoints, and dequantization with any block size
//     (every weight exactly fp8 x scale_inv);
//   - the tiny FP8 fixtures (tests/python/make_fp8_fixtures.py): dequantized on load, our fp32
//     log-probs equal transformers' on the dequantized weights to fp32 rounding (1e-4,
//     tests/parity_test.cc's rule); kept in FP8 (the twin through the whole model), within the FP8
//     rule below; an expert-parallel FP8 layer sums to the whole layer;
//   - the memory plan's FP8 weight term, and opd-ctl plan with an FP8 teacher config;
//   - on a CUDA device with FP8 GEMMs: the layers against the twin, and the model in FP8 against
//   the
//     same checkpoint dequantized to bf16 (skip without a device, fail under OPD_REQUIRE_GPU=1).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ctl/model_config_file.h"
#include "lm/io/fp8_checkpoint.h"
#include "lm/io/hf_model_dir.h"
#include "lm/io/safetensors.h"
#include "lm/io/sharded_load.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/fp8.h"
#include "lm/model/fp8_format.h"
#include "lm/model/layers.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/plan/plan.h"
#include "nlohmann/json.hpp"
#include "tests/fp8_testing.h"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"

namespace lm {
namespace {

namespace fs = std::filesystem;
using namespace fp8_testing;  // NOLINT: the shared helpers of the FP8 tests
using nlohmann::json;
using testing_util::MaxAbsDiff;

const std::string kFixtures = OPD_FP8_FIXTURES_DIR;

// ---------------------------------------------------------------------------------------------
// Loading: tiny checkpoints made here (any block size, any fault), and the fixtures

// A checkpoint tensor held in memory.
struct OwnedTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
using Tensors = std::map<std::string, OwnedTensor>;

OwnedTensor Own(const torch::Tensor& t, DType dtype) {
  auto c = t.contiguous();
  return {dtype, c.sizes().vec(), std::string(static_cast<const char*>(c.data_ptr()), c.nbytes())};
}

torch::Tensor AsTensor(const OwnedTensor& t, torch::Dtype dtype) {
  return torch::from_blob(const_cast<char*>(t.bytes.data()), t.shape,
                          torch::TensorOptions().dtype(dtype))
      .clone();
}

struct CheckpointDir {
  json config;
  Tensors tensors;
  std::map<std::string, torch::Tensor> dequantized;  // FP8 tensor -> q x scale (fp32)
};

// A tiny random Qwen3-MoE (ragged against 128: hidden 40, widths 24 and 48) as an FP8
// checkpoint: every "*_proj.weight" whose module the config converts in FP8 by br x bc blocks,
// the rest F32, per-expert names as published.
CheckpointDir TinyFp8Checkpoint(int64_t br, int64_t bc, json not_convert = json::array()) {
  CheckpointDir d;
  d.config = {{"model_type", "qwen3_moe"},
              {"vocab_size", 64},
              {"hidden_size", 40},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"head_dim", 16},
              {"num_experts", 4},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 24},
              {"intermediate_size", 48},
              {"mlp_only_layers", {1}},
              {"norm_topk_prob", true},
              {"tie_word_embeddings", false}};
  auto config = ParseModelConfig(d.config);
  EXPECT_TRUE(config.ok()) << config.status();
  auto model = CreateModel(*config);
  EXPECT_TRUE(model.ok()) << model.status();
  (*model)->InitWeights(0.2, 7);
  const fs::path tmp = testing_util::TempDir("fp8_src");
  EXPECT_TRUE(SaveModel(**model, tmp.string()).ok());
  auto files = OpenCheckpointFiles(tmp.string());
  EXPECT_TRUE(files.ok()) << files.status();
  d.config["quantization_config"] = PublishedQuantization();
  d.config["quantization_config"]["weight_block_size"] = {br, bc};
  d.config["quantization_config"]["modules_to_not_convert"] = not_convert;
  auto format = ParseFp8QuantizationConfig(d.config);
  EXPECT_TRUE(format.ok() && format->has_value()) << format.status();
  for (const auto& [name, view] : (*files)[0]->tensors()) {
    torch::Tensor t = TensorFromView(view, (*files)[0]).clone();
    const std::string suffix = "_proj.weight";
    const bool proj = name.size() > suffix.size() &&
                      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (!proj || !(*format)->Converts(name.substr(0, name.size() - 7))) {
      d.tensors[name] = Own(t, DType::kF32);
      continue;
    }
    QuantWeight q = QuantizeWeight(t, br, bc);
    d.tensors[name] = Own(q.q, DType::kF8E4M3);
    d.tensors[name + "_scale_inv"] = Own(q.scale, DType::kF32);
    d.dequantized[name] = q.deq;
  }
  fs::remove_all(tmp);
  return d;
}

fs::path Write(const CheckpointDir& d, const std::string& tag) {
  const fs::path dir = testing_util::TempDir(tag);
  std::ofstream(dir / "config.json") << d.config.dump(2);
  std::vector<TensorToWrite> out;
  for (const auto& [name, t] : d.tensors)
    out.push_back({name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()});
  EXPECT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), out).ok());
  return dir;
}

LoadOptions Options(Fp8Weights fp8, torch::Dtype dtype = torch::kFloat32) {
  LoadOptions o;
  o.dtype = dtype;
  o.fp8 = fp8;
  return o;
}

// The parameter value a checkpoint tensor fills: a whole parameter, or an expert's rows.
torch::Tensor Filled(CausalLM& model, const std::string& name) {
  const std::string experts = ".mlp.experts.";
  const size_t at = name.find(experts);
  if (at == std::string::npos) return model.named_parameters()[name];
  const std::string base = name.substr(0, at + experts.size() - 1);  // "...mlp.experts"
  const std::string rest = name.substr(at + experts.size());         // "E.gate_proj.weight"
  const int64_t e = std::stoll(rest.substr(0, rest.find('.')));
  if (rest.find("down_proj") != std::string::npos)
    return model.named_parameters()[base + ".down_proj"][e];
  auto gu = model.named_parameters()[base + ".gate_up_proj"][e];
  const int64_t I = gu.size(0) / 2;
  return gu.narrow(0, rest.find("gate_proj") != std::string::npos ? 0 : I, I);
}

// Dequantized on load, with blocks of any size (16 x 24 here: several, ragged, per weight):
// every weight is exactly fp8 x scale_inv of its block, in fp32, and bf16 is that rounded once.
TEST(Fp8Load, DequantizedWeightsAreFp8TimesTheirBlockScale) {
  CheckpointDir d = TinyFp8Checkpoint(16, 24);
  const fs::path dir = Write(d, "fp8_any_block");
  auto m = LoadModel(dir.string(), Options(Fp8Weights::kAuto));
  ASSERT_TRUE(m.ok()) << m.status();
  auto bf16 = LoadModel(dir.string(), Options(Fp8Weights::kAuto, torch::kBFloat16));
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_GE(d.dequantized.size(), 20u);
  for (const auto& [name, deq] : d.dequantized) {
    EXPECT_TRUE(torch::equal(Filled(**m, name), deq)) << name;
    EXPECT_TRUE(torch::equal(Filled(**bf16, name), deq.to(torch::kBFloat16))) << name;
  }
  for (const auto& p : (*m)->named_parameters())
    EXPECT_EQ(p.value().scalar_type(), torch::kFloat32) << p.key();
  // Kept in FP8 needs the GEMMs' 128 x 128 blocks.
  ExpectError(LoadModel(dir.string(), Options(Fp8Weights::kKeep)).status(),
              absl::StatusCode::kUnimplemented, {"weight_block_size [16, 24]", "128 x 128"});
  fs::remove_all(dir);
}

// Each malformed checkpoint is refused before anything is allocated, naming what is wrong.
TEST(Fp8Load, MalformedCheckpointsAreNamedErrors) {
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  const std::string qs = q + "_scale_inv";
  struct Case {
    std::string what;
    std::function<void(CheckpointDir&)> mutate;
    absl::StatusCode code;
    std::vector<std::string> words;
  };
  auto set_scale = [&](float v) {
    return [&, v](CheckpointDir& d) {
      auto s = AsTensor(d.tensors[qs], torch::kFloat32);
      s.view({-1})[0] = v;
      d.tensors[qs] = Own(s, DType::kF32);
    };
  };
  const std::vector<Case> cases = {
      {"missing scale",
       [&](CheckpointDir& d) { d.tensors.erase(qs); },
       absl::StatusCode::kNotFound,
       {q, qs, "block scales"}},
      {"scale of the wrong shape",
       [&](CheckpointDir& d) {
         d.tensors[qs] = Own(torch::ones({1, 2}), DType::kF32);
       },
       absl::StatusCode::kInvalidArgument,
       {qs, "[1, 2]", "expected [1, 1]", "128 x 128"}},
      {"scale of the wrong dtype",
       [&](CheckpointDir& d) {
         d.tensors[qs] = Own(torch::ones({1, 1}).to(torch::kFloat8_e4m3fn), DType::kF8E4M3);
       },
       absl::StatusCode::kInvalidArgument,
       {qs, "F8_E4M3", "expected F32, BF16 or F16"}},
      {"NaN scale",
       set_scale(NAN),
       absl::StatusCode::kInvalidArgument,
       {qs, "NaN, infinite or negative"}},
      {"infinite scale",
       set_scale(INFINITY),
       absl::StatusCode::kInvalidArgument,
       {qs, "NaN, infinite or negative"}},
      {"negative scale",
       set_scale(-1.0f),
       absl::StatusCode::kInvalidArgument,
       {qs, "NaN, infinite or negative"}},
      {"unknown fmt",
       [&](CheckpointDir& d) { d.config["quantization_config"]["fmt"] = "e3m4"; },
       absl::StatusCode::kInvalidArgument,
       {"quantization_config.fmt", "e3m4"}},
      {"FP8 without quantization_config",
       [&](CheckpointDir& d) { d.config.erase("quantization_config"); },
       absl::StatusCode::kInvalidArgument,
       {"F8_E4M3", "no quantization_config"}},
      {"FP8 in a module left unquantized",
       [&](CheckpointDir& d) {
         d.config["quantization_config"]["modules_to_not_convert"] = {"self_attn.q_proj"};
       },
       absl::StatusCode::kInvalidArgument,
       {q, "modules_to_not_convert", "self_attn.q_proj"}},
      {"a scale without its FP8 weight",
       [&](CheckpointDir& d) {
         d.tensors["model.norm.weight_scale_inv"] = Own(torch::ones({1, 1}), DType::kF32);
       },
       absl::StatusCode::kInvalidArgument,
       {"model.norm.weight_scale_inv", "not an FP8"}},
      {"an FP8 byte that is NaN",
       [&](CheckpointDir& d) { d.tensors[q].bytes[5] = static_cast<char>(0x7F); },
       absl::StatusCode::kInvalidArgument,
       {q, "1 NaN"}},
      {"a 3-D FP8 tensor",
       [&](CheckpointDir& d) {
         d.tensors[q].shape = {1, d.tensors[q].shape[0], d.tensors[q].shape[1]};
       },
       absl::StatusCode::kUnimplemented,
       {q, "only 2-D"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    CheckpointDir d = TinyFp8Checkpoint(128, 128);
    c.mutate(d);
    const fs::path dir = Write(d, "fp8_bad");
    ExpectError(LoadModel(dir.string()).status(), c.code, c.words);
    fs::remove_all(dir);
  }
}

// The generic loader (no config) refuses FP8 tensors rather than reading bytes as floats.
TEST(Fp8Load, LoadParametersWithoutAConfigRefusesFp8) {
  CheckpointDir d = TinyFp8Checkpoint(128, 128);
  const fs::path dir = Write(d, "fp8_generic");
  auto config = ParseModelConfig(d.config);
  ASSERT_TRUE(config.ok());
  auto model = CreateModel(*config, LoadOptions{});
  ASSERT_TRUE(model.ok());
  std::map<std::string, torch::Tensor> params;
  for (auto& p : (*model)->named_parameters()) params[p.key()] = p.value();
  auto files = OpenCheckpointFiles(dir.string());
  ASSERT_TRUE(files.ok());
  ExpectError(LoadParameters(*files, params, {}, {}).status(), absl::StatusCode::kInvalidArgument,
              {"F8_E4M3", "quantization_config"});
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// The fixtures: tiny Qwen3-MoE and Qwen3-Next FP8 checkpoints in the published layout

const std::vector<std::string> kFixtureNames = {"fp8_moe", "fp8_next"};

TEST(Fp8Fixtures, IndexListsThem) {
  std::ifstream in(kFixtures + "/index.json");
  ASSERT_TRUE(in) << "no FP8 fixtures in " << kFixtures;
  EXPECT_EQ(json::parse(in)["configs"].get<std::vector<std::string>>(), kFixtureNames);
}

struct Reference {
  std::vector<std::vector<int64_t>> seqs;
  torch::Tensor logits, logprobs;
};

Reference LoadReference(const std::string& dir) {
  Reference r;
  std::ifstream in(dir + "/inputs.json");
  r.seqs = json::parse(in)["sequences"].get<std::vector<std::vector<int64_t>>>();
  auto file = SafetensorsFile::Open(dir + "/ref.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return r;
  r.logits = TensorFromView(*(*file)->Get("logits"), *file).clone();
  r.logprobs = TensorFromView(*(*file)->Get("logprobs"), *file).clone();
  return r;
}

// Logits [T, V] and next-token log-probs [T - B] of the packed sequences, in fp32.
std::pair<torch::Tensor, torch::Tensor> RunModel(CausalLM& model, const Reference& ref) {
  torch::NoGradGuard no_grad;
  auto batch = PackedBatch::FromSequences(ref.seqs);
  auto hidden = model.Forward(batch);
  auto [rows, targets] = NextTokenRows(batch);
  return {model.Logits(hidden),
          TokenLogprobs(hidden.index_select(0, rows), model.LmHeadWeight(), targets)};
}

int64_t Fp8Parameters(CausalLM& model) {
  int64_t n = 0;
  for (const auto& p : model.named_parameters())
    n += p.value().scalar_type() == torch::kFloat8_e4m3fn;
  return n;
}

class Fp8Fixture : public ::testing::TestWithParam<std::string> {
 protected:
  std::string Dir() const { return kFixtures + "/" + GetParam(); }
  std::string ModelDir() const { return Dir() + "/model"; }
};

// Our CPU forward on the checkpoint dequantized on load against transformers on the dequantized
// weights: the same fp32 weights, so fp32 rounding apart (tests/parity_test.cc's 1e-4).
TEST_P(Fp8Fixture, DequantizedOnLoadEqualsTransformers) {
  const Reference ref = LoadReference(Dir());
  auto model = LoadModel(ModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(Fp8Parameters(**model), 0);
  auto [logits, lp] = RunModel(**model, ref);
  EXPECT_LE(MaxAbsDiff(logits, ref.logits), 1e-4) << "logits";
  EXPECT_LE(MaxAbsDiff(lp, ref.logprobs), 1e-4) << "log-probs";
}

// The fixture quantized exactly the linear layers transformers' should_convert_module converts;
// our reading of modules_to_not_convert must agree on every 2-D weight (the embedding aside).
TEST_P(Fp8Fixture, ModulesToNotConvertAgreeWithTheConverter) {
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(config->fp8.has_value());
  auto files = OpenCheckpointFiles(ModelDir());
  ASSERT_TRUE(files.ok()) << files.status();
  int64_t fp8 = 0, plain = 0;
  for (const auto& file : *files) {
    for (const auto& [name, view] : file->tensors()) {
      const std::string suffix = ".weight";
      if (view.shape.size() != 2 || name == "model.embed_tokens.weight" ||
          name.size() < suffix.size() ||
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const bool is_fp8 = view.dtype == DType::kF8E4M3;
      EXPECT_EQ(config->fp8->Converts(name.substr(0, name.size() - suffix.size())), is_fp8) << name;
      ++(is_fp8 ? fp8 : plain);
    }
  }
  EXPECT_GT(fp8, 10);
  EXPECT_GT(plain, 1);  // the LM head and a projection (or the routers) left in bf16
}

// Kept in FP8 on the CPU: the whole model through the twin of the CUDA kernels (activations
// quantized per token and 128-group, FP8 GEMMs), against transformers on the dequantized
// weights. The weights are the same; only the activations' rounding to e4m3 differs, 3 mantissa
// bits where bf16 keeps 8: 2^-4 relative against bf16's 2^-8. The FP8 rule is transformers' bf16
// rule (|a - b| <= 1e-2 + 1e-2 |b|, tests/bf16_test.cc) scaled by that factor 16:
// |a - b| <= 0.16 + 0.16 |b| for every log-prob.
constexpr double kFp8Rule = 0.16;

double WorstRuleRatio(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kFloat64), w = want.to(torch::kFloat64);
  return ((g - w).abs() / (kFp8Rule + kFp8Rule * w.abs())).max().item<double>();
}

TEST_P(Fp8Fixture, KeptInFp8WithinTheFp8Rule) {
  const Reference ref = LoadReference(Dir());
  auto model = LoadModel(ModelDir(), Options(Fp8Weights::kKeep));
  ASSERT_TRUE(model.ok()) << model.status();
  // Exactly the parameters whose checkpoint tensors are FP8 are FP8: the fixtures quantize every
  // linear layer but the LM head and those modules_to_not_convert names.
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  int64_t fp8_params = 0;
  for (const auto& p : (*model)->named_parameters()) {
    const std::string& n = p.key();
    const bool fp8 = p.value().scalar_type() == torch::kFloat8_e4m3fn;
    fp8_params += fp8;
    if (n.find("mlp.experts.") != std::string::npos) {
      EXPECT_TRUE(fp8) << n;
    } else if (n.size() > 7 && n.compare(n.size() - 7, 7, ".weight") == 0 && p.value().dim() == 2 &&
               n != "model.embed_tokens.weight" && n != "lm_head.weight") {
      EXPECT_EQ(fp8, config->fp8->Converts(n.substr(0, n.size() - 7))) << n;
    } else {
      EXPECT_FALSE(fp8) << n;
    }
  }
  EXPECT_GT(fp8_params, 5);
  auto [logits, lp] = RunModel(**model, ref);
  const double diff = MaxAbsDiff(lp, ref.logprobs), ratio = WorstRuleRatio(lp, ref.logprobs);
  std::printf(
      "%s kept in FP8 (CPU twin) vs transformers on the dequantized weights: max |d "
      "log-prob| %.4f, worst / FP8 rule %.3f\n",
      GetParam().c_str(), diff, ratio);
  EXPECT_LE(ratio, 1.0);
  EXPECT_GT(diff, 1e-4);  // the activations were quantized: not the dequantized path
}

// Expert parallelism over FP8 experts: the two ranks' shares of the checkpoint (LoadExpertShard:
// two experts each, their FP8 weights and the scales' slices), whose partial sums (the other
// rank's ids dropped) add up to the whole layer. With top-2 routing the sums agree bit for bit:
// each rank's partial is one product or an exact zero per slot, and every expert row is computed
// alone, whichever rank computes it.
TEST(Fp8ExpertParallel, RanksSumToTheWholeLayer) {
  const std::string dir = kFixtures + "/fp8_moe/model";
  auto model = LoadModel(dir, Options(Fp8Weights::kKeep));
  ASSERT_TRUE(model.ok()) << model.status();
  auto* block = (*model)->named_modules()["model.layers.0.mlp"]->as<SparseMoeBlockImpl>();
  ASSERT_NE(block, nullptr);
  const ExpertsImpl& all = *block->experts;
  ASSERT_TRUE(HoldsFp8(all));
  ASSERT_EQ(all.gate_up_proj.size(0), 4);
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  auto x = torch::randn({9, all.down_proj.size(1)});
  Routing r = Route(x, block->gate->weight, block->top_k, block->norm_topk_prob);
  auto whole = Fp8MoeExperts(x, r.ids, r.weights, all, /*fp32_sum=*/true);
  auto sum = torch::zeros_like(whole);
  for (int rank : {0, 1}) {
    auto shard = LoadExpertShard(dir, Options(Fp8Weights::kKeep), rank, 2);
    ASSERT_TRUE(shard.ok()) << shard.status();
    auto* local_block = (*shard)->named_modules()["model.layers.0.mlp"]->as<SparseMoeBlockImpl>();
    const ExpertsImpl& local = *local_block->experts;
    ASSERT_TRUE(HoldsFp8(local));
    ExpertParallel ep;
    ep.local = {2 * rank, 2};
    for (const char* name : {"gate_up_proj", "down_proj"}) {
      const std::string scale = std::string(name) + "_scale_inv";
      EXPECT_TRUE(torch::equal(
          local.named_parameters()[name].view(torch::kUInt8),
          all.named_parameters()[name].narrow(0, ep.local.first, 2).view(torch::kUInt8)))
          << name;
      EXPECT_TRUE(torch::equal(local.named_buffers()[scale],
                               all.named_buffers()[scale].narrow(0, ep.local.first, 2)))
          << scale;
    }
    ep.all_reduce_sum = [](torch::Tensor&) { return absl::OkStatus(); };  // one rank's share
    sum += ExpertParallelExperts(ep, x, r, local);
  }
  EXPECT_TRUE(torch::equal(sum, whole)) << MaxAbsDiff(sum, whole);
}

// A model holding FP8 weights is not saved as if they were floats; a dequantized one is saved
// without the quantization_config its weights no longer follow.
TEST(Fp8Save, RefusesFp8WeightsAndDropsTheQuantizationConfig) {
  const std::string dir = kFixtures + "/fp8_moe/model";
  auto kept = LoadModel(dir, Options(Fp8Weights::kKeep));
  ASSERT_TRUE(kept.ok()) << kept.status();
  const fs::path out = testing_util::TempDir("fp8_save");
  ExpectError(SaveModel(**kept, (out / "kept").string()), absl::StatusCode::kFailedPrecondition,
              {"FP8", "kDequantize"});
  auto plain = LoadModel(dir);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(SaveModel(**plain, (out / "plain").string()).ok());
  auto config = LoadModelConfig((out / "plain").string());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->fp8.has_value());
  auto again = LoadModel((out / "plain").string());
  ASSERT_TRUE(again.ok()) << again.status();
  const Reference ref = LoadReference(kFixtures + "/fp8_moe");
  EXPECT_TRUE(torch::equal(RunModel(**again, ref).second, RunModel(**plain, ref).second));
  fs::remove_all(out);
}

// ---------------------------------------------------------------------------------------------
// The memory plan's FP8 weight term

// By hand, for TinyFp8Checkpoint's model (hidden 40, heads 2 x 16, 4 experts of width 24, a
// dense layer of width 48, vocabulary 64, untied), every linear layer converted:
//   FP8 parameters: attention 2 x (32x40 + 16x40 + 16x40 + 40x32) = 7680, experts
//     4 x 3 x 24x40 = 11520, the dense MLP 3 x 48x40 = 5760: 24960 bytes;
//   scales: one 128 x 128 block per weight: 8 + 12 + 3 = 23 fp32, 92 bytes;
//   the rest: bf16 embedding and LM head 2 x 2 x 64x40 = 10240, fp32 norms and routers
//     4 x (40 + 2 x (32 + 80) + 4x40) = 1696: 11936 bytes.
TEST(Fp8Plan, WeightBytesByHand) {
  CheckpointDir d = TinyFp8Checkpoint(128, 128);
  auto c = ParseModelConfig(d.config);
  ASSERT_TRUE(c.ok()) << c.status();
  plan::Fp8WeightBytes b = plan::CountFp8WeightBytes(*c, 2, 1);
  EXPECT_EQ(b.fp8, 24960);
  EXPECT_EQ(b.scales, 92);
  EXPECT_EQ(b.rest, 11936);
  // Two expert-parallel devices: half the experts each (5760 FP8 bytes and 6 scales less).
  b = plan::CountFp8WeightBytes(*c, 2, 2);
  EXPECT_EQ(b.fp8, 24960 - 5760);
  EXPECT_EQ(b.scales, 92 - 24);
  EXPECT_EQ(b.rest, 11936);
  // v_proj left in bf16 by the list: its 2 x 640 parameters move to the rest at 2 bytes each.
  d.config["quantization_config"]["modules_to_not_convert"] = {"model.layers.*.self_attn.v_proj"};
  c = ParseModelConfig(d.config);
  ASSERT_TRUE(c.ok()) << c.status();
  b = plan::CountFp8WeightBytes(*c, 2, 1);
  EXPECT_EQ(b.fp8, 24960 - 1280);
  EXPECT_EQ(b.scales, 92 - 8);
  EXPECT_EQ(b.rest, 11936 + 2 * 1280);
  // The loader agrees: the FP8 parameters and scale buffers of the model kept in FP8.
  d.config["quantization_config"]["modules_to_not_convert"] = json::array();
  const fs::path dir = Write(d, "fp8_plan");
  auto model = LoadModel(dir.string(), Options(Fp8Weights::kKeep, torch::kBFloat16));
  ASSERT_TRUE(model.ok()) << model.status();
  int64_t fp8 = 0, scales = 0;
  for (const auto& p : (*model)->named_parameters())
    if (p.value().scalar_type() == torch::kFloat8_e4m3fn) fp8 += p.value().nbytes();
  for (const auto& bf : (*model)->named_buffers())
    if (bf.key().find("_scale_inv") != std::string::npos) scales += bf.value().nbytes();
  EXPECT_EQ(fp8, 24960);
  EXPECT_EQ(scales, 92);
  fs::remove_all(dir);
}

lm::ModelConfig ShippedConfig(const std::string& file) {
  auto c = ctl::ReadModelConfigFile(std::string(OPD_SOURCE_DIR) + "/configs/models/" + file);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : lm::ModelConfig{};
}

// Qwen3-Next-80B-A3B in FP8 on one H200: 148 GiB of bf16 weights need two devices; in FP8 the
// converted linear layers (all but the LM head, the embedding, the routers and the shared
// experts' gates) take one byte per parameter and the model fits one with room for a bucket.
TEST(Fp8Plan, Qwen3Next80bFp8FitsOneH200) {
  const lm::ModelConfig next = ShippedConfig("fp8/qwen3_next_80b_a3b_instruct_fp8.json");
  ASSERT_TRUE(next.fp8.has_value());
  plan::TeacherSettings t;
  EXPECT_TRUE(plan::CheckTeacherFits(next, t, 139 * plan::kGiB).ok());
  const plan::Fp8WeightBytes b = plan::CountFp8WeightBytes(next, 2, 1);
  std::printf("Qwen3-Next-80B-A3B FP8: %s FP8 + %s scales + %s rest = %s\n",
              plan::FormatGiB(b.fp8).c_str(), plan::FormatGiB(b.scales).c_str(),
              plan::FormatGiB(b.rest).c_str(), plan::FormatGiB(b.total()).c_str());
  EXPECT_LT(b.total(), 80 * plan::kGiB);
  EXPECT_GT(b.fp8, 70 * plan::kGiB);
  // scales: 4 bytes per 16384 weights
  EXPECT_NEAR(static_cast<double>(b.scales), 4.0 * b.fp8 / 16384, 0.02 * b.scales);
  t.fp8_weights = false;  // the same config with its FP8 weights dequantized: two devices
  ExpectError(plan::CheckTeacherFits(next, t, 139 * plan::kGiB),
              absl::StatusCode::kResourceExhausted, {"'weights (bf16)'"});
}

#ifdef OPD_FP8_PLAN_CLI
// opd-ctl plan reads the stage's FP8 teacher config and plans the 80B teacher on one device.
TEST(Fp8Plan, OpdCtlPlanTakesAnFp8TeacherConfig) {
  const std::string src = OPD_SOURCE_DIR, log = testing_util::TestDir().string() + "/plan.log";
  const std::string cmd = std::string(OPD_BINARY_DIR) + "/ctl/opd-ctl plan --config " + src +
                          "/configs/opd/marco_nano.yaml --model-config " + src +
                          "/configs/models/marco_nano.json --teacher-config " + src +
                          "/configs/models/qwen3_30b_a3b_instruct_2507.json," + src +
                          "/configs/models/fp8/qwen3_next_80b_a3b_instruct_fp8.json > " + log +
                          " 2>&1";
  EXPECT_EQ(testing_util::Shell(cmd), 0);
  const std::string out = testing_util::ReadFile(log);
  for (const char* want : {"teacher qwen3_next_80b_a3b", "FP8 linear layers + block scales",
                           "FP8 checkpoint:", "of block scales"})
    EXPECT_TRUE(Contains(out, want)) << want << "\n" << out;
  EXPECT_FALSE(Contains(out, "1/2 of the experts")) << out;  // one device per replica
}
#endif

// ---------------------------------------------------------------------------------------------
// CUDA (compute capability 8.9+)

// A linear layer and a MoE layer of the FP8 fixture on the GPU against the twin, fp32 activations
// (so that only the kernels differ): the linear within the GEMM bound's order (relative 2^-10 of
// the layer), the experts within one e4m3 rounding (2^-4 relative) where the SwiGLU's device exp
// moved a quantization step.
TEST(Fp8Cuda, LayersAgainstTheTwin) {
  GPU_FP8_KERNELS_OR_SKIP(gpu);
  (void)gpu;
  auto cpu_model = LoadModel(kFixtures + "/fp8_moe/model", Options(Fp8Weights::kKeep));
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  LoadOptions on_gpu = Options(Fp8Weights::kKeep);
  on_gpu.device = Gpu();
  auto gpu_model = LoadModel(kFixtures + "/fp8_moe/model", on_gpu);
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  torch::NoGradGuard no_grad;
  auto cm = (*cpu_model)->named_modules(), gm = (*gpu_model)->named_modules();
  auto* cl = cm["model.layers.0.self_attn.q_proj"]->as<LinearImpl>();
  auto* gl = gm["model.layers.0.self_attn.q_proj"]->as<LinearImpl>();
  ASSERT_TRUE(cl->weight_scale_inv.defined() && gl->weight_scale_inv.defined());
  torch::manual_seed(15);
  auto x = torch::randn({33, cl->weight.size(1)});
  auto yc = cl->forward(x), yg = gl->forward(x.to(Gpu())).cpu();
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    return ((a - b).norm() / b.norm()).item<double>();
  };
  EXPECT_LE(rel(yg, yc), std::ldexp(1.0, -10)) << "q_proj";
  auto* cb = cm["model.layers.0.mlp"]->as<SparseMoeBlockImpl>();
  auto* gb = gm["model.layers.0.mlp"]->as<SparseMoeBlockImpl>();
  auto xe = torch::randn({45, cl->weight.size(1)});
  Routing r = Route(xe, cb->gate->weight, cb->top_k, cb->norm_topk_prob);
  auto ec = Fp8MoeExperts(xe, r.ids, r.weights, *cb->experts);
  auto eg = Fp8MoeExperts(xe.to(Gpu()), r.ids.to(Gpu()), r.weights.to(Gpu()), *gb->experts).cpu();
  EXPECT_LE(rel(eg, ec), std::ldexp(1.0, -4)) << "experts";
}

// The whole model in FP8 on the GPU (bf16 activations) against the same checkpoint dequantized
// to bf16 on the GPU: within the FP8 rule against transformers' fp32 reference, and no further
// from the bf16 path than twice the CPU twin's distance from fp32 (the FP8 error this model has)
// plus the bf16 path's own distance from fp32 (tests/bf16_test.cc's yardstick, at least 1e-2).
TEST_P(Fp8Fixture, GpuFp8AgainstDequantizedBf16) {
  GPU_FP8_KERNELS_OR_SKIP(gpu);
  (void)gpu;
  const Reference ref = LoadReference(Dir());
  LoadOptions fp8 = Options(Fp8Weights::kAuto, torch::kBFloat16), bf16 = fp8;
  fp8.device = bf16.device = Gpu();
  bf16.fp8 = Fp8Weights::kDequantize;
  auto m8 = LoadModel(ModelDir(), fp8);
  ASSERT_TRUE(m8.ok()) << m8.status();
  EXPECT_GT(Fp8Parameters(**m8), 5) << "kAuto keeps FP8 on an FP8-capable device";
  auto m16 = LoadModel(ModelDir(), bf16);
  ASSERT_TRUE(m16.ok()) << m16.status();
  EXPECT_EQ(Fp8Parameters(**m16), 0);
  auto twin = LoadModel(ModelDir(), Options(Fp8Weights::kKeep));
  ASSERT_TRUE(twin.ok()) << twin.status();
  const auto lp8 = RunModel(**m8, ref).second.cpu(), lp16 = RunModel(**m16, ref).second.cpu();
  const double cpu_fp8 = MaxAbsDiff(RunModel(**twin, ref).second, ref.logprobs);
  const double bf16_own = MaxAbsDiff(lp16, ref.logprobs);
  const double gpu_fp8 = MaxAbsDiff(lp8, lp16);
  std::printf(
      "%s on the GPU: FP8 vs dequantized bf16 max |d log-prob| %.4f (CPU twin vs fp32 "
      "%.4f, bf16 vs fp32 %.4f)\n",
      GetParam().c_str(), gpu_fp8, cpu_fp8, bf16_own);
  EXPECT_LE(WorstRuleRatio(lp8, ref.logprobs), 1.0);
  EXPECT_LE(gpu_fp8, 2 * cpu_fp8 + std::max(1e-2, bf16_own));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Fp8Fixture, ::testing::ValuesIn(kFixtureNames),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace lm
