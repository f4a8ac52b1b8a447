// The torch-free request checks of the rollout worker: a GenerateRequest's conversion (the
// proto's defaults, seed indices), Validate's absence of a KV budget and its seed-index checks,
// an UpdateWeights manifest against the model's parameters, and a weight tensor's fields on the
// wire (rpc/wire_tensor.h). Validate's other bounds are covered by sampler_test; these are what the
// fuzz targets assume (fuzz/).
#include <string>

#include <gtest/gtest.h>

#include "opd/v1/common.pb.h"
#include "opd/v1/rollout.pb.h"
#include "rollout/generate_request.h"
#include "rpc/weight_manifest.h"
#include "rpc/wire_tensor.h"

namespace {

using opd::rpc::ReadManifest;
using opd::rpc::WireDtype;
using opd::rpc::WireTensor;

const opd::rpc::ParamShapes kParams = {{"embed", {16, 4}}, {"norm", {4}}, {"scale", {}}};

// A manifest entry as a sender from before the dtype enum wrote it: the dtype by name only.
struct OldEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
};

opd::v1::WeightManifest OldManifest(const std::vector<OldEntry>& entries) {
  opd::v1::WeightManifest m;
  for (const OldEntry& e : entries) {
    opd::v1::ManifestTensor* t = m.add_tensors();
    t->set_name(e.name);
    t->mutable_shape()->Add(e.shape.begin(), e.shape.end());
    t->set_dtype(e.dtype);
  }
  return m;
}

void ExpectInvalid(const std::vector<OldEntry>& entries, const std::string& needle) {
  auto got = ReadManifest(OldManifest(entries), kParams);
  ASSERT_FALSE(got.ok()) << needle;
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find(needle), std::string::npos) << got.status();
}

TEST(GenerateRequest, JobFromRequestAppliesTheProtoDefaults) {
  opd::v1::GenerateRequest req;
  req.add_prompts()->add_tokens(5);
  req.mutable_params()->set_max_new_tokens(3);
  rollout::GenerateJob job = rollout::JobFromRequest(req);
  ASSERT_EQ(job.prompts.size(), 1u);
  EXPECT_EQ(job.prompts[0], std::vector<int32_t>{5});
  EXPECT_EQ(job.params.samples_per_prompt, 1);  // 0 means 1
  EXPECT_EQ(job.params.temperature, 1.0);       // unset means 1
  EXPECT_EQ(job.params.top_p, 1.0);             // 0 is off
  EXPECT_EQ(job.params.max_new_tokens, 3);

  req.set_samples_per_prompt(4);
  req.set_return_routing(true);
  auto* p = req.mutable_params();
  p->set_temperature(0);  // set to 0: greedy, not the default
  p->set_top_p(0.5f);
  p->set_top_k(7);
  p->add_stop_token_ids(2);
  p->set_seed(99);
  job = rollout::JobFromRequest(req);
  EXPECT_EQ(job.params.samples_per_prompt, 4);
  EXPECT_EQ(job.params.temperature, 0.0);
  EXPECT_EQ(job.params.top_p, 0.5);
  EXPECT_EQ(job.params.top_k, 7);
  EXPECT_EQ(job.params.stop_ids, std::vector<int32_t>{2});
  EXPECT_EQ(job.params.seed, 99u);
  EXPECT_TRUE(job.params.return_routing);
}

// A prompt's seed_index travels to params.seed_indices when any prompt sets one (the others keep
// their position); with none set, seed_indices stays empty (positions).
TEST(GenerateRequest, JobFromRequestCarriesTheSeedIndices) {
  opd::v1::GenerateRequest req;
  for (int i = 0; i < 3; ++i) req.add_prompts()->add_tokens(i + 1);
  req.mutable_params()->set_max_new_tokens(2);
  EXPECT_TRUE(rollout::JobFromRequest(req).params.seed_indices.empty());
  req.mutable_prompts(1)->set_seed_index(7);
  const rollout::GenerateJob job = rollout::JobFromRequest(req);
  EXPECT_EQ(job.params.seed_indices, (std::vector<int64_t>{0, 7, 2}));
  EXPECT_EQ(job.params.SeedIndex(1), 7);
  req.mutable_prompts(0)->set_seed_index(0);  // set to 0 is set
  req.mutable_prompts(1)->clear_seed_index();
  EXPECT_EQ(rollout::JobFromRequest(req).params.seed_indices, (std::vector<int64_t>{0, 1, 2}));
}

