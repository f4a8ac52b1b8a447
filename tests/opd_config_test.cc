// Config validation of both learner jobs: every numeric range check refuses NaN and infinity and
// every number has an upper bound (no integer runs truncated), a key written twice is an error,
// the sections SFT and OPD share are checked the same way for both, OPD refuses sampling filters
// that would bias its importance ratio, and every error names the key. Also the endpoint lists
// of swap-teacher (opd-ctl and the learner's admin service). No model, no data.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_join.h"

#include "lm/util/config.h"
#include "lm/util/limits.h"
#include "opd/v1/learner.grpc.pb.h"
#include "rpc/client.h"
#include "trainer/opd/learner_service.h"
#include "trainer/opd/opd_config.h"
#include "trainer/sft/sft_config.h"

namespace trainer {
namespace {

// The smallest configs that pass validation; each case below breaks one key with --set.
constexpr const char* kSft =
    "model: {path: m}\ndata: {train: [{files: [a.jsonl]}]}\nrun: {dir: r}\n";
constexpr const char* kOpd =
    "model: {path: m}\nprompts: {sources: [{files: [p.jsonl]}]}\nrollout: {endpoints: [r:1]}\n"
    "stages: [{name: s1, teachers: [t:1], max_steps: 3}]\nrun: {dir: r}\n";

template <class T>
T DecodeWith(const char* base, const std::vector<std::string>& sets) {
  auto root = lm::ParseYaml(base, "test");
  EXPECT_TRUE(root.ok()) << root.status();
  for (const auto& s : sets) EXPECT_TRUE(lm::ApplyOverride(*root, s).ok()) << s;
  T c;
  const absl::Status st = lm::DecodeConfig(*root, &c);
  EXPECT_TRUE(st.ok()) << st;
  return c;
}

// The decoding error of `sets` applied to `base` (OK when it decodes).
template <class T>
absl::Status DecodeError(const char* base, const std::vector<std::string>& sets) {
  auto root = lm::ParseYaml(base, "test");
  if (!root.ok()) return root.status();
  for (const auto& s : sets) {
    if (absl::Status st = lm::ApplyOverride(*root, s); !st.ok()) return st;
  }
  T c;
  return lm::DecodeConfig(*root, &c);
}

// The job's verdict on `sets`: the decoding error (a word not among a choice field's), else the
// validation's.
absl::Status Sft(const std::vector<std::string>& sets) {
  if (absl::Status s = DecodeError<SftConfig>(kSft, sets); !s.ok()) return s;
  return ValidateSftConfig(DecodeWith<SftConfig>(kSft, sets));
}
absl::Status Opd(const std::vector<std::string>& sets) {
  if (absl::Status s = DecodeError<OpdConfig>(kOpd, sets); !s.ok()) return s;
  return ValidateOpdConfig(DecodeWith<OpdConfig>(kOpd, sets));
}

// `status` is an error whose message starts with the key.
void ExpectRefused(const absl::Status& status, const std::string& key, const std::string& set) {
  EXPECT_FALSE(status.ok()) << set << " was accepted";
  EXPECT_EQ(status.message().rfind(key + ":", 0), 0u) << set << ": " << status;
}

bool Contains(const absl::Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

TEST(ConfigValidation, BaseConfigsPass) {
  EXPECT_TRUE(Sft({}).ok()) << Sft({});
  EXPECT_TRUE(Opd({}).ok()) << Opd({});
}

// `.nan` compares false with every bound, so `if (lr <= 0)` let it through; `.inf` passed every
// lower bound. Both must be refused wherever a number has a range.
TEST(ConfigValidation, NanAndInfinityAreRefusedByEveryRangeCheck) {
  const std::vector<std::string> shared = {
      "optim.lr",    "optim.min_lr", "optim.weight_decay", "optim.beta1",
      "optim.beta2", "optim.eps",    "optim.max_grad_norm"};
  const std::vector<std::string> sft_only = {"train.epochs", "train.aux_loss_coef",
                                             "data.train.0.weight"};
  const std::vector<std::string> opd_only = {"rollout.temperature",
                                             "rollout.top_p",
                                             "rollout.timeout_s",
                                             "train.teacher_timeout_s",
                                             "train.score_deadline_s",
                                             "prompts.sources.0.weight",
                                             "stages.0.plateau.min_rel_improvement",
                                             "stages.0.plateau.ema_beta",
                                             "loss.kl_coef",
                                             "loss.tis_cap",
                                             "loss.clip_low",
                                             "loss.clip_high",
                                             "loss.alpha",
                                             "loss.kl_discount",
                                             "loss.teacher_temperature"};
  // data.train.0.weight is reported as data.train[0].weight: the path as written in errors.
  auto error_key = [](std::string k) {
    for (const char* list : {"train.0.", "sources.0.", "stages.0."}) {
      const std::string from = list;
      const size_t at = k.find(from);
      if (at != std::string::npos)
        k.replace(at, from.size(), from.substr(0, from.size() - 3) + "[0].");
    }
    return k;
  };
  for (const char* bad : {".nan", ".inf", "-.inf"}) {
    for (const auto& key : shared) {
      const std::string set = key + "=" + bad;
      ExpectRefused(Sft({set}), error_key(key), "sft " + set);
      ExpectRefused(Opd({set}), error_key(key), "opd " + set);
    }
    for (const auto& key : sft_only) {
      const std::string set = key + "=" + bad;
      ExpectRefused(Sft({set}), error_key(key), "sft " + set);
    }
    for (const auto& key : opd_only) {
      const std::string set = key + "=" + bad;
      ExpectRefused(Opd({set}), error_key(key), "opd " + set);
    }
  }
  ExpectRefused(Opd({"loss.kl_discount=1.5"}), "loss.kl_discount", "discount above 1");
  ExpectRefused(Opd({"loss.normalization=tokens"}), "loss.normalization", "unknown normalization");
  // With a step budget the epochs are unused, but a NaN is still no number of epochs.
  ExpectRefused(Sft({"train.max_steps=5", "train.epochs=.nan"}), "train.epochs", "sft epochs nan");
  // An enabled plateau rule needs a threshold > 0: a change is never below 0, so it could never
  // fire.
  ExpectRefused(Opd({"stages.0.plateau.enabled=true", "stages.0.plateau.min_rel_improvement=0"}),
                "stages[0].plateau.min_rel_improvement", "opd min_rel 0");
}

// The sections SFT and OPD share are checked by one function: a value SFT refuses, OPD refuses
// too (before, OPD read `chat_format: qwen-2` as qwen3 and never looked at checkpoint/logging).
TEST(ConfigValidation, SharedSectionsAreCheckedTheSameForBothJobs) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model.chat_format=qwen-2", "model.chat_format"},
      {"model.path=\"\"", "model.path"},
      {"optim.min_lr=1", "optim.min_lr"},
      {"optim.beta2=1.0", "optim.beta2"},
      {"optim.warmup_steps=-1", "optim.warmup_steps"},
      {"checkpoint.every=-1", "checkpoint.every"},
      {"checkpoint.keep_last=-2", "checkpoint.keep_last"},
      {"logging.log_every=0", "logging.log_every"},
      {"run.dir=\"\"", "run.dir"},
      {"run.resume=sometimes", "run.resume"},
  };
  for (const auto& [set, key] : cases) {
    ExpectRefused(Sft({set}), key, "sft " + set);
    ExpectRefused(Opd({set}), key, "opd " + set);
  }
  EXPECT_NE(Opd({"model.chat_format=qwen-2"}).message().find("qwen3, qwen2"), std::string::npos);
  EXPECT_TRUE(Opd({"model.chat_format=qwen2"}).ok());
}

// Teachers by domain and the held-out convergence set: each mistake is refused naming its key.
TEST(ConfigValidation, DomainsAndHeldoutAreChecked) {
  const std::string pool = "stages.0.domains=[{domain: math, teachers: [\"t:1\"]}]";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"stages.0.domains=[{domain: math, teachers: [\"t:1\"]}, {domain: math, teachers: "
        "[\"t:2\"]}]"},
       "stages[0].domains[1].domain"},
      {{"stages.0.domains=[{domain: \"\", teachers: [\"t:1\"]}]"}, "stages[0].domains[0].domain"},
      {{"stages.0.domains=[{domain: math, teachers: []}]"}, "stages[0].domains[0].teachers"},
      {{"stages.0.domains=[{domain: math, teachers: [\"t:1\", \"t:1\"]}]"},
       "stages[0].domains[0].teachers[1]"},
      {{"stages.0.plateau={enabled: true, per_domain: true}"}, "stages[0].plateau.per_domain"},
      {{pool, "stages.0.plateau={enabled: true, per_domain: true, metric: heldout}",
        "heldout.sources=[{files: [h.jsonl]}]"},
       "stages[0].plateau.per_domain"},
      {{"stages.0.plateau.metric=heldout"}, "stages[0].plateau.metric"},
      {{"stages.0.plateau.metric=eval"}, "stages[0].plateau.metric"},
      {{"stages.0.plateau.z=-1"}, "stages[0].plateau.z"},
      {{"heldout.sources=[{files: [h.jsonl]}]", "heldout.every=0"}, "heldout.every"},
      {{"heldout.sources=[{files: [h.jsonl]}]", "heldout.num_prompts=0"}, "heldout.num_prompts"},
  };
  for (const auto& [sets, key] : cases) ExpectRefused(Opd(sets), key, absl::StrJoin(sets, " "));
  EXPECT_TRUE(Opd({pool, "stages.0.plateau={enabled: true, per_domain: true}"}).ok());
  EXPECT_TRUE(
      Opd({"heldout.sources=[{files: [h.jsonl]}]", "stages.0.plateau.metric=heldout"}).ok());
}

