#include "rollout/engine.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <tuple>

#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/model/placement.h"
#include "lm/model/routing_trace.h"
#include "rollout/block_allocator.h"

namespace rollout {

using lm::FinishReason;
using lm::Sample;
using lm::SamplingParams;
namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

int64_t BlocksFor(int64_t tokens, int64_t block_size) {
  return (tokens + block_size - 1) / block_size;
}
}  // namespace

class Engine::Request {
 public:
  Snapshot snapshot;
  std::shared_ptr<const lm::PackedWeight> lm_head;  // the snapshot's, or packed by the engine
  std::vector<std::vector<int32_t>> prompts;
  SamplingParams params;
  std::function<void(Sample)> on_sample;
  std::function<bool()> cancelled;
  int64_t remaining = 0;  // samples not reported yet (engine thread)
  bool ended = false;     // engine thread

  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
};

// One sample: out.tokens is its prompt followed by what it generated. `cached` tokens have their
// keys/values in `blocks`; the rest (the last drawn token, or everything after a preemption) go in
// the next step.
struct Engine::Seq {
  std::shared_ptr<Request> req;
  int64_t cached = 0;
  std::vector<int32_t> blocks;
  int64_t slot = -1;  // recurrent-state slot
  std::mt19937_64 rng;
  Sample out;
  uint64_t admitted = 0;  // admission order: the largest is the youngest
};

// Waiting work: a prompt to prefill for all its samples, or a preempted sequence to recompute
// (a prompt preempted before its prefill ended still forks into all its samples).
struct Engine::Waiting {
  std::shared_ptr<Request> req;
  int64_t prompt = 0;
  std::unique_ptr<Seq> seq;  // set for a recompute
};

namespace {
// The sequences a prefilled sequence becomes: a prompt forks into its samples, a recompute
// stays one.
int64_t SamplesAfterPrefill(const Sample& out, const SamplingParams& p) {
  return out.response_length() == 0 ? p.samples_per_prompt : 1;
}
}  // namespace

// One row of a step: new_tokens of a sequence's tokens from seqs[0]->cached; once the sequence is
// fed whole, the samples its logits are drawn for (a prompt's row forks into them).
struct Engine::StepRow {
  std::shared_ptr<Request> req;
  std::vector<std::unique_ptr<Seq>> seqs;
  int64_t new_tokens = 0;
};

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const lm::CausalLM& model,
                                                       EngineOptions opts) {
  if (!model.SupportsPagedKV())
    return absl::FailedPreconditionError(
        absl::StrCat("a ", model.config().model_type, " model has no paged KV cache"));
  if (opts.block_size < 1 || opts.max_running < 1 || opts.max_requests < 1 ||
      opts.max_prefill_tokens < 1)
    return absl::InvalidArgumentError(
        "block size, max running, max requests and max prefill tokens must be >= 1");
  const lm::PagedCacheSpec spec = model.PagedSpec();
  if (opts.num_blocks == 0) {
    const double state = static_cast<double>(spec.state_bytes_per_slot) * opts.max_running;
    const double per_block = static_cast<double>(spec.kv_bytes_per_token) * opts.block_size;
    opts.num_blocks =
        per_block > 0 ? static_cast<int64_t>((opts.kv_cache_bytes - state) / per_block) : 0;
  }
  if (opts.num_blocks < 2)
    return absl::InvalidArgumentError(absl::StrFormat(
        "--kv-cache-gb=%.3f holds %d blocks of %d tokens (%d bytes per token, plus %d bytes of "
        "state per sequence for %d sequences); at least 2 are needed",
        opts.kv_cache_bytes / kGiB, opts.num_blocks, opts.block_size, spec.kv_bytes_per_token,
        spec.state_bytes_per_slot, opts.max_running));
  lm::PagedKVCache cache =
      model.NewPagedKVCache(opts.num_blocks, opts.block_size, opts.max_running);
  return std::unique_ptr<Engine>(new Engine(opts, std::move(cache)));
}