rollout::GenerateLimits Limits() {
  rollout::GenerateLimits l;
  l.vocab_size = 96;
  l.max_seq_len = 16384;
  l.max_samples_per_prompt = 64;
  l.max_slots = 1024;
  return l;
}

// No summed KV budget: one worker's share of the paper's step, 256 prompts of 2,048 tokens x 2
// samples of up to 8,192 new tokens (560 GiB of KV cache for Marco-Nano at 112 KiB a token),
// passes; the generators queue it through their cache (tests/engine_admission_test.cc).
TEST(GenerateRequest, ValidateHasNoSummedKvBudget) {
  lm::SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 8192;
  const std::vector<std::vector<int32_t>> prompts(256, std::vector<int32_t>(2048, 5));
  EXPECT_TRUE(rollout::Validate(prompts, p, Limits()).ok());
}

// A negative seed index is INVALID_ARGUMENT naming the prompt; so is a count that does not match
// the prompts'.
TEST(GenerateRequest, ValidateChecksTheSeedIndices) {
  lm::SamplingParams p;
  p.max_new_tokens = 4;
  const std::vector<std::vector<int32_t>> prompts = {{1}, {2}, {3}};
  p.seed_indices = {9, 0, 1LL << 40};
  EXPECT_TRUE(rollout::Validate(prompts, p, Limits()).ok());
  p.seed_indices = {0, -3, 2};
  absl::Status st = rollout::Validate(prompts, p, Limits());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("prompt 1: seed_index -3 is negative"), std::string::npos) << st;
  p.seed_indices = {0, 1};
  st = rollout::Validate(prompts, p, Limits());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("2 seed indices for 3 prompts"), std::string::npos) << st;
}

TEST(WeightManifest, CountsTheWireBytesOfTheAnnouncedDtypes) {
  auto read = ReadManifest(OldManifest({{"embed", {16, 4}, "bfloat16"}, {"scale", {}, "float32"}}),
                           kParams);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->bytes, 16 * 4 * 2 + 4);
  EXPECT_EQ(ReadManifest(OldManifest({}), kParams)->bytes, 0);
}

TEST(WeightManifest, RefusesTheFirstBadTensorByName) {
  ExpectInvalid({{"norm", {4}, "float32"}, {"nope", {4}, "float32"}},
                "manifest: tensor 'nope' is not a parameter of the model");
  ExpectInvalid({{"norm", {4}, "float32"}, {"norm", {4}, "float16"}},
                "manifest: tensor 'norm' is announced twice");
  ExpectInvalid({{"embed", {4, 16}, "float32"}},
                "manifest: tensor 'embed': shape [4, 16], the model's is [16, 4]");
  ExpectInvalid({{"norm", {4}, "int8"}},
                "manifest: tensor 'norm': unknown dtype 'int8' (float32, bfloat16 or float16)");
  // In manifest order: the unknown name comes before the bad dtype.
  ExpectInvalid({{"nope", {4}, "float32"}, {"norm", {4}, "int8"}}, "'nope'");
}

TEST(WeightManifest, ReadCarriesTheManifestOver) {
  opd::v1::WeightManifest m =
      OldManifest({{"embed", {16, 4}, "float16"}, {"norm", {4}, "float32"}});
  m.mutable_tensors(0)->set_checksum(0xFFFFFFFFFFFFFFFFull);
  auto read = ReadManifest(m, kParams);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->tensors.size(), 2u);
  const WireTensor& t = read->tensors[0];
  EXPECT_EQ(t.name, "embed");
  EXPECT_EQ(t.shape, (std::vector<int64_t>{16, 4}));
  EXPECT_EQ(t.dtype, WireDtype::kFloat16);
  EXPECT_EQ(t.checksum, 0xFFFFFFFFFFFFFFFFull);
  EXPECT_FALSE(read->tensors[1].checksum.has_value());  // unset: the bytes are not checked
  EXPECT_FALSE(read->base_version.has_value());
  m.set_base_version(0);  // set to 0 is not unset
  EXPECT_EQ(ReadManifest(m, kParams)->base_version, 0);
}

