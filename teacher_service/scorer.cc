#include "teacher_service/scorer.h"

#include <algorithm>

#include <cmath>
#include <future>
#include <map>
#include <numeric>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/model/batch_invariant.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/placement.h"
#include "lm/util/log.h"

namespace teacher {

struct Scorer::Pending {
  ScoreJob job;
  ScoreDone done;
  std::vector<lm::SequenceScore> results;  // each entry written by the one worker that scored it
  std::vector<int64_t> left;               // sequences not packed yet, in order (guarded by mu_)
  int64_t outstanding = 0;                 // sequences not finished or dropped (guarded by mu_)
  // The failure reported (guarded by mu_): of the batches' failures, the one of the lowest
  // sequence index (`error_sequence`), so that the report does not depend on how the job's
  // sequences were packed; a job given up as a whole (cancelled, shut down) reports that.
  absl::Status error;
  int64_t error_sequence = -1;
};

namespace {

// Why a job must not be worked on (any more), or OK.
absl::Status Abandoned(const ScoreJob& job) {
  if (job.cancelled && job.cancelled())
    return absl::CancelledError("the client cancelled the request");
  if (absl::Now() >= job.deadline)
    return absl::DeadlineExceededError("deadline passed before scoring");
  return absl::OkStatus();
}

}  // namespace

Scorer::Scorer(std::shared_ptr<lm::CausalLM> model, ScorerOptions opts)
    : model_(std::move(model)), opts_(opts) {
  const torch::Device device = model_->LmHeadWeight().device();
  for (int i = 0; i < std::max(1, opts_.workers); ++i) {
    workers_.emplace_back([this, device] {
      lm::BindThreadToDevice(device);  // CUDA's current device is per thread: the model's
      WorkerLoop();
    });
  }
}

Scorer::~Scorer() {
  Stop();
}

int64_t Scorer::batches() const {
  absl::MutexLock lock(&mu_);
  return packing_.buckets;
}

Scorer::Slot Scorer::HoldSlot() {
  absl::MutexLock lock(&mu_);
  ++held_;
  return Slot(this);
}

Scorer::Slot& Scorer::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    Slot released(std::move(*this));
    scorer_ = std::exchange(other.scorer_, nullptr);
  }
  return *this;
}

Scorer::Slot::~Slot() {
  if (scorer_ == nullptr) return;
  absl::MutexLock lock(&scorer_->mu_);
  --scorer_->held_;
}

int64_t Scorer::held_slots() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

int64_t Scorer::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

absl::Status Scorer::Submit(ScoreJob job, ScoreDone done) {
  if (job.sequences.empty())
    return absl::InvalidArgumentError("empty batch: no sequences to score");
  auto p = std::make_shared<Pending>();
  p->results.resize(job.sequences.size());
  p->outstanding = static_cast<int64_t>(job.sequences.size());
  p->left.resize(job.sequences.size());
  std::iota(p->left.begin(), p->left.end(), int64_t{0});
  p->job = std::move(job);
  p->done = std::move(done);
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the teacher is shutting down");
  // Admission control applies to requests, not to the later slices of one already admitted.
  if (!p->job.admitted && static_cast<int64_t>(queue_.size()) + held_ >= opts_.max_queue) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "scoring queue full (", queue_.size(), " requests waiting, ", held_,
        " replies waiting for their clients to read them; --max-queue=", opts_.max_queue,
        "); retry later"));
  }
  queue_.push_back(std::move(p));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<lm::SequenceScore>> Scorer::Score(ScoreJob job) {
  std::promise<absl::StatusOr<std::vector<lm::SequenceScore>>> promise;
  auto future = promise.get_future();
  absl::Status st =
      Submit(std::move(job), [&promise](absl::StatusOr<std::vector<lm::SequenceScore>> r) {
        promise.set_value(std::move(r));
      });
  if (!st.ok()) return st;
  return future.get();
}

void Scorer::Stop() {
  std::vector<std::shared_ptr<Pending>> failed;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
    for (auto& p : queue_) {
      p->error = absl::UnavailableError("the teacher is shutting down");
      p->outstanding -= static_cast<int64_t>(p->left.size());
      // A job already partly in a batch completes when that batch does.
      if (p->outstanding == 0) failed.push_back(p);
    }
    queue_.clear();
  }
  for (auto& p : failed) p->done(p->error);
  for (auto& w : workers_) w.join();
  workers_.clear();
}

