// The learner, rollout and teacher plans (lm/plan/plan.h), and the start-up checks built on them.
#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/plan/layer_rules.h"
#include "lm/plan/plan.h"

namespace lm::plan {
namespace {

using internal::CeilDiv;
using internal::IsFull;
using internal::IsMoe;

// A roofline term: the slower of the compute and the HBM time.
TimeTerm Roofline(std::string name, double flops, double bytes, const DeviceSpec& d) {
  const double compute = flops / d.bf16_flops_per_s, hbm = bytes / d.hbm_bytes_per_s;
  return {std::move(name), std::max(compute, hbm), compute >= hbm ? "compute" : "HBM"};
}

// Bytes of the weights as the forward reads them: bf16 matrices and fp32 norms and routers in
// bf16-mixed (and in bf16 serving), everything at `fp32 ? 4 : 2` otherwise.
int64_t WeightBytes(const ParameterCounts& n, bool fp32) {
  return fp32 ? 4 * n.total : 2 * (n.total - n.fp32) + 4 * n.fp32;
}

void AddReserve(MemoryPlan& m, bool cuda) {
  if (cuda)
    m.terms.push_back({"CUDA context, workspaces, fragmentation (reserve)", kCudaReserveBytes,
                       "a device with more memory"});
}

// The learner's activations for one micro-batch: what the backward keeps, and with checkpointing
// the layer being recomputed on top of the layers' inputs.
int64_t LearnerActivations(const ModelConfig& c, const LearnerSettings& s, bool checkpointing) {
  const int64_t a = s.bf16_mixed ? 2 : 4;
  int64_t per_token = TrainActivationBytesPerToken(c, a, checkpointing);
  if (checkpointing && c.num_hidden_layers > 0)
    per_token += TrainActivationBytesPerToken(c, a, false) / c.num_hidden_layers;
  return per_token * std::max(s.micro_batch_tokens, int64_t{1});
}

// The gradient terms: stage 1 keeps every rank's local sum and its reduced slice, stage 2 the
// slice and the reducer's staging buckets (`s.zero_stage` resolved).
void AddGradients(MemoryPlan& m, const ModelConfig& c, const LearnerSettings& s) {
  const ParameterCounts n = CountParameters(c);
  const int64_t ranks = std::max<int64_t>(s.ranks, 1), slice = CeilDiv(n.total, ranks);
  if (ranks == 1) {
    m.terms.push_back({"gradients (fp32)", 4 * n.total, "a smaller student"});
    return;
  }
  if (s.zero_stage != 2) {
    m.terms.push_back({absl::StrCat("gradients (fp32: local sum + reduced 1/", ranks, ")"),
                       4 * n.total + 4 * slice, "dist.zero_stage: 2 (shards the gradients)"});
    return;
  }
  m.terms.push_back(
      {absl::StrCat("gradients (fp32: reduced 1/", ranks, ")"), 4 * slice, "more learner ranks"});
  const int64_t bucket = BucketElements(c, s);
  m.terms.push_back({absl::StrCat("gradient buckets in flight (4 x ", bucket, " fp32)"),
                     4 * 4 * bucket, "a smaller dist.bucket_mb"});
  // A gradient is held as autograd made it until its buckets' turn: the largest one's at most.
  m.terms.push_back({"gradient awaiting its buckets (largest parameter)",
                     (s.bf16_mixed ? 2 : 4) * n.largest, "a student with smaller tensors"});
}

// The flat path (several ranks, or bf16-mixed) loads the fp32 model on the host and moves it into
// its buffers before the first step. On a CUDA device none of it stays; on the CPU the host is the
// device, and the loaded copy is resident with the buffers at start-up, released before a step
// holds its buckets, activations and logits in its place: the peak is the larger of the two, so
// the copy counts beyond what the step terms (from `step_terms` on, AdamW's excepted) hold.
void AddStartupCopy(MemoryPlan& m, const ModelConfig& c, const LearnerSettings& s,
                    size_t step_terms) {
  if (s.cuda || (s.ranks <= 1 && !s.bf16_mixed)) return;
  int64_t step = 0;
  for (size_t i = step_terms; i < m.terms.size(); ++i)
    if (m.terms[i].name.rfind("AdamW", 0) != 0 && m.terms[i].name.rfind("fp32 masters", 0) != 0)
      step += m.terms[i].bytes;
  // AddGradients' terms after the slice are a step's too.
  for (size_t i = 0; i < step_terms; ++i)
    if (m.terms[i].name.rfind("gradient buckets", 0) == 0 ||
        m.terms[i].name.rfind("gradient awaiting", 0) == 0)
      step += m.terms[i].bytes;
  const int64_t copy = 4 * CountParameters(c).total;
  if (copy > step)
    m.terms.push_back({"start-up: the loaded fp32 model beyond the step's terms (CPU)", copy - step,
                       "a smaller student"});
}

MemoryPlan LearnerMemory(const ModelConfig& c, const LearnerSettings& s) {
  const ParameterCounts n = CountParameters(c);
  const int64_t ranks = std::max<int64_t>(s.ranks, 1), slice = CeilDiv(n.total, ranks);
  MemoryPlan m;
  m.terms.push_back(
      {s.bf16_mixed ? "weights (bf16 matrices, fp32 norms and routers)" : "weights (fp32)",
       WeightBytes(n, !s.bf16_mixed), "a smaller student (every rank holds all)"});
  AddGradients(m, c, s);
  const size_t step_terms = m.terms.size();  // from here, what a step adds: buckets, activations
  if (s.bf16_mixed)
    m.terms.push_back(
        {absl::StrCat("fp32 masters (1/", ranks, ")"), 4 * slice, "more learner ranks"});
  m.terms.push_back(
      {absl::StrCat("AdamW moments (1/", ranks, ")"), 8 * slice, "more learner ranks"});
  const bool ckpt = s.activation_checkpointing;
  const std::string tokens = absl::StrCat(s.micro_batch_tokens, " tokens");
  m.terms.push_back({absl::StrCat("activations, ", tokens, ckpt ? ", checkpointing" : ""),
                     LearnerActivations(c, s, ckpt),
                     ckpt ? "fewer tokens per micro-batch"
                          : "train.activation_checkpointing: true, or fewer tokens per "
                            "micro-batch"});
  m.alternatives.push_back(
      {absl::StrCat("activations, ", tokens, ckpt ? ", no checkpointing" : ", checkpointing"),
       LearnerActivations(c, s, !ckpt), ""});
  m.terms.push_back({absl::StrCat("logits chunk (", s.logits_chunk_rows, " rows, fp32 + grad)"),
                     s.logits_chunk_rows * c.vocab_size * 4 * 2, "a smaller logits chunk"});
  AddStartupCopy(m, c, s, step_terms);
  AddReserve(m, s.cuda);
  return m;
}

LearnerSettings Resolved(const ModelConfig& c, LearnerSettings s, int64_t device_bytes) {
  s.zero_stage = ResolveZeroStage(c, s, device_bytes);
  return s;
}

}  // namespace

int64_t BucketElements(const ModelConfig& c, const LearnerSettings& s) {
  const int64_t ranks = std::max<int64_t>(s.ranks, 1);
  const int64_t total = CeilDiv(CountParameters(c).total, ranks) * ranks;
  return std::min(total, CeilDiv(std::max<int64_t>(s.bucket_elements, 1), ranks) * ranks);
}

int64_t ResolveZeroStage(const ModelConfig& c, const LearnerSettings& s, int64_t device_bytes) {
  if (s.ranks <= 1) return 1;
  if (s.zero_stage == 1 || s.zero_stage == 2) return s.zero_stage;
  LearnerSettings one = s;
  one.zero_stage = 1;
  return LearnerMemory(c, one).peak() <= device_bytes ? 1 : 2;
}

ProcessPlan PlanLearner(const ModelConfig& c, const LearnerSettings& settings,
                        const DeviceSpec& d) {
  const LearnerSettings s = Resolved(c, settings, d.memory_bytes);
  const ParameterCounts n = CountParameters(c);
  const int64_t ranks = std::max<int64_t>(s.ranks, 1);
  ProcessPlan p{"learner rank", ranks, LearnerMemory(c, s), {}, {}};
  const double tokens = static_cast<double>(s.tokens_per_step) / ranks;
  const int64_t len = std::max<int64_t>(s.sequence_len, 1);
  const int64_t micro = CeilDiv(static_cast<int64_t>(std::ceil(tokens)), s.micro_batch_tokens);
  const double passes = s.activation_checkpointing ? 4 : 3;  // forward, backward (2x), recompute
  const double flops = passes * tokens / len * ForwardFlops(c, len);
  // Each micro-batch reads the weights once per pass and adds into the fp32 gradients (8 B/param).
  const double bytes =
      micro * (passes * WeightBytes(n, !s.bf16_mixed) + 8.0 * static_cast<double>(n.total));
  p.time.terms.push_back(
      Roofline(absl::StrCat("forward + backward", s.activation_checkpointing ? " + recompute" : "",
                            ", ", micro, " micro-batches"),
               flops, bytes, d));
  // AdamW on this rank's slice: gradient read and norm 8, masters or weights read+write 8,
  // moments read+write 16 (B/param); then the all-gather writes every rank's full weights.
  const double slice = static_cast<double>(n.total) / ranks;
  p.time.terms.push_back(Roofline("optimizer (AdamW on the 1/N slice, weights all-gathered)", 0,
                                  32.0 * slice + static_cast<double>(WeightBytes(n, !s.bf16_mixed)),
                                  d));
  p.facts.push_back(absl::StrFormat(
      "%d parameters (%d active per token), %d tokens per step over %d ranks, sequences of %d",
      n.total, n.active, s.tokens_per_step, ranks, len));
  if (ranks > 1) {
    // A reduce-scatter of the 4P gradient bytes sends (N - 1) / N of them from every rank; stage
    // 2 reduces once per micro-batch round, stage 1 once per step.
    const int64_t rounds = s.zero_stage == 2 ? std::max<int64_t>(micro, 1) : 1;
    const double sent = 4.0 * static_cast<double>(n.total) * (ranks - 1) / ranks * rounds;
    p.facts.push_back(absl::StrFormat(
        "dist.zero_stage %d%s: gradients reduce-scattered %d time(s) per step, %s sent per rank",
        s.zero_stage, settings.zero_stage == 0 ? " (auto)" : "", rounds,
        FormatGiB(static_cast<int64_t>(sent))));
  }
  return p;
}

namespace {

struct KvShape {
  int64_t per_token = 0, state_per_seq = 0, pool = 0, blocks = 0, blocks_per_seq = 0, held = 0;
};

MemoryPlan RolloutMemory(const ModelConfig& c, const RolloutSettings& s, int64_t device_bytes,
                         KvShape* kv) {
  const ParameterCounts n = CountParameters(c);
  MemoryPlan m;
  const int64_t weights = WeightBytes(n, s.weight_bytes == 4);
  m.terms.push_back(
      {s.weight_bytes == 4 ? "weights (fp32)" : "weights (bf16)", weights, "a smaller student"});
  // rollout/weights.h: an update goes into place, or waits in host memory while requests sample
  // with the serving version; on the device only a collective push's receive bucket.
  if (s.update_bucket_bytes > 0)
    m.terms.push_back({absl::StrFormat("weight update: one receive bucket (%.0f MiB)",
                                       static_cast<double>(s.update_bucket_bytes) / (1 << 20)),
                       s.update_bucket_bytes, "rollout.weight_sync_bucket_mb"});
  m.alternatives.push_back({"weight update staged as a second model on the device", weights, ""});
  m.host.push_back({"weight update staged in page-locked host memory (one-step-off)", weights,
                    "train.async: false (an update then goes into place)"});
  const int64_t workspace =
      s.max_prefill_tokens * InferenceActivationBytesPerToken(c, s.weight_bytes) +
      s.max_running * c.vocab_size * 4 * 2;  // the last rows' fp32 logits and log-softmax
  m.terms.push_back({absl::StrCat("prefill workspace (", s.max_prefill_tokens,
                                  " tokens) + logits of ", s.max_running, " rows"),
                     workspace, "--max-running-seqs"});
  AddReserve(m, true);
  kv->per_token = KvBytesPerToken(c, s.weight_bytes);
  kv->state_per_seq = StateBytesPerSequence(c, s.weight_bytes);
  kv->pool =
      s.kv_cache_bytes > 0 ? s.kv_cache_bytes : std::max<int64_t>(device_bytes - m.peak(), 0);
  const int64_t state = kv->state_per_seq * s.max_running;
  // rollout/engine.cc: the blocks are what the pool holds after the state slots; block 0 is null.
  kv->blocks = kv->per_token > 0
                   ? std::max<int64_t>((kv->pool - state) / (kv->per_token * s.block_size) - 1, 0)
                   : 0;
  kv->blocks_per_seq = CeilDiv(s.prompt_tokens + s.response_tokens, s.block_size);
  kv->held = std::min(s.max_running, kv->blocks_per_seq > 0 ? kv->blocks / kv->blocks_per_seq : 0);
  const std::string held =
      absl::StrFormat("%d sequences of %d tokens", kv->held, s.prompt_tokens + s.response_tokens);
  if (state > 0)
    m.terms.push_back({absl::StrCat("recurrent state (", s.max_running, " sequences)"), state,
                       "--max-running-seqs"});
  m.terms.push_back(
      {absl::StrCat("KV pool: ", kv->blocks, " blocks of ", s.block_size, " tokens, holds ", held),
       std::max<int64_t>(kv->pool - state, 0), "--kv-cache-gb"});
  return m;
}

}  // namespace

ProcessPlan PlanRollout(const ModelConfig& c, const RolloutSettings& s, const DeviceSpec& d) {
  KvShape kv;
  const int64_t workers = std::max<int64_t>(s.workers, 1);
  ProcessPlan p{"rollout worker", workers, RolloutMemory(c, s, d.memory_bytes, &kv), {}, {}};
  const ParameterCounts n = CountParameters(c);
  const int64_t seqs = CeilDiv(s.sequences_per_step, workers);
  const int64_t batch = std::min(kv.held, seqs);  // sequences decoding at once
  p.facts.push_back(
      absl::StrFormat("KV %d B per token, %d B of state per sequence; %d "
                      "sequences per worker per step",
                      kv.per_token, kv.state_per_seq, seqs));
  if (kv.held == 0) {
    p.time.terms.push_back({"sampling: the KV pool holds no whole sequence",
                            std::numeric_limits<double>::infinity(), "memory"});
    return p;
  }
  const int64_t waves = CeilDiv(seqs, std::max<int64_t>(batch, 1));
  const double wb = static_cast<double>(s.weight_bytes);
  const double dense = static_cast<double>(n.dense_matmul) * wb;
  const double expert = static_cast<double>(n.one_expert) * n.moe_layers * wb;
  // Prefill goes in steps of at most max_prefill_tokens, each reading the weights once.
  const int64_t prefills =
      waves * CeilDiv(batch * s.prompt_tokens, std::max(s.max_prefill_tokens, s.prompt_tokens));
  p.time.terms.push_back(Roofline(
      absl::StrFormat("prefill: %d waves of %d prompts x %d tokens", waves, batch, s.prompt_tokens),
      waves * batch * ForwardFlops(c, s.prompt_tokens),
      prefills * (dense + expert * ExpectedExpertsTouched(c, s.max_prefill_tokens)), d));
  // One decode step of `batch` sequences at the mean context of a wave (linear in it, so the mean
  // step times the steps is the wave's sum).
  const double ctx = s.prompt_tokens + s.response_tokens / 2.0;
  const double step_flops = batch * (ForwardFlops(c, static_cast<int64_t>(ctx) + 1) -
                                     ForwardFlops(c, static_cast<int64_t>(ctx)));
  const double step_bytes = dense + expert * ExpectedExpertsTouched(c, batch) +
                            batch * (ctx * kv.per_token + 2.0 * kv.state_per_seq);
  const TimeTerm step = Roofline("", step_flops, step_bytes, d);
  p.time.terms.push_back(
      {absl::StrFormat("decode: %d waves x %d steps of %d sequences (%s/step)", waves,
                       s.response_tokens, batch, FormatSeconds(step.seconds)),
       step.seconds * waves * s.response_tokens, step.bound});
  return p;
}

ProcessPlan PlanTeacher(const ModelConfig& c, const TeacherSettings& s, const DeviceSpec& d) {
  const ParameterCounts n = CountParameters(c);
  const int64_t replicas = std::max<int64_t>(s.replicas, 1);
  const int64_t ep = std::max<int64_t>(s.devices_per_replica, 1);
  ProcessPlan p{absl::StrCat("teacher ", s.stage), replicas * ep, {}, {}, {}};
  const int64_t wb = s.weight_bytes;
  const bool fp8 = c.fp8.has_value() && s.fp8_weights;
  const Fp8WeightBytes fp8_bytes = CountFp8WeightBytes(c, wb, ep);
  const int64_t weights =
      fp8 ? fp8_bytes.total()
          : WeightBytes(n, wb == 4) - n.experts * wb + CeilDiv(n.experts, ep) * wb;
  p.memory.terms.push_back(
      {absl::StrCat("weights (", fp8 ? "FP8 linear layers + block scales, " : "",
                    wb == 4 ? "fp32" : "bf16", fp8 ? " rest" : "",
                    ep > 1 ? absl::StrCat("; 1/", ep, " of the experts)") : ")"),
       weights, "more expert-parallel devices per replica (--world-size) or a smaller teacher"});
  // Every scoring thread runs a bucket of its own, with its own logits chunk.
  const int64_t workers = std::max<int64_t>(s.workers, 1);
  const std::string each = workers > 1 ? absl::StrCat(" x ", workers, " workers") : "";
  p.memory.terms.push_back(
      {absl::StrCat("scoring bucket (", s.max_batch_tokens, " tokens)", each),
       workers * s.max_batch_tokens * InferenceActivationBytesPerToken(c, s.weight_bytes),
       "--max-batch-tokens or --workers"});
  p.memory.terms.push_back(
      {absl::StrCat("logits chunk (", s.logprob_chunk_rows, " rows, fp32)", each),
       workers * s.logprob_chunk_rows * c.vocab_size * 4 * 2, "--logprob-chunk"});
  AddReserve(p.memory, true);
  // An expert-parallel replica runs each bucket on all its devices at once: every device runs the
  // dense layers of all the bucket's tokens and 1/ep of their expert FLOPs.
  const int64_t seqs = CeilDiv(s.sequences_per_step, replicas);
  const int64_t buckets =
      CeilDiv(seqs * s.sequence_tokens, std::max(s.max_batch_tokens, s.sequence_tokens));
  const double expert_flops = 2.0 * n.moe_layers * c.num_experts_per_tok * n.one_expert *
                              static_cast<double>(seqs) * s.sequence_tokens * (1.0 - 1.0 / ep);
  p.time.terms.push_back(
      Roofline(absl::StrFormat("scoring: %d sequences of %d tokens in %d buckets", seqs,
                               s.sequence_tokens, buckets),
               seqs * ForwardFlops(c, s.sequence_tokens) - expert_flops,
               buckets * static_cast<double>(weights), d));
  p.facts.push_back(
      absl::StrFormat("%d parameters (%d active per token); %d replicas of %d devices", n.total,
                      n.active, replicas, ep));
  if (fp8)
    p.facts.push_back(absl::StrFormat(
        "FP8 checkpoint: %s of FP8 weights, %s of block scales, %s of the rest per device",
        FormatGiB(fp8_bytes.fp8), FormatGiB(fp8_bytes.scales), FormatGiB(fp8_bytes.rest)));
  return p;
}

absl::Status CheckLearnerFits(const ModelConfig& c, const LearnerSettings& s,
                              int64_t device_bytes) {
  return CheckFits(LearnerMemory(c, Resolved(c, s, device_bytes)), device_bytes, "learner rank");
}

absl::Status CheckRolloutFits(const ModelConfig& c, const RolloutSettings& s,
                              int64_t device_bytes) {
  KvShape kv;
  return CheckFits(RolloutMemory(c, s, device_bytes, &kv), device_bytes, "opd-rollout");
}

int64_t RolloutKvPoolBytes(const ModelConfig& c, const RolloutSettings& s, int64_t device_bytes) {
  KvShape kv;
  RolloutMemory(c, s, device_bytes, &kv);
  return kv.pool;
}

int64_t RolloutKvPoolSequences(const ModelConfig& c, const RolloutSettings& s,
                               int64_t device_bytes) {
  KvShape kv;
  RolloutMemory(c, s, device_bytes, &kv);
  return kv.held;
}

absl::Status CheckTeacherFits(const ModelConfig& c, const TeacherSettings& s,
                              int64_t device_bytes) {
  DeviceSpec d;
  d.memory_bytes = device_bytes;
  return CheckFits(PlanTeacher(c, s, d).memory, device_bytes, "opd-teacher");
}

absl::Status CheckFits(const MemoryPlan& plan, int64_t device_bytes, const std::string& process) {
  const int64_t peak = plan.peak();
  if (peak <= device_bytes) return absl::OkStatus();
  const Term* largest = &plan.terms.front();
  const Term* overflow = nullptr;
  int64_t before = 0;
  for (const Term& t : plan.terms) {
    if (t.bytes > largest->bytes) largest = &t;
    if (!overflow && before + t.bytes > device_bytes) overflow = &t;
    if (!overflow) before += t.bytes;
  }
  std::string msg = absl::StrFormat(
      "%s: the memory plan needs %s on a device of %s: '%s' (%s) does not fit in the %s the terms "
      "before it leave (shrink it: %s)",
      process, FormatGiB(peak), FormatGiB(device_bytes), overflow->name, FormatGiB(overflow->bytes),
      FormatGiB(std::max<int64_t>(device_bytes - before, 0)), overflow->knob);
  if (largest != overflow)
    absl::StrAppendFormat(&msg, "; the largest term is '%s' (%s; shrink it: %s)", largest->name,
                          FormatGiB(largest->bytes), largest->knob);
  return absl::ResourceExhaustedError(msg);
}

}  // namespace lm::plan
