// The memory and time plan (lm/plan/plan.h, opd-ctl plan):
//   (a) the plan of configs/{sft,opd}/marco_nano.yaml on 64 H200s against figures computed by hand
//       here from the architecture (parameter counts, the learner's per-rank state, KV bytes, the
//       decode roofline), not by the plan's own helpers;
//   (b) CheckFits refuses a device that is too small, naming the term that does not fit;
//   (c) `opd-ctl plan` on both configs (exit 0, the tables) and its bad flags (exit 2, named);
//   (d) on the CPU, a small SFT run's measured peak against the planned peak.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include <gtest/gtest.h>

#include "absl/strings/str_split.h"
#include "lm/plan/plan.h"
#include "lm/plan/step_plan.h"
#include "lm/util/config.h"
#include "nlohmann/json.hpp"
#include "tests/child_process.h"
#include "tests/testing.h"
#include "trainer/common/learner_plan.h"

using testing_util::ReadFile;
using testing_util::TestDir;

namespace {

namespace fs = std::filesystem;
using lm::plan::kGiB;

const std::string kSource = OPD_SOURCE_DIR;
const std::string kBin = OPD_BINARY_DIR;

// The config.json fields the plan reads, read here with nlohmann directly: the parser proper
// (lm::ParseModelConfig) lives in the torch library, and opd-ctl plan runs it in (c).
lm::ModelConfig ReadModel(const std::string& path) {
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  lm::ModelConfig c;
  c.model_type = j.at("model_type");
  c.vocab_size = j.at("vocab_size");
  c.hidden_size = j.at("hidden_size");
  c.intermediate_size = j.value("intermediate_size", int64_t{0});
  c.num_hidden_layers = j.at("num_hidden_layers");
  c.num_attention_heads = j.at("num_attention_heads");
  c.num_key_value_heads = j.at("num_key_value_heads");
  c.head_dim = j.at("head_dim");
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.num_experts = j.value("num_local_experts", j.value("num_experts", int64_t{0}));
  c.num_experts_per_tok = j.value("num_experts_per_tok", int64_t{0});
  c.moe_intermediate_size = j.value("moe_intermediate_size", int64_t{0});
  c.decoder_sparse_step = j.value("decoder_sparse_step", int64_t{1});
  c.shared_expert_intermediate_size = j.value("shared_expert_intermediate_size", int64_t{0});
  c.linear_num_key_heads = j.value("linear_num_key_heads", int64_t{0});
  c.linear_num_value_heads = j.value("linear_num_value_heads", int64_t{0});
  c.linear_key_head_dim = j.value("linear_key_head_dim", int64_t{0});
  c.linear_value_head_dim = j.value("linear_value_head_dim", int64_t{0});
  c.linear_conv_kernel_dim = j.value("linear_conv_kernel_dim", int64_t{4});
  if (j.contains("layer_types") && c.model_type == "qwen3_next")
    c.layer_types = j["layer_types"].get<std::vector<std::string>>();
  return c;
}

lm::ModelConfig Model(const std::string& name) {
  return ReadModel(kSource + "/configs/models/" + name + ".json");
}

int64_t TermBytes(const lm::plan::MemoryPlan& m, const std::string& prefix) {
  for (const auto& t : m.terms)
    if (t.name.rfind(prefix, 0) == 0) return t.bytes;
  ADD_FAILURE() << "no term '" << prefix << "'";
  return -1;
}

double TimeOf(const lm::plan::TimePlan& t, const std::string& prefix) {
  for (const auto& term : t.terms)
    if (term.name.rfind(prefix, 0) == 0) return term.seconds;
  ADD_FAILURE() << "no time term '" << prefix << "'";
  return -1;
}

// ---------------------------------------------------------------------------------------------
// (a) Marco-Nano by hand. Per layer (hidden 1024, 16 q / 8 kv heads of 128, 232 experts of 384):
//   attention q 1024x2048 + k, v 1024x1024 each + o 2048x1024            =   6,291,456
//   experts 232 x 3 x 1024 x 384                                           = 273,678,336
//   router 232 x 1024                                                      =     237,568
//   norms: input + post 2 x 1024, q_norm + k_norm 2 x 128                  =       2,304
// 28 layers + tied embedding 151936 x 1024 (155,582,464) + final norm 1024 = 8,001,454,080, the
// count transformers gives for the same config on the meta device (Qwen3MoeForCausalLM).
// fp32 under bf16-mixed: 28 x (237,568 + 2,304) + 1,024                   =   6,717,440.
// Active per token: 28 x (6,291,456 + 8 x 1,179,648) + the LM head 155,582,464 = 595,984,384.
constexpr int64_t kNanoParams = 8'001'454'080;
constexpr int64_t kNanoFp32 = 6'717'440;
constexpr int64_t kNanoActive = 595'984'384;

TEST(PlanByHand, MarcoNanoParameters) {
  const lm::plan::ParameterCounts n = lm::plan::CountParameters(Model("marco_nano"));
  EXPECT_EQ(n.total, kNanoParams);
  EXPECT_EQ(n.fp32, kNanoFp32);
  EXPECT_EQ(n.active, kNanoActive);
  // The reference's "8B total / 0.6B active".
  EXPECT_NEAR(n.total / 1e9, 8.0, 0.05);
  EXPECT_NEAR(n.active / 1e9, 0.6, 0.05);
}

// The other shipped architectures against transformers' meta-device counts (the MTP head of
// Qwen3-Next is not part of the model and not counted by either).
TEST(PlanByHand, ShippedArchitectures) {
  EXPECT_EQ(lm::plan::CountParameters(Model("marco_mini")).total, 17'250'582'528);
  EXPECT_EQ(lm::plan::CountParameters(Model("qwen3_30b_a3b_instruct_2507")).total, 30'532'122'624);
  EXPECT_EQ(lm::plan::CountParameters(Model("qwen3_next_80b_a3b_instruct")).total, 79'674'391'296);
  // Qwen3-30B-A3B by hand: 48 x (attention 2048x4096 + 2 x 2048x512 + 4096x2048 = 18,874,368;
  // experts 128 x 3 x 2048 x 768 = 603,979,776; router 262,144; norms 4,352) + untied embedding
  // and LM head 2 x 151936 x 2048 + 2048.
  EXPECT_EQ(
      int64_t{48} * (18'874'368 + 603'979'776 + 262'144 + 4'352) + 2 * 151'936 * 2'048 + 2'048,
      30'532'122'624);
}

TEST(PlanByHand, KvAndStateBytes) {
  // 28 layers x K and V x 8 kv heads x 128 x 2 B = 112 KiB per token.
  EXPECT_EQ(lm::plan::KvBytesPerToken(Model("marco_nano"), 2), 28 * 2 * 8 * 128 * 2);
  EXPECT_EQ(lm::plan::StateBytesPerSequence(Model("marco_nano"), 2), 0);
  // Qwen3-Next: 12 full-attention layers x 2 x 2 kv heads x 256 x 2 B; 36 linear layers of conv
  // window 3 x (2 x 16 x 128 + 32 x 128) channels in bf16 plus a 32 x 128 x 128 fp32 state.
  const lm::ModelConfig next = Model("qwen3_next_80b_a3b_instruct");
  EXPECT_EQ(lm::plan::KvBytesPerToken(next, 2), 12 * 2 * 2 * 256 * 2);
  EXPECT_EQ(lm::plan::StateBytesPerSequence(next, 2),
            36 * (3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 4));
}

lm::plan::LearnerSettings SftSettings(int64_t ranks) {
  auto c = lm::LoadConfig<trainer::SftConfig>(kSource + "/configs/sft/marco_nano.yaml", {});
  EXPECT_TRUE(c.ok()) << c.status();
  return trainer::LearnerPlanSettings(*c, ranks, /*bf16_mixed=*/true, /*cuda=*/true);
}

// SFT on 64 H200s: bf16 weights 2 (P - F) + 4 F, fp32 gradients 4P + 4P/64 (dist.zero_stage auto
// is stage 1 here: it fits), masters 4P/64, AdamW 8P/64;
// a step of 512 x 8192 tokens is 8 sequences per rank, each 4 passes (checkpointing) of
// 2 x active x 8192 + attention 2 x 16 x 128 x 8192 x 8193 x 28 FLOPs.
TEST(PlanByHand, SftLearnerOn64H200) {
  const lm::plan::LearnerSettings s = SftSettings(64);
  EXPECT_EQ(s.tokens_per_step, 512 * 8192);
  EXPECT_EQ(s.micro_batch_tokens, 8192);
  const lm::plan::DeviceSpec h200;
  const lm::plan::ProcessPlan p = lm::plan::PlanLearner(Model("marco_nano"), s, h200);
  const auto& m = p.memory;
  EXPECT_EQ(TermBytes(m, "weights"), 2 * (kNanoParams - kNanoFp32) + 4 * kNanoFp32);
  EXPECT_EQ(TermBytes(m, "weights"), 16'016'343'040);  // 14.92 GiB
  EXPECT_EQ(TermBytes(m, "gradients"), 32'005'816'320 + 4 * (kNanoParams / 64));
  EXPECT_EQ(TermBytes(m, "fp32 masters"), 4 * (kNanoParams / 64));  // 64 divides P
  EXPECT_EQ(TermBytes(m, "AdamW"), 8 * (kNanoParams / 64));
  EXPECT_EQ(TermBytes(m, "logits chunk"), 512 * int64_t{151'936} * 8);
  EXPECT_LT(m.peak(), h200.memory_bytes);
  const double flops = 8 * 4 * (2.0 * kNanoActive * 8192 + 2.0 * 16 * 128 * 8192.0 * 8193 * 28);
  const double hbm = 8 * (4.0 * 16'016'343'040 + 8.0 * kNanoParams);  // 8 micro-batches
  EXPECT_NEAR(TimeOf(p.time, "forward + backward"), std::max(flops / 989e12, hbm / 4.8e12), 1e-9);
  std::printf("SFT learner on 64 H200: peak %.2f GiB, step %.2f s\n",
              static_cast<double>(m.peak()) / kGiB, p.time.total());
}

lm::plan::RolloutSettings OpdRollout() {
  auto c = lm::LoadConfig<trainer::OpdConfig>(kSource + "/configs/opd/marco_nano.yaml", {});
  EXPECT_TRUE(c.ok()) << c.status();
  lm::plan::RolloutSettings r;
  r.workers = static_cast<int64_t>(c->rollout.endpoints.size());
  r.prompt_tokens = c->prompts.max_prompt_len;
  r.response_tokens = c->rollout.max_new_tokens;
  r.sequences_per_step = c->train.prompts_per_step * c->rollout.samples_per_prompt;
  return r;
}

TEST(PlanByHand, OpdLearner) {
  auto c = lm::LoadConfig<trainer::OpdConfig>(kSource + "/configs/opd/marco_nano.yaml", {});
  ASSERT_TRUE(c.ok()) << c.status();
  const auto s = trainer::LearnerPlanSettings(*c, 48, true, true);
  EXPECT_EQ(s.sequence_len, 2048 + 8192);
  EXPECT_EQ(s.tokens_per_step, 512 * 2 * 10240);
  EXPECT_EQ(s.micro_batch_tokens, 32768);
  const auto p = lm::plan::PlanLearner(Model("marco_nano"), s, {});
  EXPECT_EQ(TermBytes(p.memory, "fp32 masters"), 4 * (kNanoParams / 48));  // 48 divides P
  EXPECT_EQ(TermBytes(p.memory, "AdamW"), 8 * (kNanoParams / 48));
  // The learner's start-up check reads its settings back from the resolved config it writes
  // (trainer/common/training_job.cc): the same micro-batch as the file's.
  auto root = lm::ParseYaml(lm::EncodeConfig(*c), "resolved");
  ASSERT_TRUE(root.ok()) << root.status();
  trainer::OpdConfig back;
  ASSERT_TRUE(lm::DecodeConfig(*root, &back).ok());
  const auto again = trainer::LearnerPlanSettings(back, 48, true, true);
  EXPECT_EQ(again.tokens_per_step, s.tokens_per_step);
  EXPECT_EQ(again.micro_batch_tokens, s.micro_batch_tokens);
  EXPECT_EQ(again.activation_checkpointing, s.activation_checkpointing);
}

// A rollout worker with a 64 GiB pool: 64 GiB / (112 KiB x 16) = 37,449 blocks less the null one;
// a sequence of 2048 + 8192 tokens takes 640 blocks, so 58 run at once; 512 sequences per worker
// (1,024 over 2) are 9 waves of 8,192 decode steps. A step at the mean context 6,144 reads the
// dense weights (2 x (28 x 6,291,456 + 155,582,464) B), the experts 58 tokens touch
// (232 (1 - (224/232)^58) per layer, 2 x 1,179,648 B each) and 58 x 6,144 tokens of KV.
TEST(PlanByHand, DecodeRoofline) {
  lm::plan::RolloutSettings r = OpdRollout();
  r.workers = 2;
  r.kv_cache_bytes = 64 * kGiB;
  const auto p = lm::plan::PlanRollout(Model("marco_nano"), r, {});
  EXPECT_EQ(TermBytes(p.memory, "KV pool"), 64 * kGiB);
  EXPECT_NE(TermBytes(p.memory, "KV pool: 37448 blocks of 16 tokens, holds 58 sequences of 10240"),
            -1);
  const double touched = 232 * (1 - std::pow(224.0 / 232.0, 58));
  const double bytes = 2.0 * (28 * 6'291'456 + 155'582'464) + 28 * touched * 2 * 1'179'648.0 +
                       58 * 6144.0 * 28 * 2 * 8 * 128 * 2;
  const double flops = 58 * (2.0 * kNanoActive + 4.0 * 16 * 128 * 6145 * 28);
  const double step = std::max(bytes / 4.8e12, flops / 989e12);
  EXPECT_GT(bytes / 4.8e12, flops / 989e12) << "decode is bandwidth-bound";
  EXPECT_NEAR(TimeOf(p.time, "decode"), 9 * 8192 * step, 1e-6);
  std::printf("decode step of 58 sequences at context 6144: %.2f ms\n", step * 1e3);
}

// A weight update (rollout/weights.h) never stages a second model on the device: the device holds
// one 64 MiB receive bucket of a collective push; under one-step-off the update waits in
// page-locked host memory, the whole model in the serving dtype, 2 (P - F) + 4 F bytes:
//   Marco-Nano  2 x (8,001,454,080 - 6,717,440) + 4 x 6,717,440   = 16,016,343,040 (14.92 GiB)
//   Marco-Mini  2 x (17,250,582,528 - 7,405,568) + 4 x 7,405,568 = 34,515,976,192 (32.15 GiB)
// (Mini's fp32: 28 x (router 256 x 1024 + norms 2,304) + 1,024 = 7,405,568). The old design's
// second model on the device is printed as the alternative, of the same size; --kv-cache-gb auto
// gives the pool 139 GiB less the weights, the bucket, the prefill workspace and the 2 GiB
// reserve.
TEST(PlanByHand, RolloutWeightUpdateStaging) {
  const std::vector<std::pair<std::string, int64_t>> models = {{"marco_nano", 16'016'343'040},
                                                               {"marco_mini", 34'515'976'192}};
  for (const auto& [name, weights] : models) {
    SCOPED_TRACE(name);
    const lm::ModelConfig c = Model(name);
    lm::plan::RolloutSettings r = OpdRollout();
    const auto p = lm::plan::PlanRollout(c, r, {});
    EXPECT_EQ(TermBytes(p.memory, "weights (bf16)"), weights);
    EXPECT_EQ(TermBytes(p.memory, "weight update: one receive bucket (64 MiB)"), int64_t{64} << 20);
    ASSERT_EQ(p.memory.host.size(), 1u);
    EXPECT_EQ(p.memory.host[0].name,
              "weight update staged in page-locked host memory (one-step-off)");
    EXPECT_EQ(p.memory.host[0].bytes, weights);
    ASSERT_EQ(p.memory.alternatives.size(), 1u);
    EXPECT_EQ(p.memory.alternatives[0].name,
              "weight update staged as a second model on the device");
    EXPECT_EQ(p.memory.alternatives[0].bytes, weights);
    const int64_t pool = 139 * kGiB - weights - (int64_t{64} << 20) -
                         TermBytes(p.memory, "prefill workspace") - 2 * kGiB;
    EXPECT_EQ(lm::plan::RolloutKvPoolBytes(c, r, 139 * kGiB), pool);
    EXPECT_EQ(TermBytes(p.memory, "KV pool"), pool);
    EXPECT_EQ(p.memory.peak(), 139 * kGiB);
    // gRPC pushes only: no bucket, the pool gets it.
    r.update_bucket_bytes = 0;
    EXPECT_EQ(lm::plan::RolloutKvPoolBytes(c, r, 139 * kGiB), pool + (int64_t{64} << 20));
  }
}

// ---------------------------------------------------------------------------------------------
// (b) Refusals name the term that does not fit.

TEST(PlanCheck, LearnerOnASmallDevice) {
  lm::plan::LearnerSettings s = SftSettings(64);
  EXPECT_TRUE(lm::plan::CheckLearnerFits(Model("marco_nano"), s, 139 * kGiB).ok());
  // 16 GiB in stage 1: the weights (14.92 GiB) fit, the full gradients after them do not, and the
  // refusal names the setting that shards them.
  s.zero_stage = 1;
  absl::Status st = lm::plan::CheckLearnerFits(Model("marco_nano"), s, 16 * kGiB);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("learner rank"), std::string::npos) << st;
  EXPECT_NE(st.message().find("'gradients (fp32: local sum + reduced 1/64)' (30.27 GiB) does not "
                              "fit"),
            std::string::npos)
      << st;
  EXPECT_NE(st.message().find("dist.zero_stage: 2"), std::string::npos) << st;
  // auto takes stage 2 there: 0.47 GiB of gradients, 0.5 GiB of buckets and the largest
  // parameter's 0.34 GiB gradient fit after the weights, the masters then pass 16 GiB.
  s.zero_stage = 0;
  EXPECT_EQ(lm::plan::ResolveZeroStage(Model("marco_nano"), s, 16 * kGiB), 2);
  st = lm::plan::CheckLearnerFits(Model("marco_nano"), s, 16 * kGiB);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("'fp32 masters (1/64)'"), std::string::npos) << st;
}

// ZeRO-2 by hand: Marco-Nano SFT on 64 ranks, stage 2: gradients 4 ceil(P/64), 4 fp32 buckets of
// 32 MiB (8 Mi elements, a multiple of 64) and the largest parameter's bf16 gradient (a layer's
// fused gate_up experts, 232 x 768 x 1024, above the 151936 x 1024 embedding); stage 1 4P + 4P/64.
TEST(PlanByHand, ShardedGradients) {
  lm::plan::LearnerSettings s = SftSettings(64);
  const lm::plan::DeviceSpec h200;
  s.zero_stage = 2;
  const lm::plan::ProcessPlan two = lm::plan::PlanLearner(Model("marco_nano"), s, h200);
  EXPECT_EQ(TermBytes(two.memory, "gradients"), 4 * (kNanoParams / 64));
  EXPECT_EQ(TermBytes(two.memory, "gradient buckets"), 4 * 4 * (int64_t{8} << 20));
  constexpr int64_t kLargest = 232 * 2 * 384 * 1024;
  EXPECT_EQ(lm::plan::CountParameters(Model("marco_nano")).largest, kLargest);
  EXPECT_EQ(TermBytes(two.memory, "gradient awaiting"), 2 * kLargest);
  s.zero_stage = 1;
  const lm::plan::ProcessPlan one = lm::plan::PlanLearner(Model("marco_nano"), s, h200);
  EXPECT_EQ(TermBytes(one.memory, "gradients"), 4 * kNanoParams + 4 * (kNanoParams / 64));
  EXPECT_EQ(one.memory.peak() - two.memory.peak(),
            4 * kNanoParams - 4 * 4 * (int64_t{8} << 20) - 2 * kLargest);
  // One rank has nothing to shard: 4P, whatever the setting.
  s = SftSettings(1);
  s.zero_stage = 2;
  EXPECT_EQ(TermBytes(lm::plan::PlanLearner(Model("marco_nano"), s, h200).memory, "gradients"),
            4 * kNanoParams);
}

// Marco-Mini (17.25B parameters, 34.5 GB of bf16 weights) on 80 GiB devices, the OPD config's
// micro-batch: with full gradients (69 GB) no rank count fits; sharded, 8 ranks and more do (4 do
// not: 16 GiB of masters and 32 GiB of moments), and dist.zero_stage auto picks stage 2 for them.
//   16 ranks: weights 2 (P - F) + 4 F = 32.15 GiB, gradients 4P/16 = 4.02 GiB, buckets 0.5 GiB,
//   masters 4.02 GiB, AdamW 8.03 GiB, activations and logits chunk, 2 GiB reserve.
TEST(PlanByHand, MarcoMiniFitsEightyGigabytesFromSixteenRanks) {
  auto c = lm::LoadConfig<trainer::OpdConfig>(kSource + "/configs/opd/marco_nano.yaml", {});
  ASSERT_TRUE(c.ok()) << c.status();
  const lm::ModelConfig mini = Model("marco_mini");
  const int64_t p = lm::plan::CountParameters(mini).total;
  const int64_t device = 80 * kGiB;
  for (int64_t ranks : {4, 8, 16, 32, 64}) {
    lm::plan::LearnerSettings s = trainer::LearnerPlanSettings(*c, ranks, true, true);
    s.zero_stage = 0;  // auto
    const absl::Status fits = lm::plan::CheckLearnerFits(mini, s, device);
    EXPECT_EQ(fits.ok(), ranks >= 8) << ranks << " ranks: " << fits;
    EXPECT_EQ(lm::plan::ResolveZeroStage(mini, s, device), 2) << ranks;
    s.zero_stage = 1;
    EXPECT_FALSE(lm::plan::CheckLearnerFits(mini, s, device).ok()) << ranks;
    if (ranks != 16) continue;
    s.zero_stage = 0;
    lm::plan::DeviceSpec d;
    d.memory_bytes = device;
    const lm::plan::ProcessPlan plan = lm::plan::PlanLearner(mini, s, d);
    EXPECT_EQ(TermBytes(plan.memory, "gradients"), 4 * ((p + 15) / 16));
    std::printf("Marco-Mini OPD learner, 16 ranks, ZeRO-2: peak %.2f GiB of 80\n",
                static_cast<double>(plan.memory.peak()) / kGiB);
  }
}

TEST(PlanCheck, RolloutPoolTooLarge) {
  lm::plan::RolloutSettings r = OpdRollout();
  r.kv_cache_bytes = 200 * kGiB;
  const absl::Status st = lm::plan::CheckRolloutFits(Model("marco_nano"), r, 139 * kGiB);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("'KV pool"), std::string::npos) << st;
  EXPECT_NE(st.message().find("--kv-cache-gb"), std::string::npos) << st;
  r.kv_cache_bytes = 64 * kGiB;
  EXPECT_TRUE(lm::plan::CheckRolloutFits(Model("marco_nano"), r, 139 * kGiB).ok());
}

TEST(PlanCheck, Qwen3NextNeedsTwoDevices) {
  // 79.67B parameters in bf16 are 148 GiB: more than one H200; half the experts fit.
  lm::plan::TeacherSettings t;
  const lm::ModelConfig next = Model("qwen3_next_80b_a3b_instruct");
  const absl::Status st = lm::plan::CheckTeacherFits(next, t, 139 * kGiB);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("opd-teacher"), std::string::npos) << st;
  EXPECT_NE(st.message().find("'weights (bf16)'"), std::string::npos) << st;
  t.devices_per_replica = 2;
  EXPECT_TRUE(lm::plan::CheckTeacherFits(next, t, 139 * kGiB).ok());
}

// ---------------------------------------------------------------------------------------------
// (c) opd-ctl plan.

// Runs opd-ctl plan with `flags`; the exit code, and stdout + stderr in `*out`.
int Plan(const std::vector<std::string>& flags, const std::string& log, std::string* out) {
  std::vector<std::string> argv = {kBin + "/ctl/opd-ctl", "plan"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  testing_util::ChildProcess p(argv, log);
  const int code = p.Wait(std::chrono::seconds(60));
  *out = ReadFile(log);
  return code;
}

std::vector<std::string> NanoFlags(const std::string& job) {
  return {"--config",       kSource + "/configs/" + job + "/marco_nano.yaml",
          "--model-config", kSource + "/configs/models/marco_nano.json",
          "--models-dir",   kSource + "/configs/models"};
}

TEST(PlanCli, PrintsBothConfigs) {
  const std::string dir = TestDir();
  std::string out;
  ASSERT_EQ(Plan(NanoFlags("sft"), dir + "/sft.log", &out), 0) << out;
  for (const char* s : {"learner rank (x64 devices)", "gradients (fp32: local sum + reduced 1/64)",
                        "30.27 GiB", "dist.zero_stage 1 (auto)", "fp32 masters (1/64)",
                        "AdamW moments (1/64)", "checkpointing", "forward + backward", "SFT step"})
    EXPECT_NE(out.find(s), std::string::npos) << s << "\n" << out;
  ASSERT_EQ(Plan(NanoFlags("opd"), dir + "/opd.log", &out), 0) << out;
  for (const char* s :
       {"learner rank", "rollout worker (x40 devices)", "KV pool", "teacher qwen3_30b_a3b",
        "teacher qwen3_next_80b_a3b", "1/2 of the experts", "decode", "scoring", "OPD step, stage"})
    EXPECT_NE(out.find(s), std::string::npos) << s << "\n" << out;
  std::printf("%s", out.c_str());
}

// The step as the job runs it (lm/plan/step_plan.h), from three process plans with one time term
// each of known seconds and bound: compute terms divided by their compute share, HBM terms by
// theirs; phase by phase the sum, pipelined the slowest stage plus the tail, one-step-off the
// slowest side.
TEST(PlanStep, PhasesPipelineAndOneStepOff) {
  lm::plan::ProcessPlan rollout, teacher, learner;
  rollout.time.terms = {{"decode", 30, "HBM"}};                            // / 0.3 = 100 s
  teacher.time.terms = {{"scoring", 12, "compute"}};                       // / 0.2 = 60 s
  learner.time.terms = {{"passes", 4.5, "compute"}, {"adamw", 1, "HBM"}};  // 50 s, 2 s
  lm::plan::Efficiencies e;
  lm::plan::StepShape shape;
  shape.student_weight_bytes = 50'000'000'000;  // 2 s at 25 GB/s
  shape.micro_batches = 10;                     // 5 s each
  shape.score_calls = 20;                       // 3 s each
  shape.pipeline = false;
  lm::plan::StepPlan p = lm::plan::PlanStep(rollout, teacher, learner, shape, e);
  EXPECT_NEAR(p.sample, 100, 1e-9);
  EXPECT_NEAR(p.score, 60, 1e-9);
  EXPECT_NEAR(p.learn, 50, 1e-9);
  EXPECT_NEAR(p.optimizer, 2, 1e-9);
  EXPECT_NEAR(p.push, 2, 1e-9);
  EXPECT_NEAR(p.step, 100 + 60 + 50 + 2 + 2, 1e-9);
  shape.pipeline = true;
  p = lm::plan::PlanStep(rollout, teacher, learner, shape, e);
  EXPECT_NEAR(p.step, 100 + (3 + 5 + 2 + 2), 1e-9) << p.formula;
  shape.async = true;
  p = lm::plan::PlanStep(rollout, teacher, learner, shape, e);
  EXPECT_NEAR(p.step, 100 + 5, 1e-9) << p.formula;
  // A learner slower than sampling sets the one-step-off step.
  learner.time.terms[0].seconds = 9.9;  // 110 s
  p = lm::plan::PlanStep(rollout, teacher, learner, shape, e);
  EXPECT_NEAR(p.step, 110 + 2 + 2 + 11, 1e-9) << p.formula;
}

// The shipped split (40 rollout, 16 learner, 8 teacher devices, one-step-off) puts the paper's step
// under its ~137 s for both stages at the plan's measured efficiencies, with responses averaging
// half the cap; the worst case (every response 8,192 tokens) is printed beside it. The shipped
// deadlines are above the worst case: no warning.
TEST(PlanCli, TheShippedSplitStepsUnderThePapersPace) {
  const std::string dir = TestDir();
  std::string out;
  ASSERT_EQ(Plan(NanoFlags("opd"), dir + "/step.log", &out), 0) << out;
  int lines = 0;
  for (const absl::string_view piece : absl::StrSplit(out, '\n')) {
    const std::string line(piece);
    if (line.rfind("OPD step, stage ", 0) != 0) continue;
    ++lines;
    EXPECT_NE(line.find("one-step-off"), std::string::npos) << line;
    const size_t eq = line.rfind("= ");
    ASSERT_NE(eq, std::string::npos) << line;
    const double seconds = std::stod(line.substr(eq + 2));
    ASSERT_NE(line.find(" s", eq), std::string::npos) << line;
    if (line.find("on average") != std::string::npos) EXPECT_LT(seconds, 137) << line;
  }
  EXPECT_EQ(lines, 4) << out;  // two stages, typical and worst case
  EXPECT_EQ(out.find("warning: "), std::string::npos) << out;
  // A pool that cannot hold a worker's share at once is named (8 GiB: 7 sequences of 10,240).
  std::vector<std::string> flags = NanoFlags("opd");
  flags.push_back("--kv-cache-gb");
  flags.push_back("8");
  ASSERT_EQ(Plan(flags, dir + "/pool.log", &out), 0) << out;
  EXPECT_NE(out.find("warning: a rollout worker's KV pool holds 7 sequences"), std::string::npos)
      << out;
}

TEST(PlanCli, BadFlagsExit2NamingThem) {
  const std::string dir = TestDir();
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--gpus", "0"}, "--gpus"},
      {{"--gpu-memory-gb", "-1"}, "--gpu-memory-gb"},
      {{"--hbm-tbps", "0"}, "--hbm-tbps"},
      {{"--tflops", "abc"}, "--tflops"},
      {{"--kv-block-size", "5000"}, "--kv-block-size"},
      {{"--max-batch-tokens", "0"}, "--max-batch-tokens"},
      {{"--teacher-ep", "1000"}, "--teacher-ep"},
      {{"--precision", "bf17"}, "--precision"},
  };
  int i = 0;
  for (const auto& [extra, flag] : cases) {
    std::vector<std::string> flags = NanoFlags("opd");
    flags.insert(flags.end(), extra.begin(), extra.end());
    std::string out;
    EXPECT_EQ(Plan(flags, dir + "/" + std::to_string(i++) + ".log", &out), 2) << flag << out;
    EXPECT_NE(out.find(flag), std::string::npos) << out;
  }
  std::string out;
  EXPECT_EQ(Plan({}, dir + "/none.log", &out), 2);
  EXPECT_NE(out.find("--config is required"), std::string::npos) << out;
  // A 16 GiB device cannot hold the SFT learner even with sharded gradients: exit 1, refused.
  std::vector<std::string> flags = NanoFlags("sft");
  flags.insert(flags.end(), {"--gpu-memory-gb", "16"});
  EXPECT_EQ(Plan(flags, dir + "/small.log", &out), 1) << out;
  EXPECT_NE(out.find("DOES NOT FIT"), std::string::npos) << out;
  EXPECT_NE(out.find("does not fit in the"), std::string::npos) << out;
}

// ---------------------------------------------------------------------------------------------
// (d) Planned against measured on the CPU: `opd-trainer sft` for one step of a 54M-parameter
// student in fp32 (weights 4P + gradients 4P + AdamW 8P = 16 B per parameter, 822 MiB, plus 82
// MiB of activations for 4 x 128 tokens) and of the 2-layer tiny student (3 MiB). The difference
// of the two runs' peak resident sizes (summary.json peak_rss_mb, getrusage's ru_maxrss) removes
// what both share: LibTorch's code and thread pools, the tokenizer, the data, the run's records.
// Tolerance: the measured difference is at least the planned one less 2% (the plan counts bytes
// the run must hold; 2% is page and allocator rounding) and at most the planned one plus four
// times the largest parameter (the fused experts' [16, 1024, 512] fp32 stack, 32 MiB): AdamW's
// update and the backward's gradient accumulation allocate temporaries of a parameter's size, a
// few alive at once, and the heap never returns freed memory (lm::RetainFreedMemory), so they
// stay in the peak. Measured here: 979 MiB against 897 MiB planned (+82 MiB, 2.5 of them).

const std::string kFixtures = kBin + "/fixtures_sft";

// 4 layers, hidden 512, 8 q / 4 kv heads of 64, 16 experts of 512 (top-2), vocabulary 320 (the
// fixture tokenizer's): 53,842,944 parameters, nearly all in the experts.
constexpr const char* kMediumModel = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 320,
  "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16,
  "num_experts_per_tok": 2, "moe_intermediate_size": 512, "norm_topk_prob": true,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.01,
  "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "max_position_embeddings": 1024, "tie_word_embeddings": false, "attention_bias": false,
  "use_sliding_window": false, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})";

int RunOrFail(const std::vector<std::string>& argv, const std::string& log) {
  testing_util::ChildProcess p(argv, log);
  const int code = p.Wait(std::chrono::seconds(300));
  if (code != 0) ADD_FAILURE() << p.Log();
  return code;
}

// One fp32 SFT step of the model of `config_json` on the CPU as `world` ranks (Gloo on loopback)
// with `sets`; rank 0's summary.json peak_rss_mb (every rank here holds the same: one micro-batch
// each, the same slice sizes give or take a bucket's padding).
double SftPeakRssMb(const std::string& dir, const std::string& config_json, int world = 1,
                    const std::vector<std::string>& sets = {}) {
  const std::string student = dir + "/student";
  if (RunOrFail({kBin + "/ctl/opd-ctl", "init-model", "--config", config_json, "--out", student,
                 "--tokenizer", kFixtures + "/tokenizer", "--seed", "1"},
                dir + "/init.log") != 0)
    return -1;
  std::vector<std::string> argv = {kBin + "/trainer/opd-trainer", "sft", "--config",
                                   kSource + "/configs/sft/tiny.yaml"};
  std::vector<std::string> all = {"model.path=" + student,
                                  "data.train.0.files=[" + kFixtures + "/data/train.jsonl]",
                                  "data.eval=[]",
                                  "run.dir=" + dir + "/run",
                                  "train.threads=1",
                                  "train.max_steps=1",
                                  "train.precision=fp32",
                                  "train.device=cpu",
                                  "checkpoint.at_end=false",
                                  "logging.tensorboard=false"};
  all.insert(all.end(), sets.begin(), sets.end());
  for (const std::string& set : all) {
    argv.push_back("--set");
    argv.push_back(set);
  }
  const std::string port = std::to_string(testing_util::FreeLoopbackPort());
  std::vector<std::unique_ptr<testing_util::ChildProcess>> ranks;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env;
    if (world > 1)
      env = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
             "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port};
    ranks.push_back(std::make_unique<testing_util::ChildProcess>(
        argv, dir + "/sft.rank" + std::to_string(r) + ".log", env));
  }
  bool ok = true;
  for (auto& p : ranks) {
    if (p->Wait(std::chrono::seconds(300)) == 0) continue;
    ADD_FAILURE() << p->Log();
    ok = false;
  }
  if (!ok) return -1;
  std::ifstream in(dir + "/run/summary.json");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.contains("peak_rss_mb")) {
    ADD_FAILURE() << dir << "/run/summary.json: no peak_rss_mb";
    return -1;
  }
  return j["peak_rss_mb"].get<double>();
}

lm::plan::LearnerSettings CpuSettings(int64_t ranks = 1,
                                      const std::vector<std::string>& sets = {}) {
  auto c = lm::LoadConfig<trainer::SftConfig>(kSource + "/configs/sft/tiny.yaml", sets);
  EXPECT_TRUE(c.ok()) << c.status();
  return trainer::LearnerPlanSettings(*c, ranks, /*bf16_mixed=*/false, /*cuda=*/false);
}

TEST(PlanMeasured, CpuSftPeakMatchesThePlan) {
  const std::string dir = TestDir();
  const std::string medium_json = dir + "/medium.json";
  std::ofstream(medium_json) << kMediumModel;
  fs::create_directories(dir + "/medium");
  fs::create_directories(dir + "/tiny");
  const double medium = SftPeakRssMb(dir + "/medium", medium_json);
  const double tiny = SftPeakRssMb(dir + "/tiny", kSource + "/configs/sft/tiny_model.json");
  ASSERT_GT(medium, 0);
  ASSERT_GT(tiny, 0);
  const lm::plan::LearnerSettings s = CpuSettings();
  const lm::ModelConfig medium_config = ReadModel(medium_json);
  EXPECT_EQ(lm::plan::CountParameters(medium_config).total, 53'842'944);
  const auto planned = [&](const lm::ModelConfig& c) {
    return static_cast<double>(lm::plan::PlanLearner(c, s, {}).memory.peak()) / (1 << 20);
  };
  const double plan =
      planned(medium_config) - planned(ReadModel(kSource + "/configs/sft/tiny_model.json"));
  const double measured = medium - tiny;
  std::printf("planned %.1f MiB, measured %.1f MiB (peaks %.1f - %.1f), ratio %.3f\n", plan,
              measured, medium, tiny, measured / plan);
  constexpr double kLargestParameterMiB = 16.0 * 1024 * 512 * 4 / (1 << 20);
  EXPECT_GE(measured, 0.98 * plan);
  EXPECT_LE(measured, plan + 4 * kLargestParameterMiB);
}

// The same on 4 ranks with sharded gradients (dist.zero_stage 2), each rank one micro-batch of 2
// sequences: a rank holds weights 4P, its slice of the gradients 4P/4, AdamW 8P/4, up to 4
// gradient buckets of 512 Ki elements (2 MiB each) and one gradient awaiting its buckets (the
// largest parameter, a fused expert stack of 32 MiB): 354 + 8 + 32 MiB + activations for the
// medium student; and, this being the CPU, the loaded fp32 model the flat buffers were filled
// from (4P: on a GPU it stays on the host), which the plan counts as the larger of the start-up
// (the copy beside the buffers) and the step (buckets, activations and logits in its place). Stage
// 1 would hold 4P + 4P/4 of gradients, 154 MiB more than the whole tolerance (4 x the largest
// parameter). Same upper tolerance as above. Measured over 10 runs: 524-671 MiB against 558
// planned (the step's allocations reuse the start-up copy's memory or not, as the ranks'
// collectives interleave with them). The plan holds the largest parameter's gradient and the
// buckets at once; whether they are still alive at the peak depends on that interleaving, so the
// lower bound leaves them out (32 + 8 MiB; a peak below it would mean the plan counts something
// the step never holds).
TEST(PlanMeasured, CpuShardedSftPeakMatchesThePlan) {
  const std::string dir = TestDir();
  const std::string medium_json = dir + "/medium.json";
  std::ofstream(medium_json) << kMediumModel;
  fs::create_directories(dir + "/medium");
  fs::create_directories(dir + "/tiny");
  // Buckets of 2 MiB: small against the model, as 32 MiB ones are against a real student (a
  // bucket of the 54M student at 32 MiB would be 15% of it, its AdamW pieces as large).
  const std::vector<std::string> sets = {"dist.zero_stage=2", "train.micro_batch_size=2",
                                         "dist.bucket_mb=2", "dist.timeout_s=300"};
  const double medium = SftPeakRssMb(dir + "/medium", medium_json, 4, sets);
  const double tiny =
      SftPeakRssMb(dir + "/tiny", kSource + "/configs/sft/tiny_model.json", 4, sets);
  ASSERT_GT(medium, 0);
  ASSERT_GT(tiny, 0);
  const lm::plan::LearnerSettings s = CpuSettings(4, sets);
  EXPECT_EQ(s.zero_stage, 2);
  EXPECT_EQ(s.micro_batch_tokens, 2 * 128);
  const auto planned = [&](const lm::ModelConfig& c) {
    return static_cast<double>(lm::plan::PlanLearner(c, s, {}).memory.peak()) / (1 << 20);
  };
  const double plan = planned(ReadModel(medium_json)) -
                      planned(ReadModel(kSource + "/configs/sft/tiny_model.json"));
  const double measured = medium - tiny;
  std::printf(
      "4 ranks, ZeRO-2: planned %.1f MiB, measured %.1f MiB (peaks %.1f - %.1f), ratio "
      "%.3f\n",
      plan, measured, medium, tiny, measured / plan);
  constexpr double kLargestParameterMiB = 16.0 * 1024 * 512 * 4 / (1 << 20);
  constexpr double kBucketsMiB = 4 * 2;
  EXPECT_GE(measured, 0.98 * (plan - kLargestParameterMiB - kBucketsMiB));
  EXPECT_LE(measured, plan + 4 * kLargestParameterMiB);
}

}  // namespace