TEST(ConfigValidation, OpdTimeoutsAndCountsAreChecked) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"rollout.timeout_s=0", "rollout.timeout_s"},
      {"rollout.timeout_s=-5", "rollout.timeout_s"},
      {"rollout.weight_sync=nccl", "rollout.weight_sync"},
      {"rollout.weight_sync_timeout_s=0", "rollout.weight_sync_timeout_s"},
      {"rollout.weight_sync_bucket_mb=0", "rollout.weight_sync_bucket_mb"},
      {"train.teacher_timeout_s=0", "train.teacher_timeout_s"},
      {"train.threads=-1", "train.threads"},
      {"train.max_consecutive_nonfinite=0", "train.max_consecutive_nonfinite"},
      {"stages.0.plateau.min_steps=-1", "stages[0].plateau.min_steps"},
      {"loss.kl_coef=0", "loss.kl_coef"},
      {"loss.clip_low=1", "loss.clip_low"},
      {"prompts.sources.0.weight=0", "prompts.sources[0].weight"},
      {"prompts.sources.0.files=[]", "prompts.sources[0].files"},
      {"debug.nan_steps=[0]", "debug.nan_steps[0]"},
  };
  for (const auto& [set, key] : cases) ExpectRefused(Opd({set}), key, "opd " + set);
  for (const char* mode : {"grpc", "collective", "auto"})
    EXPECT_TRUE(Opd({std::string("rollout.weight_sync=") + mode}).ok()) << mode;
}

