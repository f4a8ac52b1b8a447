// Batched sampling of responses from a causal LM with a KV cache.
//
//   1. prefill: all prompts in one packed forward, writing each prompt's keys/values to its slot;
//   2. the cache is repeated per sample (KVCache::RepeatInterleave): the samples of a prompt share
//      its prefill instead of recomputing it;
//   3. decode: one Decode step per new token for every live slot; finished samples leave the
//      batch (KVCache::Select) and are reported at once.
//
// Randomness: sample s of prompt p draws from its own generator seeded by (seed, p's seed index
// (SamplingParams::SeedIndex: its position unless the request names one), s), one uniform per
// token (inverse-CDF sampling over the softmax, through per-1024-token block sums),
// so a sample does not depend on which other prompts or samples share its batch. The log-prob
// reported for a token is under the distribution it was drawn from: temperature-scaled, then top-k,
// then top-p filtered and renormalised (0 for greedy).
// OPD refuses the filters (trainer/opd/opd_config.cc): the learner's log-probs are the full
// softmax, and the importance ratio needs both sides under the same distribution.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "lm/generate/generator.h"
#include "lm/generate/sampling.h"
#include "lm/model/config.h"

namespace lm {

class CausalLM;
class PackedWeight;

struct SamplerStats {
  int64_t prefill_tokens = 0;  // tokens run through the prefill forward
  int64_t decode_steps = 0;    // Decode calls
  int64_t decoded_tokens = 0;  // slot-steps over all Decode calls
};

// Bytes of KV cache per token of a sequence: keys and values of every layer's KV heads, in the
// model's dtype (element_size bytes).
int64_t KvBytesPerToken(const ModelConfig& config, int64_t element_size);

// Samples every prompt; `on_sample` receives each sample as it finishes (on the calling thread).
// `cancelled` is polled between decode steps; when it returns true, sampling stops with
// CANCELLED; when the model produces non-finite log-probs, with CheckDrawn's
// FAILED_PRECONDITION. Prompts and params must have passed rollout's Validate(). `lm_head`: the
// model's LM head already packed (PackLmHead; a snapshot's); without one it is packed here when a
// kernel applies. `max_batch_kv_bytes` > 0 runs the prompts in consecutive batches whose
// contiguous cache fits it (PlanStaticBatches; a sample draws from its own seeded stream, so its
// tokens do not depend on the batching); 0: one batch.
absl::StatusOr<SamplerStats> SampleResponses(
    CausalLM& model, const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params,
    const std::function<void(Sample)>& on_sample, const std::function<bool()>& cancelled = nullptr,
    const PackedWeight* lm_head = nullptr, int64_t max_batch_kv_bytes = 0);

// What the static sampler's contiguous cache costs (KVCache: keys/values of the attention layers
// per token of a slot's capacity, plus recurrent state per slot).
struct StaticCacheCost {
  int64_t bytes_per_token = 0, bytes_per_slot = 0;
  // A batch of `prompts` prompts, the longest `longest` tokens, at its peak: the prompts' cache
  // and its repetition per sample, (1 + samples_per_prompt) x prompts slots of longest +
  // max_new_tokens tokens.
  int64_t BatchBytes(int64_t prompts, int64_t longest, const SamplingParams& params) const;
};
StaticCacheCost StaticCacheCostOf(CausalLM& model);

// The static sampler's batches over `prompts`, [begin, end) each, in order: consecutive prompts
// while the batch's cache fits `max_batch_kv_bytes` (0: one batch of all). RESOURCE_EXHAUSTED
// naming the first prompt whose samples alone cannot fit it (a prompt's samples share its
// prefill, so they are never split).
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> PlanStaticBatches(
    const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params,
    const StaticCacheCost& cost, int64_t max_batch_kv_bytes);

// The logits [B, V] (fp32) of the distribution sampled from: logits / temperature, keep the
// top_k largest (exactly k; 0 = all), then the smallest most-likely set whose probability
// reaches top_p; everything else is -inf. temperature must be > 0.
torch::Tensor FilteredLogits(const torch::Tensor& logits, double temperature, int64_t top_k,
                             double top_p);
// log_softmax of FilteredLogits: the log-probs of every token under that distribution.
torch::Tensor FilteredLogprobs(const torch::Tensor& logits, double temperature, int64_t top_k,
                               double top_p);

// The generator seed of sample `sample` of the prompt whose seed index is `prompt` (SplitMix64
// mixing).
uint64_t SampleSeed(uint64_t seed, int64_t prompt, int64_t sample);

// One token per row of logits [B, V], on the logits' device: greedy is the argmax; otherwise row i
// draws one uniform from *rngs[i] and takes the inverse CDF of the filtered softmax (per-1024-token
// block sums, then within the block, in fp64). The tokens and their log-probs come back to the
// host in one copy. A row whose logits are not finite gets a NaN log-prob (see CheckDrawn).
struct Draws {
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
};
Draws DrawTokens(const torch::Tensor& logits, const std::vector<std::mt19937_64*>& rngs,
                 const SamplingParams& params);

// ---- The keyed draw: one token per logits row on the rows' device, CPU and GPU alike ----
//
// Row b of logits [B, V] (fp32) draws one uniform u = U / 2^53 from a counter-based generator:
// U = the top 53 bits of the first two words of Philox4x32-10 (at::philox_engine's) with key
// keys[b] (SampleSeed(seed, prompt, sample): the sample's stream) and counter (positions[b], 0):
// the draw is a pure function of (seed, prompt, sample, position), whatever batch, step, device
// or process draws it. positions[b] is the index the drawn token will have in its sequence
// (prompt length + tokens drawn before it). The distribution, with m the row's max:
//   weights q_i = round(exp((x_i - m) / temperature) 2^S), S = 62 - ceil(log2 V), integers, so
//     that every sum below is exact and the same on every device (exp and log are computed from
//     correctly rounded fp64 operations only: kernels/cpu/draw_math.h);
//   top_k (0 < k < V): the k largest logits, the lower token id first among equal ones;
//   top_p (0 < p < 1): in the order larger logit then lower id, the shortest prefix of the kept
//     tokens whose weight reaches ceil(p * their total);
//   the token: the first (in token order) kept token whose running weight exceeds
//     floor(u * total); its log-prob (x - m) / temperature - log(total 2^-S), under the kept
//     distribution (what FilteredLogprobs computes, up to the weights' rounding, < V 2^-(S+1)).
// temperature 0: the argmax (the first of equal maxima), log-prob 0. A row whose logits hold
// NaN or +inf or are all -inf, or whose temperature is negative or NaN: token 0, log-prob NaN
// (CheckDrawn turns it into an error). stopped[b]: the token is one of stop_ids[b] (-1 pads).
// The CPU (kernels/cpu/sampler_cpu.h) and CUDA (kernels/cuda/sampler.cuh) kernels compute the
// same tokens and log-probs bit for bit; on CUDA nothing waits on the device.
struct SamplerRows {
  torch::Tensor keys;         // [B] int64: the uint64 stream keys' bits
  torch::Tensor positions;    // [B] int64
  torch::Tensor temperature;  // [B] float64, 0: greedy
  torch::Tensor top_k;        // [B] int64, <= 0 or >= V: off
  torch::Tensor top_p;        // [B] float64, outside (0, 1): off
  torch::Tensor stop_ids;     // [B, S] int64 (S may be 0), negative entries unused
};
struct SampledRows {
  torch::Tensor tokens;    // [B] int64
  torch::Tensor logprobs;  // [B] fp32
  torch::Tensor stopped;   // [B] bool
};

// INVALID_ARGUMENT naming the tensor when shapes, dtypes or devices are off (checked from the
// tensors' metadata: no sync).
absl::StatusOr<SampledRows> SampleRows(const torch::Tensor& logits, const SamplerRows& rows);

// Rows of one request's parameters: row b is sample samples[b] of prompt prompts[b] at
// positions[b]; stop ids from params. On `device` (from pinned memory, not waiting on a CUDA
// stream).
SamplerRows MakeSamplerRows(const SamplingParams& params, const std::vector<int64_t>& prompts,
                            const std::vector<int64_t>& samples,
                            const std::vector<int64_t>& positions, const torch::Device& device);

// SampleRows with the results on the host, as DrawTokens returns them (one copy back).
absl::StatusOr<Draws> DrawKeyed(const torch::Tensor& logits, const SamplerRows& rows);

// FAILED_PRECONDITION naming the sample and the position of the token about to be appended to
// `s` when its drawn log-prob is not finite: finite logits always give finite log-probs (a greedy
// draw's is NaN when its logit is not finite), so the model produced NaN or infinite values and
// nothing drawn from them may be returned as OK. A host check on the step's one copy back.
absl::Status CheckDrawn(const Sample& s, float logprob);

// Logits [B, V] fp32 of a decode step's hidden states [B, H]: the packed LM head (when given and
// B is at most kPackedHeadMaxRows), else the model's.
constexpr int64_t kPackedHeadMaxRows = 64;
torch::Tensor DecodeLogits(CausalLM& model, const PackedWeight* lm_head,
                           const torch::Tensor& hidden);

// The model's LM head packed for the decode steps where the device has a kernel for it
// (FastPaths::pack_lm_head: the CPU's AVX2 one for fp32), else null.
std::shared_ptr<const PackedWeight> PackLmHead(CausalLM& model);

// SampleResponses behind the interface; `max_batch_kv_bytes` (0: none) bounds one batch's cache,
// so that a request of any number of prompts runs in batches instead of allocating them all.
class StaticSampler final : public Generator {
 public:
  explicit StaticSampler(int64_t max_batch_kv_bytes = 0)
      : max_batch_kv_bytes_(max_batch_kv_bytes) {}
  absl::Status Generate(const ModelSnapshot& snapshot,
                        const std::vector<std::vector<int32_t>>& prompts,
                        const SamplingParams& params, const std::function<void(Sample)>& on_sample,
                        const std::function<bool()>& cancelled) override;
  const char* name() const override { return "static"; }

 private:
  int64_t max_batch_kv_bytes_;
};

}  // namespace lm
