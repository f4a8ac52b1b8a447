// The Qwen3-MoE / Qwen3 model beyond its parity with transformers (tests/parity_test.cc), on the
// tiny random models that tests/python/make_fixtures.py builds: loading and saving HF model
// directories, the config, the MoE and CPU kernel paths, log-probs, expected shapes. fp32 on the
// CPU; each test states its tolerance.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/cpu/cpu_inference.h"
#include "kernels/cpu/cpu_kernels.h"
#include "lm/io/hf_model_dir.h"
#include "lm/io/sharded_load.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/fast_paths.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/util/memory.h"
#include "lm/util/threads.h"
#include "nlohmann/json.hpp"
#include "tests/tensor_testing.h"
#include "tests/testing.h"

using testing_util::MaxAbsDiff;
using testing_util::TempDir;

namespace lm {
namespace {

namespace fs = std::filesystem;

struct Fixture {
  std::string dir;
  std::vector<std::vector<int64_t>> seqs;
  std::map<std::string, torch::Tensor> ref;
};

Fixture LoadFixture(const std::string& name) {
  Fixture f;
  f.dir = std::string(OPD_FIXTURES_DIR) + "/" + name;
  std::ifstream in(f.dir + "/inputs.json");
  f.seqs = nlohmann::json::parse(in)["sequences"].get<std::vector<std::vector<int64_t>>>();
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

TEST(SharedPrefill, RepeatedCacheSlotsDecodeIdentically) {
  torch::NoGradGuard no_grad;
  auto model = MustLoad(std::string(OPD_FIXTURES_DIR) + "/moe_tied_topk8/model");
  ASSERT_TRUE(model);
  KVCache cache = model->NewKVCache(1, 16);
  ForwardOptions opts;
  opts.cache = &cache;
  model->Forward(PackedBatch::FromSequences({{1, 2, 3, 4}}), opts);
  KVCache two = cache.RepeatInterleave(2);
  ASSERT_EQ(two.batch(), 2);
  auto h = model->Decode(torch::tensor({5, 5}, torch::kInt64), two);
  EXPECT_TRUE(torch::equal(h[0], h[1]));
  auto ref = model->Logits(model->Forward(PackedBatch::FromSequences({{1, 2, 3, 4, 5}})));
  EXPECT_LE(MaxAbsDiff(model->Logits(h[0].unsqueeze(0)), ref.narrow(0, 4, 1)), 1e-4);
}

// C++ saves (sharded, to exercise the index), transformers loads and reproduces the logits.
TEST(RoundTrip, CppSavesTransformersLoads) {
  for (const std::string name : {"moe_tied_topk8", "moe_mlp_only_gqa4", "dense_qwen3"}) {
    const std::string fixture = std::string(OPD_FIXTURES_DIR) + "/" + name;
    auto model = MustLoad(fixture + "/model");
    ASSERT_TRUE(model);
    auto dir = TempDir(name);
    SaveOptions so;
    so.max_shard_bytes = 64 * 1024;  // several shards even for a tiny model
    ASSERT_TRUE(SaveModel(*model, dir.string(), so).ok());
    EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
    const std::string cmd = std::string(OPD_PYTHON) + " " + OPD_SOURCE_DIR +
                            "/tests/python/check_model.py --model " + dir.string() + " --fixture " +
                            fixture;
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    // And we load our own output back to identical parameters.
    auto again = MustLoad(dir.string());
    ASSERT_TRUE(again);
    auto a = model->named_parameters(), b = again->named_parameters();
    for (const auto& p : a) EXPECT_TRUE(torch::equal(p.value(), b[p.key()])) << p.key();
    fs::remove_all(dir);
  }
}

// A checkpoint in the fused in-memory layout (experts.gate_up_proj / experts.down_proj) loads too.
TEST(Checkpoint, FusedExpertLayoutLoads) {
  const std::string fixture = std::string(OPD_FIXTURES_DIR) + "/moe_many_experts/model";
  auto model = MustLoad(fixture);
  ASSERT_TRUE(model);
  auto dir = TempDir("fused");
  fs::copy_file(fixture + "/config.json", dir / "config.json");
  std::vector<TensorToWrite> tensors;
  std::vector<torch::Tensor> keep;
  for (const auto& p : model->named_parameters()) {
    keep.push_back(p.value().contiguous());
    tensors.push_back({p.key(), DType::kF32, keep.back().sizes().vec(), keep.back().data_ptr(),
                       static_cast<size_t>(keep.back().nbytes())});
  }
  ASSERT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), tensors).ok());
  auto again = MustLoad(dir.string());
  ASSERT_TRUE(again);
  for (const auto& p : model->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), again->named_parameters()[p.key()])) << p.key();
  }
  fs::remove_all(dir);
}

// Rewrites the fixture checkpoint with one edit and returns the load error.
absl::Status LoadEdited(
    const std::string& tag,
    const std::function<void(std::vector<std::pair<std::string, torch::Tensor>>&)>& edit,
    const LoadOptions& opts = {}) {
  const std::string fixture = std::string(OPD_FIXTURES_DIR) + "/moe_tied_topk8/model";
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
  auto m = LoadModel(dir.string(), opts);
  fs::remove_all(dir);
  return m.status();
}

