// The OPD job's life around its steps: start-up (the student, the prompts, the rollout workers,
// the stage's teachers, the admin port, the first push), resume, checkpoints, failures and the
// run loop. The step itself is opd_step.cc.
#include "trainer/opd/opd_job.h"

#include <algorithm>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/model/routing_trace.h"
#include "lm/text/chat.h"
#include "lm/util/file.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rpc/auth.h"
#include "rpc/codec.h"
#include "trainer/common/job_main.h"
#include "trainer/common/job_util.h"
#include "trainer/common/learner_plan.h"
#include "trainer/common/signals.h"
#include "trainer/opd/opd.h"

namespace trainer::opd_detail {
namespace {

bool Contains(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// A prompt's data domain (its samples'): its line's "domain", or else its source's name.
std::string DomainOf(const std::vector<SftSourceConfig>& sources, const lm::PromptExample& p) {
  if (!p.domain.empty()) return p.domain;
  const size_t s = static_cast<size_t>(p.source);
  return s < sources.size() ? sources[s].name : std::string();
}

// The prompt files' options: the prompts section's, in the student's chat format.
lm::PromptDatasetOptions PromptOptionsOf(const OpdConfig& c) {
  lm::PromptDatasetOptions po;
  for (const auto& s : c.prompts.sources) po.sources.push_back({s.name, s.files, s.weight});
  po.max_prompt_len = static_cast<int32_t>(c.prompts.max_prompt_len);
  po.skip_bad_lines = c.prompts.skip_bad_lines;
  po.shuffle = c.prompts.shuffle;
  po.seed = static_cast<uint64_t>(c.prompts.seed);
  po.chat_format = ChatFormatOf(c.model.chat_format);
  po.drop_final_assistant = true;
  return po;
}

}  // namespace

OpdJob::OpdJob(OpdConfig config, RunDir run, std::string yaml)
    : TrainingJob("opd", std::move(run), std::move(yaml), config.checkpoint, config.optim,
                  config.dist),
      c_(std::move(config)) {}

OpdJob::~OpdJob() {
  canceller_->Cancel();
}  // what runs in the background ends before we do

std::string OpdJob::TokenizerPath() const {
  return c_.model.tokenizer.empty() ? c_.model.path : c_.model.tokenizer;
}

lm::plan::LearnerSettings OpdJob::PlanSettings(int64_t ranks, bool bf16_mixed) const {
  return LearnerPlanSettings(c_, ranks, bf16_mixed, /*cuda=*/true);
}

StepPipelineOptions OpdJob::PipelineOptions() {
  StepPipelineOptions o;
  o.samples_per_prompt = static_cast<int32_t>(c_.rollout.samples_per_prompt);
  o.micro_batch_tokens = c_.train.micro_batch_tokens;
  o.overlap = c_.train.pipeline;
  o.domain_of = [sources = c_.prompts.sources](const lm::PromptExample& p) {
    return DomainOf(sources, p);
  };
  if (c_.rollout.routing_replay) {
    // Every sample's routed_experts covers its fed positions (prompt + response - 1) x the
    // student's MoE layers x top_k, with ids of its experts.
    o.check = [layout = lm::RoutingTrace(model_->config())](const lm::Sample& s) {
      return layout.Check(absl::StrCat("rollout.routing_replay: routed_experts of prompt ",
                                       s.prompt_index, ", sample ", s.sample_index),
                          s.routed_experts, s.routing_layers, s.routing_top_k,
                          static_cast<int64_t>(s.tokens.size()) - 1);
    };
  }
  return o;
}

ScoreStreamOptions OpdJob::ScoringOptions() const {
  ScoreStreamOptions o;
  o.score.temperature = static_cast<float>(c_.loss.teacher_temperature);
  o.score.top_k = c_.loss.form == LossForm::kTopK ? static_cast<int32_t>(c_.loss.top_k) : 0;
  o.max_calls_per_pool = static_cast<int>(c_.train.score_calls_per_pool);
  o.max_call_tokens = c_.train.ScoreCallTokens();
  o.stop = [] { return StopRequested(); };
  o.rank = group_->rank();
  o.step = step_ + 1;
  return o;
}

// The prompts, the rollout workers (every rank samples its own share and pushes its share), the
// held-out set, the stages' teachers and the rules.
absl::Status OpdJob::Connect(bool resumed) {
  RETURN_IF_ERROR(LoadTokenizer());
  const lm::PromptDatasetOptions po = PromptOptionsOf(c_);
  ASSIGN_OR_RETURN(std::unique_ptr<lm::PromptDataset> prompts, LoadPrompts(po, resumed));
  ASSIGN_OR_RETURN(std::unique_ptr<RolloutPool> rollout, ConnectRollout());
  ASSIGN_OR_RETURN(const lm::SamplingParams sampling, RolloutSampling());
  RETURN_IF_ERROR(MakeHeldout(po, sampling));
  source_ = std::make_unique<SampleSource>(std::move(prompts), std::move(rollout),
                                           SourceOptions(sampling));
  const TeacherPoolOptions tp = TeacherOptions();
  teachers_ = std::make_unique<StageTeachers>(
      c_.stages, StageRequirements(c_, *tokenizer_, model_->config().vocab_size), tp);
  convergence_ =
      std::make_unique<StageConvergence>([this](const std::string& line) { progress_->Log(line); });
  return absl::OkStatus();
}

// The student's tokenizer; its ids must all be rows of the student's embedding.
absl::Status OpdJob::LoadTokenizer() {
  ASSIGN_OR_RETURN(tokenizer_, lm::Tokenizer::Load(TokenizerPath()));
  if (tokenizer_->vocab_size() > model_->config().vocab_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the tokenizer (", tokenizer_->vocab_size(),
        " ids) does not fit the student's vocabulary (", model_->config().vocab_size, ")"));
  }
  return absl::OkStatus();
}

// The training prompts, at the checkpoint's cursor when resumed.
absl::StatusOr<std::unique_ptr<lm::PromptDataset>> OpdJob::LoadPrompts(
    const lm::PromptDatasetOptions& po, bool resumed) {
  ASSIGN_OR_RETURN(std::unique_ptr<lm::PromptDataset> prompts,
                   lm::PromptDataset::Load(*tokenizer_, po));
  lm::log::Info(absl::StrCat("prompts: ", prompts->stats().Summary()));
  if (resumed) RETURN_IF_ERROR(prompts->Seek(cursor_));
  cursor_ = prompts->cursor();
  return prompts;
}

// The rollout workers, and the publisher that pushes each weight version to them.
absl::StatusOr<std::unique_ptr<RolloutPool>> OpdJob::ConnectRollout() {
  opd::rpc::ClientOptions base;
  base.secret = secret_;
  base.tls = ClientTls(c_.auth);
  base.timeout = absl::Seconds(c_.rollout.timeout_s);
  base.canceller = canceller_;
  ASSIGN_OR_RETURN(std::unique_ptr<RolloutPool> rollout,
                   RolloutPool::Connect(c_.rollout.endpoints, base, tokenizer_->Fingerprint(),
                                        model_->config().vocab_size));
  // Every rank pushes its share of each version (collective sync), or rank 0 every tensor (grpc).
  ASSIGN_OR_RETURN(publisher_,
                   WeightPublisher::Create(group_.get(), c_.rollout.endpoints, base,
                                           PushOptionsOf(c_.rollout), device_, rollout.get()));
  return rollout;
}

// The rollout section is the sampling settings (and more): sliced to them, plus the stop ids.
absl::StatusOr<lm::SamplingParams> OpdJob::RolloutSampling() const {
  lm::SamplingParams sampling = c_.rollout;
  ASSIGN_OR_RETURN(sampling.stop_ids, lm::ChatFormat::StopIds(*tokenizer_));
  return sampling;
}

// The held-out evaluator: the heldout section's prompts, or none (it then never evaluates).
absl::Status OpdJob::MakeHeldout(lm::PromptDatasetOptions po, const lm::SamplingParams& sampling) {
  if (c_.heldout.sources.empty()) {
    heldout_ =
        std::make_unique<HeldoutEvaluator>(std::vector<lm::PromptExample>{}, 1, sampling,
                                           StepPipelineOptions{}, group_->rank(), group_->size());
    return absl::OkStatus();
  }
  // The held-out set: the first num_prompts prompts in file order, the same at every evaluation.
  po.sources.clear();
  for (const auto& s : c_.heldout.sources) po.sources.push_back({s.name, s.files, s.weight});
  po.shuffle = false;
  ASSIGN_OR_RETURN(std::unique_ptr<lm::PromptDataset> set,
                   lm::PromptDataset::Load(*tokenizer_, po));
  std::vector<lm::PromptExample> heldout =
      set->NextBatch(static_cast<size_t>(c_.heldout.num_prompts));
  lm::log::Info(absl::StrCat("held-out prompts: ", heldout.size(), ", evaluated every ",
                             c_.heldout.every, " steps"));
  lm::SamplingParams hg = sampling;
  hg.samples_per_prompt = 1;
  hg.seed = c_.heldout.seed;
  StepPipelineOptions ho = PipelineOptions();
  ho.check = nullptr;  // held-out samples are not learned: their routing is not asked for
  ho.domain_of = [sources = c_.heldout.sources](const lm::PromptExample& p) {
    return DomainOf(sources, p);
  };
  heldout_ = std::make_unique<HeldoutEvaluator>(std::move(heldout), c_.heldout.every, hg, ho,
                                                group_->rank(), group_->size());
  return absl::OkStatus();
}

// This rank's share of each step's prompts, sampled as `sampling` says.
SampleSourceOptions OpdJob::SourceOptions(const lm::SamplingParams& sampling) {
  SampleSourceOptions so;
  so.prompts_per_step = c_.train.prompts_per_step;
  so.sampling = sampling;
  so.sampling.return_routing = c_.rollout.routing_replay;
  so.pipeline = PipelineOptions();
  so.prefetch = c_.train.async;
  so.rank = group_->rank();
  so.ranks = group_->size();
  return so;
}

// How the stages' teacher pools call their teachers.
TeacherPoolOptions OpdJob::TeacherOptions() const {
  TeacherPoolOptions tp;
  tp.client.secret = secret_;
  tp.client.tls = ClientTls(c_.auth);
  tp.client.timeout = absl::Seconds(c_.train.teacher_timeout_s);
  tp.client.canceller = canceller_;
  tp.score_deadline = absl::Seconds(c_.train.score_deadline_s);
  return tp;
}

// Connects stage `index`'s teachers on every rank, and every rank agrees that it could: a stage
// that cannot start on one rank ends every rank there, before any step.
absl::Status OpdJob::StartStage(size_t index) {
  if (index >= c_.stages.size())
    return absl::FailedPreconditionError(absl::StrCat(
        "stage ", index + 1, " does not exist: the config has ", c_.stages.size(), " stage(s)"));
  absl::Status mine = teachers_->Connect(index);
  if (mine.ok() && Contains(c_.debug.fail_stage_starts, static_cast<int64_t>(index) + 1) &&
      (c_.debug.fail_rank < 0 || c_.debug.fail_rank == group_->rank()))
    mine = absl::UnavailableError(
        absl::StrCat("debug.fail_stage_starts: stage ", index + 1, " on rank ", group_->rank()));
  RETURN_IF_ERROR(
      sync_->Agree(absl::StrCat("stage '", c_.stages[index].name, "' connected"), mine));
  stage_ = index;
  return absl::OkStatus();
}

absl::Status OpdJob::StartAdmin() {
  if (!is_root() || c_.admin.listen.empty()) return absl::OkStatus();
  LearnerServerOptions ao;
  ao.listen = c_.admin.listen;
  ao.secret = secret_;
  ao.port_file = c_.admin.port_file;
  ao.tls = AdminTls(c_.auth);
  ao.insecure = c_.admin.insecure;
  for (const auto& s : c_.stages) {
    ao.stages.push_back(s.name);
    for (const auto& d : s.domains) ao.stage_domains[s.name].push_back(d.domain);
  }
  ASSIGN_OR_RETURN(admin_, LearnerServer::Start(ao));
  return absl::OkStatus();
}

absl::Status OpdJob::Init(const JobArgs& args) {
  RETURN_IF_ERROR(JoinGroup(c_.train, c_.dist));
  lm::dist::RankSyncOptions rs;
  rs.stall_timeout = absl::Seconds(c_.dist.stall_timeout_s);
  ASSIGN_OR_RETURN(sync_, lm::dist::RankSync::Create(*group_, rs));
  sync_->SetPhase("starting");
  ASSIGN_OR_RETURN(secret_, opd::rpc::LoadSecret(c_.auth.secret_file));
  schedule_ = {c_.optim.lr, c_.optim.min_lr, c_.optim.warmup_steps, 1};
  int64_t total = 0;
  for (const auto& s : c_.stages) total += s.max_steps;
  schedule_.total_steps = std::max<int64_t>(total, 1);

  ASSIGN_OR_RETURN(const std::string resume_from, AgreeOnCheckpoint(args, c_.run));
  const bool resumed = !resume_from.empty();
  if (resumed) {
    RETURN_IF_ERROR(Resume(resume_from));
  } else {
    torch::manual_seed(static_cast<uint64_t>(c_.train.seed));
    RETURN_IF_ERROR(LoadModel(c_.model.path));
    if (c_.rollout.routing_replay && !model_->SupportsRoutingReplay())
      return absl::InvalidArgumentError(
          absl::StrCat("rollout.routing_replay: a ", model_->config().model_type,
                       " student does not support routing replay (qwen3_moe students do)"));
    RETURN_IF_ERROR(Connect(false));
    RETURN_IF_ERROR(StartStage(0));
    convergence_->Start(c_.stages[0], !c_.heldout.sources.empty());
  }
  // Versions only grow, across restarts: above what any worker serves (rank 0 asks them).
  const int64_t served = is_root() ? source_->rollout().MaxWeightVersion().value_or(0) : 0;
  ASSIGN_OR_RETURN(
      std::vector<double> v,
      group_->AllReduceDoubles({static_cast<double>(std::max(weight_version_, served))},
                               lm::dist::ReduceOp::kMax));
  weight_version_ = static_cast<int64_t>(v[0]);
  RETURN_IF_ERROR(StartAdmin());
  RETURN_IF_ERROR(OpenRecords(schedule_.total_steps, c_.logging, resumed));
  // The workers serve the student we start from (the SFT model, or the resumed checkpoint).
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(PushWeights());
  if (is_root())
    lm::log::Info(absl::StrFormat(
        "pushed the student's weights to %d rollout worker(s) as version %d (%.1fs)",
        source_->rollout().size(), weight_version_, Seconds(t0)));
  // An evaluation the checkpoint owes runs on the weights just pushed (its step's).
  heldout_->Relaunch(source_->rollout(), *teachers_, ScoringOptions());
  return absl::OkStatus();
}

namespace {

// OPD's own fields of a trainer state, each present and of its type and range, before any is used.
absl::Status CheckOpdState(const nlohmann::json& s, const std::string& checkpoint, size_t stages) {
  const std::string file = checkpoint + "/trainer_state.json";
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(file, ": ", what));
  };
  for (const char* key : {"weight_version", "stage"}) {
    if (!s.contains(key) || !s[key].is_number_integer() || s[key].get<int64_t>() < 0)
      return bad(absl::StrCat(key, " is missing or not a non-negative integer"));
  }
  if (s["stage"].get<int64_t>() >= static_cast<int64_t>(stages))
    return bad(absl::StrCat("stage ", s["stage"].get<int64_t>(), " is not one of the config's ",
                            stages, " stage(s)"));
  if (!s.contains("stage_name") || !s["stage_name"].is_string()) return bad("stage_name");
  if (!s.contains("stage_done") || !s["stage_done"].is_boolean()) return bad("stage_done");
  if (!s.contains("stage_summaries") || !s["stage_summaries"].is_array())
    return bad("stage_summaries");
  if (!s.contains("convergence") || !s["convergence"].is_object() ||
      !s["convergence"].contains("reason") || !s["convergence"]["reason"].is_string())
    return bad("convergence.reason");
  return absl::OkStatus();
}

}  // namespace