void Scorer::WorkerLoop() {
  // Scoring never needs gradients; the guard is per thread, as is the batch-invariant mode.
  torch::NoGradGuard no_grad;
  lm::ScopedBatchInvariant invariant(opts_.batch_invariant);
  while (true) {
    std::vector<Item> items = TakeBatch();
    if (items.empty()) {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      continue;  // every job taken was abandoned
    }
    RunBatch(items);
  }
}

std::vector<Scorer::Item> Scorer::TakeBatch() {
  std::vector<Item> items;
  std::vector<std::shared_ptr<Pending>> abandoned;
  {
    auto ready = [this]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
    absl::MutexLock lock(&mu_, absl::Condition(&ready));
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (absl::Status why = Abandoned((*it)->job); !why.ok()) {
        Pending& p = **it;
        p.error = why;
        p.outstanding -= static_cast<int64_t>(p.left.size());
        if (p.outstanding == 0) abandoned.push_back(*it);
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    const int64_t tokens = PackBucket(&items);
    if (!items.empty()) {
      ++packing_.buckets;
      packing_.tokens += tokens;
      if (!queue_.empty()) {  // closed for want of room, not of work
        ++packing_.closed_buckets;
        packing_.closed_tokens += tokens;
      }
    }
  }
  for (auto& p : abandoned) p->done(p->error);
  return items;
}

int64_t Scorer::PackBucket(std::vector<Item>* items) {
  // Fair first-fit decreasing: passes over the queued jobs in order, each pass offering every
  // job one sequence: its longest unpacked one that fits the room left (the first of equals;
  // into an empty bucket, its longest, however long). Long sequences go in while there is room
  // for them and short ones fill what is left. A job with nothing that fits is passed over for
  // the rest of the bucket (the room only shrinks). Every job queued when a bucket is packed is
  // offered a place in it before any job gets a second, so a small request waits for at most the
  // bucket in flight, not for every bucket of the large ones ahead of it. The packer before this
  // took each job's next sequence and stopped at the first that did not fit, leaving buckets
  // 60-75% full on a mix of 2k- and 10k-token documents; this one fills them to 95-98%
  // (Scorer.BucketsAreFullOnAMixedLengthQueue).
  const size_t n = queue_.size();
  std::vector<char> open(n, 1), got(n, 0);
  int64_t tokens = 0;
  for (bool took = true; took && tokens < opts_.max_batch_tokens;) {
    took = false;
    for (size_t j = 0; j < n && tokens < opts_.max_batch_tokens; ++j) {
      if (!open[j]) continue;
      Pending& p = *queue_[j];
      const int64_t room = opts_.max_batch_tokens - tokens;
      auto length = [&](int64_t i) {
        return static_cast<int64_t>(p.job.sequences[i].tokens.size());
      };
      auto best = p.left.end();
      for (auto it = p.left.begin(); it != p.left.end(); ++it) {
        if ((items->empty() || length(*it) <= room) &&
            (best == p.left.end() || length(*it) > length(*best)))
          best = it;
      }
      if (best == p.left.end()) {
        open[j] = 0;
        continue;
      }
      auto it = best;
      tokens += length(*it);
      items->push_back({queue_[j], *it});
      p.left.erase(it);
      got[j] = took = true;
      open[j] = !p.left.empty();
    }
  }
  // Jobs fully packed leave the queue. A job that got nothing (none of its sequences fitted the
  // room the others left) goes to the front: the next bucket offers it a place first, when the
  // bucket is empty and anything fits.
  std::deque<std::shared_ptr<Pending>> starved, rest;
  for (size_t j = 0; j < n; ++j) {
    if (queue_[j]->left.empty()) continue;
    (got[j] ? rest : starved).push_back(std::move(queue_[j]));
  }
  starved.insert(starved.end(), std::make_move_iterator(rest.begin()),
                 std::make_move_iterator(rest.end()));
  queue_ = std::move(starved);
  return tokens;
}

Scorer::Packing Scorer::packing() const {
  absl::MutexLock lock(&mu_);
  return packing_;
}

namespace {

// One group's results on the model's device, packed into one fp32 tensor so that a whole batch
// comes back to the host in a single copy: [logprobs (n) | top-k log-probs (n k) | top-k ids
// (n k, int32 bits viewed as fp32)].
torch::Tensor PackGroup(const torch::Tensor& logprobs, const lm::TopKLogprobs* top) {
  if (top == nullptr) return logprobs.reshape({-1});
  return torch::cat({logprobs.reshape({-1}), top->logprobs.reshape({-1}),
                     top->ids.to(torch::kInt32).contiguous().view(torch::kFloat32).reshape({-1})});
}

// FAILED_PRECONDITION naming the sequence (`index` in its job) and the position of the first
// non-finite log-prob in `s`, a scored token's or a top-k one. Finite logits always give finite
// log-probs (log_softmax), so this means the model produced NaN or infinite values (broken
// weights) and the score must not go out as OK. Runs on the batch's host copy: no device sync.
absl::Status CheckFinite(const lm::SequenceScore& s, int64_t index, int64_t response_start,
                         int64_t k) {
  auto bad = [&](float lp, int64_t j, const char* what) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", index, ": the ", what, " log-prob at position ", response_start + j, " is ",
        lp, ": the model produced non-finite values (are its weights broken?)"));
  };
  for (size_t j = 0; j < s.logprobs.size(); ++j)
    if (!std::isfinite(s.logprobs[j])) return bad(s.logprobs[j], j, "scored token's");
  for (size_t j = 0; j < s.topk_logprobs.size(); ++j)
    if (!std::isfinite(s.topk_logprobs[j])) return bad(s.topk_logprobs[j], j / k, "top-k");
  return absl::OkStatus();
}