Engine::Engine(EngineOptions opts, lm::PagedKVCache cache) : opts_(opts), cache_(std::move(cache)) {
  blocks_ = std::make_unique<BlockAllocator>(opts_.num_blocks);
  for (int64_t s = opts_.max_running - 1; s >= 0; --s) free_slots_.push_back(s);
  local_.usable_blocks = blocks_->usable();
  local_.pool_bytes = cache_.bytes();
  stats_ = local_;
  const torch::Device device = !cache_.k.empty()       ? cache_.k.front().device()
                               : !cache_.state.empty() ? cache_.state.front().device()
                                                       : torch::Device(torch::kCPU);
  // The engine thread inherits its creator's debug info (a profiler's or memory reporter's
  // state, which LibTorch keeps per thread), so that what watches the creator sees the steps.
  thread_ = std::thread([this, device, info = c10::ThreadLocalDebugInfo::current()] {
    c10::DebugInfoGuard debug_info(info);
    lm::BindThreadToDevice(device);  // CUDA's current device is per thread: the pool's
    Loop();
  });
}

Engine::~Engine() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::StatusOr<std::shared_ptr<Engine::Request>> Engine::Submit(
    Snapshot snapshot, std::vector<std::vector<int32_t>> prompts, SamplingParams params,
    std::function<void(Sample)> on_sample, std::function<bool()> cancelled) {
  if (params.samples_per_prompt > opts_.max_running)
    return absl::ResourceExhaustedError(absl::StrCat(
        "samples_per_prompt ", params.samples_per_prompt, " is more than the ", opts_.max_running,
        " sequences this worker decodes at once (--max-running-seqs)"));
  if (params.return_routing) {
    const lm::ModelConfig& c = snapshot.model->config();
    if (!snapshot.model->SupportsRoutingReplay() || !lm::RoutingTrace(c).recordable())
      return absl::InvalidArgumentError(
          absl::StrCat("return_routing: a ", c.model_type,
                       " model has no recordable MoE routing (routing replay supports qwen3_moe)"));
  }
  // A sequence must fit the whole pool on its own, or it could never finish.
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t tokens = static_cast<int64_t>(prompts[i].size()) + params.max_new_tokens;
    const int64_t need = BlocksFor(tokens, opts_.block_size);
    if (need > blocks_->usable())
      return absl::ResourceExhaustedError(absl::StrFormat(
          "prompt %d: %d tokens of prompt + max_new_tokens need %d KV blocks of %d tokens, more "
          "than the whole KV cache of this worker (%d blocks, %.3f GiB, --kv-cache-gb): send a "
          "shorter prompt or a smaller max_new_tokens",
          i, tokens, need, opts_.block_size, blocks_->usable(),
          static_cast<double>(cache_.bytes()) / kGiB));
  }
  auto req = std::make_shared<Request>();
  req->snapshot = std::move(snapshot);
  req->lm_head = req->snapshot.lm_head;
  req->prompts = std::move(prompts);
  req->params = std::move(params);
  req->on_sample = std::move(on_sample);
  req->cancelled = std::move(cancelled);
  req->remaining = static_cast<int64_t>(req->prompts.size()) * req->params.samples_per_prompt;
  absl::MutexLock lock(&mu_);
  if (requests_in_engine_ >= opts_.max_requests)
    return absl::ResourceExhaustedError(
        absl::StrCat("the rollout engine's queue is full: ", opts_.max_requests,
                     " requests are waiting or running (--max-queued-requests); retry later"));
  ++requests_in_engine_;
  inbox_.push_back(req);
  return req;
}

absl::Status Engine::Wait(Request& req) {
  absl::MutexLock lock(&req.mu);
  req.mu.Await(absl::Condition(&req.done));
  return req.status;
}

absl::Status Engine::Generate(const Snapshot& snapshot,
                              const std::vector<std::vector<int32_t>>& prompts,
                              const SamplingParams& params,
                              const std::function<void(Sample)>& on_sample,
                              const std::function<bool()>& cancelled) {
  auto req = Submit(snapshot, prompts, params, on_sample, cancelled);
  if (!req.ok()) return req.status();
  return Wait(**req);
}

void Engine::Pause() {
  absl::MutexLock lock(&mu_);
  paused_ = true;
}

void Engine::Resume() {
  absl::MutexLock lock(&mu_);
  paused_ = false;
}

