// opd-ctl plan --config JOB.yaml [--model-config F] [--teacher-config F1,F2] [--gpus N] ...
// The memory and time plan of an SFT or OPD job (lm/plan/plan.h): for the learner's ranks, the
// rollout workers and each stage's teachers, what one device holds and a roofline time per step.
// Exit 0 when every process fits its device, 1 when one does not (the refusal it would get at
// start-up on stderr), 2 on a bad flag.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "ctl/args.h"
#include "ctl/command.h"
#include "ctl/flag_ranges.h"
#include "ctl/model_config_file.h"
#include "lm/model/config.h"
#include "lm/plan/plan.h"
#include "lm/plan/step_plan.h"
#include "lm/util/config.h"
#include "lm/util/limits.h"
#include "lm/util/status.h"
#include "trainer/common/learner_plan.h"

namespace ctl {
namespace {

namespace fs = std::filesystem;
using lm::plan::DeviceSpec;
using lm::plan::ProcessPlan;

constexpr const char* kUsage =
    "usage: opd-ctl plan --config JOB.yaml [flags]\n"
    "  --config JOB.yaml       an SFT or OPD job config (OPD when it has stages:)\n"
    "  --model-config F        the student's config.json when model.path has none\n"
    "  --teacher-config F,G    each stage's teacher config.json, in stage order (default: the\n"
    "                          one file of --models-dir whose name starts with the stage's name)\n"
    "  --models-dir DIR        where default teacher configs are found (configs/models)\n"
    "  --gpus N                devices of the job (64)\n"
    "  --gpu-memory-gb G       memory of one device, GiB (139: an H200 as it reports itself)\n"
    "  --hbm-tbps B            HBM bandwidth, TB/s (4.8)\n"
    "  --tflops F              dense bf16 peak, TFLOP/s (989)\n"
    "  --precision P           the learner's: bf16-mixed (default) | fp32\n"
    "  --rollout-gpus N        rollout workers (default: rollout.endpoints)\n"
    "  --teacher-gpus N        teacher replicas per stage (default: the stage's endpoints)\n"
    "  --teacher-ep N          devices per teacher replica, expert parallel (default: the\n"
    "                          fewest of 1, 2, 4, ... that fit)\n"
    "  --learner-gpus N        learner ranks (default: --gpus less the rollout and the largest\n"
    "                          stage's teachers; SFT: --gpus)\n"
    "  --kv-cache-gb G         a rollout worker's KV pool (0: what its device leaves; default 0)\n"
    "  --max-running-seqs N    sequences a rollout worker decodes at once (256)\n"
    "  --kv-block-size N       tokens per KV block (16)\n"
    "  --max-batch-tokens N    a teacher's scoring bucket (16384)\n"
    "  --logprob-chunk N       a teacher's logits chunk, rows (512)\n"
    "  --decode-efficiency E   share of the HBM roof decode reaches (0.30, docs/gpu.md)\n"
    "  --forward-efficiency E  share of the bf16 peak prefill and scoring reach (0.20)\n"
    "  --learn-efficiency E    share of the bf16 peak the learner's passes reach (0.09)\n"
    "  --push-gbps G           GB/s a worker receives a weight push at (25)\n"
    "  --response-tokens N     the responses' mean length for the step's time (default: half\n"
    "                          rollout.max_new_tokens; the worst case is printed too)\n"
    "exit 0: every process fits; 1: one does not (its start-up refusal is printed); 2: bad flag\n";

constexpr int64_t kMaxDevices = int64_t{1} << 20;
using lm::limits::kMaxGiB;
constexpr double kMaxTbps = 1000, kMaxTflops = 1e6;
// Expert-parallel devices per teacher replica tried by default (the largest nodes have 8; 64 is
// far above what any published MoE needs in bf16).
constexpr int64_t kMaxExpertParallel = 64;

absl::Status CheckRanges(const Args& a) {
  return FirstError({
      CheckFlagRange("--gpus", a.Int64("gpus", 64), 1, kMaxDevices),
      CheckFlagPositive("--gpu-memory-gb", a.Number("gpu-memory-gb", 139), kMaxGiB),
      CheckFlagPositive("--hbm-tbps", a.Number("hbm-tbps", 4.8), kMaxTbps),
      CheckFlagPositive("--tflops", a.Number("tflops", 989), kMaxTflops),
      CheckFlagRange("--rollout-gpus", a.Int64("rollout-gpus", 1), 1, kMaxDevices),
      CheckFlagRange("--teacher-gpus", a.Int64("teacher-gpus", 1), 1, kMaxDevices),
      CheckFlagRange("--learner-gpus", a.Int64("learner-gpus", 1), 1, kMaxDevices),
      CheckFlagRange("--teacher-ep", a.Int64("teacher-ep", 1), 1, kMaxExpertParallel),
      CheckFlagRange("--kv-cache-gb", a.Number("kv-cache-gb", 0), 0.0, kMaxGiB),
      CheckFlagRange("--max-running-seqs", a.Int64("max-running-seqs", 256), 1, kMillion),
      CheckFlagRange("--kv-block-size", a.Int64("kv-block-size", 16), 1, 1024),
      CheckFlagRange("--max-batch-tokens", a.Int64("max-batch-tokens", 16384), 1, kMaxTokens),
      CheckFlagRange("--logprob-chunk", a.Int64("logprob-chunk", 512), 1, kMaxTokens),
      CheckFlagRange("--decode-efficiency", a.Number("decode-efficiency", 0.3), 1e-3, 1.0),
      CheckFlagRange("--forward-efficiency", a.Number("forward-efficiency", 0.2), 1e-3, 1.0),
      CheckFlagRange("--learn-efficiency", a.Number("learn-efficiency", 0.09), 1e-3, 1.0),
      CheckFlagPositive("--push-gbps", a.Number("push-gbps", 25), kMaxTbps * 1000),
      CheckFlagRange("--response-tokens", a.Int64("response-tokens", 1), 1, kMaxTokens),
  });
}

// model.path's config.json, else --model-config (the shipped configs' paths are placeholders).
absl::StatusOr<lm::ModelConfig> StudentConfig(const std::string& model_path, const Args& a) {
  const std::string own = model_path + "/config.json";
  if (!model_path.empty() && fs::is_regular_file(own)) return ReadModelConfigFile(own);
  if (a.Has("model-config")) return ReadModelConfigFile(a.Get("model-config"));
  return absl::NotFoundError(absl::StrCat(
      "model.path '", model_path,
      "' has no config.json: pass --model-config F (e.g. configs/models/marco_nano.json)"));
}

// Stage `i`'s teacher: the i-th of --teacher-config, else the one file of the models directory
// whose name starts with the stage's name; nullopt (the stage is not planned) when neither.
absl::StatusOr<std::optional<lm::ModelConfig>> TeacherConfig(const std::string& stage, size_t i,
                                                             const Args& a) {
  const std::vector<std::string> given =
      absl::StrSplit(a.Get("teacher-config"), ',', absl::SkipEmpty());
  if (i < given.size()) return ReadModelConfigFile(given[i]);
  const fs::path dir = a.Get("models-dir", "configs/models");
  std::vector<fs::path> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, stage) && absl::EndsWith(name, ".json")) found.push_back(e.path());
  }
  if (found.size() != 1) return std::optional<lm::ModelConfig>();
  return ReadModelConfigFile(found[0].string());
}