// One sequence of a batch, as the scoring steps see it.
struct Scored {
  const lm::Sample* sample;
  double temperature;
  int64_t top_k;
  int64_t index;              // in its job, for messages
  lm::SequenceScore* result;  // where its scores go
};

// One group of sequences sharing a temperature and a top-k (one pass through the LM head), and
// where its scores sit in the batch's packed scores.
struct ScoreGroup {
  std::vector<size_t> members;
  int64_t k = 0, rows = 0, offset = 0;
};

// The batch's hidden states, packed as `batch` on the model's device.
torch::Tensor Hidden(lm::CausalLM& model, const std::vector<Scored>& seqs, lm::PackedBatch* batch) {
  std::vector<std::vector<int64_t>> tokens;
  tokens.reserve(seqs.size());
  for (const Scored& s : seqs)
    tokens.emplace_back(s.sample->tokens.begin(), s.sample->tokens.end());
  const torch::Device device = model.LmHeadWeight().device();
  // Indexing, gathers and log-probs run where the model is; only the results come back.
  *batch = lm::PackedBatch::FromSequences(tokens);
  batch->input_ids = batch->input_ids.to(device);
  batch->position_ids = batch->position_ids.to(device);
  return model.Forward(*batch);
}

// Every group's log-probs (and top-k) in one device tensor (undefined when nothing is scored);
// `groups` says where each group's are.
torch::Tensor ScoreGroups(lm::CausalLM& model, int64_t chunk_rows, const std::vector<Scored>& seqs,
                          const lm::PackedBatch& batch, const torch::Tensor& hidden,
                          std::vector<ScoreGroup>* groups) {
  std::map<std::pair<double, int64_t>, std::vector<size_t>> by_key;
  for (size_t i = 0; i < seqs.size(); ++i)
    by_key[{seqs[i].temperature, seqs[i].top_k}].push_back(i);
  const auto weight = model.LmHeadWeight();
  const torch::Device device = weight.device();
  std::vector<torch::Tensor> packed;
  int64_t offset = 0;
  for (auto& [key, members] : by_key) {
    // Rows predicting the scored tokens: position p is predicted by row p - 1.
    std::vector<int64_t> rows, targets;
    for (size_t i : members) {
      const lm::Sample& s = *seqs[i].sample;
      for (int64_t p = s.response_start; p < static_cast<int64_t>(s.tokens.size()); ++p) {
        rows.push_back(batch.cu_seqlens[i] + p - 1);
        targets.push_back(s.tokens[p]);
      }
    }
    if (rows.empty()) continue;
    lm::LogprobOptions lo;
    lo.temperature = key.first;
    lo.chunk_rows = chunk_rows;
    const auto h = hidden.index_select(0, torch::tensor(rows, torch::kInt64).to(device));
    const auto lp =
        lm::TokenLogprobs(h, weight, torch::tensor(targets, torch::kInt64).to(device), lo);
    const int64_t k = key.second;
    lm::TopKLogprobs top;
    if (k > 0) top = lm::TopK(h, weight, k, lo);
    packed.push_back(PackGroup(lp, k > 0 ? &top : nullptr));
    const int64_t n = static_cast<int64_t>(rows.size());
    groups->push_back({std::move(members), k, n, offset});
    offset += n * (1 + 2 * k);
  }
  return packed.empty() ? torch::Tensor() : torch::cat(packed);
}