absl::Status OpdJob::Resume(const std::string& checkpoint) {
  ASSIGN_OR_RETURN(nlohmann::json state, ResumeCommon(checkpoint));
  RETURN_IF_ERROR(CheckOpdState(state, checkpoint, c_.stages.size()));
  if (c_.rollout.routing_replay && !model_->SupportsRoutingReplay())
    return absl::InvalidArgumentError(
        absl::StrCat("rollout.routing_replay: a ", model_->config().model_type,
                     " student does not support routing replay (qwen3_moe students do)"));
  weight_version_ = state.at("weight_version").get<int64_t>();
  stage_ = state.at("stage").get<size_t>();
  if (stage_ >= c_.stages.size() ||
      c_.stages[stage_].name != state.at("stage_name").get<std::string>()) {
    return absl::FailedPreconditionError(
        absl::StrCat(checkpoint, ": stage '", state.at("stage_name").get<std::string>(),
                     "' is not stage ", stage_ + 1, " of the config"));
  }
  done_ = state.at("stage_done").get<bool>();
  RETURN_IF_ERROR(Connect(true));
  // Endpoints swapped in through the admin RPC outlive a restart; the config's others stand.
  teachers_->RestoreSwaps(state.value("swapped_teachers", nlohmann::json::object()),
                          state.value("swapped_domain_teachers", nlohmann::json::object()));
  convergence_->RestoreSummaries(state.at("stage_summaries"));
  RETURN_IF_ERROR(source_->LoadPrefetched(checkpoint, state));
  heldout_->Restore(state.value("heldout_pending", nlohmann::json()));
  // A checkpoint written as its stage finished starts the next stage.
  const bool stage_finished = !state.at("convergence").at("reason").get<std::string>().empty();
  if (stage_finished && !done_) {
    RETURN_IF_ERROR(StartStage(stage_ + 1));
    convergence_->Start(c_.stages[stage_], !c_.heldout.sources.empty());
  } else {
    RETURN_IF_ERROR(StartStage(stage_));
    convergence_->Start(c_.stages[stage_], !c_.heldout.sources.empty());
    convergence_->Restore(state);
  }
  lm::log::Info(absl::StrFormat("resumed from %s at step %d (stage '%s')", checkpoint, step_,
                                c_.stages[stage_].name));
  return absl::OkStatus();
}