// Sampling filters make the sampler's log-probs (renormalised over the kept tokens) differ from
// the learner's (full softmax): OPD refuses them, saying why.
// The rollout section is lm::SamplingParams with the paper's defaults: the keys users write
// (rollout.temperature, rollout.seed, ...) decode into the one sampling type the sampler takes,
// and a section that writes none keeps 2 samples of up to 8192 tokens (not the type's 1 and 16).
TEST(ConfigValidation, RolloutSectionIsTheSamplingParams) {
  const OpdConfig defaults = DecodeWith<OpdConfig>(kOpd, {});
  EXPECT_EQ(defaults.rollout.samples_per_prompt, 2);
  EXPECT_EQ(defaults.rollout.max_new_tokens, 8192);
  EXPECT_EQ(defaults.rollout.temperature, 1.0);
  EXPECT_EQ(defaults.rollout.seed, 0);
  const OpdConfig set = DecodeWith<OpdConfig>(
      kOpd, {"rollout.samples_per_prompt=4", "rollout.temperature=0.7", "rollout.top_p=1.0",
             "rollout.top_k=0", "rollout.max_new_tokens=64", "rollout.seed=-3"});
  const lm::SamplingParams& p = set.rollout;  // the sampler's type, as the job slices it
  EXPECT_EQ(p.samples_per_prompt, 4);
  EXPECT_EQ(p.temperature, 0.7);
  EXPECT_EQ(p.max_new_tokens, 64);
  EXPECT_EQ(p.seed, -3);
  // The resolved config writes them under rollout, where a user wrote them.
  auto root = lm::ParseYaml(lm::EncodeConfig(set), "resolved");
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ((*root)["rollout"]["temperature"].as<double>(), 0.7);
  EXPECT_EQ((*root)["rollout"]["seed"].as<int64_t>(), -3);
  EXPECT_TRUE(ValidateOpdConfig(set).ok());
}

TEST(ConfigValidation, OpdRefusesTopPAndTopK) {
  for (const char* set : {"rollout.top_p=0.9", "rollout.top_p=0", "rollout.top_p=1.5"}) {
    const absl::Status s = Opd({set});
    ExpectRefused(s, "rollout.top_p", set);
    EXPECT_NE(s.message().find("importance ratio"), std::string::npos) << s;
  }
  for (const char* set : {"rollout.top_k=50", "rollout.top_k=-1"}) {
    const absl::Status s = Opd({set});
    ExpectRefused(s, "rollout.top_k", set);
    EXPECT_NE(s.message().find("importance ratio"), std::string::npos) << s;
  }
  EXPECT_TRUE(Opd({"rollout.top_p=1.0", "rollout.top_k=0"}).ok());
}