EngineStats Engine::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void Engine::Loop() {
  torch::NoGradGuard no_grad;
  std::shared_ptr<const lm::PackedWeight> last_head;  // packed for last_model
  std::shared_ptr<lm::CausalLM> last_model;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (!paused_ && (!inbox_.empty() || !active_.empty()));
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) break;
      for (auto& req : inbox_) {
        // Decode steps compute logits on the packed LM head (lm::PackLmHead) where a kernel
        // applies, packed once per model when the snapshot brings none.
        if (!req->lm_head) {
          if (req->snapshot.model != last_model) {
            last_model = req->snapshot.model;
            last_head = lm::PackLmHead(*last_model);
          }
          req->lm_head = last_head;
        }
        EnqueuePrompts(req);
        active_.push_back(std::move(req));
      }
      inbox_.clear();
    }
    try {
      DropCancelled();
      PrefillStep();
      DecodeStep();
    } catch (const std::exception& e) {  // LibTorch reports failures (e.g. OOM) by throwing
      FailAll(absl::InternalError(absl::StrCat("sampling failed: ", e.what())));
    }
    active_.erase(
        std::remove_if(active_.begin(), active_.end(), [](const auto& r) { return r->ended; }),
        active_.end());
    local_.peak_used_blocks = blocks_->peak_used();
    {
      absl::MutexLock lock(&mu_);
      stats_ = local_;
    }
    SignalEnded();
  }
  FailAll(absl::UnavailableError("the rollout engine stopped"));
  SignalEnded();
}

void Engine::Finish(Request& req, absl::Status st) {
  if (req.ended) return;
  req.ended = true;
  {
    absl::MutexLock lock(&mu_);
    --requests_in_engine_;
  }
  absl::MutexLock lock(&req.mu);
  req.status = std::move(st);
  for (auto& r : active_)
    if (r.get() == &req) ended_.push_back(r);
}

void Engine::SignalEnded() {
  for (auto& r : ended_) {
    absl::MutexLock lock(&r->mu);
    r->done = true;
  }
  ended_.clear();
}

void Engine::ReleaseSeq(Seq& seq) {
  for (int32_t b : seq.blocks) blocks_->Release(b);
  seq.blocks.clear();
  seq.cached = 0;
  if (seq.slot >= 0) free_slots_.push_back(seq.slot);
  seq.slot = -1;
}

// Removes the sequences of ended requests (cancelled now, or failed) from the queue and the batch.
void Engine::DropCancelled() {
  for (auto& req : active_) {
    if (!req->ended && req->cancelled && req->cancelled())
      Finish(*req, absl::CancelledError("cancelled while sampling"));
  }
  for (auto* seqs : {&running_, &prefilling_}) {
    for (auto& s : *seqs)
      if (s->req->ended) ReleaseSeq(*s);
    seqs->erase(
        std::remove_if(seqs->begin(), seqs->end(), [](const auto& s) { return s->req->ended; }),
        seqs->end());
  }
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                [](const Waiting& w) { return w.req->ended; }),
                 waiting_.end());
}

void Engine::FailAll(const absl::Status& st) {
  for (auto* seqs : {&running_, &prefilling_}) {
    for (auto& s : *seqs) ReleaseSeq(*s);
    seqs->clear();
  }
  waiting_.clear();
  for (auto& req : active_) Finish(*req, st);
  absl::MutexLock lock(&mu_);
  for (auto& req : inbox_) {
    --requests_in_engine_;
    absl::MutexLock rl(&req->mu);
    req->status = st;
    req->done = true;
  }
  inbox_.clear();
}

// A new request's prompts join the waiting queue by turn: its prompt p goes behind every waiting
// prompt of index <= p of the requests before it (and before those of index > p), behind the
// preempted sequences, which come back first. So requests take turns, one prompt each: a small
// request waits for about as many admissions as it has prompts, not for every prompt of the large
// requests queued ahead of it, and requests of one prompt each keep their arrival order.
void Engine::EnqueuePrompts(const std::shared_ptr<Request>& req) {
  auto queued = waiting_.begin();
  while (queued != waiting_.end() && queued->seq) ++queued;  // recomputes stay first
  std::deque<Waiting> added;
  for (int64_t p = 0; p < static_cast<int64_t>(req->prompts.size()); ++p)
    added.push_back(Waiting{req, p, nullptr});
  std::deque<Waiting> merged(std::make_move_iterator(waiting_.begin()),
                             std::make_move_iterator(queued));
  // The waiting prompts are in turn order already (this merge keeps it; admission takes the
  // front); on a tie the older request's prompt stays first.
  std::merge(std::make_move_iterator(queued), std::make_move_iterator(waiting_.end()),
             std::make_move_iterator(added.begin()), std::make_move_iterator(added.end()),
             std::back_inserter(merged),
             [](const Waiting& a, const Waiting& b) { return a.prompt < b.prompt; });
  waiting_ = std::move(merged);
}

