#include "trainer/sft/sft.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <thread>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/data/jsonl.h"
#include "lm/data/sft_dataset.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/text/tokenizer.h"
#include "lm/util/file.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "trainer/common/checkpoint.h"
#include "trainer/common/job_main.h"
#include "trainer/common/job_util.h"
#include "trainer/common/learner_plan.h"
#include "trainer/common/metrics.h"
#include "trainer/common/optim.h"
#include "trainer/common/progress.h"
#include "trainer/common/run_dir.h"
#include "trainer/common/signals.h"
#include "trainer/common/training_job.h"
#include "trainer/common/zero1.h"
#include "trainer/sft/fused_nll.h"
#include "trainer/sft/sft_data.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

std::string StudentTokenizerPath(const SftConfig& c) {
  return c.model.tokenizer.empty() ? c.model.path : c.model.tokenizer;
}

lm::SftDatasetOptions DatasetOptions(const SftConfig& c,
                                     const std::vector<SftSourceConfig>& sources, bool shuffle) {
  lm::SftDatasetOptions o;
  for (const auto& s : sources) o.sources.push_back({s.name, s.files, s.weight});
  o.max_seq_len = static_cast<int32_t>(c.data.max_seq_len);
  o.overlong = c.data.overlong;
  o.skip_bad_lines = c.data.skip_bad_lines;
  o.shuffle = shuffle;
  o.seed = static_cast<uint64_t>(c.data.seed);
  o.chat_format = ChatFormatOf(c.model.chat_format);
  return o;
}

// Cheap checks of every input before anything heavy is loaded: data files exist and the model's
// config.json parses. (The tokenizer, and that its ids fit the model's vocabulary, are checked
// when they are loaded, still before the first step.)
absl::Status CheckInputs(const SftConfig& c) {
  for (const auto& [key, sources] :
       {std::pair{"data.train", &c.data.train}, {"data.eval", &c.data.eval}}) {
    for (size_t i = 0; i < sources->size(); ++i) {
      absl::StatusOr<std::vector<std::string>> files = lm::ExpandDataFiles((*sources)[i].files);
      if (!files.ok())
        return absl::Status(files.status().code(),
                            absl::StrCat(key, "[", i, "].files: ", files.status().message()));
    }
  }
  absl::StatusOr<lm::ModelConfig> model = lm::LoadModelConfig(c.model.path);
  if (!model.ok())
    return absl::Status(model.status().code(),
                        absl::StrCat("model.path: ", model.status().message()));
  return absl::OkStatus();
}

lm::PackedBatch ToDevice(const HostMicroBatch& mb, torch::Device device) {
  lm::PackedBatch b;
  b.input_ids = torch::tensor(mb.input_ids, torch::kInt64).to(device);
  b.position_ids = torch::tensor(mb.position_ids, torch::kInt64).to(device);
  b.cu_seqlens = mb.cu_seqlens;
  return b;
}

// What one optimizer step consumes.
struct StepBatch {
  std::vector<HostMicroBatch> micro;
  std::vector<nlohmann::json> docs;  // per micro-batch, only with debug.dump_batches
  int64_t tokens = 0;
  int64_t trained = 0;  // N_step: the loss normaliser
  lm::DataCursor cursor_after;
};

struct StepOutcome {
  bool abandoned = false;  // a stop signal arrived before the last micro-batch
  bool skipped = false;    // non-finite loss or gradient: no update
  double loss = 0;         // mean cross-entropy over the step's trained tokens
  double aux_loss = 0;     // mean load-balancing loss over the micro-batches
  double grad_norm = 0;    // before clipping
  double lr = 0;
};

class SftJob : public TrainingJob {
 public:
  SftJob(SftConfig config, RunDir run, std::string config_yaml)
      : TrainingJob("sft", std::move(run), std::move(config_yaml), config.checkpoint, config.optim,
                    config.dist),
        c_(std::move(config)) {}

  absl::Status Init(const JobArgs& args) override;
  absl::Status Run() override;

 private:
  nlohmann::json JobState() const override;
  std::string TokenizerPath() const override { return StudentTokenizerPath(c_); }
  lm::plan::LearnerSettings PlanSettings(int64_t ranks, bool bf16_mixed) const override {
    return LearnerPlanSettings(c_, ranks, bf16_mixed, /*cuda=*/true);
  }