TEST(Checkpoint, MissingTensorIsNamed) {
  auto st = LoadEdited("missing", [](auto& ts) {
    ts.erase(
        std::remove_if(ts.begin(), ts.end(),
                       [](auto& p) { return p.first == "model.layers.1.self_attn.k_norm.weight"; }),
        ts.end());
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(st.message().find("model.layers.1.self_attn.k_norm.weight"), std::string::npos) << st;
}

TEST(Checkpoint, MissingExpertIsNamed) {
  auto st = LoadEdited("missing_expert", [](auto& ts) {
    ts.erase(std::remove_if(
                 ts.begin(), ts.end(),
                 [](auto& p) { return p.first == "model.layers.0.mlp.experts.3.up_proj.weight"; }),
             ts.end());
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(st.message().find("model.layers.0.mlp.experts.gate_up_proj"), std::string::npos) << st;
}

TEST(Checkpoint, WrongShapeIsNamed) {
  auto st = LoadEdited("shape", [](auto& ts) {
    for (auto& [n, t] : ts) {
      if (n == "model.layers.0.self_attn.q_proj.weight") t = torch::zeros({3, 5});
    }
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << st;
  EXPECT_NE(st.message().find("[3, 5]"), std::string::npos) << st;
}

TEST(Checkpoint, UnexpectedTensorIsNamed) {
  auto st = LoadEdited("unexpected", [](auto& ts) {
    ts.emplace_back("model.layers.0.mystery.weight", torch::zeros({2}));
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.layers.0.mystery.weight"), std::string::npos) << st;
}

TEST(Checkpoint, TruncatedFileIsAnError) {
  const std::string fixture = std::string(OPD_FIXTURES_DIR) + "/moe_tied_topk8/model";
  auto dir = TempDir("truncated");
  fs::copy_file(fixture + "/config.json", dir / "config.json");
  fs::copy_file(fixture + "/model.safetensors", dir / "model.safetensors");
  fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") - 100);
  auto m = LoadModel(dir.string());
  EXPECT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("model.safetensors"), std::string::npos) << m.status();
  fs::remove_all(dir);
}

// --- checkpoint loading on a hand-made parameter set (no fixtures needed) ---

// A fused MoE block of 8 experts (gate_up [8, 4, 3], down [8, 3, 2]) plus a norm, as the model
// exposes its parameters to LoadParameters.
std::map<std::string, torch::Tensor> MoeParams() {
  return {{"m.mlp.experts.gate_up_proj", torch::zeros({8, 4, 3})},
          {"m.mlp.experts.down_proj", torch::zeros({8, 3, 2})},
          {"m.norm.weight", torch::zeros({3})}};
}

// One checkpoint tensor: a name and a value whose entries identify it (for the copy checks).
struct NamedTensor {
  std::string name;
  torch::Tensor value;
};

// Every per-expert tensor of MoeParams() in the published layout, value = 1 + expert.
std::vector<NamedTensor> PerExpertTensors() {
  std::vector<NamedTensor> ts = {{"m.norm.weight", torch::ones({3})}};
  for (int e = 0; e < 8; ++e) {
    const std::string base = "m.mlp.experts." + std::to_string(e);
    ts.push_back({base + ".gate_proj.weight", torch::full({2, 3}, 1.0f + e)});
    ts.push_back({base + ".up_proj.weight", torch::full({2, 3}, 1.0f + e)});
    ts.push_back({base + ".down_proj.weight", torch::full({3, 2}, 1.0f + e)});
  }
  return ts;
}

void WriteShard(const fs::path& path, const std::vector<NamedTensor>& ts) {
  std::vector<TensorToWrite> out;
  for (const auto& t : ts)
    out.push_back({t.name, DType::kF32, t.value.sizes().vec(), t.value.data_ptr(),
                   static_cast<size_t>(t.value.nbytes())});
  ASSERT_TRUE(WriteSafetensors(path.string(), out).ok()) << path;
}

// Writes `shards` (file name -> tensors) and their index into `dir`, then loads MoeParams().
absl::Status LoadShards(const fs::path& dir,
                        const std::map<std::string, std::vector<NamedTensor>>& shards) {
  nlohmann::json index = {{"metadata", nlohmann::json::object()},
                          {"weight_map", nlohmann::json::object()}};
  for (const auto& [file, ts] : shards) {
    WriteShard(dir / file, ts);
    for (const auto& t : ts) index["weight_map"][t.name] = file;
  }
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  auto files = OpenCheckpointFiles(dir.string());
  if (!files.ok()) return files.status();
  auto params = MoeParams();
  return LoadParameters(*files, params, {}, {}).status();
}

TEST(CheckpointFiles, ShardedPerExpertTensorsFillTheFusedParameters) {
  auto dir = TempDir("ckpt_ok");
  auto ts = PerExpertTensors();
  const std::vector<NamedTensor> first(ts.begin(), ts.begin() + 10),
      second(ts.begin() + 10, ts.end());
  ASSERT_TRUE(LoadShards(dir, {{"a.safetensors", first}, {"b.safetensors", second}}).ok());
  auto files = OpenCheckpointFiles(dir.string());
  ASSERT_TRUE(files.ok()) << files.status();
  auto params = MoeParams();
  auto report = LoadParameters(*files, params, {}, {});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->tensors_loaded, 25);
  for (int e = 0; e < 8; ++e) {
    EXPECT_TRUE(
        torch::equal(params["m.mlp.experts.gate_up_proj"][e], torch::full({4, 3}, 1.0f + e)));
    EXPECT_TRUE(torch::equal(params["m.mlp.experts.down_proj"][e], torch::full({3, 2}, 1.0f + e)));
  }
  fs::remove_all(dir);
}

// An expert index that does not fit int64 used to throw std::out_of_range out of the loader; one
// that fits but exceeds num_experts was already an error. Both name the tensor. A very long name
// used to go through a recursive std::regex.
TEST(CheckpointFiles, HugeExpertIndexIsANamedError) {
  for (const std::string index : {"99999999999", "99999999999999999999", "8"}) {
    auto dir = TempDir("ckpt_huge");
    auto ts = PerExpertTensors();
    const std::string name = "m.mlp.experts." + index + ".gate_proj.weight";
    ts.push_back({name, torch::zeros({2, 3})});
    auto st = LoadShards(dir, {{"model.safetensors", ts}});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(name), std::string::npos) << st;
    EXPECT_NE(st.message().find("expert index " + index), std::string::npos) << st;
    fs::remove_all(dir);
  }
  auto dir = TempDir("ckpt_long");
  auto ts = PerExpertTensors();
  const std::string name = std::string(200000, 'x') + ".mlp.experts.1.up_proj.weight";
  ts.push_back({name, torch::zeros({2, 3})});
  auto st = LoadShards(dir, {{"model.safetensors", ts}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("unexpected tensor"), std::string::npos);
  fs::remove_all(dir);
}

// Expert 3's gate_proj twice (in two shards) and expert 5's absent: counting slices saw 16 of 16
// and loaded a model with expert 5's gate rows left at zero. Now the duplicate is named, and so is
// the missing slice once the duplicate is gone.
TEST(CheckpointFiles, DuplicateExpertSliceIsNamedAndCannotHideAMissingOne) {
  auto dir = TempDir("ckpt_dup");
  auto ts = PerExpertTensors();
  std::vector<NamedTensor> first, second;
  for (const auto& t : ts) {
    if (t.name == "m.mlp.experts.5.gate_proj.weight") continue;
    (t.name.rfind("m.mlp.experts.3.", 0) == 0 ? second : first).push_back(t);
  }
  first.push_back({"m.mlp.experts.3.gate_proj.weight", torch::zeros({2, 3})});
  auto st = LoadShards(dir, {{"a.safetensors", first}, {"b.safetensors", second}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("expert 3 gate_proj of 'm.mlp.experts.gate_up_proj'"),
            std::string::npos)
      << st;
  EXPECT_NE(st.message().find("duplicate"), std::string::npos) << st;
  fs::remove_all(dir);

  // Without the duplicate: the missing slice is named.
  dir = TempDir("ckpt_missing");
  first.pop_back();
  st = LoadShards(dir, {{"a.safetensors", first}, {"b.safetensors", second}});
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_NE(st.message().find("m.mlp.experts.gate_up_proj (expert 5 gate_proj)"), std::string::npos)
      << st;
  fs::remove_all(dir);

  // A fused tensor and per-expert slices of the same parameter are duplicates too.
  dir = TempDir("ckpt_mixed");
  ts.push_back({"m.mlp.experts.down_proj", torch::zeros({8, 3, 2})});
  st = LoadShards(dir, {{"model.safetensors", ts}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("duplicate"), std::string::npos) << st;
  fs::remove_all(dir);
}

// Shard names in model.safetensors.index.json come from the file: an absolute path, a ".."
// component or a symbolic link out of the directory used to be opened wherever they pointed.
TEST(CheckpointFiles, ShardNamesAreConfinedToTheModelDirectory) {
  auto outside = TempDir("ckpt_outside");
  WriteShard(outside / "evil.safetensors", PerExpertTensors());
  auto dir = TempDir("ckpt_confined");
  fs::create_directories(dir / "sub");
  const std::string evil = outside.filename().string() + "/evil.safetensors";
  for (const std::string& shard : std::vector<std::string>{
           (outside / "evil.safetensors").string(), "../" + evil, "sub/../../" + evil,
           "link.safetensors", "sub/link.safetensors", ""}) {
    fs::remove(dir / "link.safetensors");
    fs::remove(dir / "sub" / "link.safetensors");
    fs::create_symlink(outside / "evil.safetensors", dir / "link.safetensors");
    fs::create_symlink(outside / "evil.safetensors", dir / "sub" / "link.safetensors");
    nlohmann::json index = {{"weight_map", {{"m.norm.weight", shard}}}};
    std::ofstream(dir / "model.safetensors.index.json") << index.dump();
    auto files = OpenCheckpointFiles(dir.string());
    ASSERT_FALSE(files.ok()) << "shard '" << shard << "' was opened";
    EXPECT_EQ(files.status().code(), absl::StatusCode::kInvalidArgument) << files.status();
    EXPECT_NE(files.status().message().find("\"m.norm.weight\""), std::string::npos)
        << files.status();
    EXPECT_NE(files.status().message().find("model.safetensors.index.json"), std::string::npos)
        << files.status();
  }
  // A link that stays inside the directory, and a subdirectory, are fine.
  WriteShard(dir / "sub" / "real.safetensors", PerExpertTensors());
  fs::create_symlink("sub/real.safetensors", dir / "inside.safetensors");
  for (const std::string shard : {"inside.safetensors", "sub/real.safetensors"}) {
    nlohmann::json index = {{"weight_map", {{"m.norm.weight", shard}}}};
    std::ofstream(dir / "model.safetensors.index.json") << index.dump();
    auto files = OpenCheckpointFiles(dir.string());
    EXPECT_TRUE(files.ok()) << shard << ": " << files.status();
  }
  fs::remove_all(dir);
  fs::remove_all(outside);
}

// A Hugging Face cache snapshot: the shards are links into the repository's blobs/, which load;
// a link from the snapshot anywhere else is still refused.
TEST(CheckpointFiles, HuggingFaceCacheSnapshotsLoad) {
  auto repo = TempDir("models--org--name");
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "snapshots" / "abc123");
  WriteShard(repo / "blobs" / "0f1e2d", PerExpertTensors());
  const fs::path snapshot = repo / "snapshots" / "abc123";
  fs::create_symlink("../../blobs/0f1e2d", snapshot / "model-00001-of-00001.safetensors");
  nlohmann::json index = {{"weight_map", {{"m.norm.weight", "model-00001-of-00001.safetensors"}}}};
  std::ofstream(snapshot / "model.safetensors.index.json") << index.dump();
  auto files = OpenCheckpointFiles(snapshot.string());
  EXPECT_TRUE(files.ok()) << files.status();

  auto outside = TempDir("ckpt_outside_cache");
  WriteShard(outside / "evil.safetensors", PerExpertTensors());
  fs::create_symlink(outside / "evil.safetensors", snapshot / "evil.safetensors");
  index = {{"weight_map", {{"m.norm.weight", "evil.safetensors"}}}};
  std::ofstream(snapshot / "model.safetensors.index.json") << index.dump();
  files = OpenCheckpointFiles(snapshot.string());
  EXPECT_FALSE(files.ok()) << "a link out of the cache repository was opened";
  fs::remove_all(repo);
  fs::remove_all(outside);
}

TEST(Config, ParsesEveryField) {
  auto j = nlohmann::json::parse(R"({
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000000, "max_position_embeddings": 262144,
    "tie_word_embeddings": false, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": true, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "rope_scaling": null})");
  auto c = ParseModelConfig(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);  // not hidden/heads = 64
  EXPECT_EQ(c->rope_theta, 1e7);
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_TRUE(c->IsMoeLayer(0));
  EXPECT_EQ(c->max_position_embeddings, 262144);
}

TEST(Config, RopeThetaInsideRopeParametersAndSparseStep) {
  auto j = nlohmann::json::parse(R"({"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 8,
    "intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}})");
  auto c = ParseModelConfig(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->head_dim, 4);
  EXPECT_EQ(c->num_experts, 4);
  EXPECT_FALSE(c->IsMoeLayer(0));
  EXPECT_TRUE(c->IsMoeLayer(1));
  EXPECT_FALSE(c->IsMoeLayer(3));  // in mlp_only_layers
}

TEST(Config, UnsupportedThingsAreErrors) {
  const std::string base =
      R"("vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2)";
  auto parse = [&](const std::string& extra) {
    return ParseModelConfig(nlohmann::json::parse("{" + base + "," + extra + "}")).status();
  };
  auto st = parse(R"("model_type": "llama")");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("llama"), std::string::npos);
  st = parse(R"("model_type": "qwen3", "rope_scaling": {"rope_type": "yarn", "factor": 4.0})");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(st.message().find("yarn"), std::string::npos);
  st = parse(R"("model_type": "qwen3", "num_key_value_heads": 3)");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  st = parse(R"("model_type": "qwen3", "hidden_act": "gelu")");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  st = ParseModelConfig(nlohmann::json::parse(R"({"model_type": "qwen3"})")).status();
  EXPECT_NE(st.message().find("vocab_size"), std::string::npos);
}

// The experts path runs only experts that received tokens and equals a plain dense loop.
TEST(Moe, SortedGroupedPathEqualsPlainLoop) {
  torch::manual_seed(0);
  const int64_t T = 37, H = 16, I = 8, E = 12, k = 3;
  auto x = torch::randn({T, H}, torch::requires_grad());
  auto gu = torch::randn({E, 2 * I, H}, torch::requires_grad());
  auto dn = torch::randn({E, H, I}, torch::requires_grad());
  auto logits = torch::randn({T, E});
  logits.narrow(1, 5, 4).fill_(-1e4);  // experts 5..8 receive no tokens
  auto [w, ids] = torch::softmax(logits, -1).topk(k, -1);
  auto y = MoeExpertsCpu(x, ids, w, gu, dn);
  auto ref = torch::zeros({T, H});
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t][j].item<int64_t>();
      auto g = torch::mv(gu[e].narrow(0, 0, I), x[t]), u = torch::mv(gu[e].narrow(0, I, I), x[t]);
      ref[t] += w[t][j] * torch::mv(dn[e], torch::silu(g) * u);
    }
  }
  EXPECT_LE(MaxAbsDiff(y, ref), 1e-4);
  auto gy = torch::randn({T, H});
  auto grads = torch::autograd::grad({y}, {x, gu, dn}, {gy});
  auto gref = torch::autograd::grad({ref}, {x, gu, dn}, {gy});
  for (int i = 0; i < 3; ++i) EXPECT_LE(MaxAbsDiff(grads[i], gref[i]), 1e-3) << i;
  EXPECT_EQ(grads[1].narrow(0, 5, 4).abs().sum().item<double>(), 0.0);  // idle experts: no gradient
}

// The few-row kernel behind the fused decode experts: every remainder of the 4-row and 2-column
// tiles, strided rows, and a K long enough to use many vector steps.
TEST(CpuKernels, MatmulWeightTEqualsLibraryMatmul) {
  if (!cpu::HasAvx2Fma()) GTEST_SKIP() << "no AVX2/FMA on this CPU";
  torch::manual_seed(2);
  for (int64_t m : {1, 2, 3, 4, 5, 7, 9, 33}) {
    for (int64_t N : {1, 2, 63, 130}) {
      for (int64_t K : {8, 64, 520}) {
        auto a = torch::randn({m, K + 8}).narrow(1, 0, K);  // rows K + 8 floats apart
        auto w = torch::randn({N, K});
        auto out = torch::full({m, N + 3}, 7.0f);
        cpu::MatmulWeightT(a.data_ptr<float>(), K + 8, m, w.data_ptr<float>(), N, K,
                           out.data_ptr<float>(), N + 3);
        auto ref = torch::mm(a, w.t());
        EXPECT_LE(MaxAbsDiff(out.narrow(1, 0, N), ref), 2e-5 * std::sqrt(double(K)))
            << m << "x" << N << "x" << K;
        EXPECT_TRUE(torch::all(out.narrow(1, N, 3) == 7.0f).item<bool>()) << "wrote past N";
      }
    }
  }
}

// The LM head packed for decode: every row remainder of the 6-row tile, a last panel that is
// partly padding, and a K that is not a multiple of 8.
TEST(CpuKernels, PackedLinearEqualsLibraryMatmul) {
  if (!cpu::HasAvx2Fma()) GTEST_SKIP() << "no AVX2/FMA on this CPU";
  torch::manual_seed(4);
  for (int64_t N : {1, 16, 37, 1000}) {
    for (int64_t K : {5, 64, 520}) {
      auto w = torch::randn({N, K});
      auto packed = PackedLinear::Pack(w);
      ASSERT_TRUE(packed.has_value());
      for (int64_t m : {1, 5, 6, 7, 13, 64}) {
        auto x = torch::randn({m, K});
        EXPECT_LE(MaxAbsDiff((*packed)(x), torch::mm(x, w.t())), 2e-5 * std::sqrt(double(K)))
            << m << "x" << N << "x" << K;
      }
      EXPECT_THROW((*packed)(torch::randn({2, K + 1})), c10::Error);  // wrong width
    }
  }
  EXPECT_FALSE(PackedLinear::Pack(torch::randn({4, 8}, torch::kFloat64)).has_value());
}

// The scoring log-sum-exp (two reads, polynomial exp) against the library's, on lengths that end
// in every vector remainder, across the range of logits, with -inf entries, and on a vocabulary-
// sized row; all rows of a strided [rows, V] view in parallel.
TEST(CpuKernels, LogSumExpEqualsLibrary) {
  if (!cpu::HasAvx2Fma()) GTEST_SKIP() << "no AVX2/FMA on this CPU";
  torch::manual_seed(4);
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 33, 1023, 1024, 1025, 4099, 151936}) {
    for (double scale : {0.1, 10.0, 60.0}) {
      auto x = torch::randn({n}) * scale;
      const double want = torch::logsumexp(x.to(torch::kFloat64), 0).item<double>();
      const double got = cpu::LogSumExp(x.data_ptr<float>(), n);
      // fp32 rounding of x - max is ~6e-8 |max|; the sum's own error is far below 1e-6.
      EXPECT_NEAR(got, want, 1e-6 + 1e-7 * std::abs(want)) << "n=" << n << " x" << scale;
    }
  }
  // The exp itself, through log(1 + exp(d)) on a vector of [0, d, -inf...]: its error shows
  // undiluted (about half its relative error), across the polynomial's whole range.
  for (float d = -6.0f; d <= 0.0f; d += 0.01f) {
    float x8[8] = {0.0f, d, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    EXPECT_NEAR(cpu::LogSumExp(x8, 8), std::log1p(std::exp(double{d})), 3e-7) << "d=" << d;
  }
  auto x = torch::randn({100});
  x.narrow(0, 10, 50).fill_(-INFINITY);
  EXPECT_NEAR(cpu::LogSumExp(x.data_ptr<float>(), 100), torch::logsumexp(x, 0).item<float>(), 1e-5);
  x.fill_(-INFINITY);
  EXPECT_EQ(cpu::LogSumExp(x.data_ptr<float>(), 100), -INFINITY);

  auto wide = torch::randn({6, 3000}) * 5;
  auto rows = wide.narrow(1, 0, 2999);  // rows 3000 floats apart
  ASSERT_TRUE(UseCpuLogSumExpRows(rows));
  EXPECT_LE(MaxAbsDiff(LogSumExpRowsCpu(rows), torch::logsumexp(rows, 1)), 1e-5);
  EXPECT_FALSE(UseCpuLogSumExpRows(wide.t()));  // columns are not rows
}

// The SwiGLU activation of the experts, in place on [gate | up] rows: against the library's
// silu(gate) * up, with a width that leaves a scalar tail and gates far into both saturations.
TEST(CpuKernels, SiluMulEqualsLibrary) {
  torch::manual_seed(5);
  const int64_t m = 3, I = 21;
  auto gu = torch::randn({m, 2 * I}) * 4;
  gu[0][0] = 100.0f;
  gu[0][1] = -100.0f;
  gu[0][2] = -1000.0f;
  auto want = torch::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
  auto got = gu.clone();
  cpu::SiluMulInPlace(got.data_ptr<float>(), m, I);
  EXPECT_TRUE(torch::allclose(got.narrow(1, 0, I), want, 1e-6, 1e-6))
      << MaxAbsDiff(got.narrow(1, 0, I), want);
  EXPECT_TRUE(torch::equal(got.narrow(1, I, I), gu.narrow(1, I, I)));  // up untouched
}

// A thread limited to one compute thread must not start an OpenMP pool from the kernels that
// run at::parallel_for inline (cpu_inference.cc keeps its own copy of LibTorch's lazy thread-count
// initialisation): a pool's idle workers make every other pool's barriers sleep (threads.h).
TEST(CpuKernels, OneThreadSettingHoldsForInlineParallelLoops) {
  if (!cpu::HasAvx2Fma()) GTEST_SKIP() << "no AVX2/FMA on this CPU";
  if (torch::get_num_threads() < 2) GTEST_SKIP() << "needs 2 or more threads";
  torch::set_num_threads(torch::get_num_threads());  // an explicit setting, as the services make
  auto count_threads = [] {
    return std::distance(std::filesystem::directory_iterator("/proc/self/task"),
                         std::filesystem::directory_iterator{});
  };
  std::ptrdiff_t before = 0, after = 0;
  std::thread t([&] {
    SetThreadsForThisThread(1);
    before = count_threads();
    auto packed = PackedLinear::Pack(torch::randn({4096, 64}));
    ASSERT_TRUE(packed.has_value());
    after = count_threads();
  });
  t.join();
  EXPECT_EQ(after, before) << "PackedLinear::Pack started OpenMP workers on a 1-thread thread";
}

// Inference takes the expert-parallel CPU path (kernels/cpu/cpu_inference.h); it must equal the
// grouped-GEMM path the model is tested with, for any thread count, with idle experts, with rows
// that share an expert in several slots, at decode sizes (the streaming kernel), and at prefill
// sizes (the library GEMM, busy experts split into several tasks).
TEST(Moe, InferencePathEqualsGroupedPath) {
  if (!cpu::HasAvx2Fma()) GTEST_SKIP() << "no AVX2/FMA on this CPU";
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  const int64_t H = 64, I = 24, E = 12, k = 3;
  auto gu = torch::randn({E, 2 * I, H}) * 0.1, dn = torch::randn({E, H, I}) * 0.1;
  const int threads = torch::get_num_threads();
  for (int64_t T : {1, 5, 32, 64, 700}) {
    auto x = torch::randn({T, H});
    auto logits = torch::randn({T, E});
    logits.narrow(1, 5, 4).fill_(-1e4);  // experts 5..8 receive no tokens
    auto [w, ids] = torch::softmax(logits, -1).topk(k, -1);
    auto ref = MoeExpertsCpu(x, ids, w, gu, dn);
    torch::set_num_threads(1);
    auto one = MoeExperts(x, ids, w, gu, dn);
    torch::set_num_threads(std::max(2, threads));
    auto many = MoeExperts(x, ids, w, gu, dn);
    EXPECT_LE(MaxAbsDiff(one, ref), 1e-5) << "T=" << T;
    EXPECT_TRUE(torch::equal(one, many)) << "T=" << T << ": depends on the thread count";
  }
  torch::set_num_threads(threads);
  // An id outside [0, E) is an error, not a read past the weights.
  auto x = torch::randn({2, H});
  auto bad = torch::tensor({{0, 1, 2}, {3, 4, 12}}, torch::kInt64);
  EXPECT_THROW(MoeExperts(x, bad, torch::ones({2, k}), gu, dn), c10::Error);
}

// kernels/cpu registers its paths for CPU tensors by itself (lm never names them), and the model
// ops dispatch to them: on fp32 inference inputs MoeExperts is the registered kernel's result
// bit for bit; with gradients needed it is the reference path (MoeExpertsCpu).
TEST(FastPaths, CpuKernelsRegisterThemselvesAndAreTaken) {
  const FastPaths& cpu_paths = FastPathsFor(torch::kCPU);
  ASSERT_NE(cpu_paths.moe_experts, nullptr);
  ASSERT_NE(cpu_paths.gated_delta_rule, nullptr);
  ASSERT_NE(cpu_paths.token_logprobs, nullptr);
  ASSERT_NE(cpu_paths.logsumexp_rows, nullptr);
  EXPECT_EQ(FastPathsFor(torch::kMeta).moe_experts, nullptr);
  if (!cpu::HasAvx2Fma()) GTEST_SKIP() << "no AVX2/FMA on this CPU";
  torch::manual_seed(4);
  const int64_t T = 9, H = 32, I = 16, E = 6, k = 2;
  auto x = torch::randn({T, H});
  auto gu = torch::randn({E, 2 * I, H}) * 0.1, dn = torch::randn({E, H, I}) * 0.1;
  auto [w, ids] = torch::softmax(torch::randn({T, E}), -1).topk(k, -1);
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(
        torch::equal(MoeExperts(x, ids, w, gu, dn), MoeExpertsInferenceCpu(x, ids, w, gu, dn)));
  }
  auto gu_train = gu.clone().requires_grad_(true);
  EXPECT_TRUE(
      torch::equal(MoeExperts(x, ids, w, gu_train, dn).detach(), MoeExpertsCpu(x, ids, w, gu, dn)));
}

