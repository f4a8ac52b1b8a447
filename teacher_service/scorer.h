// The teacher's scoring engine: a bounded queue of scoring jobs and worker thread(s) that pack
// sequences of several jobs into one PackedBatch under a token budget (continuous batching), run
// the model once per batch and hand each job its log-probs.
//
// Teacher scoring dominates an OPD step, so the forward runs on as many tokens as the budget
// allows regardless of how clients split their requests. Sequences are the unit of packing: a
// big job spans several batches, and each batch takes sequences from every queued job in turn,
// so that a small request is not held behind the whole of a large one. Log-probs go through
// lm::TokenLogprobs / lm::TopK, which chunk the LM head over rows: [tokens, vocab] logits are never
// materialised. Everything runs on the model's device (the batch's ids, the row gathers, the LM
// head, top-k); a batch's results come back to the host in one copy at its end.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lm {
class CausalLM;
}

namespace teacher {

struct ScoreJob {
  std::vector<std::vector<int64_t>> sequences;  // prompt + response each
  std::vector<int64_t> response_starts;         // first scored position of each, in [1, len]
  double temperature = 1.0;
  int64_t top_k = 0;  // > 0: also the top-k ids and log-probs per scored position
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // polled before the job's sequences are packed; may be empty
};

struct SequenceScore {
  std::vector<float> logprobs;       // [n], n = len - response_start
  std::vector<int32_t> topk_ids;     // [n * k] row-major
  std::vector<float> topk_logprobs;  // [n * k]
};

using ScoreDone = std::function<void(absl::StatusOr<std::vector<SequenceScore>>)>;

// What a job may ask for; Validate() turns a violation into INVALID_ARGUMENT naming the sequence.
struct ScoreLimits {
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;
  int64_t max_top_k = 1024;
  int64_t max_sequences = 4096;  // per job
  // The reply a job may cost (ReplyBytes): the server holds it whole until it is sent, and
  // protobuf cannot serialise a message of 2 GiB or more (gRPC aborts on one).
  int64_t max_reply_bytes = int64_t{1} << 30;
};

// The serialised size of a job's reply, an upper bound: per scored position a float32 log-prob and
// top_k (int32 id, float32 log-prob) pairs, per sequence its field tags and lengths.
int64_t ReplyBytes(const ScoreJob& job);

// Checks a job against the limits; a reply over max_reply_bytes is RESOURCE_EXHAUSTED naming its
// size and the limit, everything else INVALID_ARGUMENT naming the field.
absl::Status Validate(const ScoreJob& job, const ScoreLimits& limits);

struct ScorerOptions {
  int64_t max_batch_tokens = 16384;  // tokens per forward (one longer sequence runs alone)
  int64_t max_queue = 64;            // jobs waiting; more are refused with RESOURCE_EXHAUSTED
  int workers = 1;                   // threads running forwards
  int64_t logprob_chunk_rows = 512;  // rows of [rows, vocab] logits alive at once
};

class Scorer {
 public:
  Scorer(std::shared_ptr<lm::CausalLM> model, ScorerOptions opts);
  ~Scorer();
  Scorer(const Scorer&) = delete;
  Scorer& operator=(const Scorer&) = delete;

  // Queues `job` (already validated); `done` is called exactly once, from a worker thread, with
  // the scores in job order or the reason there are none (CANCELLED, DEADLINE_EXCEEDED,
  // UNAVAILABLE at shutdown, INTERNAL). Returns RESOURCE_EXHAUSTED, without calling `done`, when
  // the queue is full. A job whose scores came out non-finite (a broken model) fails with
  // FAILED_PRECONDITION naming the sequence and position: no NaN log-prob is ever returned as OK.
  absl::Status Submit(ScoreJob job, ScoreDone done);
  // Blocking convenience for in-process use.
  absl::StatusOr<std::vector<SequenceScore>> Score(ScoreJob job);

  // Fails queued jobs with UNAVAILABLE, finishes the batches in flight, joins the workers.
  void Stop();

  int64_t queued() const;
  // Batches packed so far (a batch counts from the moment it is packed).
  int64_t batches() const;

 private:
  struct Pending;
  struct Item {  // one sequence of a pending job, packed into a batch
    std::shared_ptr<Pending> job;
    int64_t index;
  };

  void WorkerLoop();
  // Waits for work and takes sequences up to the token budget; empty when stopping.
  std::vector<Item> TakeBatch();
  void RunBatch(const std::vector<Item>& items);
  // Records that `items` finished (with `error` when not OK) and completes finished jobs.
  void Complete(const std::vector<Item>& items, const absl::Status& error);
  // The same with one verdict per item (a job fails with the first of its items' errors).
  void Complete(const std::vector<Item>& items, const std::vector<absl::Status>& errors);

  std::shared_ptr<lm::CausalLM> model_;
  ScorerOptions opts_;
  mutable absl::Mutex mu_;
  std::deque<std::shared_ptr<Pending>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t batches_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;
};

}  // namespace teacher