// Every choice field is an enum decoded once: a word not among its choices is an error naming the
// key and every choice, and so is a list or a mapping.
TEST(ConfigEnums, UnknownWordsNameTheKeyAndTheChoices) {
  const std::vector<std::pair<std::string, std::string>> shared = {
      {"model.chat_format", "qwen3, qwen2"},
      {"train.precision", "auto, fp32, bf16-mixed"},
      {"run.resume", "auto, never"},
      {"dist.backend", "auto, gloo, nccl"},
      {"dist.allgather_dtype", "auto, float32, bfloat16"},
      {"dist.zero_stage", "auto, 1, 2"},
  };
  for (const auto& [key, choices] : shared) {
    const std::string want = key + ": 'bogus' is not one of " + choices;
    EXPECT_EQ(DecodeError<SftConfig>(kSft, {key + "=bogus"}).message(), want);
    EXPECT_EQ(DecodeError<OpdConfig>(kOpd, {key + "=bogus"}).message(), want);
  }
  EXPECT_EQ(DecodeError<SftConfig>(kSft, {"data.overlong=cut"}).message(),
            "data.overlong: 'cut' is not one of truncate, drop");
  const std::vector<std::pair<std::string, std::string>> opd = {
      {"rollout.weight_sync", "grpc, collective, auto"},
      {"loss.form", "sampled, topk"},
      {"loss.correction", "none, tis, ppo"},
      {"loss.divergence", "forward, reverse, mixed"},
      {"loss.normalization", "token, sequence"},
  };
  for (const auto& [key, choices] : opd)
    EXPECT_EQ(DecodeError<OpdConfig>(kOpd, {key + "=bogus"}).message(),
              key + ": 'bogus' is not one of " + choices);
  EXPECT_EQ(DecodeError<OpdConfig>(kOpd, {"stages.0.plateau.metric=eval"}).message(),
            "stages[0].plateau.metric: 'eval' is not one of auto, train, heldout");
  // Words are exact: no case folding, no other spelling.
  EXPECT_FALSE(DecodeError<OpdConfig>(kOpd, {"loss.form=TopK"}).ok());
  EXPECT_FALSE(DecodeError<OpdConfig>(kOpd, {"loss.form=top-k"}).ok());
  EXPECT_EQ(DecodeError<OpdConfig>(kOpd, {"loss.form=[topk]"}).message(),
            "loss.form: expected a word, got a list");
  // Through the whole pipeline, as the job reports it (exit 2).
  const std::string path = testing::TempDir() + "/bad_enum.yaml";
  std::ofstream(path) << kOpd << "loss: {correction: clip}\n";
  auto c = lm::LoadConfig<OpdConfig>(path, {});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), path + ": loss.correction: 'clip' is not one of none, tis, ppo");
}

// The YAML spellings decode to their values; the defaults are the documented ones.
TEST(ConfigEnums, SpellingsDecodeToTheirValues) {
  const OpdConfig d = DecodeWith<OpdConfig>(kOpd, {});
  EXPECT_EQ(d.model.chat_format, ChatFormatName::kQwen3);
  EXPECT_EQ(d.train.precision, PrecisionSetting::kAuto);
  EXPECT_EQ(d.run.resume, ResumeMode::kAuto);
  EXPECT_EQ(d.dist.backend, DistBackend::kAuto);
  EXPECT_EQ(d.dist.allgather_dtype, AllGatherDtype::kAuto);
  EXPECT_EQ(d.dist.zero_stage, ZeroStage::kAuto);
  EXPECT_EQ(d.rollout.weight_sync, WeightSyncMode::kGrpc);
  EXPECT_EQ(d.stages[0].plateau.metric, PlateauMetric::kAuto);
  EXPECT_EQ(d.loss.form, LossForm::kSampled);
  EXPECT_EQ(d.loss.correction, Correction::kTruncatedIs);
  EXPECT_EQ(d.loss.divergence, TopKDivergence::kMixed);
  EXPECT_EQ(d.loss.normalization, Normalization::kToken);
  const OpdConfig c = DecodeWith<OpdConfig>(
      kOpd, {"model.chat_format=qwen2", "train.precision=bf16-mixed", "run.resume=never",
             "dist.backend=nccl", "dist.allgather_dtype=bfloat16", "dist.zero_stage=2",
             "rollout.weight_sync=collective", "stages.0.plateau.metric=heldout", "loss.form=topk",
             "loss.correction=ppo", "loss.divergence=reverse", "loss.normalization=sequence"});
  EXPECT_EQ(c.model.chat_format, ChatFormatName::kQwen2);
  EXPECT_EQ(c.train.precision, PrecisionSetting::kBf16Mixed);
  EXPECT_EQ(c.run.resume, ResumeMode::kNever);
  EXPECT_EQ(c.dist.backend, DistBackend::kNccl);
  EXPECT_EQ(c.dist.allgather_dtype, AllGatherDtype::kBfloat16);
  EXPECT_EQ(c.dist.zero_stage, ZeroStage::kTwo);
  EXPECT_EQ(c.rollout.weight_sync, WeightSyncMode::kCollective);
  EXPECT_EQ(c.stages[0].plateau.metric, PlateauMetric::kHeldout);
  EXPECT_EQ(c.loss.form, LossForm::kTopK);
  EXPECT_EQ(c.loss.correction, Correction::kPpoClip);
  EXPECT_EQ(c.loss.divergence, TopKDivergence::kReverse);
  EXPECT_EQ(c.loss.normalization, Normalization::kSequence);
  EXPECT_EQ(
      DecodeWith<OpdConfig>(kOpd, {"loss.correction=none", "dist.backend=gloo"}).loss.correction,
      Correction::kNone);
  EXPECT_EQ(DecodeWith<SftConfig>(kSft, {"data.overlong=drop"}).data.overlong,
            lm::OverlongPolicy::kDrop);
  EXPECT_EQ(DecodeWith<SftConfig>(kSft, {}).data.overlong, lm::OverlongPolicy::kTruncate);
  EXPECT_STREQ(lm::ChoiceName(LossForm::kTopK), "topk");
  EXPECT_STREQ(lm::ChoiceName(PrecisionSetting::kBf16Mixed), "bf16-mixed");
}