int64_t Engine::SeatsTaken() const {
  int64_t seats = static_cast<int64_t>(running_.size());
  for (const auto& s : prefilling_) seats += SamplesAfterPrefill(s->out, s->req->params);
  return seats;
}

// One prefill step of at most max_prefill_tokens new tokens: the next chunk of every sequence
// already prefilling (oldest first), then newly admitted work with what is left.
void Engine::PrefillStep() {
  std::vector<StepRow> rows;
  int64_t budget = opts_.max_prefill_tokens;
  size_t taken = 0;
  for (; taken < prefilling_.size() && budget > 0; ++taken) {
    Seq& seq = *prefilling_[taken];
    StepRow row;
    row.req = seq.req;
    row.new_tokens = std::min(static_cast<int64_t>(seq.out.tokens.size()) - seq.cached, budget);
    budget -= row.new_tokens;
    row.seqs.push_back(std::move(prefilling_[taken]));
    rows.push_back(std::move(row));
  }
  prefilling_.erase(prefilling_.begin(), prefilling_.begin() + static_cast<int64_t>(taken));
  Admit(budget, rows);
  if (rows.empty()) return;
  const int64_t tokens = opts_.max_prefill_tokens - budget;
  ++local_.prefill_steps;
  local_.prefill_tokens += tokens;
  local_.largest_prefill_step = std::max(local_.largest_prefill_step, tokens);
  RunRows(rows, /*prefill=*/true);
}

// Admits waiting work in order while seats and blocks allow: a sequence gets blocks for all its
// tokens at once (so its later chunks never wait for blocks) and a state slot; its first chunk is
// what the budget has left. A prompt's samples take their seats now and fork after its prefill.
void Engine::Admit(int64_t& budget, std::vector<StepRow>& rows) {
  int64_t seats = opts_.max_running - SeatsTaken();
  while (!waiting_.empty() && budget > 0) {
    Waiting& w = waiting_.front();
    const int64_t n =
        w.seq ? SamplesAfterPrefill(w.seq->out, w.req->params) : w.req->params.samples_per_prompt;
    const int64_t len = w.seq ? static_cast<int64_t>(w.seq->out.tokens.size())
                              : static_cast<int64_t>(w.req->prompts[w.prompt].size());
    const int64_t need = BlocksFor(len, opts_.block_size);
    if (n > seats) break;
    // Room for the sequence and one block of growth per sample; into an idle engine the
    // sequence alone (its samples may then preempt each other, but the oldest always progresses).
    const bool idle = running_.empty() && prefilling_.empty() && rows.empty();
    if (need + n > blocks_->free() && !(idle && need <= blocks_->free())) break;
    std::unique_ptr<Seq> seq = std::move(w.seq);
    if (!seq) {
      seq = std::make_unique<Seq>();
      seq->req = w.req;
      seq->out.SetPrompt(w.req->prompts[w.prompt]);
      seq->rng.seed(lm::SampleSeed(w.req->params.seed, w.req->params.SeedIndex(w.prompt), 0));
      seq->out.prompt_index = w.prompt;
      seq->out.sample_index = 0;
    }
    for (int64_t b = 0; b < need; ++b) seq->blocks.push_back(*blocks_->Allocate());
    seq->slot = free_slots_.back();
    free_slots_.pop_back();
    seq->admitted = ++admissions_;
    StepRow row;
    row.req = w.req;
    row.new_tokens = std::min(len, budget);
    row.seqs.push_back(std::move(seq));
    waiting_.pop_front();
    seats -= n;
    budget -= row.new_tokens;
    rows.push_back(std::move(row));
  }
}

// The step's rows as the paged forward takes them: each row's sequence, context and blocks, and
// its fed tokens, read from the samples (int32) straight into the int64 tensor on `device`.
lm::PagedStep Engine::StepOf(const std::vector<StepRow>& rows, const std::vector<size_t>& idx,
                             const torch::Device& device) {
  lm::PagedStep step;
  step.cu_seqlens.push_back(0);
  for (size_t i : idx) {
    const Seq& s = *rows[i].seqs[0];
    step.cu_seqlens.push_back(step.cu_seqlens.back() + rows[i].new_tokens);
    step.context_lens.push_back(s.cached);
    step.block_tables.push_back(s.blocks);
    step.state_slots.push_back(s.slot);
  }
  torch::Tensor fed = torch::empty({step.cu_seqlens.back()}, torch::kInt64);
  int64_t* at = fed.data_ptr<int64_t>();
  for (size_t i : idx) {
    const Seq& s = *rows[i].seqs[0];
    at = std::copy_n(s.out.tokens.begin() + s.cached, rows[i].new_tokens, at);
  }
  step.input_ids = fed.to(device);
  return step;
}

