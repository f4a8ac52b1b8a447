// The rollout engine: continuous batching over a paged KV cache (lm/model/paged_kv.h).
//
// One engine thread owns the model's cache pool and runs every sequence of every request:
//   - Submit() queues a request of any number of prompts (a bounded number of requests in the
//     engine: more are RESOURCE_EXHAUSTED naming the bound; a request with a sequence whose prompt
//     + max_new_tokens could never fit the whole pool is RESOURCE_EXHAUSTED naming the prompt and
//     --kv-cache-gb). A waiting prompt costs the request's copy of its tokens and a queue entry:
//     nothing is reserved for its response until it is admitted;
//   - each iteration runs one prefill step, then one decode step. The prefill step takes at most
//     max_prefill_tokens new tokens: the next chunk of the sequences already prefilling (oldest
//     first), then waiting work admitted first come, first served while sequence seats
//     (max_running) and blocks allow, each fed as much as the budget has left. So a long prompt
//     (or a preempted sequence's recompute) is prefilled in chunks across iterations, the running
//     sequences decoding between them, and no step's attention holds more than a chunk's scores;
//   - a prompt's samples fork when its prefill ends: they share the prompt's blocks (reference
//     counts; the partly filled last block is copied when a sample first writes into it);
//   - the decode step runs every running sequence one token in one batch; a finished sequence is
//     reported and retires by releasing its blocks (nothing is copied);
//   - when a sequence needs a block and none is free, the youngest sequence holding blocks
//     (running or prefilling) is preempted: its blocks are released and it waits at the front of
//     the queue to be recomputed from its prompt and the tokens it has generated (its generator
//     carries on where it was). Host memory per preempted sequence is its tokens so far.
// Sampling is the static sampler's (lm/generate/sampler.h): sample s of prompt p draws with
// SampleSeed(seed, SeedIndex(p), s), one uniform per token, so tokens do not depend on batching,
// admission order, chunking or preemption.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <torch/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "lm/generate/generator.h"
#include "lm/generate/sampler.h"
#include "lm/model/paged_kv.h"
#include "rollout/weights.h"

namespace lm {
class RoutingTrace;
}  // namespace lm

namespace rollout {

class BlockAllocator;

struct EngineOptions {
  int64_t block_size = 16;  // tokens per block
  // The pool: num_blocks blocks when set, else as many as kv_cache_bytes holds (--kv-cache-gb).
  int64_t num_blocks = 0;
  double kv_cache_bytes = 4.0 * (1 << 30);
  int64_t max_running = 256;  // sequences decoding at once (and recurrent-state slots)
  int64_t max_requests = 64;  // requests in the engine (waiting or running)
  // New tokens one prefill step feeds at most: longer prompts and recomputes go in chunks.
  int64_t max_prefill_tokens = 8192;
};

// The scheduler's own counters (cumulative).
struct EngineStats {
  int64_t prefill_steps = 0, prefill_tokens = 0;  // recomputes included
  int64_t largest_prefill_step = 0;               // the most tokens one prefill step fed
  int64_t partial_prefills = 0;  // prefill rows that left part of their sequence for later
  int64_t decode_steps = 0, decoded_tokens = 0;  // decoded_tokens: running sequences summed
  // The same over the decode steps taken while work was waiting for admission: the batch is
  // full when waiting_decoded_tokens == waiting_decode_steps x max_running.
  int64_t waiting_decode_steps = 0, waiting_decoded_tokens = 0;
  int64_t preemptions = 0, copy_on_writes = 0;
  int64_t peak_used_blocks = 0;
  int64_t usable_blocks = 0;  // the pool less the null block
  int64_t pool_bytes = 0;
};

class Engine final : public lm::Generator {
 public:
  class Request;

  // The pool is built for `model`'s architecture; requests may bring other models of the same
  // architecture (later weight versions). FAILED_PRECONDITION when the model has no paged cache.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const lm::CausalLM& model,
                                                        EngineOptions opts);
  ~Engine() override;  // requests still in the engine end UNAVAILABLE

