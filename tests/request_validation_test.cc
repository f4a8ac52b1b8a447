// The torch-free request checks of the rollout worker: a GenerateRequest's conversion (the
// proto's defaults, seed indices), Validate's absence of a KV budget and its seed-index checks,
// and an UpdateWeights manifest against the model's parameters. Validate's other bounds are
// covered by sampler_test; these are what the fuzz targets assume (fuzz/).
#include <string>

#include <gtest/gtest.h>

#include "opd/v1/rollout.pb.h"
#include "rollout/generate_request.h"
#include "rpc/weight_manifest.h"

namespace {

using opd::rpc::AnnouncedTensor;
using opd::rpc::CheckAnnounced;

const opd::rpc::ParamShapes kParams = {{"embed", {16, 4}}, {"norm", {4}}, {"scale", {}}};

void ExpectInvalid(const std::vector<AnnouncedTensor>& announced, const std::string& needle) {
  auto got = CheckAnnounced(announced, kParams);
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
  auto bytes =
      CheckAnnounced({{"embed", {16, 4}, "bfloat16", 1}, {"scale", {}, "float32", 2}}, kParams);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, 16 * 4 * 2 + 4);
  EXPECT_EQ(*CheckAnnounced({}, kParams), 0);
}

TEST(WeightManifest, RefusesTheFirstBadTensorByName) {
  ExpectInvalid({{"norm", {4}, "float32", 0}, {"nope", {4}, "float32", 0}},
                "manifest: tensor 'nope' is not a parameter of the model");
  ExpectInvalid({{"norm", {4}, "float32", 0}, {"norm", {4}, "float16", 0}},
                "manifest: tensor 'norm' is announced twice");
  ExpectInvalid({{"embed", {4, 16}, "float32", 0}},
                "manifest: tensor 'embed': shape [4, 16], the model's is [16, 4]");
  ExpectInvalid({{"norm", {4}, "int8", 0}},
                "manifest: tensor 'norm': unknown dtype 'int8' (float32, bfloat16 or float16)");
  // In manifest order: the unknown name comes before the bad dtype.
  ExpectInvalid({{"nope", {4}, "float32", 0}, {"norm", {4}, "int8", 0}}, "'nope'");
}

TEST(WeightManifest, AnnouncedCarriesTheManifestOver) {
  opd::v1::WeightManifest m;
  auto* t = m.add_tensors();
  t->set_name("embed");
  t->add_shape(16);
  t->add_shape(4);
  t->set_dtype("float16");
  t->set_checksum(0xFFFFFFFFFFFFFFFFull);
  const auto announced = opd::rpc::Announced(m);
  ASSERT_EQ(announced.size(), 1u);
  EXPECT_EQ(announced[0].name, "embed");
  EXPECT_EQ(announced[0].shape, (std::vector<int64_t>{16, 4}));
  EXPECT_EQ(announced[0].dtype, "float16");
  EXPECT_EQ(announced[0].checksum, 0xFFFFFFFFFFFFFFFFull);
  EXPECT_FALSE(opd::rpc::BaseVersion(m).has_value());
  m.set_base_version(0);  // set to 0 is not unset
  EXPECT_EQ(opd::rpc::BaseVersion(m), 0);
}

}  // namespace