absl::Status OpdJob::PrepareCheckpoint() {
  prefetched_record_ = nlohmann::json();
  heldout_record_ = nlohmann::json();
  // One-step-off: the next step's samples go into the checkpoint, so that its resume samples
  // nothing anew; and the held-out evaluation of this step, done or owed.
  ASSIGN_OR_RETURN(prefetched_record_, source_->Settle(*sync_, *group_));
  ASSIGN_OR_RETURN(heldout_record_, heldout_->Checkpoint(*group_));
  return absl::OkStatus();
}

nlohmann::json OpdJob::JobState() const {
  nlohmann::json state = convergence_->ToJson();
  state["stage"] = stage_;
  state["stage_name"] = c_.stages[stage_].name;
  state["stage_done"] = done_;
  state["stage_summaries"] = convergence_->summaries();
  state["swapped_teachers"] = teachers_->swapped_stages();
  state["swapped_domain_teachers"] = teachers_->swapped_domains();
  state["weight_version"] = weight_version_;
  if (!prefetched_record_.is_null()) state["prefetched"] = prefetched_record_;
  if (!heldout_record_.is_null()) state["heldout_pending"] = heldout_record_;
  return state;
}

absl::Status OpdJob::WriteJobFiles(const std::string& dir) const {
  if (prefetched_record_.is_null()) return absl::OkStatus();
  return lm::WriteFileAtomic(dir + "/" + PrefetchedFileName(group_->rank()),
                             source_->settled_bytes());
}