  absl::Status LoadData();
  absl::Status LoadStudent(const std::string& dir) override;
  absl::Status Resume(const std::string& checkpoint);
  absl::Status ResumeFrom(const std::string& checkpoint);
  absl::StatusOr<int64_t> PlanSteps();
  void PrepareEvalSet();

  StepBatch NextStepBatch();
  void DumpBatches(const StepBatch& b);
  absl::StatusOr<StepOutcome> TrainStep(const StepBatch& b);
  torch::Tensor MicroBatchLoss(const HostMicroBatch& mb, const StepBatch& b, double* ce_sum,
                               double* aux);
  absl::Status AfterStep(const StepOutcome& o, const StepBatch& b, double seconds);
  absl::StatusOr<double> Evaluate(int64_t* tokens);
  absl::Status LogEval();
  void WriteSummary(double wall_s);

  SftConfig c_;
  std::unique_ptr<lm::Tokenizer> tokenizer_;
  std::unique_ptr<lm::SftDataset> train_, eval_;
  std::vector<HostMicroBatch> eval_set_;
  std::unique_ptr<std::ofstream> batch_dump_;
  double aux_coef_ = 0;

  int64_t tokens_seen_ = 0, trained_tokens_seen_ = 0;
  double first_eval_loss_ = std::nan(""), last_eval_loss_ = std::nan("");
  int64_t last_eval_step_ = -1;
  double step_seconds_sum_ = 0, step_tokens_sum_ = 0;  // throughput after the first step
};

absl::Status SftJob::LoadData() {
  absl::StatusOr<std::unique_ptr<lm::Tokenizer>> tokenizer = lm::Tokenizer::Load(TokenizerPath());
  if (!tokenizer.ok())
    return absl::Status(
        tokenizer.status().code(),
        absl::StrCat(c_.model.tokenizer.empty() ? "model.tokenizer (default: model.path)"
                                                : "model.tokenizer",
                     ": ", tokenizer.status().message()));
  tokenizer_ = std::move(*tokenizer);
  ASSIGN_OR_RETURN(train_, lm::SftDataset::Load(
                               *tokenizer_, DatasetOptions(c_, c_.data.train, c_.data.shuffle)));
  lm::log::Info("train data: " + train_->stats().Summary());
  if (!c_.data.eval.empty()) {
    ASSIGN_OR_RETURN(eval_,
                     lm::SftDataset::Load(*tokenizer_, DatasetOptions(c_, c_.data.eval, false)));
    lm::log::Info("eval data: " + eval_->stats().Summary());
  }
  return absl::OkStatus();
}

