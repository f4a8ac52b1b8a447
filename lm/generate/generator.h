// One interface for generation. A rollout worker holds one Generator and hands it every request;
// three implement it:
//   StaticSampler            one batch per request with a contiguous KV cache (SampleResponses,
//                            lm/generate/sampler.h): the reference, and what expert parallelism
//                            runs on every rank
//   rollout::Engine          continuous batching over a paged KV cache (rollout/engine.h)
//   rollout::EpRollout       a request run on every rank of an expert-parallel group
//                            (rollout/ep_rollout.h)
// They differ in scheduling only: sample s of prompt p draws with SampleSeed(seed,
// params.SeedIndex(p), s), so every generator gives a request the same tokens, and a prompt sent
// with a seed index gets the same tokens in any request, at any position, on any worker.
// None of them bounds a request by its summed KV cache: the paged engine queues the sequences
// through its pool, the static sampler runs them in batches that fit its cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "lm/generate/sampling.h"

namespace lm {

class CausalLM;
class PackedWeight;

// One version of the weights to generate with; requests keep it for their whole duration.
struct ModelSnapshot {
  std::shared_ptr<CausalLM> model;
  int64_t version = 0;
  // The LM head packed for the decode steps (PackLmHead), built once per version and shared by
  // its generations; null where no kernel applies.
  std::shared_ptr<const PackedWeight> lm_head;
  // Held by every copy of the snapshot: the rollout's weight store writes a new version into the
  // model only once no lease of the serving one is alive (rollout/weights.h), so whoever keeps
  // the model pointer alone (a cache) does not hold an update back. Null outside a store.
  std::shared_ptr<const void> lease;
};

class Generator {
 public:
  virtual ~Generator() = default;

  // Samples every prompt (prompts and params as rollout's Validate() accepted them) on
  // `snapshot`; `on_sample` receives each sample as it finishes, `cancelled` is polled between
  // steps (true: the call ends CANCELLED). A model producing non-finite log-probs ends the call
  // FAILED_PRECONDITION (CheckDrawn); a sequence that could never fit the generator's KV cache
  // alone ends it RESOURCE_EXHAUSTED naming the prompt, before anything is sampled.
  virtual absl::Status Generate(const ModelSnapshot& snapshot,
                                const std::vector<std::vector<int32_t>>& prompts,
                                const SamplingParams& params,
                                const std::function<void(Sample)>& on_sample,
                                const std::function<bool()>& cancelled) = 0;

  // Whether it can record routing (SamplingParams::return_routing); UNIMPLEMENTED otherwise.
  virtual bool RecordsRouting() const { return true; }
  virtual const char* name() const = 0;  // for messages and logs
};

}  // namespace lm