// The resolved config (config.yaml in the run directory) writes each enum as its word, quoted as
// the string fields were, and reads back to the same values and the same text.
TEST(ConfigEnums, ResolvedConfigRoundTrips) {
  const OpdConfig c = DecodeWith<OpdConfig>(
      kOpd, {"loss.form=topk", "loss.correction=none", "rollout.weight_sync=auto",
             "stages.0.plateau.metric=heldout", "train.precision=fp32"});
  const std::string text = lm::EncodeConfig(c);
  for (const char* line :
       {"form: \"topk\"", "correction: \"none\"", "weight_sync: \"auto\"", "metric: \"heldout\"",
        "precision: \"fp32\"", "chat_format: \"qwen3\"", "divergence: \"mixed\"",
        "normalization: \"token\"", "resume: \"auto\"", "backend: \"auto\"",
        "allgather_dtype: \"auto\"", "zero_stage: \"auto\""})
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  auto root = lm::ParseYaml(text, "resolved");
  ASSERT_TRUE(root.ok()) << root.status();
  OpdConfig again;
  ASSERT_TRUE(lm::DecodeConfig(*root, &again).ok()) << text;
  EXPECT_EQ(lm::EncodeConfig(again), text);
  EXPECT_EQ(again.loss.form, LossForm::kTopK);
  EXPECT_EQ(again.loss.correction, Correction::kNone);
  EXPECT_EQ(again.rollout.weight_sync, WeightSyncMode::kAuto);
  EXPECT_EQ(again.stages[0].plateau.metric, PlateauMetric::kHeldout);
  EXPECT_EQ(again.train.precision, PrecisionSetting::kFp32);

  const SftConfig s =
      DecodeWith<SftConfig>(kSft, {"data.overlong=drop", "model.chat_format=qwen2"});
  const std::string sft_text = lm::EncodeConfig(s);
  EXPECT_NE(sft_text.find("overlong: \"drop\""), std::string::npos) << sft_text;
  auto sft_root = lm::ParseYaml(sft_text, "resolved");
  ASSERT_TRUE(sft_root.ok()) << sft_root.status();
  SftConfig sft_again;
  ASSERT_TRUE(lm::DecodeConfig(*sft_root, &sft_again).ok()) << sft_text;
  EXPECT_EQ(lm::EncodeConfig(sft_again), sft_text);
  EXPECT_EQ(sft_again.data.overlong, lm::OverlongPolicy::kDrop);
  EXPECT_EQ(sft_again.model.chat_format, ChatFormatName::kQwen2);
}

TEST(ConfigValidation, TeacherTemperatureOtherThanRolloutTemperatureWarns) {
  EXPECT_TRUE(OpdConfigWarnings(DecodeWith<OpdConfig>(kOpd, {})).empty());
  EXPECT_TRUE(OpdConfigWarnings(DecodeWith<OpdConfig>(kOpd, {"rollout.temperature=0.7",
                                                             "loss.teacher_temperature=0.7"}))
                  .empty());
  const auto w = OpdConfigWarnings(DecodeWith<OpdConfig>(kOpd, {"loss.teacher_temperature=0.5"}));
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("loss.teacher_temperature (0.5)"), std::string::npos) << w[0];
  EXPECT_NE(w[0].find("rollout.temperature (1)"), std::string::npos) << w[0];
  // A warning, not an error: the setting is allowed.
  EXPECT_TRUE(Opd({"loss.teacher_temperature=0.5"}).ok());
}

// The configs in the repository pass the stricter checks (the demo's placeholders are non-empty
// strings, which is all validation asks of paths and endpoints).
TEST(ConfigValidation, ShippedConfigsPass) {
  const std::string root = std::string(OPD_SOURCE_DIR) + "/configs/";
  for (const char* f : {"opd/marco_nano.yaml", "demo/opd.yaml"}) {
    auto c = lm::LoadConfig<OpdConfig>(root + f, {});
    ASSERT_TRUE(c.ok()) << f << ": " << c.status();
    EXPECT_TRUE(ValidateOpdConfig(*c).ok()) << f << ": " << ValidateOpdConfig(*c);
    EXPECT_TRUE(OpdConfigWarnings(*c).empty()) << f;
  }
  for (const char* f : {"sft/marco_nano.yaml", "sft/tiny.yaml", "demo/sft.yaml"}) {
    auto c = lm::LoadConfig<SftConfig>(root + f, {});
    ASSERT_TRUE(c.ok()) << f << ": " << c.status();
    EXPECT_TRUE(ValidateSftConfig(*c).ok()) << f << ": " << ValidateSftConfig(*c);
  }
}

}  // namespace
}  // namespace trainer