TEST(Logprobs, ChunkedEqualsFullSoftmaxWithTemperatureAndGradients) {
  torch::manual_seed(1);
  auto h = torch::randn({50, 16}, torch::requires_grad());
  auto w = torch::randn({300, 16}, torch::requires_grad());
  auto t = torch::randint(0, 300, {50}, torch::kInt64);
  LogprobOptions o;
  o.temperature = 0.7;
  o.chunk_rows = 8;
  torch::Tensor ent;
  auto lp = TokenLogprobs(h, w, t, o, &ent);
  auto full = torch::log_softmax(torch::mm(h, w.t()) / 0.7, -1);
  auto ref = full.gather(1, t.unsqueeze(1)).squeeze(1);
  EXPECT_LE(MaxAbsDiff(lp, ref), 1e-5);
  EXPECT_LE(MaxAbsDiff(ent, -(full.exp() * full).sum(-1)), 1e-4);
  auto g = torch::randn({50});
  auto a = torch::autograd::grad({lp}, {h, w}, {g});
  auto b = torch::autograd::grad({ref}, {h, w}, {g});
  EXPECT_LE(MaxAbsDiff(a[0], b[0]), 1e-4);
  EXPECT_LE(MaxAbsDiff(a[1], b[1]), 1e-4);
  auto top = TopK(h.detach(), w.detach(), 5, o);
  auto [v, i] = full.topk(5, -1);
  EXPECT_TRUE(torch::equal(top.ids, i));
  EXPECT_LE(MaxAbsDiff(top.logprobs, v), 1e-5);
}