int64_t CeilDiv(int64_t a, int64_t b) {
  return b > 0 ? (a + b - 1) / b : 0;
}

// The job's deadlines against its planned step: each one that the planned work would pass.
std::vector<std::string> TimeoutWarnings(const trainer::OpdConfig& c,
                                         const lm::plan::StepPlan& step) {
  std::vector<std::string> out;
  const auto check = [&](const char* name, double limit, double needed, const char* what) {
    if (limit < needed)
      out.push_back(absl::StrFormat("%s %s is shorter than %s (%s)", name,
                                    lm::plan::FormatSeconds(limit), what,
                                    lm::plan::FormatSeconds(needed)));
  };
  // A rank's Generate call lasts about as long as its worker's whole step of sampling (every
  // rank's sequences share the worker's pool).
  check("rollout.timeout_s", c.rollout.timeout_s, step.sample, "a worker's planned sampling");
  // A Score call waits its turn behind the calls of every rank on its replica.
  check("train.teacher_timeout_s", c.train.teacher_timeout_s, step.score,
        "a teacher replica's planned scoring of a step");
  check("train.score_deadline_s", c.train.score_deadline_s, step.step, "the planned step");
  check("rollout.weight_sync_timeout_s", c.rollout.weight_sync_timeout_s, step.push,
        "the planned weight push");
  check("dist.timeout_s", c.dist.timeout_s, step.optimizer + step.micro_batch,
        "the step's collective part (reductions and the optimizer)");
  return out;
}