bool Engine::AnyReturnsRouting(const std::vector<StepRow>& rows, const std::vector<size_t>& idx) {
  bool routing = false;
  for (size_t i : idx) routing |= rows[i].req->params.return_routing;
  return routing;
}

// A recompute after a preemption refeeds positions whose routing is recorded: it routes them as
// recorded, so that the recomputed keys/values are the ones the later tokens would have seen, and
// the learner's replay of one routing per position stays exact. The step's routing per layer,
// -1 where not recorded; empty when nothing fed is recorded.
std::vector<torch::Tensor> Engine::RecordedRouting(const std::vector<StepRow>& rows,
                                                   const std::vector<size_t>& idx,
                                                   const lm::RoutingTrace& layout) {
  lm::RoutingTrace forced = layout;  // the step's tokens, -1 where not recorded
  bool any = false;
  for (size_t k = 0; k < idx.size(); ++k) {
    const Seq& s = *rows[idx[k]].seqs[0];
    const int64_t fed = rows[idx[k]].new_tokens;
    const int64_t have =
        s.req->params.return_routing
            ? static_cast<int64_t>(s.out.routed_experts.size()) / layout.per_position()
            : 0;
    const int64_t recorded = std::clamp<int64_t>(have - s.cached, 0, fed);
    if (recorded > 0) {
      const auto ids =
          absl::MakeConstSpan(s.out.routed_experts)
              .subspan(s.cached * layout.per_position(), recorded * layout.per_position());
      TORCH_CHECK(forced.Append(ids).ok(), "return_routing: a partial position");
      any = true;
    }
    forced.AppendUnrouted(fed - recorded);
  }
  if (!any) return {};
  return forced.PerLayer();
}

// Appends the routing `seen` in the step to the samples that asked for it.
void Engine::AppendRouting(std::vector<StepRow>& rows, const std::vector<size_t>& idx,
                           const lm::RoutingTrace& layout, const std::vector<torch::Tensor>& seen,
                           const lm::PagedStep& step) {
  lm::RoutingTrace recorded = layout;  // the step's tokens
  const absl::Status st = recorded.AppendRecorded(seen, step.cu_seqlens.back());
  TORCH_CHECK(st.ok(), st.message());
  for (size_t k = 0; k < idx.size(); ++k) {
    Seq& s = *rows[idx[k]].seqs[0];
    if (!s.req->params.return_routing) continue;
    auto& r = s.out.routed_experts;
    s.out.routing_layers = layout.layers();
    s.out.routing_top_k = layout.top_k();
    // Positions s.cached.. were fed in this step; after a preemption the recompute refeeds
    // positions already recorded (routed as recorded, above): only new ones are appended.
    const int64_t have = static_cast<int64_t>(r.size()) / layout.per_position();
    const int64_t from = std::max(have, s.cached), end = s.cached + rows[idx[k]].new_tokens;
    if (from >= end) continue;
    const auto ids = recorded.Positions(step.cu_seqlens[k] + (from - s.cached), end - from);
    r.insert(r.end(), ids.begin(), ids.end());
  }
}

torch::Tensor Engine::Forward(lm::CausalLM& model, std::vector<StepRow>& rows,
                              const std::vector<size_t>& idx) {
  const lm::PagedStep step = StepOf(rows, idx, model.LmHeadWeight().device());
  // Routing replay: the experts each fed token was routed to, recorded for the requests that
  // asked (over the whole step: they share the forward).
  const bool routing = AnyReturnsRouting(rows, idx);
  std::vector<torch::Tensor> seen, replay;
  const lm::RoutingTrace layout(model.config());
  if (routing) replay = RecordedRouting(rows, idx, layout);
  std::optional<lm::ScopedRoutingRecorder> record;
  std::optional<lm::ScopedRoutingReplay> replaying;
  if (routing) record.emplace(&seen);
  if (!replay.empty()) replaying.emplace(&replay);
  torch::Tensor hidden = model.PagedForward(step, cache_);
  replaying.reset();
  record.reset();
  if (routing) AppendRouting(rows, idx, layout, seen, step);
  return hidden;
}