// Scoring without gradients takes the vocabulary-tiled path (kernels/cpu/cpu_inference.h); it must
// equal the full log-softmax across row blocks and vocabulary tiles (256 rows, 512 entries per
// tile: sizes on both sides of each), with a temperature, targets on tile edges, for any thread
// count, and refuse an out-of-range target.
TEST(Logprobs, InferencePathEqualsFullSoftmax) {
  if (!cpu::HasAvx2Fma()) GTEST_SKIP() << "no AVX2/FMA on this CPU";
  torch::NoGradGuard no_grad;
  torch::manual_seed(6);
  const int threads = torch::get_num_threads();
  for (int64_t N : {1, 7, 300}) {
    for (int64_t V : {100, 512, 1500}) {
      auto h = torch::randn({N, 32}), w = torch::randn({V, 32});
      auto t = torch::randint(0, V, {N}, torch::kInt64);
      t[0] = V - 1;
      if (N > 1) t[1] = std::min<int64_t>(V - 1, 512);
      ASSERT_TRUE(UseCpuInferenceLogprobs(h, w));
      LogprobOptions o;
      o.temperature = 0.7;
      auto full = torch::log_softmax(torch::mm(h, w.t()) / 0.7, -1);
      auto ref = full.gather(1, t.unsqueeze(1)).squeeze(1);
      torch::set_num_threads(1);
      auto one = TokenLogprobs(h, w, t, o);
      torch::set_num_threads(std::max(2, threads));
      auto many = TokenLogprobs(h, w, t, o);
      EXPECT_LE(MaxAbsDiff(one, ref), 2e-5) << "N=" << N << " V=" << V;
      EXPECT_TRUE(torch::equal(one, many)) << "N=" << N << " V=" << V << ": thread count";
    }
  }
  torch::set_num_threads(threads);
  auto h = torch::randn({2, 8}), w = torch::randn({10, 8});
  try {
    TokenLogprobsInferenceCpu(h, w, torch::tensor({3, 10}, torch::kInt64), 1.0);
    ADD_FAILURE() << "target 10 of a 10-word vocabulary accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("target id 10 out of range [0, 10)"), std::string::npos)
        << e.what();
  }
  torch::AutoGradMode grad(true);
  EXPECT_FALSE(UseCpuInferenceLogprobs(h.requires_grad_(), w));  // training keeps the chunked path
}