// A KV pool that holds fewer sequences than the worker decodes at once makes decode run in more
// waves than --max-running-seqs says; empty when it holds them.
std::string PoolWarning(const lm::ModelConfig& student, const lm::plan::RolloutSettings& r,
                        const DeviceSpec& d) {
  const int64_t held = lm::plan::RolloutKvPoolSequences(student, r, d.memory_bytes);
  const int64_t share = CeilDiv(r.sequences_per_step, std::max<int64_t>(r.workers, 1));
  const int64_t wanted = std::min(r.max_running, share);
  if (held >= wanted) return "";
  return absl::StrFormat(
      "a rollout worker's KV pool holds %d sequences of %d tokens, fewer than the %d it would "
      "decode at once (--max-running-seqs %d, %d sequences per worker per step): more workers, "
      "a larger --kv-cache-gb or shorter responses",
      held, r.prompt_tokens + r.response_tokens, wanted, r.max_running, share);
}

DeviceSpec Device(const Args& a) {
  DeviceSpec d;
  d.count = a.Int64("gpus", d.count);
  d.memory_bytes = static_cast<int64_t>(a.Number("gpu-memory-gb", 139) * lm::plan::kGiB);
  d.hbm_bytes_per_s = a.Number("hbm-tbps", 4.8) * 1e12;
  d.bf16_flops_per_s = a.Number("tflops", 989) * 1e12;
  return d;
}

std::string Header(const std::string& job, const Args& a, const DeviceSpec& d,
                   const lm::ModelConfig& student) {
  const lm::plan::ParameterCounts n = lm::plan::CountParameters(student);
  return absl::StrFormat(
      "plan of %s (%s) on %d devices of %s, %.1f TB/s, %.0f TFLOP/s bf16\n"
      "student: %s, %.3fB parameters, %.3fB active per token\n\n",
      a.Get("config"), job, d.count, lm::plan::FormatGiB(d.memory_bytes), d.hbm_bytes_per_s / 1e12,
      d.bf16_flops_per_s / 1e12, student.model_type, n.total / 1e9, n.active / 1e9);
}

// Prints the plan's table; false (and the start-up refusal on stderr) when it does not fit.
bool Print(const ProcessPlan& p, const DeviceSpec& d) {
  std::cout << lm::plan::FormatPlan(p, d) << "\n";
  const absl::Status fits = lm::plan::CheckFits(p.memory, d.memory_bytes, p.process);
  if (!fits.ok()) std::cerr << "opd-ctl plan: " << fits.message() << "\n";
  return fits.ok();
}