namespace trainer {
namespace {

// yaml-cpp keeps both entries of a repeated key and a lookup finds the first: a second `train:`
// block was silently ignored. It is an error naming the key's path and both lines.
TEST(Config, DuplicateKeysAreErrorsNamingKeyAndLine) {
  auto top =
      lm::ParseYaml("train:\n  threads: 1\nrun: {dir: r}\ntrain:\n  threads: 2\n", "job.yaml");
  ASSERT_FALSE(top.ok());
  EXPECT_EQ(top.status().message(), "job.yaml:4:1: duplicate key 'train' (first at line 1)");
  auto nested = lm::ParseYaml("train:\n  threads: 1\n  seed: 3\n  threads: 2\n", "job.yaml");
  ASSERT_FALSE(nested.ok());
  EXPECT_EQ(nested.status().message(),
            "job.yaml:4:3: duplicate key 'train.threads' (first at line 2)");
  auto in_list = lm::ParseYaml("stages:\n  - name: a\n  - {name: b, max_steps: 1, name: c}\n", "j");
  ASSERT_FALSE(in_list.ok());
  EXPECT_TRUE(Contains(in_list.status(), "j:3:")) << in_list.status();
  EXPECT_TRUE(Contains(in_list.status(), "duplicate key 'stages[1].name'")) << in_list.status();
  // Quoting does not make it another key: both decode as `seed`.
  EXPECT_FALSE(lm::ParseYaml("seed: 1\n\"seed\": 2\n", "j").ok());
  // The same name in different mappings is no duplicate.
  EXPECT_TRUE(lm::ParseYaml("a: {x: 1}\nb: {x: 1}\nl: [{x: 1}, {x: 2}]\n", "j").ok());

  // Aliases are walked where they are used: an alias bomb (10^7 nodes from 70 lines) is refused
  // instead of walked.
  std::string bomb = "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 7; ++i) {
    const std::string prev = "*l" + std::to_string(i - 1);
    bomb += "l" + std::to_string(i) + ": &l" + std::to_string(i) + " [" + prev;
    for (int j = 1; j < 10; ++j) bomb += ", " + prev;
    bomb += "]\n";
  }
  auto bombed = lm::ParseYaml(bomb, "j");
  ASSERT_FALSE(bombed.ok());
  EXPECT_TRUE(Contains(bombed.status(), "YAML nodes")) << bombed.status();

  // A --set value is checked as a file is.
  auto root = lm::ParseYaml(kSft, "test");
  ASSERT_TRUE(root.ok());
  const absl::Status set = lm::ApplyOverride(*root, "train={threads: 1, threads: 2}");
  EXPECT_FALSE(set.ok());
  EXPECT_TRUE(Contains(set, "duplicate key 'train.threads'")) << set;