  // Queues a request (prompts and params as Validate() accepted them). `on_sample` gets each
  // sample as it finishes, on the engine thread; `cancelled` is polled every iteration (also on
  // the engine thread): when it returns true the request's sequences leave and it ends CANCELLED.
  // A request whose model produces a non-finite log-prob ends with CheckDrawn's
  // FAILED_PRECONDITION (lm/generate/sampler.h), the others sharing its steps going on.
  absl::StatusOr<std::shared_ptr<Request>> Submit(Snapshot snapshot,
                                                  std::vector<std::vector<int32_t>> prompts,
                                                  lm::SamplingParams params,
                                                  std::function<void(lm::Sample)> on_sample,
                                                  std::function<bool()> cancelled = nullptr);
  // Blocks until the request has ended; its status.
  static absl::Status Wait(Request& request);
  // lm::Generator: Submit and Wait.
  absl::Status Generate(const Snapshot& snapshot, const std::vector<std::vector<int32_t>>& prompts,
                        const lm::SamplingParams& params,
                        const std::function<void(lm::Sample)>& on_sample,
                        const std::function<bool()>& cancelled) override;
  const char* name() const override { return "paged"; }

  // While paused the engine thread schedules nothing (tests queue several requests first).
  void Pause();
  void Resume();

  EngineStats stats() const;
  const EngineOptions& options() const { return opts_; }

 private:
  struct Seq;
  struct Waiting;
  struct StepRow;
  Engine(EngineOptions opts, lm::PagedKVCache cache);

  void Loop();
  void DropCancelled();
  void EnqueuePrompts(const std::shared_ptr<Request>& req);
  void PrefillStep();
  // Admits waiting work into `rows` while seats, blocks and `budget` (tokens) allow.
  void Admit(int64_t& budget, std::vector<StepRow>& rows);
  void DecodeStep();
  // Runs `rows` (one model forward per model among them); each row whose sequence is then fed
  // whole draws its next token (a prompt's forks into its samples first), the others go back to
  // prefilling_.
  void RunRows(std::vector<StepRow>& rows, bool prefill);
  // The hidden states [B, H] of one model's rows (`idx` into rows), recording or replaying
  // routing for the requests that asked.
  torch::Tensor Forward(lm::CausalLM& model, std::vector<StepRow>& rows,
                        const std::vector<size_t>& idx);
  // Forward's steps: the paged step of the rows, whether any asks for routing, the recorded
  // routing a recompute replays, and the routing seen appended to the samples that asked.
  static lm::PagedStep StepOf(const std::vector<StepRow>& rows, const std::vector<size_t>& idx,
                              const torch::Device& device);
  static bool AnyReturnsRouting(const std::vector<StepRow>& rows, const std::vector<size_t>& idx);
  static std::vector<torch::Tensor> RecordedRouting(const std::vector<StepRow>& rows,
                                                    const std::vector<size_t>& idx,
                                                    const lm::RoutingTrace& layout);
  static void AppendRouting(std::vector<StepRow>& rows, const std::vector<size_t>& idx,
                            const lm::RoutingTrace& layout, const std::vector<torch::Tensor>& seen,
                            const lm::PagedStep& step);
  void Fork(StepRow& row);
  bool MakeWritable(Seq& seq);  // a writable row for the seq's next token; false: no block
  // Preempts the youngest sequence holding blocks (running or prefilling); false: none.
  bool PreemptYoungest();
  void Preempt(std::unique_ptr<Seq> seq);
  int64_t SeatsTaken() const;  // running sequences and the samples of the prefilling ones
  void Append(std::unique_ptr<Seq>& seq, int64_t token, float logprob);
  void Retire(std::unique_ptr<Seq> seq);
  void ReleaseSeq(Seq& seq);
  // Ends a request; Wait() returns once the iteration's stats are published (SignalEnded).
  void Finish(Request& req, absl::Status st);
  void SignalEnded();
  void FailAll(const absl::Status& st);

  EngineOptions opts_;
  lm::PagedKVCache cache_;

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Request>> inbox_ ABSL_GUARDED_BY(mu_);
  int64_t requests_in_engine_ ABSL_GUARDED_BY(mu_) = 0;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);

  // Engine thread only.
  std::vector<std::shared_ptr<Request>> active_;
  std::deque<Waiting> waiting_;
  std::vector<std::unique_ptr<Seq>> running_;     // oldest admission first
  std::vector<std::unique_ptr<Seq>> prefilling_;  // admitted, not fed whole yet; oldest first
  std::unique_ptr<BlockAllocator> blocks_;
  std::vector<std::shared_ptr<Request>> ended_;  // to signal once the stats are published
  std::vector<int64_t> free_slots_;
  uint64_t admissions_ = 0;
  EngineStats local_;  // published to stats_ after every iteration
  std::thread thread_;
};

}  // namespace rollout
