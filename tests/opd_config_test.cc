// Config validation of both learner jobs: every numeric range check refuses NaN and infinity, the
// sections SFT and OPD share are checked the same way for both, OPD refuses sampling filters that
// would bias its importance ratio, and every error names the key. No files, no processes.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/common/config.h"
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
  auto root = ParseYaml(base, "test");
  EXPECT_TRUE(root.ok()) << root.status();
  for (const auto& s : sets) EXPECT_TRUE(ApplyOverride(*root, s).ok()) << s;
  T c;
  const absl::Status st = DecodeConfig(*root, &c);
  EXPECT_TRUE(st.ok()) << st;
  return c;
}

absl::Status Sft(const std::vector<std::string>& sets) {
  return ValidateSftConfig(DecodeWith<SftConfig>(kSft, sets));
}
absl::Status Opd(const std::vector<std::string>& sets) {
  return ValidateOpdConfig(DecodeWith<OpdConfig>(kOpd, sets));
}

// `status` is an error whose message starts with the key.
void ExpectRefused(const absl::Status& status, const std::string& key, const std::string& set) {
  EXPECT_FALSE(status.ok()) << set << " was accepted";
  EXPECT_EQ(status.message().rfind(key + ":", 0), 0u) << set << ": " << status;
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
    auto c = LoadConfig<OpdConfig>(root + f, {});
    ASSERT_TRUE(c.ok()) << f << ": " << c.status();
    EXPECT_TRUE(ValidateOpdConfig(*c).ok()) << f << ": " << ValidateOpdConfig(*c);
    EXPECT_TRUE(OpdConfigWarnings(*c).empty()) << f;
  }
  for (const char* f : {"sft/marco_nano.yaml", "sft/tiny.yaml", "demo/sft.yaml"}) {
    auto c = LoadConfig<SftConfig>(root + f, {});
    ASSERT_TRUE(c.ok()) << f << ": " << c.status();
    EXPECT_TRUE(ValidateSftConfig(*c).ok()) << f << ": " << ValidateSftConfig(*c);
  }
}

}  // namespace
}  // namespace trainer