// A step that cannot finish, agreed by every rank. When a stop signal is what failed it, stops as
// for the signal; otherwise ends the calls still in flight, checkpoints the last completed step
// and returns the error saying what failed. After a stall no collective can be trusted: the last
// checkpoint stays the one to resume from.
absl::Status OpdJob::FailStep(const absl::Status& error, const std::string& what) {
  canceller_->Cancel();
  if (sync_->broken())
    return absl::Status(
        error.code(),
        absl::StrCat(what, " failed: ", error.message(),
                     "; the ranks no longer agree, so nothing is checkpointed: resume from the "
                     "last checkpoint once the cause is fixed"));
  absl::StatusOr<bool> stop = group_->AnyRank(StopRequested());
  if (stop.ok() && *stop) return StopForSignal();
  progress_->Log(absl::StrFormat("%s failed: %s; writing a checkpoint of step %d", what,
                                 error.message(), step_));
  const absl::Status saved = SaveCheckpoint();
  return absl::Status(
      error.code(),
      absl::StrCat(what, " failed: ", error.message(),
                   saved.ok() ? absl::StrFormat("; step %d is checkpointed, resume with the same "
                                                "command once the cause is fixed",
                                                step_)
                              : absl::StrCat("; the checkpoint failed too: ", saved.message())));
}