absl::StatusOr<bool> PlanSft(const Args& a, const DeviceSpec& d) {
  ASSIGN_OR_RETURN(auto c, lm::LoadConfig<trainer::SftConfig>(a.Get("config"), {}));
  ASSIGN_OR_RETURN(const lm::ModelConfig student, StudentConfig(c.model.path, a));
  std::cout << Header("sft", a, d, student);
  const bool mixed = a.Get("precision", "bf16-mixed") == "bf16-mixed";
  const ProcessPlan learner = lm::plan::PlanLearner(
      student, trainer::LearnerPlanSettings(c, a.Int64("learner-gpus", d.count), mixed, true), d);
  const bool ok = Print(learner, d);
  std::cout << "SFT step: " << lm::plan::FormatSeconds(learner.time.total()) << "\n";
  return ok;
}

int64_t StageEndpoints(const trainer::OpdStageConfig& s) {
  int64_t n = static_cast<int64_t>(s.teachers.size());
  for (const auto& d : s.domains) n += static_cast<int64_t>(d.teachers.size());
  return n;
}

lm::plan::RolloutSettings RolloutOf(const trainer::OpdConfig& c, const Args& a) {
  lm::plan::RolloutSettings r;
  r.workers = a.Int64("rollout-gpus", std::max<int64_t>(c.rollout.endpoints.size(), 1));
  r.kv_cache_bytes = static_cast<int64_t>(a.Number("kv-cache-gb", 0) * lm::plan::kGiB);
  r.block_size = a.Int64("kv-block-size", 16);
  r.max_running = a.Int64("max-running-seqs", 256);
  // A collective push needs one receive bucket on the worker's device; gRPC pushes none.
  r.update_bucket_bytes = c.rollout.weight_sync == trainer::WeightSyncMode::kGrpc
                              ? 0
                              : c.rollout.weight_sync_bucket_mb << 20;
  r.prompt_tokens = c.prompts.max_prompt_len;
  r.response_tokens = c.rollout.max_new_tokens;
  r.sequences_per_step = c.train.prompts_per_step * c.rollout.samples_per_prompt;
  return r;
}

// Stage `stage`'s teacher settings: --teacher-gpus replicas (default: its endpoints), each on
// --teacher-ep expert-parallel devices (default: the fewest, 1, 2, 4, ..., that fit).
lm::plan::TeacherSettings TeacherOf(const trainer::OpdStageConfig& stage,
                                    const lm::ModelConfig& teacher, const Args& a,
                                    const lm::plan::RolloutSettings& r, const DeviceSpec& d) {
  lm::plan::TeacherSettings t;
  t.stage = stage.name;
  t.replicas = a.Int64("teacher-gpus", std::max<int64_t>(StageEndpoints(stage), 1));
  t.max_batch_tokens = a.Int64("max-batch-tokens", 16384);
  t.logprob_chunk_rows = a.Int64("logprob-chunk", 512);
  t.sequence_tokens = r.prompt_tokens + r.response_tokens;
  t.sequences_per_step = r.sequences_per_step;
  t.devices_per_replica = a.Int64("teacher-ep", 1);
  if (a.Has("teacher-ep")) return t;
  while (t.devices_per_replica < kMaxExpertParallel &&
         !lm::plan::CheckTeacherFits(teacher, t, d.memory_bytes).ok())
    t.devices_per_replica *= 2;
  return t;
}

// Each stage's teacher plan; nullopt for a stage without a teacher config (not planned).
absl::StatusOr<std::vector<std::optional<ProcessPlan>>> StagePlans(
    const trainer::OpdConfig& c, const Args& a, const DeviceSpec& d,
    const lm::plan::RolloutSettings& r) {
  std::vector<std::optional<ProcessPlan>> plans;
  for (size_t i = 0; i < c.stages.size(); ++i) {
    const auto& stage = c.stages[i];
    absl::StatusOr<std::optional<lm::ModelConfig>> teacher = TeacherConfig(stage.name, i, a);
    if (!teacher.ok())
      return absl::Status(teacher.status().code(),
                          absl::StrCat("stage ", stage.name, ": ", teacher.status().message()));
    if (!teacher->has_value()) {
      plans.emplace_back();
      continue;
    }
    plans.push_back(lm::plan::PlanTeacher(**teacher, TeacherOf(stage, **teacher, a, r, d), d));
  }
  return plans;
}