// opd-ctl logprobs prints, per input line, the log-probs transformers computed.
TEST(OpdCtl, LogprobsMatchesReference) {
  Fixture f = LoadFixture("moe_untied_top1_sparse2");
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
  int lines = 0;
  while (std::getline(out, line)) {
    auto v = nlohmann::json::parse(line)["logprobs"].get<std::vector<float>>();
    EXPECT_EQ(v.size(), f.seqs[lines].size() - 1);
    got.insert(got.end(), v.begin(), v.end());
    ++lines;
  }
  EXPECT_EQ(lines, static_cast<int>(f.seqs.size()));
  EXPECT_LE(MaxAbsDiff(torch::tensor(got), f.ref["logprobs"]), 1e-4);
  // Out-of-vocabulary ids are refused with a message naming the line.
  {
    std::ofstream bad(dir / "bad.jsonl");
    bad << R"({"tokens": [1, 2, 99999]})"
        << "\n";
  }
  const std::string bad_cmd = std::string(OPD_BINARY_DIR) + "/ctl/opd-ctl logprobs --model " +
                              f.dir + "/model --input " + (dir / "bad.jsonl").string() + " 2> " +
                              (dir / "err.txt").string();
  EXPECT_NE(std::system(bad_cmd.c_str()), 0);
  std::ifstream err(dir / "err.txt");
  std::string msg((std::istreambuf_iterator<char>(err)), {});
  EXPECT_NE(msg.find("bad.jsonl:1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("99999"), std::string::npos) << msg;
  fs::remove_all(dir);
}

// --- absurd configs, checkpoints that do not fit them, the memory budget, non-finite weights ---

// Small configs of every architecture and layer kind: dense and MoE layers (sparse step,
// mlp_only_layers), tied and untied, Qwen3-Next's linear and full attention with a shared expert.
std::vector<nlohmann::json> ShapeConfigs() {
  const auto qwen3 = nlohmann::json::parse(R"({"model_type": "qwen3", "vocab_size": 50,
    "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": true})");
  const auto moe = nlohmann::json::parse(R"({"model_type": "qwen3_moe", "vocab_size": 50,
    "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 1, "num_experts": 6, "num_experts_per_tok": 2,
    "moe_intermediate_size": 12, "decoder_sparse_step": 2, "mlp_only_layers": [3]})");
  const auto next = nlohmann::json::parse(R"({"model_type": "qwen3_next", "vocab_size": 50,
    "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 8, "partial_rotary_factor": 0.5,
    "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 4, "linear_value_head_dim": 6, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 10, "shared_expert_intermediate_size": 14,
    "mlp_only_layers": [1]})");
  return {qwen3, moe, next};
}