// The enum is what a reader takes; the name is for peers from before it, both ways.
TEST(WireTensor, ReadsTheEnumAndFallsBackToTheName) {
  opd::v1::ManifestTensor m;
  m.set_name("norm");
  m.set_dtype("float32");  // an older sender: the name alone
  EXPECT_EQ(opd::rpc::FromProto(m)->dtype, WireDtype::kFloat32);
  m.set_wire_dtype(opd::v1::WIRE_DTYPE_BFLOAT16);  // the enum wins over a stale name
  EXPECT_EQ(opd::rpc::FromProto(m)->dtype, WireDtype::kBFloat16);
  m.clear_dtype();
  EXPECT_EQ(opd::rpc::FromProto(m)->dtype, WireDtype::kBFloat16);
  m.set_wire_dtype(static_cast<opd::v1::WireDtype>(9));  // a dtype from a newer sender
  auto bad = opd::rpc::FromProto(m);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "tensor 'norm': unknown wire_dtype 9 (float32, bfloat16 or float16)");
  m.clear_wire_dtype();  // neither: the empty name is unknown
  EXPECT_EQ(opd::rpc::FromProto(m).status().message(),
            "tensor 'norm': unknown dtype '' (float32, bfloat16 or float16)");
}

TEST(WireTensor, TravelsWithItsDtypeBothWays) {
  for (WireDtype dtype : {WireDtype::kFloat32, WireDtype::kBFloat16, WireDtype::kFloat16}) {
    const std::string bytes = "abcdef";
    WireTensor t{"embed", {16, 4}, dtype, 42, 128, bytes};
    opd::v1::ManifestTensor m;
    opd::rpc::ToProto(t, &m);
    EXPECT_EQ(m.dtype(), opd::rpc::WireDtypeName(dtype));  // what an older worker reads
    auto entry = opd::rpc::FromProto(m);
    ASSERT_TRUE(entry.ok()) << entry.status();
    EXPECT_EQ(entry->name, t.name);
    EXPECT_EQ(entry->shape, t.shape);
    EXPECT_EQ(entry->dtype, dtype);
    EXPECT_EQ(entry->checksum, 42u);
    EXPECT_TRUE(entry->data.empty());  // a manifest carries no bytes

    opd::v1::WeightChunk c;
    opd::rpc::ToProto(t, &c);
    EXPECT_EQ(c.dtype(), opd::rpc::WireDtypeName(dtype));
    EXPECT_FALSE(c.has_manifest());
    auto chunk = opd::rpc::FromProto(c);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(chunk->dtype, dtype);
    EXPECT_EQ(chunk->offset, 128);
    EXPECT_EQ(chunk->data, bytes);
    EXPECT_EQ(static_cast<const void*>(chunk->data.data()), c.data().data());  // a view
    EXPECT_EQ(opd::rpc::WireDtypeFromName(opd::rpc::WireDtypeName(dtype)).value(), dtype);
  }
  EXPECT_EQ(opd::rpc::WireDtypeSize(WireDtype::kFloat32), 4);
  EXPECT_EQ(opd::rpc::WireDtypeSize(WireDtype::kBFloat16), 2);
  EXPECT_EQ(opd::rpc::WireDtypeSize(WireDtype::kFloat16), 2);
}

TEST(WireTensor, AServiceSaysTheDtypeItTakes) {
  opd::v1::ServiceInfo info;
  EXPECT_EQ(opd::rpc::ServedDtype(info).value(), WireDtype::kFloat32);  // older ones do not say
  info.set_dtype("bfloat16");
  EXPECT_EQ(opd::rpc::ServedDtype(info).value(), WireDtype::kBFloat16);
  info.set_dtype("float64");
  EXPECT_EQ(opd::rpc::ServedDtype(info).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