// The step of each planned stage (lm/plan/step_plan.h) for config `c`'s sequence lengths, as one
// line `OPD step, stage NAME (how) = T s`; with `warn`, the deadlines the step would pass.
absl::Status PrintSteps(const trainer::OpdConfig& c, const Args& a, const DeviceSpec& d,
                        const lm::ModelConfig& student, int64_t learners, bool mixed,
                        const std::string& label, bool warn) {
  const lm::plan::RolloutSettings r = RolloutOf(c, a);
  ASSIGN_OR_RETURN(const auto stages, StagePlans(c, a, d, r));
  const lm::plan::LearnerSettings ls = trainer::LearnerPlanSettings(c, learners, mixed, true);
  const ProcessPlan learner = lm::plan::PlanLearner(student, ls, d);
  const ProcessPlan rollout = lm::plan::PlanRollout(student, r, d);
  lm::plan::Efficiencies e;
  e.decode_hbm = a.Number("decode-efficiency", e.decode_hbm);
  e.forward_compute = a.Number("forward-efficiency", e.forward_compute);
  e.learn_compute = a.Number("learn-efficiency", e.learn_compute);
  e.push_bytes_per_s = a.Number("push-gbps", e.push_bytes_per_s / 1e9) * 1e9;
  lm::plan::StepShape shape;
  shape.pipeline = c.train.pipeline;
  shape.async = c.train.async;
  shape.student_weight_bytes = 2 * lm::plan::CountParameters(student).total;
  shape.micro_batches = CeilDiv(CeilDiv(ls.tokens_per_step, learners), ls.micro_batch_tokens);
  for (size_t i = 0; i < stages.size(); ++i) {
    if (!stages[i]) continue;
    shape.score_calls =
        CeilDiv(CeilDiv(ls.tokens_per_step, c.train.ScoreCallTokens()), stages[i]->replicas);
    const lm::plan::StepPlan step = lm::plan::PlanStep(rollout, *stages[i], learner, shape, e);
    std::cout << absl::StrFormat("OPD step, stage %s, %s (%s) = %s\n", c.stages[i].name, label,
                                 step.formula, lm::plan::FormatSeconds(step.step));
    if (warn)
      for (const std::string& w : TimeoutWarnings(c, step)) std::cout << "warning: " << w << "\n";
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> PlanOpd(const Args& a, const DeviceSpec& d) {
  ASSIGN_OR_RETURN(auto c, lm::LoadConfig<trainer::OpdConfig>(a.Get("config"), {}));
  ASSIGN_OR_RETURN(const lm::ModelConfig student, StudentConfig(c.model.path, a));
  const lm::plan::RolloutSettings r = RolloutOf(c, a);
  ASSIGN_OR_RETURN(const auto stages, StagePlans(c, a, d, r));
  int64_t teachers = 0;  // one stage runs at a time: the largest stage's devices
  for (const auto& p : stages)
    if (p) teachers = std::max(teachers, p->replicas);
  const int64_t learners =
      a.Int64("learner-gpus", std::max<int64_t>(d.count - r.workers - teachers, 1));
  const bool mixed = a.Get("precision", "bf16-mixed") == "bf16-mixed";
  const ProcessPlan learner =
      lm::plan::PlanLearner(student, trainer::LearnerPlanSettings(c, learners, mixed, true), d);
  const ProcessPlan rollout = lm::plan::PlanRollout(student, r, d);
  std::cout << Header("opd", a, d, student);
  bool ok = Print(learner, d);
  ok = Print(rollout, d) && ok;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (stages[i]) {
      ok = Print(*stages[i], d) && ok;
    } else {
      std::cout << "teacher " << c.stages[i].name
                << ": no config.json (--teacher-config): not planned\n\n";
    }
  }
  const int64_t mean = a.Int64("response-tokens", c.rollout.max_new_tokens / 2);
  trainer::OpdConfig typical = c;
  typical.rollout.max_new_tokens = std::min(mean, c.rollout.max_new_tokens);
  RETURN_IF_ERROR(
      PrintSteps(typical, a, d, student, learners, mixed,
                 absl::StrFormat("responses of %d tokens on average (--response-tokens)",
                                 typical.rollout.max_new_tokens),
                 /*warn=*/false));
  RETURN_IF_ERROR(
      PrintSteps(c, a, d, student, learners, mixed,
                 absl::StrFormat("worst case: every response %d tokens", c.rollout.max_new_tokens),
                 /*warn=*/true));
  if (const std::string w = PoolWarning(student, r, d); !w.empty())
    std::cout << "warning: " << w << "\n";
  if (learners + r.workers + teachers > d.count)
    std::cout << absl::StrFormat(
        "note: %d learner + %d rollout + %d teacher devices are more than --gpus %d\n", learners,
        r.workers, teachers, d.count);
  return ok;
}

// OPD when the file has a `stages:` section, else SFT.
absl::StatusOr<bool> IsOpd(const std::string& path) {
  ASSIGN_OR_RETURN(YAML::Node root, lm::LoadYamlFile(path));
  return root.IsMap() && root["stages"].IsDefined();
}

}  // namespace