void Engine::RunRows(std::vector<StepRow>& rows, bool prefill) {
  // One forward per model (requests of different weight versions do not share a batch).
  std::map<lm::CausalLM*, std::vector<size_t>> by_model;
  for (size_t i = 0; i < rows.size(); ++i) by_model[rows[i].req->snapshot.model.get()].push_back(i);
  std::vector<torch::Tensor> logits(rows.size());
  std::vector<bool> fed(rows.size());  // the row's sequence is fed whole: it draws
  for (auto& [model, idx] : by_model) {
    const torch::Tensor hidden = Forward(*model, rows, idx);
    std::vector<int64_t> drawing;
    for (size_t k = 0; k < idx.size(); ++k) {
      const Seq& s = *rows[idx[k]].seqs[0];
      fed[idx[k]] = s.cached + rows[idx[k]].new_tokens == static_cast<int64_t>(s.out.tokens.size());
      if (fed[idx[k]]) drawing.push_back(static_cast<int64_t>(k));
    }
    if (drawing.empty()) continue;
    const torch::Tensor h =
        static_cast<int64_t>(drawing.size()) == hidden.size(0)
            ? hidden
            : hidden.index_select(0, torch::tensor(drawing, torch::kInt64).to(hidden.device()));
    // The prefill's logits through the model's head, a decode step's as the static sampler's:
    // fp32 either way, from a bf16 head without bf16 rounding (lm/model/precision.h LogitsFp32).
    const torch::Tensor lg =
        prefill ? model->Logits(h) : lm::DecodeLogits(*model, rows[idx[0]].req->lm_head.get(), h);
    for (size_t j = 0; j < drawing.size(); ++j) logits[idx[drawing[j]]] = lg[j];
  }
  // Sequences not fed whole go on prefilling next step, ahead of the younger ones waiting there.
  std::vector<std::unique_ptr<Seq>> unfinished;
  for (size_t i = 0; i < rows.size(); ++i) {
    Seq& first = *rows[i].seqs[0];
    first.cached += rows[i].new_tokens;
    if (fed[i]) {
      if (prefill) Fork(rows[i]);
      continue;
    }
    ++local_.partial_prefills;
    unfinished.push_back(std::move(rows[i].seqs[0]));
    rows[i].seqs.clear();
  }
  prefilling_.insert(prefilling_.begin(), std::make_move_iterator(unfinished.begin()),
                     std::make_move_iterator(unfinished.end()));
  // One draw per distinct filter (temperature, top-k, top-p) in the step, usually one for the
  // whole batch: each sample still draws from its own generator.
  std::map<std::tuple<double, int64_t, double>, std::vector<size_t>> by_filter;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!fed[i]) continue;
    const SamplingParams& p = rows[i].req->params;
    by_filter[{p.temperature, p.top_k, p.top_p}].push_back(i);
  }
  for (auto& [filter, idx] : by_filter) {
    std::vector<torch::Tensor> lg;
    std::vector<std::mt19937_64*> rngs;
    for (size_t i : idx)
      for (auto& s : rows[i].seqs) {
        lg.push_back(logits[i]);
        rngs.push_back(&s->rng);
      }
    const lm::Draws d = lm::DrawTokens(torch::stack(lg), rngs, rows[idx[0]].req->params);
    size_t k = 0;
    for (size_t i : idx)
      for (auto& s : rows[i].seqs) {
        // A non-finite log-prob ends its request only: others (other weight versions) go on.
        if (absl::Status st = lm::CheckDrawn(s->out, d.logprobs[k]); !st.ok())
          Finish(*s->req, std::move(st));
        Append(s, d.tokens[k], d.logprobs[k]);
        ++k;
      }
  }
}

// A prompt fed whole forks into its samples: they share its blocks and copy its state slot.
void Engine::Fork(StepRow& row) {
  Seq& first = *row.seqs[0];
  if (first.out.response_length() > 0 || row.req->params.samples_per_prompt == 1) return;
  for (int64_t s = 1; s < row.req->params.samples_per_prompt; ++s) {
    auto seq = std::make_unique<Seq>();
    seq->req = row.req;
    seq->out.SetPrompt(first.out.tokens);
    seq->cached = first.cached;
    seq->blocks = first.blocks;
    for (int32_t b : seq->blocks) blocks_->Share(b);
    seq->slot = free_slots_.back();
    free_slots_.pop_back();
    cache_.CopyStateSlot(first.slot, seq->slot);
    seq->rng.seed(
        lm::SampleSeed(row.req->params.seed, row.req->params.SeedIndex(first.out.prompt_index), s));
    seq->out.prompt_index = first.out.prompt_index;
    seq->out.sample_index = s;
    seq->out.routed_experts = first.out.routed_experts;
    seq->out.routing_layers = first.out.routing_layers;
    seq->out.routing_top_k = first.out.routing_top_k;
    seq->admitted = first.admitted;
    row.seqs.push_back(std::move(seq));
  }
}