// ExpectedParameterShapes, from the config alone, names and sizes every parameter the
// constructors make: the checks before allocating rely on it.
TEST(ExpectedShapes, EqualTheConstructedModels) {
  for (const nlohmann::json& j : ShapeConfigs()) {
    for (const int ranks : {1, 2}) {
      auto config = ParseModelConfig(j);
      ASSERT_TRUE(config.ok()) << config.status();
      if (ranks > 1 && config->num_experts == 0) continue;
      ASSERT_TRUE(ShardConfig(*config, 1, ranks).ok());  // rank 1's experts: a row range
      auto model = CreateModel(*config);
      ASSERT_TRUE(model.ok()) << model.status();
      ParameterShapes built;
      for (const auto& p : (*model)->named_parameters()) built[p.key()] = p.value().sizes().vec();
      EXPECT_EQ(ExpectedParameterShapes(*config), built) << j.dump() << " ranks=" << ranks;
      int64_t numel = 0;
      for (const auto& p : (*model)->parameters()) numel += p.numel();
      EXPECT_EQ(ParameterCount(built), numel);
      EXPECT_EQ(ShapeBytes(built, 2), 2 * numel);
    }
  }
}

absl::Status ParseEdited(const nlohmann::json& base, const nlohmann::json& patch) {
  nlohmann::json j = base;
  j.merge_patch(patch);
  return ParseModelConfig(j).status();
}

// A size beyond any model used to be parsed and handed to the allocator (an uncaught c10::Error,
// exit 134 in every loader). Each bound is named in the error, and the bound itself is accepted.
TEST(Config, AbsurdSizesAreRefusedNamingTheField) {
  const std::vector<nlohmann::json> configs = ShapeConfigs();
  const nlohmann::json& moe = configs[1];
  const nlohmann::json& next = configs[2];
  const std::vector<std::tuple<const nlohmann::json*, std::string, int64_t>> cases = {
      {&moe, "hidden_size", 1000000000},
      {&moe, "hidden_size", 65537},
      {&moe, "num_hidden_layers", 1000000},
      {&moe, "vocab_size", (int64_t{1} << 24) + 1},
      {&moe, "intermediate_size", int64_t{1} << 40},
      {&moe, "num_attention_heads", 4096},
      {&moe, "head_dim", 8192},
      {&moe, "num_experts", 1000000},
      {&moe, "moe_intermediate_size", int64_t{1} << 30},
      {&moe, "max_position_embeddings", int64_t{1} << 40},
      {&next, "linear_num_value_heads", 1 << 20},
      {&next, "linear_value_head_dim", 1 << 20},
      {&next, "linear_conv_kernel_dim", 1 << 20},
      {&next, "shared_expert_intermediate_size", int64_t{1} << 40},
      {&next, "shared_expert_intermediate_size", -1},
  };
  for (const auto& [base, key, value] : cases) {
    const absl::Status st = ParseEdited(*base, {{key, value}});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << key << "=" << value << ": " << st;
    EXPECT_NE(st.message().find("'" + key + "'"), std::string::npos) << st;
  }
  EXPECT_TRUE(ParseEdited(moe, {{"hidden_size", 65536}, {"head_dim", 4096}}).ok());
  EXPECT_TRUE(ParseEdited(moe, {{"num_hidden_layers", 1024}}).ok());
  EXPECT_TRUE(ParseEdited(moe, {{"vocab_size", int64_t{1} << 24}}).ok());
  EXPECT_TRUE(ParseEdited(moe, {{"max_position_embeddings", 10485760}}).ok());  // Llama 4 Scout
}

// rms_norm_eps -1, max_position_embeddings 0 and the like were accepted and the model served
// (NaN from every forward, or no sequence short enough to score).
TEST(Config, NonPositiveEpsilonRopeBaseAndPositionsAreRefused) {
  const nlohmann::json base = ShapeConfigs()[0];
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"rms_norm_eps", R"({"rms_norm_eps": -1})"},
      {"rms_norm_eps", R"({"rms_norm_eps": 0})"},
      {"rope_theta", R"({"rope_theta": 0})"},
      {"rope_theta", R"({"rope_parameters": {"rope_type": "default", "rope_theta": -5}})"},
      {"max_position_embeddings", R"({"max_position_embeddings": 0})"},
      {"max_position_embeddings", R"({"max_position_embeddings": -4})"},
  };
  for (const auto& [key, patch] : cases) {
    const absl::Status st = ParseEdited(base, nlohmann::json::parse(patch));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << patch << ": " << st;
    EXPECT_NE(st.message().find("'" + key + "'"), std::string::npos) << st;
  }
}