absl::Status SftJob::LoadStudent(const std::string& dir) {
  RETURN_IF_ERROR(LoadModel(dir));
  const lm::ModelConfig& mc = model_->config();
  if (tokenizer_->vocab_size() > mc.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("the tokenizer has ", tokenizer_->vocab_size(),
                                                   " ids but the model's vocabulary has only ",
                                                   mc.vocab_size));
  aux_coef_ = c_.train.aux_loss_coef >= 0 ? c_.train.aux_loss_coef : mc.router_aux_loss_coef;
  if (mc.num_experts == 0) aux_coef_ = 0;
  int64_t count = 0;
  for (const auto& p : model_->parameters()) count += p.numel();
  lm::log::Info(
      absl::StrFormat("model %s: %s, %d parameters (%d tensors with weight decay, %d without), aux "
                      "loss coef %g, device %s",
                      dir, mc.model_type, count, optimizer_->num_decay(),
                      optimizer_->num_no_decay(), aux_coef_, device_.str()));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> SftJob::PlanSteps() {
  if (c_.train.max_steps > 0) return c_.train.max_steps;
  // One epoch = as many conversations drawn as the sources hold; the last step may be partial
  // in data terms and is completed from the next epoch's order.
  const uint64_t draws =
      static_cast<uint64_t>(std::ceil(c_.train.epochs * train_->stats().conversations));
  ASSIGN_OR_RETURN(int64_t packs, CountPacks(*train_, draws));
  const int64_t steps = (packs + c_.train.global_batch_size - 1) / c_.train.global_batch_size;
  lm::log::Info(absl::StrFormat(
      "%g epoch(s): %d conversations in %d packed sequences -> %d steps of %d sequences",
      c_.train.epochs, draws, packs, steps, c_.train.global_batch_size));
  return std::max<int64_t>(steps, 1);
}

void SftJob::PrepareEvalSet() {
  if (!eval_) return;
  const int64_t micro =
      c_.eval.micro_batch_size > 0 ? c_.eval.micro_batch_size : c_.train.micro_batch_size;
  std::vector<lm::PackedSequence> packs;
  const uint64_t pass = static_cast<uint64_t>(eval_->stats().conversations);
  while (
      eval_->cursor().step < pass &&
      (c_.eval.max_sequences == 0 || static_cast<int64_t>(packs.size()) < c_.eval.max_sequences)) {
    packs.push_back(eval_->NextPacked());
  }
  int64_t trained = 0;
  for (size_t i = 0; i < packs.size(); i += micro) {
    eval_set_.push_back(AssembleMicroBatch(packs, i, std::min(packs.size(), i + micro)));
    trained += eval_set_.back().trained();
  }
  lm::log::Info(absl::StrFormat("held-out set: %d packed sequences, %d trained tokens",
                                packs.size(), trained));
}

// A trainer_state.json with a missing or mistyped field is an error naming the file and the field
// (nlohmann's exception says which), never an abort.
absl::Status SftJob::Resume(const std::string& checkpoint) {
  try {
    return ResumeFrom(checkpoint);
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(
        absl::StrCat(checkpoint, "/trainer_state.json: not a valid SFT trainer state: ", e.what()));
  }
}

absl::Status SftJob::ResumeFrom(const std::string& checkpoint) {
  ASSIGN_OR_RETURN(nlohmann::json state, ResumeCommon(checkpoint));
  const int64_t saved_total = state.at("total_steps").get<int64_t>();
  if (saved_total != schedule_.total_steps) {
    lm::log::Warn(
        absl::StrFormat("the checkpoint planned %d steps, the config now gives %d: keeping %d so "
                        "that the schedule continues",
                        saved_total, schedule_.total_steps, saved_total));
    schedule_.total_steps = saved_total;
  }
  RETURN_IF_ERROR(train_->Seek(cursor_));
  tokens_seen_ = state.at("tokens_seen").get<int64_t>();
  trained_tokens_seen_ = state.at("trained_tokens_seen").get<int64_t>();
  // null when no evaluation has run yet (or none is configured): json::value would throw on it.
  const nlohmann::json& first_eval = state.value("first_eval_loss", nlohmann::json());
  first_eval_loss_ = first_eval.is_number() ? first_eval.get<double>() : std::nan("");
  last_eval_step_ = step_;  // an evaluation due at this step ran before the checkpoint was written
  lm::log::Info(absl::StrCat("resumed from ", checkpoint, " at step ", step_));
  return absl::OkStatus();
}

absl::Status SftJob::Init(const JobArgs& args) {
  RETURN_IF_ERROR(JoinGroup(c_.train, c_.dist));
  ASSIGN_OR_RETURN(const std::string resume_from, AgreeOnCheckpoint(args, c_.run));
  RETURN_IF_ERROR(LoadData());
  schedule_ = {c_.optim.lr, c_.optim.min_lr, c_.optim.warmup_steps, 1};
  ASSIGN_OR_RETURN(schedule_.total_steps, PlanSteps());
  cursor_ = train_->cursor();
  if (resume_from.empty()) {
    torch::manual_seed(static_cast<uint64_t>(c_.train.seed));
    RETURN_IF_ERROR(LoadStudent(c_.model.path));
  } else {
    RETURN_IF_ERROR(Resume(resume_from));
  }
  PrepareEvalSet();
  RETURN_IF_ERROR(OpenRecords(schedule_.total_steps, c_.logging, !resume_from.empty()));
  if (is_root() && c_.debug.dump_batches) {
    fs::create_directories(run_.debug());
    batch_dump_ = std::make_unique<std::ofstream>(
        run_.debug() + "/batches.jsonl", resume_from.empty() ? std::ios::trunc : std::ios::app);
  }
  return absl::OkStatus();
}

StepBatch SftJob::NextStepBatch() {
  StepBatch b;
  std::vector<lm::PackedSequence> seqs;
  seqs.reserve(c_.train.global_batch_size);
  for (int64_t i = 0; i < c_.train.global_batch_size; ++i) seqs.push_back(train_->NextPacked());
  for (size_t i = 0; i < seqs.size(); i += c_.train.micro_batch_size) {
    const size_t end = i + c_.train.micro_batch_size;
    b.micro.push_back(AssembleMicroBatch(seqs, i, end));
    b.tokens += b.micro.back().tokens();
    b.trained += b.micro.back().trained();
    if (c_.debug.dump_batches) b.docs.push_back(DocumentsJson(seqs, i, end));
  }
  b.cursor_after = train_->cursor();
  return b;
}

void SftJob::DumpBatches(const StepBatch& b) {
  if (!batch_dump_) return;
  for (size_t i = 0; i < b.docs.size(); ++i) {
    *batch_dump_ << nlohmann::json{{"step", step_ + 1},
                                   {"micro", i},
                                   {"num_micro", b.micro.size()},
                                   {"step_trained_tokens", b.trained},
                                   {"docs", b.docs[i]}}
                        .dump()
                 << "\n";
  }
  batch_dump_->flush();
}

// The micro-batch's share of the step loss: sum of its token losses / N_step, plus its part of
// the mean load-balancing loss. Returns the tensor to backpropagate.
torch::Tensor SftJob::MicroBatchLoss(const HostMicroBatch& mb, const StepBatch& b, double* ce_sum,
                                     double* aux) {
  ForwardPrecision autocast(optimizer_->precision(), device_);
  std::vector<torch::Tensor> router_logits;
  lm::ForwardOptions fwd;
  if (aux_coef_ > 0) fwd.router_logits = &router_logits;
  fwd.checkpoint_layers = c_.train.activation_checkpointing;
  torch::Tensor hidden = model_->Forward(ToDevice(mb, device_), fwd);
  auto rows = torch::tensor(mb.rows, torch::kInt64).to(device_);
  auto targets = torch::tensor(mb.targets, torch::kInt64).to(device_);
  torch::Tensor ce = FusedNllSum(hidden.index_select(0, rows), model_->LmHeadWeight(), targets);
  *ce_sum = ce.item<double>();
  // A step without any trained token contributes no cross-entropy (not 0/0).
  torch::Tensor loss = ce / static_cast<double>(std::max<int64_t>(b.trained, 1));
  if (aux_coef_ > 0 && !router_logits.empty()) {
    const auto& mc = model_->config();
    torch::Tensor lb = lm::LoadBalancingLoss(router_logits, mc.num_experts, mc.num_experts_per_tok);
    *aux = lb.item<double>();
    loss = loss + lb * (aux_coef_ / static_cast<double>(b.micro.size()));
  }
  return loss;
}

absl::StatusOr<StepOutcome> SftJob::TrainStep(const StepBatch& b) {
  StepOutcome o;
  const int64_t this_step = step_ + 1;
  const bool poison = std::find(c_.debug.nan_steps.begin(), c_.debug.nan_steps.end(), this_step) !=
                      c_.debug.nan_steps.end();
  double ce_total = 0, aux_total = 0;
  // Rank r runs micro-batches r, r + N, ...; each backpropagates its tokens over the step's
  // global count, so the gradients summed over ranks are the one-process gradient.
  const int rank = group_->rank(), ranks = group_->size();
  // Every rank says how many backwards it runs (a rank with none too): with sharded gradients
  // (dist.zero_stage 2) each backward's gradients are reduced in rounds every rank joins.
  const size_t mine =
      b.micro.size() > static_cast<size_t>(rank)
          ? (b.micro.size() - static_cast<size_t>(rank) + ranks - 1) / static_cast<size_t>(ranks)
          : 0;
  RETURN_IF_ERROR(optimizer_->ExpectBackwards(static_cast<int64_t>(mine)));
  for (size_t i = static_cast<size_t>(rank); i < b.micro.size(); i += static_cast<size_t>(ranks)) {
    // One process may abandon a step at any micro-batch; ranks agree on stops between steps.
    if (ranks == 1 && StopRequested()) {
      optimizer_->ZeroGrad();
      o.abandoned = true;
      return o;
    }
    double ce = 0, aux = 0;
    torch::Tensor loss = MicroBatchLoss(b.micro[i], b, &ce, &aux);
    if (poison) {
      loss = loss * std::numeric_limits<double>::quiet_NaN();  // debug hook: NaN loss and grads
      ce = std::numeric_limits<double>::quiet_NaN();
    }
    // Its gradient buckets are reduce-scattered as they complete (stage 1: in the last backward).
    RETURN_IF_ERROR(optimizer_->Backward(loss));
    if (rank == c_.debug.kill_rank && this_step == c_.debug.kill_at_step) {
      lm::log::Warn(
          absl::StrFormat("debug.kill_rank: rank %d kills itself in step %d", rank, this_step));
      std::raise(SIGKILL);
    }
    ce_total += ce;
    aux_total += aux;
  }
  // The gradient buckets first, then the statistics, on every rank: a rank with micro-batches sent
  // its buckets in its backwards, a rank with fewer or none sends the rest in ReduceAndClip, and a
  // sum of statistics before that would pair with another rank's bucket.
  ASSIGN_OR_RETURN(o.grad_norm, optimizer_->ReduceAndClip(c_.optim.max_grad_norm));
  ASSIGN_OR_RETURN(std::vector<double> sums, group_->AllReduceDoubles({ce_total, aux_total}));
  o.loss = sums[0] / static_cast<double>(std::max<int64_t>(b.trained, 1));
  o.aux_loss = sums[1] / static_cast<double>(b.micro.size());
  o.lr = NextLr();
  o.skipped = !std::isfinite(o.loss) || !std::isfinite(o.aux_loss) || !std::isfinite(o.grad_norm);
  RETURN_IF_ERROR(ApplyUpdate(o.skipped, o.lr, b.cursor_after));
  tokens_seen_ += b.tokens;
  trained_tokens_seen_ += b.trained;
  return o;
}

absl::Status SftJob::AfterStep(const StepOutcome& o, const StepBatch& b, double seconds) {
  if (step_ > 1 || schedule_.total_steps == 1) {  // the first step pays for warm-up
    step_seconds_sum_ += seconds;
    step_tokens_sum_ += static_cast<double>(b.tokens);
  }
  CountNonFinite(o.skipped, o.loss, o.grad_norm);
  const double tps = static_cast<double>(b.tokens) / seconds;
  if (metrics_)
    metrics_->Log(step_, {{"train/loss", o.loss},
                          {"train/aux_loss", o.aux_loss},
                          {"train/lr", o.lr},
                          {"train/grad_norm", o.grad_norm},
                          {"train/tokens", static_cast<double>(b.tokens)},
                          {"train/trained_tokens", static_cast<double>(b.trained)},
                          {"train/tokens_per_s", tps},
                          {"train/step_time_s", seconds},
                          {"train/skipped", o.skipped ? 1.0 : 0.0},
                          {"train/nonfinite_total", static_cast<double>(nonfinite_total_)}});
  progress_->Update({step_, o.loss, o.lr, tps, o.grad_norm, o.skipped}, seconds);
  return CheckNonFinite(c_.train.max_consecutive_nonfinite);
}

// The held-out loss; each rank evaluates its share of the set and the sums are combined.
absl::StatusOr<double> SftJob::Evaluate(int64_t* tokens) {
  torch::NoGradGuard no_grad;
  ForwardPrecision autocast(optimizer_->precision(), device_);
  double sum = 0, count = 0;
  for (size_t i = static_cast<size_t>(group_->rank()); i < eval_set_.size();
       i += static_cast<size_t>(group_->size())) {
    const HostMicroBatch& mb = eval_set_[i];
    if (mb.trained() == 0) continue;
    torch::Tensor hidden = model_->Forward(ToDevice(mb, device_));
    auto rows = torch::tensor(mb.rows, torch::kInt64).to(device_);
    auto targets = torch::tensor(mb.targets, torch::kInt64).to(device_);
    sum -= lm::TokenLogprobs(hidden.index_select(0, rows), model_->LmHeadWeight(), targets)
               .sum()
               .item<double>();
    count += static_cast<double>(mb.trained());
  }
  ASSIGN_OR_RETURN(std::vector<double> total, group_->AllReduceDoubles({sum, count}));
  *tokens = static_cast<int64_t>(total[1]);
  return total[1] > 0 ? total[0] / total[1] : std::nan("");
}

absl::Status SftJob::LogEval() {
  if (eval_set_.empty() || last_eval_step_ == step_) return absl::OkStatus();
  const auto t0 = Clock::now();
  int64_t tokens = 0;
  ASSIGN_OR_RETURN(const double loss, Evaluate(&tokens));
  if (std::isnan(first_eval_loss_)) first_eval_loss_ = loss;
  last_eval_loss_ = loss;
  last_eval_step_ = step_;
  if (metrics_)
    metrics_->Log(step_, {{"eval/loss", loss}, {"eval/tokens", static_cast<double>(tokens)}});
  progress_->Log(absl::StrFormat("step %d: held-out loss %.4f over %d tokens (%.1fs)", step_, loss,
                                 tokens, Seconds(t0)));
  return absl::OkStatus();
}

nlohmann::json SftJob::JobState() const {
  return {{"total_steps", schedule_.total_steps},
          {"schedule",
           {{"type", "cosine"},
            {"peak_lr", schedule_.peak_lr},
            {"min_lr", schedule_.min_lr},
            {"warmup_steps", schedule_.warmup_steps},
            {"total_steps", schedule_.total_steps},
            {"next_lr", NextLr()}}},
          {"tokens_seen", tokens_seen_},
          {"trained_tokens_seen", trained_tokens_seen_},
          {"first_eval_loss",
           std::isnan(first_eval_loss_) ? nlohmann::json() : nlohmann::json(first_eval_loss_)}};
}

void SftJob::WriteSummary(double wall_s) {
  if (!group_->is_root()) return;
  const nlohmann::json s = {
      {"steps", step_},
      {"total_steps", schedule_.total_steps},
      {"first_eval_loss",
       std::isnan(first_eval_loss_) ? nlohmann::json() : nlohmann::json(first_eval_loss_)},
      {"final_eval_loss",
       std::isnan(last_eval_loss_) ? nlohmann::json() : nlohmann::json(last_eval_loss_)},
      {"tokens_per_s", step_seconds_sum_ > 0 ? step_tokens_sum_ / step_seconds_sum_ : 0.0},
      {"nonfinite_total", nonfinite_total_},
      {"peak_rss_mb", PeakRssMb()},
      {"world_size", group_->size()},
      {"optimizer_state_bytes_per_rank", optimizer_->state_bytes()},
      {"wall_s", wall_s}};
  (void)lm::WriteFileAtomic(run_.path() + "/summary.json", s.dump(2) + "\n");
}

absl::Status SftJob::Run() {
  InstallStopHandlers();
  const auto start = Clock::now();
  lm::log::Info(absl::StrFormat(
      "training steps %d..%d: %d sequences per step in %d micro-batches of %d, lr %g -> %g "
      "(warm-up %d)",
      step_ + 1, schedule_.total_steps, c_.train.global_batch_size,
      c_.train.global_batch_size / c_.train.micro_batch_size, c_.train.micro_batch_size,
      schedule_.peak_lr, schedule_.min_lr, schedule_.warmup_steps));
  if (step_ == 0) RETURN_IF_ERROR(LogEval());
  while (step_ < schedule_.total_steps) {
    ASSIGN_OR_RETURN(const bool stop, StopAgreed());
    if (stop) return StopForSignal();
    const auto t0 = Clock::now();
    StepBatch batch = NextStepBatch();
    DumpBatches(batch);
    ASSIGN_OR_RETURN(StepOutcome outcome, TrainStep(batch));
    if (outcome.abandoned) return StopForSignal();
    RETURN_IF_ERROR(AfterStep(outcome, batch, Seconds(t0)));
    if (c_.eval.every > 0 && step_ % c_.eval.every == 0) RETURN_IF_ERROR(LogEval());
    if (c_.checkpoint.every > 0 && step_ % c_.checkpoint.every == 0)
      RETURN_IF_ERROR(SaveCheckpoint());
    if (c_.debug.step_sleep_ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(c_.debug.step_sleep_ms));
  }
  RETURN_IF_ERROR(LogEval());
  if (c_.checkpoint.at_end) RETURN_IF_ERROR(SaveCheckpoint());
  progress_->Finish();
  WriteSummary(Seconds(start));
  lm::log::Info(absl::StrFormat(
      "done: %d steps, held-out loss %.4f -> %.4f, %.0f tokens/s, peak RSS %.0f MiB", step_,
      first_eval_loss_, last_eval_loss_,
      step_seconds_sum_ > 0 ? step_tokens_sum_ / step_seconds_sum_ : 0.0, PeakRssMb()));
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSft(const SftConfig& config, const JobArgs& args) {
  RETURN_IF_ERROR(ValidateSftConfig(config));
  RETURN_IF_ERROR(CheckInputs(config));
  return RunTrainingJob("sft", config.run, lm::EncodeConfig(config), args,
                        [&config](RunDir run, std::string yaml) {
                          return std::make_unique<SftJob>(config, std::move(run), std::move(yaml));
                        });
}

int SftMain(const std::vector<std::string>& words) {
  return JobMain<SftConfig>({"sft", "configs/sft/NAME.yaml", ValidateSftConfig, RunSft}, words);
}

}  // namespace trainer