// Each sequence's scores out of the batch's host copy, with its verdict (OK, or why its scores
// must not go out).
std::vector<absl::Status> Unpack(const std::vector<Scored>& seqs, const torch::Tensor& host,
                                 const std::vector<ScoreGroup>& groups) {
  std::vector<absl::Status> verdicts(seqs.size());
  const float* base = host.defined() ? host.data_ptr<float>() : nullptr;
  for (const ScoreGroup& g : groups) {
    const float* lpp = base + g.offset;
    const float* tlp = lpp + g.rows;
    const int32_t* ids = reinterpret_cast<const int32_t*>(tlp + g.rows * g.k);
    for (size_t i : g.members) {
      const lm::Sample& s = *seqs[i].sample;
      const int64_t n = s.response_length();
      lm::SequenceScore& out = *seqs[i].result;
      out.logprobs.assign(lpp, lpp + n);
      if (g.k > 0) {
        out.topk_ids.assign(ids, ids + n * g.k);
        out.topk_logprobs.assign(tlp, tlp + n * g.k);
      }
      verdicts[i] = CheckFinite(out, seqs[i].index, s.response_start, g.k);
      lpp += n;
      tlp += n * g.k;
      ids += n * g.k;
    }
  }
  return verdicts;
}

}  // namespace

void Scorer::RunBatch(const std::vector<Item>& items) {
  std::vector<Scored> seqs;
  seqs.reserve(items.size());
  for (const Item& it : items) {
    const auto& job = it.job->job;
    seqs.push_back({&job.sequences[it.index], job.temperature, job.top_k, it.index,
                    &it.job->results[it.index]});
  }
  std::vector<absl::Status> verdicts;  // per item: OK or why its scores are bad
  try {
    lm::PackedBatch batch;
    const torch::Tensor hidden = Hidden(*model_, seqs, &batch);
    std::vector<ScoreGroup> groups;
    const torch::Tensor packed =
        ScoreGroups(*model_, opts_.logprob_chunk_rows, seqs, batch, hidden, &groups);
    // The one device-to-host copy of the batch.
    const torch::Tensor host =
        packed.defined() ? packed.to(torch::kCPU).contiguous() : torch::Tensor();
    verdicts = Unpack(seqs, host, groups);
  } catch (const lm::CollectiveError& e) {  // expert parallelism: the group failed (UNAVAILABLE)
    Complete(items, e.status());
    return;
  } catch (const std::exception& e) {
    lm::log::Error(absl::StrCat("scoring batch failed: ", e.what()));
    Complete(items, absl::InternalError(absl::StrCat("scoring failed: ", e.what())));
    return;
  }
  Complete(items, verdicts);
}

void Scorer::Complete(const std::vector<Item>& items, const absl::Status& error) {
  Complete(items, std::vector<absl::Status>(items.size(), error));
}

void Scorer::Complete(const std::vector<Item>& items, const std::vector<absl::Status>& errors) {
  std::vector<std::shared_ptr<Pending>> finished;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      Pending& job = *it.job;
      if (!errors[i].ok() &&
          (job.error.ok() || (job.error_sequence >= 0 && it.index < job.error_sequence))) {
        job.error = errors[i];
        job.error_sequence = it.index;
      }
      if (--it.job->outstanding == 0) finished.push_back(it.job);
    }
  }
  for (auto& p : finished) {
    if (p->error.ok()) {
      p->done(std::move(p->results));
    } else {
      p->done(p->error);
    }
  }
}

}  // namespace teacher