// A copy of fixture model `name` in a fresh directory, its config.json patched with `patch`.
fs::path EditedFixture(const std::string& name, const std::string& tag,
                       const nlohmann::json& patch) {
  const fs::path dir = TempDir(tag);
  fs::copy(std::string(OPD_FIXTURES_DIR) + "/" + name + "/model", dir, fs::copy_options::recursive);
  std::ifstream in(dir / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  in.close();
  config.merge_patch(patch);
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir;
}

TEST(Config, LoadNamesTheFileAndTheField) {
  const fs::path dir =
      EditedFixture("moe_tied_topk8", "cfg_named", {{"num_hidden_layers", 1000000}});
  auto config = LoadModelConfig(dir.string());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(config.status().message().find((dir / "config.json").string()), std::string::npos)
      << config.status();
  EXPECT_NE(config.status().message().find("'num_hidden_layers'"), std::string::npos);
  fs::remove_all(dir);
}

// A config whose sizes are within bounds but not its checkpoint's: hidden_size 65536 and
// intermediate_size 2^20 over a 48-wide model. The model was allocated first (a 256 GiB MLP
// matrix: std::bad_alloc or c10::Error, uncaught); now the headers are compared with the
// shapes the config implies, and the first tensor that differs is named, before any allocation.
TEST(Checkpoint, ConfigThatDisagreesWithTheCheckpointIsRefusedBeforeAllocating) {
  const fs::path dir = EditedFixture("moe_tied_topk8", "cfg_mismatch",
                                     {{"hidden_size", 65536}, {"intermediate_size", 1 << 20}});
  auto m = LoadModel(dir.string());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("tensor '"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find(", 65536]"), std::string::npos) << m.status();
  fs::remove_all(dir);

  // More layers than the checkpoint holds: the missing ones are named, still before allocating.
  const fs::path more =
      EditedFixture("moe_tied_topk8", "cfg_layers", {{"num_hidden_layers", 1024}});
  m = LoadModel(more.string());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();
  EXPECT_NE(m.status().message().find("11242 parameter(s) missing"), std::string::npos)
      << m.status();
  EXPECT_NE(m.status().message().find("model.layers.10.input_layernorm.weight"), std::string::npos)
      << m.status();
  fs::remove_all(more);
}

// A checkpoint that matches its config but is far larger than the memory there is: a sparse
// file (nothing of it on disk) whose header declares a qwen3 with a [2^22, 65536] embedding,
// 1 TiB in float32.
fs::path HugeSparseModel(const std::string& tag) {
  const fs::path dir = TempDir(tag);
  const nlohmann::json config = {
      {"model_type", "qwen3"},  {"vocab_size", 1 << 22},     {"hidden_size", 65536},
      {"num_hidden_layers", 1}, {"num_attention_heads", 8},  {"num_key_value_heads", 8},
      {"head_dim", 128},        {"intermediate_size", 1024}, {"tie_word_embeddings", true}};
  std::ofstream(dir / "config.json") << config.dump();
  auto parsed = ParseModelConfig(config);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& [name, shape] : ExpectedParameterShapes(*parsed)) {
    const uint64_t bytes = 2 * static_cast<uint64_t>(ParameterCount({{name, shape}}));
    header[name] = {
        {"dtype", "BF16"}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(dir / "model.safetensors", std::ios::binary);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << text;
  out.close();
  fs::resize_file(dir / "model.safetensors", 8 + n + offset);
  return dir;
}

TEST(Checkpoint, ModelLargerThanTheMemoryIsRefusedNamingTheBytes) {
  const fs::path dir = HugeSparseModel("huge");
  auto config = LoadModelConfig(dir.string());
  ASSERT_TRUE(config.ok()) << config.status();
  const int64_t needed = ShapeBytes(ExpectedParameterShapes(*config), 4);
  auto available = AvailableMemoryBytes();
  ASSERT_TRUE(available.ok()) << available.status();
  ASSERT_GT(needed, *available) << "a machine with more than 1 TiB free";
  auto m = LoadModel(dir.string());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted) << m.status();
  EXPECT_NE(m.status().message().find(dir.string()), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find(absl::StrCat(needed, " bytes")), std::string::npos)
      << m.status();
  EXPECT_NE(m.status().message().find("available"), std::string::npos) << m.status();
  fs::remove_all(dir);
}

// When an allocation fails anyway (here a 4 TiB embedding, beyond what the kernel commits to),
// CreateModel returns RESOURCE_EXHAUSTED naming the model instead of throwing.
TEST(Checkpoint, FailedAllocationIsAStatus) {
  std::ifstream overcommit("/proc/sys/vm/overcommit_memory");
  int mode = 0;
  if (overcommit >> mode && mode == 1) GTEST_SKIP() << "overcommit_memory=1 grants any allocation";
  auto config = ParseModelConfig(nlohmann::json::parse(R"({"model_type": "qwen3",
    "vocab_size": 16777216, "hidden_size": 65536, "num_hidden_layers": 1,
    "num_attention_heads": 8, "head_dim": 128, "intermediate_size": 64})"));
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::shared_ptr<CausalLM>> m = absl::UnknownError("not run");
  EXPECT_NO_THROW(m = CreateModel(*config, LoadOptions{}));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted) << m.status();
  EXPECT_NE(m.status().message().find("qwen3"), std::string::npos) << m.status();
}

// NaN or infinite weights loaded and were served (NaN log-probs). The tensor is named; a value
// that only overflows in the target dtype (FLT_MAX as bfloat16) too.
TEST(Checkpoint, NonFiniteWeightsAreRefusedNamingTheTensor) {
  const std::string q = "model.layers.1.self_attn.q_proj.weight";
  for (const float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    auto st = LoadEdited("nonfinite", [&](auto& ts) {
      for (auto& [n, t] : ts) {
        if (n == q) t[2][3] = bad;
      }
    });
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("tensor '" + q + "'"), std::string::npos) << st;
    EXPECT_NE(st.message().find("1 non-finite"), std::string::npos) << st;
  }
  const std::string expert = "model.layers.0.mlp.experts.5.down_proj.weight";
  auto edit = [&](auto& ts) {
    for (auto& [n, t] : ts) {
      if (n == expert) t[0][0] = std::numeric_limits<float>::max();
    }
  };
  EXPECT_TRUE(LoadEdited("fp32max", edit).ok());  // finite in float32
  auto st = LoadEdited("bf16max", edit, LoadOptions{torch::kBFloat16, torch::kCPU});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("tensor '" + expert + "'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("once converted to BFloat16"), std::string::npos) << st;
}