  // Through the whole pipeline (what the job's exit 2 reports).
  const std::string path = testing::TempDir() + "/duplicate_block.yaml";
  std::ofstream(path) << kOpd << "train:\n  threads: 1\ntrain:\n  threads: 100\n";
  auto c = lm::LoadConfig<OpdConfig>(path, {});
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(Contains(c.status(), path + ":8:1: duplicate key 'train' (first at line 6)"))
      << c.status();
}

// An integer is decoded whole or refused: never wrapped, clamped or truncated.
TEST(Config, IntegersOutOfRangeAreRefusedWhenDecoded) {
  const absl::Status big = DecodeError<SftConfig>(kSft, {"data.max_seq_len=9223372036854775808"});
  EXPECT_EQ(big.message(),
            "data.max_seq_len: expected an integer in [-9223372036854775808, "
            "9223372036854775807], got '9223372036854775808'");
  EXPECT_FALSE(DecodeError<SftConfig>(kSft, {"data.max_seq_len=-9223372036854775809"}).ok());
  EXPECT_FALSE(DecodeError<SftConfig>(kSft, {"data.max_seq_len=8192.5"}).ok());
  EXPECT_TRUE(DecodeError<SftConfig>(kSft, {"data.seed=-9223372036854775808"}).ok());
}

// 4294967424 is 2^32 + 128: it ran as 128 through an int32 cast while config.yaml recorded the
// big value; threads 100000 hung creating them. Every count has an upper bound, named in the
// error, and the bound itself is accepted.
TEST(ConfigValidation, EveryIntegerHasAnUpperBound) {
  const absl::Status seq = Sft({"data.max_seq_len=4294967424"});
  ExpectRefused(seq, "data.max_seq_len", "max_seq_len 2^32 + 128");
  EXPECT_TRUE(Contains(seq, "must be in [8, 16777216], got 4294967424")) << seq;
  for (auto* job : {&Sft, &Opd}) {
    const absl::Status threads = (*job)({"train.threads=100000"});
    ExpectRefused(threads, "train.threads", "threads 100000");
    EXPECT_TRUE(Contains(threads, "[0, 1024]")) << threads;
    EXPECT_TRUE((*job)({"train.threads=1024"}).ok());
  }
  const std::string int32_over = "=2147483648", steps_over = "=2147483648",
                    tokens_over = "=16777217";
  const std::vector<std::pair<std::string, std::string>> shared = {
      {"optim.warmup_steps" + steps_over, "optim.warmup_steps"},
      {"checkpoint.every" + steps_over, "checkpoint.every"},
      {"checkpoint.keep_last" + int32_over, "checkpoint.keep_last"},
      {"logging.log_every" + steps_over, "logging.log_every"},
      {"train.max_consecutive_nonfinite" + steps_over, "train.max_consecutive_nonfinite"},
  };
  for (const auto& [set, key] : shared) {
    ExpectRefused(Sft({set}), key, "sft " + set);
    ExpectRefused(Opd({set}), key, "opd " + set);
  }
  const std::vector<std::pair<std::string, std::string>> sft = {
      {"train.global_batch_size=1048577", "train.global_batch_size"},
      {"train.micro_batch_size=1048577", "train.micro_batch_size"},
      {"train.max_steps" + steps_over, "train.max_steps"},
      {"eval.every" + steps_over, "eval.every"},
      {"eval.max_sequences" + int32_over, "eval.max_sequences"},
      {"eval.micro_batch_size=1048577", "eval.micro_batch_size"},
      {"debug.nan_steps=[0]", "debug.nan_steps[0]"},
      {"debug.nan_steps=[1, 2147483648]", "debug.nan_steps[1]"},
      {"debug.step_sleep_ms=3600001", "debug.step_sleep_ms"},
      {"debug.kill_rank=-2", "debug.kill_rank"},
      {"debug.kill_at_step=-1", "debug.kill_at_step"},
  };
  for (const auto& [set, key] : sft) ExpectRefused(Sft({set}), key, "sft " + set);
  const std::vector<std::pair<std::string, std::string>> opd = {
      {"prompts.max_prompt_len" + tokens_over, "prompts.max_prompt_len"},
      {"rollout.max_new_tokens" + tokens_over, "rollout.max_new_tokens"},
      {"rollout.samples_per_prompt=1048577", "rollout.samples_per_prompt"},
      {"rollout.weight_sync_bucket_mb=8796093022208", "rollout.weight_sync_bucket_mb"},
      {"train.prompts_per_step=1048577", "train.prompts_per_step"},
      {"train.micro_batch_tokens" + tokens_over, "train.micro_batch_tokens"},
      {"stages.0.max_steps=9223372036854775807", "stages[0].max_steps"},
      {"stages.0.plateau.window=9223372036854775807", "stages[0].plateau.window"},
      {"stages.0.plateau.min_steps" + steps_over, "stages[0].plateau.min_steps"},
      {"debug.nan_steps=[2147483648]", "debug.nan_steps[0]"},
  };
  for (const auto& [set, key] : opd) ExpectRefused(Opd({set}), key, "opd " + set);
  ExpectRefused(Opd({"loss.form=topk", "loss.top_k=16777217"}), "loss.top_k", "top_k 2^24 + 1");
  // The bounds themselves pass.
  EXPECT_TRUE(Sft({"data.max_seq_len=16777216", "train.global_batch_size=1048576",
                   "train.max_steps=2147483647", "debug.kill_rank=-1"})
                  .ok());
  EXPECT_TRUE(Opd({"rollout.max_new_tokens=16777216", "prompts.max_prompt_len=16777216",
                   "rollout.samples_per_prompt=1048576", "stages.0.max_steps=2147483647",
                   "loss.form=topk", "loss.top_k=16777216"})
                  .ok());
}

// Deadlines, buffer sizes, epochs and weights are bounded too: 1e300 seconds or MiB overflowed
// their conversions (an int64 cast of 1e300 is undefined).
TEST(ConfigValidation, EveryRealHasABound) {
  const std::vector<std::pair<std::string, std::string>> shared = {
      {"dist.timeout_s=604801", "dist.timeout_s"},
      {"dist.bucket_mb=1e300", "dist.bucket_mb"},
  };
  for (const auto& [set, key] : shared) {
    ExpectRefused(Sft({set}), key, "sft " + set);
    ExpectRefused(Opd({set}), key, "opd " + set);
  }
  const absl::Status bucket = Opd({"dist.bucket_mb=1048577"});
  EXPECT_TRUE(Contains(bucket, "in (0, 1048576], got 1048577")) << bucket;  // not 1.04858e+06
  ExpectRefused(Sft({"train.epochs=1e7"}), "train.epochs", "epochs 1e7");
  ExpectRefused(Sft({"train.max_steps=3", "train.epochs=-1"}), "train.epochs", "epochs -1");
  ExpectRefused(Sft({"data.train.0.weight=1e13"}), "data.train[0].weight", "weight 1e13");
  const std::vector<std::pair<std::string, std::string>> opd = {
      {"rollout.timeout_s=1e9", "rollout.timeout_s"},
      {"rollout.weight_sync_timeout_s=1e9", "rollout.weight_sync_timeout_s"},
      {"train.teacher_timeout_s=1e9", "train.teacher_timeout_s"},
      {"train.score_deadline_s=1e9", "train.score_deadline_s"},
      {"stages.0.plateau.min_rel_improvement=-1", "stages[0].plateau.min_rel_improvement"},
  };
  for (const auto& [set, key] : opd) ExpectRefused(Opd({set}), key, "opd " + set);
  EXPECT_TRUE(Sft({"dist.timeout_s=604800", "dist.bucket_mb=1048576", "train.epochs=1e6"}).ok());
  EXPECT_TRUE(Opd({"rollout.timeout_s=604800", "train.score_deadline_s=604800"}).ok());
}

// 1e-45 is a float denormal: logits / T overflowed to inf and the log-probs were NaN. Both
// temperatures (sampling and teacher scoring) are refused below lm::kMinTemperature.
TEST(ConfigValidation, TemperaturesBelowTheMinimumAreRefused) {
  for (const char* key : {"rollout.temperature", "loss.teacher_temperature"}) {
    for (const char* bad : {"1e-45", "5e-5", "0", "-1", "1001", ".nan"}) {
      const std::string set = std::string(key) + "=" + bad;
      const absl::Status s = Opd({set});
      ExpectRefused(s, key, set);
      EXPECT_TRUE(Contains(s, "must be in [1e-04, 1000], got ")) << s;
    }
  }
  EXPECT_EQ(lm::kMinTemperature, 1e-4);
  EXPECT_EQ(lm::kMaxTemperature, 1000);
  EXPECT_TRUE(Opd({"rollout.temperature=1e-4", "loss.teacher_temperature=1e-4"}).ok());
  EXPECT_TRUE(Opd({"rollout.temperature=1000", "loss.teacher_temperature=1000"}).ok());
}

// A replica listed twice would be connected twice and get two shares of every step.
TEST(ConfigValidation, EndpointListsHaveNoDuplicatesOrBlanks) {
  const absl::Status rollout = Opd({"rollout.endpoints=[r:1, r:2, r:1]"});
  ExpectRefused(rollout, "rollout.endpoints[2]", "rollout twice");
  EXPECT_TRUE(Contains(rollout, "'r:1' is listed twice (also rollout.endpoints[0])")) << rollout;
  ExpectRefused(Opd({"stages.0.teachers=[t:1, t:1]"}), "stages[0].teachers[1]", "teacher twice");
  ExpectRefused(Opd({"stages.0.teachers=[\"\"]"}), "stages[0].teachers[0]", "empty teacher");
  ExpectRefused(Opd({"rollout.endpoints=[\"\"]"}), "rollout.endpoints[0]", "empty rollout");
  EXPECT_TRUE(Opd({"rollout.endpoints=[r:1, r:2]", "stages.0.teachers=[t:1, t:2]"}).ok());
}

// The learner's admin service refuses a swap naming a replica twice at once (INVALID_ARGUMENT),
// before queueing it for the step boundary.
TEST(SwapTeacher, ServiceRefusesAnEndpointGivenTwice) {
  LearnerServerOptions lo;
  lo.listen = "127.0.0.1:0";
  lo.secret = "swap-test-secret";
  lo.stages = {"s1"};
  auto learner = LearnerServer::Start(lo);
  ASSERT_TRUE(learner.ok()) << learner.status();
  opd::rpc::ClientOptions co;
  co.address = "127.0.0.1:" + std::to_string((*learner)->port());
  co.secret = lo.secret;
  co.timeout = absl::Seconds(30);
  auto channel = opd::rpc::MakeChannel(co);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto stub = opd::v1::Learner::NewStub(*channel);
  for (const std::vector<std::string>& endpoints :
       std::vector<std::vector<std::string>>{{"t:1", "t:1"}, {"t:1", "t:2", "t:1"}, {"t:1", ""}}) {
    opd::v1::SwapTeacherRequest req;
    req.set_stage("s1");
    for (const auto& e : endpoints) req.add_endpoints(e);
    opd::v1::SwapTeacherResponse resp;
    grpc::ClientContext ctx;
    opd::rpc::PrepareContext(co, &ctx);
    const grpc::Status s = stub->SwapTeacher(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(endpoints[1].empty() ? "empty" : "listed twice"),
              std::string::npos)
        << s.error_message();
    EXPECT_FALSE((*learner)->swap_pending());
  }
}

// opd-ctl refuses it too, with exit 2 (a bad flag), before connecting to anything.
TEST(SwapTeacher, CtlRefusesAnEndpointGivenTwice) {
  const std::string out = testing::TempDir() + "/swap_twice.txt";
  for (const char* endpoints : {"t:1,t:1", "t:1, t:2 ,t:1", ","}) {
    const std::string cmd = std::string(OPD_BINARY_DIR) +
                            "/ctl/opd-ctl swap-teacher --learner 127.0.0.1:1 --stage s1 "
                            "--endpoints '" +
                            endpoints + "' > " + out + " 2>&1";
    const int rc = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(rc)) << cmd;
    EXPECT_EQ(WEXITSTATUS(rc), 2) << cmd;
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    const bool blank = std::string(endpoints) == ",";
    EXPECT_NE(text.find(blank ? "--endpoints: no endpoint given" : "'t:1' is given twice"),
              std::string::npos)
        << text;
  }
}

}  // namespace
}  // namespace trainer
