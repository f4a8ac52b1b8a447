// The teacher's scoring engine: a bounded queue of scoring jobs and worker thread(s) that pack
// sequences of several jobs into one PackedBatch under a token budget (continuous batching), run
// the model once per batch and hand each job its log-probs.
//
// Teacher scoring dominates an OPD step, so the forward runs on as many tokens as the budget
// allows regardless of how clients split their requests. Sequences are the unit of packing: a
// big job spans several batches, and each batch (bucket) is packed first-fit from every queued
// job's sequences, the jobs taking turns, so that buckets fill and a small request is not held
// behind the whole of a large one (PackBucket in scorer.cc). Log-probs go through
// lm::TokenLogprobs / lm::TopK, which chunk the LM head over rows: [tokens, vocab] logits are never
// materialised. Everything runs on the model's device (the batch's ids, the row gathers, the LM
// head, top-k); a batch's results come back to the host in one copy at its end. The jobs, their
// limits and checks are torch-free, in teacher_service/score_job.h.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "teacher_service/score_job.h"

namespace lm {
class CausalLM;
}

namespace teacher {

using ScoreDone = std::function<void(absl::StatusOr<std::vector<lm::SequenceScore>>)>;

struct ScorerOptions {
  int64_t max_batch_tokens = 16384;  // tokens per forward (one longer sequence runs alone)
  int64_t max_queue = 64;            // jobs waiting; more are refused with RESOURCE_EXHAUSTED
  int workers = 1;                   // threads running forwards
  int64_t logprob_chunk_rows = 512;  // rows of [rows, vocab] logits alive at once
  // Batch-invariant scoring (lm/model/batch_invariant.h): a sequence's scores are the same bits
  // whatever else its batch holds, so that runs whose steps need several teacher calls (packed as
  // they happen to arrive) are reproducible and resume exactly. CPU only; costs some speed.
  bool batch_invariant = true;
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
  // max_queue requests are waiting or replies waiting to be written (Slot), unless the job is
  // `admitted` (a later slice of a stream, ScoreJob). A job
  // whose scores came out non-finite (a broken model) fails with FAILED_PRECONDITION naming the
  // sequence and position: no NaN log-prob is ever returned as OK.
  absl::Status Submit(ScoreJob job, ScoreDone done);
  // Blocking convenience for in-process use.
  absl::StatusOr<std::vector<lm::SequenceScore>> Score(ScoreJob job);

  // Fails queued jobs with UNAVAILABLE, finishes the batches in flight, joins the workers.
  void Stop();

  // An admission slot held by a reply that is scored and waiting to be written to its client (a
  // ScoreStream chunk, a unary reply; teacher_service/service.h): counted with the queued requests
  // against max_queue, so that clients who stop reading cannot make the server hold replies
  // without bound: new requests are refused instead. Released when destroyed.
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept : scorer_(std::exchange(other.scorer_, nullptr)) {}
    Slot& operator=(Slot&& other) noexcept;
    ~Slot();

   private:
    friend class Scorer;
    explicit Slot(Scorer* scorer) : scorer_(scorer) {}
    Scorer* scorer_ = nullptr;
  };
  Slot HoldSlot();

  int64_t queued() const;
  // Replies holding a Slot.
  int64_t held_slots() const;
  // Batches packed so far (a batch counts from the moment it is packed).
  int64_t batches() const;

  // How full the buckets (batches) were packed: all of them, and those closed while work was
  // still queued (closed for want of room; the others ran out of work). The fill of the packer is
  // closed_tokens / (closed_buckets * max_batch_tokens).
  struct Packing {
    int64_t buckets = 0, tokens = 0;
    int64_t closed_buckets = 0, closed_tokens = 0;
  };
  Packing packing() const;

 private:
  struct Pending;
  struct Item {  // one sequence of a pending job, packed into a batch
    std::shared_ptr<Pending> job;
    int64_t index;
  };

  void WorkerLoop();
  // Waits for work and takes sequences up to the token budget; empty when stopping.
  std::vector<Item> TakeBatch();
  // Packs one bucket from the queued jobs (fair first-fit, in scorer.cc); returns its tokens.
  int64_t PackBucket(std::vector<Item>* items) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  Packing packing_ ABSL_GUARDED_BY(mu_);
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;  // Slots alive
  std::vector<std::thread> workers_;
};

}  // namespace teacher