// An expert-parallel rank checks its part the same way: its experts' shapes before allocating,
// and the values it reads (another rank's experts are never read, so never refused here).
TEST(ExpertShard, ChecksItsPartOfTheCheckpoint) {
  const std::string fixture = std::string(OPD_FIXTURES_DIR) + "/moe_many_experts/model";
  auto shard = LoadExpertShard(fixture, {}, 0, 2);
  ASSERT_TRUE(shard.ok()) << shard.status();
  const fs::path wide =
      EditedFixture("moe_many_experts", "ep_mismatch", {{"moe_intermediate_size", 1 << 20}});
  auto st = LoadExpertShard(wide.string(), {}, 0, 2).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(".mlp.experts."), std::string::npos) << st;
  fs::remove_all(wide);

  const fs::path dir = EditedFixture("moe_many_experts", "ep_nan", nlohmann::json::object());
  auto file = SafetensorsFile::Open((dir / "model.safetensors").string());
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<std::pair<std::string, torch::Tensor>> ts;
  for (const auto& [n, v] : (*file)->tensors())
    ts.emplace_back(n, TensorFromView(v, *file).clone());
  file->reset();
  const std::string mine = "model.layers.1.mlp.experts.3.up_proj.weight";     // rank 0's
  const std::string theirs = "model.layers.1.mlp.experts.20.up_proj.weight";  // rank 1's
  for (auto& [n, t] : ts) {
    if (n == mine || n == theirs) t[0][0] = std::nanf("");
  }
  std::vector<TensorToWrite> out;
  for (auto& [n, t] : ts)
    out.push_back({n, DType::kF32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.nbytes())});
  ASSERT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), out).ok());
  st = LoadExpertShard(dir.string(), {}, 0, 2).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("tensor '" + mine + "'"), std::string::npos) << st;
  st = LoadExpertShard(dir.string(), {}, 1, 2).status();
  EXPECT_NE(st.message().find("tensor '" + theirs + "'"), std::string::npos) << st;
  fs::remove_all(dir);
}

TEST(Memory, ParsesMemAvailableAndNamesBothCountsWhenShort) {
  auto n = ParseMemAvailable("MemTotal:       24683584 kB\nMemAvailable:   22143260 kB\n");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, int64_t{22143260} * 1024);
  EXPECT_FALSE(ParseMemAvailable("MemTotal: 1 kB\n").ok());
  EXPECT_FALSE(ParseMemAvailable("MemAvailable: lots kB\n").ok());
  EXPECT_FALSE(ParseMemAvailable("MemAvailable: 99999999999999999 kB\n").ok());  // overflows
  EXPECT_TRUE(AvailableMemoryBytes().ok());
  EXPECT_TRUE(CheckMemoryBudget("m", 10, 10).ok());
  const absl::Status st = CheckMemoryBudget("/models/big", int64_t{3} << 40, int64_t{1} << 30);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("/models/big"), std::string::npos) << st;
  EXPECT_NE(st.message().find("3.0 TiB (3298534883328 bytes)"), std::string::npos) << st;
  EXPECT_NE(st.message().find("1.0 GiB (1073741824 bytes) available"), std::string::npos) << st;
}

// Runs `opd-ctl ARGS`, returning its exit code (-1 when it did not exit) and its stderr.
std::pair<int, std::string> RunCtl(const std::string& args, const fs::path& scratch) {
  const fs::path err = scratch / "ctl_err.txt";
  const std::string cmd =
      std::string(OPD_BINARY_DIR) + "/ctl/opd-ctl " + args + " > /dev/null 2> " + err.string();
  const int rc = std::system(cmd.c_str());
  std::ifstream in(err);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, text};
}

// issue #27: every loader died on an absurd config.json (exit 134, an uncaught c10::Error from
// the allocation) and served one with rms_norm_eps -1 or NaN weights. opd-ctl logprobs now
// exits 1 with a message naming the field, the tensor or the memory.
TEST(OpdCtl, LogprobsRefusesAbsurdModelsWithoutACrash) {
  const fs::path scratch = TempDir("ctl_absurd");
  std::ofstream(scratch / "in.jsonl") << R"({"tokens": [1, 2, 3]})"
                                      << "\n";
  const std::vector<std::pair<nlohmann::json, std::string>> cases = {
      {{{"hidden_size", 1000000000}}, "'hidden_size'"},
      {{{"num_hidden_layers", 1000000}}, "'num_hidden_layers'"},
      {{{"rms_norm_eps", -1}}, "'rms_norm_eps'"},
      {{{"max_position_embeddings", 0}}, "'max_position_embeddings'"},
      {{{"hidden_size", 65536}, {"intermediate_size", 1 << 20}}, ", 65536]"},
  };
  for (const auto& [patch, named] : cases) {
    const fs::path dir = EditedFixture("moe_untied_top1_sparse2", "ctl_model", patch);
    const auto [rc, err] =
        RunCtl("logprobs --model " + dir.string() + " --input " + (scratch / "in.jsonl").string(),
               scratch);
    EXPECT_EQ(rc, 1) << patch.dump() << ": " << err;
    EXPECT_NE(err.find(named), std::string::npos) << patch.dump() << ": " << err;
    EXPECT_NE(err.find(dir.string()), std::string::npos) << err;
    fs::remove_all(dir);
  }
  const fs::path huge = HugeSparseModel("ctl_huge");
  auto [rc, err] = RunCtl(
      "logprobs --model " + huge.string() + " --input " + (scratch / "in.jsonl").string(), scratch);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_NE(err.find(huge.string()), std::string::npos) << err;
  EXPECT_NE(err.find("available"), std::string::npos) << err;
  fs::remove_all(huge);
  fs::remove_all(scratch);
}

// init-model builds a random model from a config alone: an absurd size is refused by the config
// checks, and one within the bounds but beyond the memory by the budget, before construction.
TEST(OpdCtl, InitModelRefusesAbsurdConfigsWithoutACrash) {
  const fs::path scratch = TempDir("ctl_init");
  const nlohmann::json base = ShapeConfigs()[1];
  const std::vector<std::pair<nlohmann::json, std::string>> cases = {
      {{{"hidden_size", 1000000000}}, "'hidden_size'"},
      {{{"num_hidden_layers", 1000000}}, "'num_hidden_layers'"},
      {{{"vocab_size", 1 << 24}, {"hidden_size", 65536}, {"head_dim", 128}}, "available"},
  };
  for (const auto& [patch, named] : cases) {
    nlohmann::json config = base;
    config.merge_patch(patch);
    std::ofstream(scratch / "config.json") << config.dump();
    const auto [rc, err] = RunCtl("init-model --config " + (scratch / "config.json").string() +
                                      " --out " + (scratch / "out").string(),
                                  scratch);
    EXPECT_EQ(rc, 1) << patch.dump() << ": " << err;
    EXPECT_NE(err.find(named), std::string::npos) << patch.dump() << ": " << err;
    EXPECT_NE(err.find((scratch / "config.json").string()), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(scratch / "out")) << patch.dump();
  }
  // The unedited config still builds.
  std::ofstream(scratch / "config.json") << base.dump();
  const auto [rc, err] = RunCtl("init-model --config " + (scratch / "config.json").string() +
                                    " --out " + (scratch / "out").string(),
                                scratch);
  EXPECT_EQ(rc, 0) << err;
  EXPECT_TRUE(LoadModel((scratch / "out").string()).ok());
  fs::remove_all(scratch);
}

}  // namespace
}  // namespace lm