int RunPlan(const std::vector<std::string>& words) {
  Args args;
  const FlagSpec spec = {{"config", Kind::kString},
                         {"model-config", Kind::kString},
                         {"teacher-config", Kind::kString},
                         {"models-dir", Kind::kString},
                         {"gpus", Kind::kInt64},
                         {"gpu-memory-gb", Kind::kNumber},
                         {"hbm-tbps", Kind::kNumber},
                         {"tflops", Kind::kNumber},
                         {"precision", Kind::kString},
                         {"rollout-gpus", Kind::kInt64},
                         {"teacher-gpus", Kind::kInt64},
                         {"learner-gpus", Kind::kInt64},
                         {"kv-cache-gb", Kind::kNumber},
                         {"max-running-seqs", Kind::kInt64},
                         {"kv-block-size", Kind::kInt64},
                         {"max-batch-tokens", Kind::kInt64},
                         {"logprob-chunk", Kind::kInt64},
                         {"teacher-ep", Kind::kInt64},
                         {"decode-efficiency", Kind::kNumber},
                         {"forward-efficiency", Kind::kNumber},
                         {"learn-efficiency", Kind::kNumber},
                         {"push-gbps", Kind::kNumber},
                         {"response-tokens", Kind::kInt64}};
  if (int rc = ParseCommandArgs("plan", words, spec, {"config"}, kUsage, &args); rc >= 0) return rc;
  absl::Status range = CheckRanges(args);
  const std::string precision = args.Get("precision", "bf16-mixed");
  if (range.ok() && precision != "bf16-mixed" && precision != "fp32")
    range = absl::InvalidArgumentError(
        absl::StrCat("--precision=", precision, " is neither bf16-mixed nor fp32"));
  if (int rc = RangeExitCode("plan", range, kUsage); rc >= 0) return rc;
  const DeviceSpec device = Device(args);
  absl::StatusOr<bool> fits = IsOpd(args.Get("config"));
  if (fits.ok()) fits = *fits ? PlanOpd(args, device) : PlanSft(args, device);
  if (!fits.ok()) {
    std::cerr << "opd-ctl plan: " << fits.status().message() << "\n";
    return 1;
  }
  return *fits ? 0 : 1;
}

}  // namespace ctl
