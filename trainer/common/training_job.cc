#include "trainer/common/training_job.h"

#include <torch/torch.h>

#include <csignal>
#include <filesystem>
#include <optional>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/plan/device_memory.h"
#include "lm/plan/plan.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "trainer/common/gradient_order.h"
#include "trainer/common/job_util.h"
#include "trainer/common/learner_group.h"
#include "trainer/common/signals.h"

namespace trainer {

namespace fs = std::filesystem;

TrainingJob::TrainingJob(std::string job, RunDir run, std::string config_yaml,
                         const CheckpointConfig& ckpt, const OptimConfig& optim,
                         const DistConfig& dist)
    : job_(std::move(job)),
      run_(std::move(run)),
      config_yaml_(std::move(config_yaml)),
      checkpoints_(run_.checkpoints(), ckpt.keep_last),
      optim_config_(optim),
      dist_config_(dist) {}

absl::Status TrainingJob::JoinGroup(const LearnerTrainConfig& train, const DistConfig& dist) {
  if (train.threads > 0) torch::set_num_threads(static_cast<int>(train.threads));
  ASSIGN_OR_RETURN(LearnerPlacement placement,
                   JoinLearnerGroup(train.device, dist.timeout_s, dist.backend));
  device_ = placement.device;
  group_ = std::move(placement.group);
  precision_ = ResolvePrecision(train.precision, device_);
  checkpoint_layers_ = train.activation_checkpointing;
  return CheckSameOnEveryRank(*group_, config_yaml_, "resolved config");
}

namespace {

// Rank 0's choice: --resume=DIR, else the latest complete checkpoint whose files are readable
// (CheckpointManager::LatestReadable) unless run.resume is "never" (then an existing checkpoint is
// an error unless --resume asks for it), "" for none.
absl::StatusOr<std::string> PickCheckpoint(const CheckpointManager& checkpoints,
                                           const RunDir& run_dir, const JobArgs& args,
                                           const RunConfig& run) {
  if (!args.resume_from.empty()) {
    if (!fs::exists(fs::path(args.resume_from) / "trainer_state.json"))
      return absl::NotFoundError(
          absl::StrCat("--resume=", args.resume_from, ": not a complete checkpoint"));
    return args.resume_from;
  }
  if (!checkpoints.Latest().ok() && args.resume) return checkpoints.Latest().status();
  if (checkpoints.Latest().ok() && run.resume == ResumeMode::kNever && !args.resume)
    return absl::FailedPreconditionError(absl::StrCat(
        run_dir.path(), " already has checkpoints and run.resume is 'never': use another run.dir"));
  absl::StatusOr<std::string> latest = checkpoints.LatestReadable();
  if (!latest.ok() && absl::IsNotFound(latest.status()) && !args.resume) return std::string();
  return latest;
}

}  // namespace

absl::StatusOr<std::string> TrainingJob::AgreeOnCheckpoint(const JobArgs& args,
                                                           const RunConfig& run) {
  std::string chosen;
  absl::Status found = absl::OkStatus();
  if (is_root()) {
    checkpoints_.RemoveIncomplete();
    absl::StatusOr<std::string> r = PickCheckpoint(checkpoints_, run_, args, run);
    found = r.status();
    if (r.ok()) chosen = *r;
  }
  std::string verdict = found.ok() ? "" : std::string(found.message());
  RETURN_IF_ERROR(group_->BroadcastBytes(&verdict));
  if (!found.ok()) return found;
  if (!verdict.empty()) return absl::FailedPreconditionError("rank 0: " + verdict);
  RETURN_IF_ERROR(group_->BroadcastBytes(&chosen));
  return chosen;
}

namespace {

// What the plan needs on a CUDA device: its memory, the model's config.json, the job's settings
// (nullopt, with a warning, when any cannot be read: the plan guards against a configuration that
// cannot fit, it never stops one it cannot read).
struct PlanInputs {
  int64_t device_bytes = 0;
  lm::ModelConfig model;
  lm::plan::LearnerSettings settings;
};
std::optional<PlanInputs> ReadPlanInputs(const std::string& dir, torch::Device device,
                                         lm::plan::LearnerSettings settings) {
  absl::StatusOr<int64_t> device_bytes =
      lm::plan::CudaDeviceMemoryBytes(device.has_index() ? device.index() : 0);
  // A model directory without a readable config.json is lm::LoadModel's error to report.
  absl::StatusOr<lm::ModelConfig> config = lm::LoadModelConfig(dir);
  for (const absl::Status& s : {device_bytes.status(), config.status()}) {
    if (s.ok()) continue;
    lm::log::Warn(absl::StrCat("memory plan not checked: ", s.message()));
    return std::nullopt;
  }
  return PlanInputs{*device_bytes, *config, settings};
}

}  // namespace

absl::StatusOr<ZeroStage> TrainingJob::ResolveZeroStage(const std::string& dir) const {
  if (group_->size() == 1) return ZeroStage::kOne;  // nothing to shard
  if (dist_config_.zero_stage != ZeroStage::kAuto) return dist_config_.zero_stage;
  // A host has no fixed budget to plan against: stage 1 reduces once per step.
  if (!device_.is_cuda()) return ZeroStage::kOne;
  const std::optional<PlanInputs> in = ReadPlanInputs(
      dir, device_, PlanSettings(group_->size(), precision_ == Precision::kBf16Mixed));
  if (!in) return ZeroStage::kTwo;  // the smaller footprint when the plan cannot say
  return lm::plan::ResolveZeroStage(in->model, in->settings, in->device_bytes) == 1
             ? ZeroStage::kOne
             : ZeroStage::kTwo;
}

absl::Status TrainingJob::CheckPlannedMemory(const std::string& dir, ZeroStage stage) const {
  // A host has no fixed budget: lm::LoadModel checks the weights against MemAvailable, and the
  // rest grows into swap or the OOM killer, which no start-up figure predicts.
  if (!device_.is_cuda()) return absl::OkStatus();
  std::optional<PlanInputs> in = ReadPlanInputs(
      dir, device_, PlanSettings(group_->size(), precision_ == Precision::kBf16Mixed));
  if (!in) return absl::OkStatus();
  in->settings.zero_stage = stage == ZeroStage::kTwo ? 2 : 1;
  return lm::plan::CheckLearnerFits(in->model, in->settings, in->device_bytes);
}

absl::Status TrainingJob::LoadModel(const std::string& dir) {
  ASSIGN_OR_RETURN(const ZeroStage stage, ResolveZeroStage(dir));
  // Before any weight is allocated: a plan that cannot fit is refused naming its term, instead of
  // a CUDA out-of-memory error some steps in.
  RETURN_IF_ERROR(CheckPlannedMemory(dir, stage));
  // The sharded (flat) path places the weights on the device itself, a parameter at a time:
  // loading the fp32 model there first would hold it and the flat buffers at once (in bf16-mixed
  // 4P + 2P bytes at start-up against the 2P the plan counts). One fp32 rank loads in place.
  const bool flat = group_->size() > 1 || precision_ == Precision::kBf16Mixed;
  lm::LoadOptions opts;
  opts.dtype = torch::kFloat32;  // master weights; GPUs compute in bf16 under autocast
  opts.device = flat ? torch::Device(torch::kCPU) : device_;
  absl::StatusOr<std::shared_ptr<lm::CausalLM>> model = lm::LoadModel(dir, opts);
  if (!model.ok())
    return absl::Status(model.status().code(),
                        absl::StrCat("model ", dir, ": ", model.status().message()));
  model_ = *model;
  model_->train();
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : model_->named_parameters()) params.emplace_back(p.key(), p.value());
  ASSIGN_OR_RETURN(const std::vector<std::string> order, FlatOrder());
  ASSIGN_OR_RETURN(optimizer_,
                   MakeLearnerOptimizer(params, optim_config_, dist_config_, group_.get(),
                                        precision_, stage, order, device_));
  if (group_->size() > 1)
    lm::log::Info(absl::StrCat("dist.zero_stage ", stage == ZeroStage::kTwo ? 2 : 1,
                               dist_config_.zero_stage == ZeroStage::kAuto ? " (auto)" : "", ": ",
                               optimizer_->num_buckets(), " gradient buckets, ",
                               optimizer_->memory().gradients >> 20,
                               " MiB of gradients on this rank"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> TrainingJob::FlatOrder() const {
  // One rank in fp32 keeps AdamW per parameter: no flat space to order.
  if (group_->size() == 1 && precision_ == Precision::kFp32) return std::vector<std::string>();
  std::string order;
  if (is_root()) {
    absl::StatusOr<std::vector<std::string>> found =
        GradientArrivalOrder(*model_, precision_, checkpoint_layers_);
    if (found.ok()) {
      order = nlohmann::json(*found).dump();
    } else {
      lm::log::Warn(absl::StrCat("the backward's gradient order is unknown (",
                                 found.status().message(), "): reverse model order"));
    }
  }
  // Every rank lays the flat space out in rank 0's order.
  RETURN_IF_ERROR(group_->BroadcastBytes(&order));
  if (order.empty()) return std::vector<std::string>();
  return nlohmann::json::parse(order).get<std::vector<std::string>>();
}

absl::StatusOr<nlohmann::json> TrainingJob::ResumeCommon(const std::string& checkpoint) {
  absl::StatusOr<nlohmann::json> state = LoadCheckpoint(checkpoint);
  if (state.ok()) return state;
  // Say that this checkpoint is unusable, and what remains: the run never falls back to an older
  // checkpoint by itself (that would silently redo steps a user may believe done).
  std::string hint;
  const auto all = checkpoints_.List();
  std::error_code ec;
  if (!all.empty() && fs::equivalent(all.back().second, checkpoint, ec)) {
    hint =
        "; it is the newest checkpoint of this run and is not replaced by an older one "
        "automatically: ";
    hint += all.size() > 1
                ? absl::StrCat("move it aside to resume from ", all[all.size() - 2].second,
                               ", or name one with --resume=DIR")
                : std::string("no older checkpoint exists");
  }
  return absl::Status(state.status().code(), absl::StrCat("cannot resume from ", checkpoint, ": ",
                                                          state.status().message(), hint));
}

absl::StatusOr<nlohmann::json> TrainingJob::LoadCheckpoint(const std::string& checkpoint) {
  ASSIGN_OR_RETURN(nlohmann::json state, ReadTrainerState(checkpoint));
  // Checkpoints written before the job field existed are SFT's.
  const std::string job = state.value("job", "sft");
  if (job != job_)
    return absl::FailedPreconditionError(
        absl::StrCat(checkpoint, ": a '", job, "' checkpoint, not a '", job_, "' one"));
  RETURN_IF_ERROR(LoadStudent(checkpoint + "/model"));
  step_ = state.at("step").get<int64_t>();
  // AdamW's bias correction counts the updates applied, not the steps run: a skipped
  // (non-finite) step made no update, so step_ would overcount it.
  RETURN_IF_ERROR(optimizer_->LoadState(checkpoint, state.at("optimizer_steps").get<int64_t>()));
  RETURN_IF_ERROR(RestoreRngState(state.at("rng")));
  absl::StatusOr<lm::DataCursor> cursor = lm::DataCursor::FromJson(state.at("data_cursor").dump());
  if (!cursor.ok())
    return absl::DataLossError(
        absl::StrCat(checkpoint, "/trainer_state.json: data_cursor: ", cursor.status().message()));
  cursor_ = *cursor;
  nonfinite_consecutive_ = state.at("nonfinite").at("consecutive").get<int64_t>();
  nonfinite_total_ = state.at("nonfinite").at("total").get<int64_t>();
  last_checkpoint_step_ = step_;
  return state;
}

absl::Status TrainingJob::OpenRecords(int64_t total_steps, const LoggingConfig& logging,
                                      bool resumed) {
  progress_ = std::make_unique<Progress>(total_steps, logging.log_every,
                                         is_root() && ::isatty(STDERR_FILENO) == 1);
  if (!is_root()) return absl::OkStatus();
  ASSIGN_OR_RETURN(MetricsLogger m, MetricsLogger::Open(run_.metrics_jsonl(), run_.tensorboard(),
                                                        logging.tensorboard, resumed ? step_ : -1));
  metrics_ = std::make_unique<MetricsLogger>(std::move(m));
  return absl::OkStatus();
}

void TrainingJob::CountNonFinite(bool skipped, double loss, double grad_norm) {
  nonfinite_consecutive_ = skipped ? nonfinite_consecutive_ + 1 : 0;
  nonfinite_total_ += skipped ? 1 : 0;
  if (!skipped) return;
  progress_->Log(
      absl::StrFormat("step %d: non-finite loss (%g) or gradient norm (%g): update skipped (%d "
                      "in a row, %d in total)",
                      step_, loss, grad_norm, nonfinite_consecutive_, nonfinite_total_));
}

absl::Status TrainingJob::CheckNonFinite(int64_t max_consecutive) const {
  if (nonfinite_consecutive_ < max_consecutive) return absl::OkStatus();
  return absl::AbortedError(
      absl::StrFormat("%d consecutive steps with a non-finite loss or gradient "
                      "(train.max_consecutive_nonfinite = %d): stopping at step %d",
                      nonfinite_consecutive_, max_consecutive, step_));
}

absl::Status TrainingJob::ApplyUpdate(bool skipped, double lr, const lm::DataCursor& after) {
  if (!skipped) {
    update_torn_ = true;
    RETURN_IF_ERROR(optimizer_->Step(lr));
    update_torn_ = false;
  }
  optimizer_->ZeroGrad();
  ++step_;
  cursor_ = after;
  return absl::OkStatus();
}

absl::Status TrainingJob::SaveCheckpoint() {
  if (update_torn_)
    return absl::FailedPreconditionError(absl::StrCat(
        "the update of step ", step_ + 1,
        " failed half-way, so the weights are those of no step: nothing is checkpointed; ",
        last_checkpoint_step_ >= 0
            ? absl::StrCat("resume from the last checkpoint (step ", last_checkpoint_step_, ")")
            : "no checkpoint of this run exists yet"));
  if (last_checkpoint_step_ == step_) return absl::OkStatus();
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(PrepareCheckpoint());
  nlohmann::json state = JobState();
  state["job"] = job_;
  state["data_cursor"] = nlohmann::json::parse(cursor_.ToJson());
  state["rng"] = CaptureRngState();
  state["nonfinite"] = {{"consecutive", nonfinite_consecutive_}, {"total", nonfinite_total_}};
  state["config"] = config_yaml_;
  RETURN_IF_ERROR(checkpoints_.Save(step_, *model_, *optimizer_, state,
                                    TokenizerFiles(TokenizerPath()), *group_,
                                    [this](const std::string& dir) { return WriteJobFiles(dir); }));
  last_checkpoint_step_ = step_;
  progress_->Log(absl::StrFormat("step %d: checkpoint %s/%s (%.1fs)", step_, checkpoints_.dir(),
                                 StepDirName(step_), Seconds(t0)));
  return absl::OkStatus();
}

absl::StatusOr<bool> TrainingJob::StopAgreed() {
  return group_->AnyRank(StopRequested());
}

absl::Status TrainingJob::StopForSignal() {
  const int sig = StopSignal();
  const std::string what = sig == SIGINT    ? "SIGINT"
                           : sig == SIGTERM ? "SIGTERM"
                                            : "a stop signal on another rank";
  progress_->Log(absl::StrFormat(
      "received %s: the step in progress is abandoned; writing a checkpoint of step %d", what,
      step_));
  RETURN_IF_ERROR(SaveCheckpoint());
  return absl::CancelledError(
      absl::StrFormat("stopped by %s at step %d of %d; resume with the same command", what, step_,
                      schedule_.total_steps));
}

void TrainingJob::CheckpointAfterException() {
  if (!model_ || !optimizer_ || !progress_) return;  // nothing trained yet
  try {
    optimizer_->ZeroGrad();  // a half-done step's gradients are not part of the state
    if (absl::Status s = SaveCheckpoint(); !s.ok())
      lm::log::Error(absl::StrCat("checkpoint after the error failed: ", s.message()));
  } catch (const std::exception& e) {
    lm::log::Error(absl::StrCat("checkpoint after the error failed: ", e.what()));
  }
}

absl::Status RunTrainingJob(const std::string& name, const RunConfig& run,
                            const std::string& config_yaml, const JobArgs& args,
                            const JobFactory& make) {
  ASSIGN_OR_RETURN(const lm::dist::LaunchEnv env, lm::dist::LaunchEnv::FromEnvironment());
  lm::log::SetRank(env.rank, env.world_size);
  ASSIGN_OR_RETURN(RunDir dir, RunDir::Open(run.dir));
  if (env.rank == 0) RETURN_IF_ERROR(dir.SaveConfig(config_yaml));
  lm::log::Info(absl::StrCat("opd-trainer ", name, ": run directory ", dir.path(),
                             ", resolved config in ", dir.config_file()));
  std::unique_ptr<TrainingJob> job = make(std::move(dir), config_yaml);
  // A torch or JSON exception (a tensor of the wrong shape, a malformed file) becomes an error
  // naming it instead of aborting the process; once training, the last completed step is
  // checkpointed first.
  try {
    RETURN_IF_ERROR(job->Init(args));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("while starting the job: ", e.what()));
  }
  try {
    return job->Run();
  } catch (const std::exception& e) {
    job->CheckpointAfterException();
    return absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
}

}  // namespace trainer