// Records a drawn token; the sequence goes on running, or retires when it is done.
void Engine::Append(std::unique_ptr<Seq>& seq, int64_t token, float logprob) {
  if (seq->req->ended) return ReleaseSeq(*seq);  // failed or cancelled: the sequence leaves
  const SamplingParams& p = seq->req->params;
  seq->out.tokens.push_back(static_cast<int32_t>(token));
  seq->out.logprobs.push_back(logprob);
  const bool stop = std::find(p.stop_ids.begin(), p.stop_ids.end(), token) != p.stop_ids.end();
  if (stop || seq->out.response_length() >= p.max_new_tokens) {
    seq->out.finish = stop ? FinishReason::kStop : FinishReason::kLength;
    Retire(std::move(seq));
  } else {
    running_.push_back(std::move(seq));
  }
}

void Engine::Retire(std::unique_ptr<Seq> seq) {
  ReleaseSeq(*seq);
  Request& req = *seq->req;
  if (req.ended) return;
  req.on_sample(std::move(seq->out));
  if (--req.remaining == 0) Finish(req, absl::OkStatus());
}

bool Engine::PreemptYoungest() {
  const Seq* running = running_.empty() ? nullptr : running_.back().get();
  const Seq* prefilling = prefilling_.empty() ? nullptr : prefilling_.back().get();
  if (!running && !prefilling) return false;
  auto& from =
      prefilling && (!running || prefilling->admitted > running->admitted) ? prefilling_ : running_;
  Preempt(std::move(from.back()));
  from.pop_back();
  return true;
}

void Engine::Preempt(std::unique_ptr<Seq> seq) {
  ReleaseSeq(*seq);
  ++local_.preemptions;
  waiting_.push_front(Waiting{seq->req, seq->out.prompt_index, std::move(seq)});
}

bool Engine::MakeWritable(Seq& seq) {
  const int64_t i = seq.cached / opts_.block_size;
  if (i == static_cast<int64_t>(seq.blocks.size())) {  // the last block is full: a new one
    auto b = blocks_->Allocate();
    if (!b) return false;
    seq.blocks.push_back(*b);
  } else if (blocks_->refs(seq.blocks[i]) > 1) {  // shared: copy before writing
    auto b = blocks_->Allocate();
    if (!b) return false;
    cache_.CopyBlock(seq.blocks[i], *b);
    blocks_->Release(seq.blocks[i]);
    seq.blocks[i] = *b;
    ++local_.copy_on_writes;
  }
  return true;
}

// One token for every running sequence, in one batch; blocks first, oldest sequences first,
// preempting the youngest when the pool is full.
void Engine::DecodeStep() {
  std::stable_sort(running_.begin(), running_.end(),
                   [](const auto& a, const auto& b) { return a->admitted < b->admitted; });
  std::vector<std::unique_ptr<Seq>> batch;
  while (!running_.empty()) {
    std::unique_ptr<Seq> seq = std::move(running_.front());
    running_.erase(running_.begin());
    bool ok = MakeWritable(*seq);
    while (!ok && PreemptYoungest()) ok = MakeWritable(*seq);
    if (!ok) {
      Preempt(std::move(seq));  // the youngest itself
      continue;
    }
    batch.push_back(std::move(seq));
  }
  if (batch.empty()) return;
  ++local_.decode_steps;
  local_.decoded_tokens += static_cast<int64_t>(batch.size());
  if (!waiting_.empty()) {
    ++local_.waiting_decode_steps;
    local_.waiting_decoded_tokens += static_cast<int64_t>(batch.size());
  }
  std::vector<StepRow> rows;
  for (auto& s : batch) {
    StepRow row;
    row.req = s->req;
    row.new_tokens = 1;
    row.seqs.push_back(std::move(s));
    rows.push_back(std::move(row));
  }
  RunRows(rows, /*prefill=*/false);
}

}  // namespace rollout