void OpdJob::CheckpointAfterException() {
  canceller_->Cancel();
  // An exception outside a step's agreed points: with several ranks the others may be inside a
  // collective, so only a one-process job writes a checkpoint here.
  if (group_->size() > 1) {
    lm::log::Error(
        "an unexpected error outside the agreed points of a step: no checkpoint is "
        "written (the last one stays the one to resume from)");
    return;
  }
  TrainingJob::CheckpointAfterException();
}

absl::Status OpdJob::Run() {
  InstallStopHandlers();
  // The signal handler only sets a flag; this ends the calls in flight (deadlines up to an hour).
  StopCallback cancel_calls([c = canceller_] { c->Cancel(); });
  while (!done_) {
    // A stop signal on any rank, agreed at the step boundary (the ranks meet outside the
    // collectives: one may arrive late from a long push or evaluation).
    sync_->SetPhase(absl::StrCat("step ", step_ + 1, ": starting"));
    const absl::Status begin =
        sync_->Agree(absl::StrCat("step ", step_ + 1, ": begin"),
                     StopRequested() ? absl::CancelledError("stop requested") : absl::OkStatus());
    if (absl::IsCancelled(begin)) return StopForSignal();
    RETURN_IF_ERROR(begin);
    RETURN_IF_ERROR(Step());
  }
  progress_->Finish();
  nlohmann::json summary = {{"steps", step_},
                            {"stages", convergence_->summaries()},
                            {"peak_rss_mb", PeakRssMb()},
                            {"world_size", group_->size()},
                            {"optimizer_state_bytes_per_rank", optimizer_->state_bytes()}};
  if (is_root()) (void)lm::WriteFileAtomic(run_.path() + "/summary.json", summary.dump(2) + "\n");
  lm::log::Info(
      absl::StrFormat("done: %d steps over %d stage(s)", step_, convergence_->summaries().size()));
  return absl::OkStatus();
}

}  // namespace trainer::opd_detail

namespace trainer {

absl::Status RunOpd(const OpdConfig& config, const JobArgs& args) {
  RETURN_IF_ERROR(ValidateOpdConfig(config));
  for (const std::string& w : OpdConfigWarnings(config)) lm::log::Warn(w);
  return RunTrainingJob(
      "opd", config.run, lm::EncodeConfig(config), args, [&config](RunDir run, std::string yaml) {
        return std::make_unique<opd_detail::OpdJob>(config, std::move(run), std::move(yaml));
      });
}

int OpdMain(const std::vector<std::string>& words) {
  return JobMain<OpdConfig>({"opd", "configs/opd/NAME.yaml", ValidateOpdConfig, RunOpd}, words);
}

}  // namespace trainer
