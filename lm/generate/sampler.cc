#include "lm/generate/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/model/fast_paths.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/model/routing_trace.h"
#include "lm/util/splitmix.h"
#include "lm/util/status.h"

namespace lm {
namespace {

// A uniform double in [0, 1) from the top 53 bits: defined by the bits alone, unlike
// std::uniform_real_distribution, whose algorithm the standard leaves open.
double Uniform(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

// One sample being decoded.
struct Slot {
  std::mt19937_64 rng;
  Sample out;
};

constexpr int64_t kBlock = 1024;  // probabilities summed per block for the two-level search

// Inverse-CDF draw per row of probs [B, V] (fp32) with uniforms u [B] (fp64), on their device:
// the first token whose cumulative probability exceeds u * total, found through the row's block
// sums and then within one block, accumulating in fp64 in token order (a scan). A token of
// probability 0 never adds mass, so it can never be the one chosen; when rounding leaves the
// target above the block's mass, the block's last token with mass (else the row's).
torch::Tensor InverseCdf(const torch::Tensor& probs, const torch::Tensor& u) {
  const int64_t B = probs.size(0), V = probs.size(1);
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  const auto padded =
      torch::constant_pad_nd(probs, {0, blocks * kBlock - V}).view({B, blocks, kBlock});
  const auto sums = padded.sum(-1, /*keepdim=*/false, torch::kFloat64);  // [B, blocks]
  const auto cum = sums.cumsum(-1);
  const auto target = (u * cum.select(1, blocks - 1)).unsqueeze(1);  // [B, 1]
  // The block: the first whose running sum passes the target (the last one at most).
  const auto j = (cum.narrow(1, 0, blocks - 1) <= target).sum(1, false, torch::kInt64);  // [B]
  const auto acc = torch::constant_pad_nd(cum, {1, 0}).gather(1, j.unsqueeze(1));        // [B, 1]
  const auto in_block =
      padded.gather(1, j.view({B, 1, 1}).expand({B, 1, kBlock})).squeeze(1);  // [B, kBlock]
  // Sequential fp64 accumulation from the mass before the block: ((acc + p0) + p1) + ...
  const auto running =
      torch::cat({acc, in_block.to(torch::kFloat64)}, 1).cumsum(1).narrow(1, 1, kBlock);
  const auto pos = torch::arange(kBlock, j.options());
  const auto positive = in_block > 0;
  const auto none = torch::full({}, kBlock, j.options());
  const auto first = torch::where((running > target) & positive, pos, none).amin(1);
  const auto last_in_block = torch::where(positive, pos, torch::full({}, -1, j.options())).amax(1);
  const auto vpos = torch::arange(V, j.options());
  const auto last_in_row =
      torch::where(probs > 0, vpos, torch::full({}, -1, j.options())).amax(1).clamp_min(0);
  return torch::where(first < kBlock, j * kBlock + first,
                      torch::where(last_in_block >= 0, j * kBlock + last_in_block, last_in_row));
}

// Logits [P, V] (fp32) at the last position of every prompt, filling `cache`.
// `routing`, when given, receives what a ScopedRoutingRecorder saw over the prefill.
torch::Tensor Prefill(CausalLM& model, const std::vector<std::vector<int32_t>>& prompts,
                      KVCache& cache, SamplerStats& stats,
                      std::vector<torch::Tensor>* routing = nullptr) {
  auto batch = PackedBatch::FromSpans(
      std::vector<absl::Span<const int32_t>>(prompts.begin(), prompts.end()));
  const auto device = model.LmHeadWeight().device();
  batch.input_ids = batch.input_ids.to(device);
  batch.position_ids = batch.position_ids.to(device);
  ForwardOptions fo;
  fo.cache = &cache;
  std::optional<ScopedRoutingRecorder> record;
  if (routing) record.emplace(routing);
  const auto hidden = model.Forward(batch, fo);
  record.reset();
  stats.prefill_tokens += batch.num_tokens();
  std::vector<int64_t> last;
  for (int64_t b = 0; b < batch.num_sequences(); ++b) last.push_back(batch.cu_seqlens[b + 1] - 1);
  // fp32 logits from the head as they are (bf16 operands, fp32 accumulate: CausalLM::Logits).
  return model.Logits(
      hidden.index_select(0, torch::tensor(last, torch::kInt64).to(hidden.device())));
}

bool IsStopId(const SamplingParams& params, int64_t id) {
  return std::find(params.stop_ids.begin(), params.stop_ids.end(), id) != params.stop_ids.end();
}

// Decode steps (few rows) compute logits on the packed LM head where it applies; many rows (a
// large batch, the prefill) are a real GEMM, where the library is faster. Null: none to pack
// here (the caller gave one, the batch has too many rows, or the device has no kernel for it).
std::shared_ptr<const PackedWeight> OwnLmHead(CausalLM& model, const PackedWeight* given,
                                              int64_t rows) {
  if (given || rows > kPackedHeadMaxRows) return nullptr;
  return PackLmHead(model);
}

// One batch being decoded: its cache, its live slots and the logits of each slot's next token,
// which the prefill sets up and every draw and decode step moves on.
class BatchDecoder {
 public:
  BatchDecoder(CausalLM& model, const SamplingParams& params, const PackedWeight* lm_head,
               SamplerStats& stats)
      : model_(model),
        params_(params),
        lm_head_(lm_head),
        stats_(stats),
        device_(model.LmHeadWeight().device()),
        layout_(model.config()) {}

  // Prefills the prompts [first, first + prompts.size()) and gives each its samples' slots.
  absl::Status Start(const std::vector<std::vector<int32_t>>& prompts, int64_t first);
  // Every live slot's next token, drawn from its own stream; CheckDrawn's error when the model
  // produced non-finite log-probs.
  absl::StatusOr<Draws> Draw();
  // Appends the drawn tokens and hands every sample that stopped or reached max_new_tokens to
  // `on_sample` at once. Returns the slots still live.
  std::vector<int64_t> Append(const Draws& d, const std::function<void(Sample)>& on_sample);
  // One decode step of the live slots `keep`, each fed its drawn token.
  absl::Status Decode(const std::vector<int64_t>& keep, const std::vector<int64_t>& drawn);

 private:
  // Routing replay: every MoE layer's top-k per fed token, [positions, layers, k] per slot.
  bool routing() const { return params_.return_routing; }
  absl::Status CheckRouting() const;
  // The prompts' routing over the prefill, one prompt after another.
  absl::StatusOr<RoutingTrace> PrefillPrompts(const std::vector<std::vector<int32_t>>& prompts);
  void MakeSlots(const std::vector<std::vector<int32_t>>& prompts, int64_t first,
                 const RoutingTrace& prompt_routing);
  // Finished samples leave the batch, so that the decode steps cost only the live ones.
  void DropFinished(const std::vector<int64_t>& keep);
  // One position per live slot, from what the decode step's recorder saw.
  absl::Status AppendStepRouting(const std::vector<torch::Tensor>& seen);

  CausalLM& model_;
  const SamplingParams& params_;
  const PackedWeight* lm_head_;
  SamplerStats& stats_;
  const torch::Device device_;
  const RoutingTrace layout_;
  KVCache cache_;
  std::vector<Slot> slots_;
  torch::Tensor logits_;  // [slots, V] fp32: the distribution of every slot's next token
};

absl::Status BatchDecoder::Start(const std::vector<std::vector<int32_t>>& prompts, int64_t first) {
  RETURN_IF_ERROR(CheckRouting());
  ASSIGN_OR_RETURN(const RoutingTrace prompt_routing, PrefillPrompts(prompts));
  MakeSlots(prompts, first, prompt_routing);
  return absl::OkStatus();
}

absl::Status BatchDecoder::CheckRouting() const {
  if (routing() && (!model_.SupportsRoutingReplay() || !layout_.recordable()))
    return absl::InvalidArgumentError(
        absl::StrCat("return_routing: a ", model_.config().model_type,
                     " model has no recordable MoE routing (routing replay supports qwen3_moe)"));
  return absl::OkStatus();
}

absl::StatusOr<RoutingTrace> BatchDecoder::PrefillPrompts(
    const std::vector<std::vector<int32_t>>& prompts) {
  const int64_t P = static_cast<int64_t>(prompts.size()), n = params_.samples_per_prompt;
  int64_t longest = 0;
  for (const auto& p : prompts)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  std::vector<torch::Tensor> seen;
  cache_ = model_.NewKVCache(P, longest + params_.max_new_tokens);
  logits_ =
      Prefill(model_, prompts, cache_, stats_, routing() ? &seen : nullptr).repeat_interleave(n, 0);
  // The samples of a prompt share its prefill instead of recomputing it.
  cache_ = cache_.RepeatInterleave(n);
  RoutingTrace prompt_routing = layout_;
  if (routing()) {
    int64_t rows = 0;
    for (const auto& p : prompts) rows += static_cast<int64_t>(p.size());
    RETURN_IF_ERROR(prompt_routing.AppendRecorded(seen, rows));
  }
  return prompt_routing;
}

void BatchDecoder::MakeSlots(const std::vector<std::vector<int32_t>>& prompts, int64_t first,
                             const RoutingTrace& prompt_routing) {
  const int64_t P = static_cast<int64_t>(prompts.size()), n = params_.samples_per_prompt;
  slots_.reserve(P * n);
  int64_t prompt_position = 0;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t prompt_length = static_cast<int64_t>(prompts[p].size());
    for (int64_t s = 0; s < n; ++s) {
      // Its own stream, so that its tokens do not depend on what else shares the batch.
      Slot slot{std::mt19937_64(SampleSeed(params_.seed, params_.SeedIndex(first + p), s)),
                Sample{}};
      slot.out.prompt_index = first + p;
      slot.out.sample_index = s;
      slot.out.SetPrompt(prompts[p]);
      if (routing()) {
        const auto ids = prompt_routing.Positions(prompt_position, prompt_length);
        slot.out.routed_experts.assign(ids.begin(), ids.end());
        slot.out.routing_layers = layout_.layers();
        slot.out.routing_top_k = layout_.top_k();
      }
      slots_.push_back(std::move(slot));
    }
    prompt_position += prompt_length;
  }
}

absl::StatusOr<Draws> BatchDecoder::Draw() {
  std::vector<std::mt19937_64*> rngs;
  for (auto& slot : slots_) rngs.push_back(&slot.rng);
  Draws d = DrawTokens(logits_, rngs, params_);
  for (size_t i = 0; i < slots_.size(); ++i)
    RETURN_IF_ERROR(CheckDrawn(slots_[i].out, d.logprobs[i]));
  return d;
}

std::vector<int64_t> BatchDecoder::Append(const Draws& d,
                                          const std::function<void(Sample)>& on_sample) {
  std::vector<int64_t> keep;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Sample& out = slots_[i].out;
    out.tokens.push_back(static_cast<int32_t>(d.tokens[i]));
    out.logprobs.push_back(d.logprobs[i]);
    const bool stop = IsStopId(params_, d.tokens[i]);
    if (stop || out.response_length() >= params_.max_new_tokens) {
      out.finish = stop ? FinishReason::kStop : FinishReason::kLength;
      on_sample(std::move(out));
    } else {
      keep.push_back(static_cast<int64_t>(i));
    }
  }
  return keep;
}

absl::Status BatchDecoder::Decode(const std::vector<int64_t>& keep,
                                  const std::vector<int64_t>& drawn) {
  std::vector<int64_t> next;
  for (int64_t i : keep) next.push_back(drawn[i]);
  DropFinished(keep);
  std::vector<torch::Tensor> seen;
  std::optional<ScopedRoutingRecorder> record;
  if (routing()) record.emplace(&seen);
  const auto hidden = model_.Decode(torch::tensor(next, torch::kInt64).to(device_), cache_);
  record.reset();
  if (routing()) RETURN_IF_ERROR(AppendStepRouting(seen));
  ++stats_.decode_steps;
  stats_.decoded_tokens += static_cast<int64_t>(keep.size());
  logits_ = DecodeLogits(model_, lm_head_, hidden);
  return absl::OkStatus();
}

void BatchDecoder::DropFinished(const std::vector<int64_t>& keep) {
  if (keep.size() == slots_.size()) return;
  cache_ = cache_.Select(keep);
  std::vector<Slot> live;
  live.reserve(keep.size());
  for (int64_t i : keep) live.push_back(std::move(slots_[i]));
  slots_ = std::move(live);
}

absl::Status BatchDecoder::AppendStepRouting(const std::vector<torch::Tensor>& seen) {
  RoutingTrace step = layout_;
  RETURN_IF_ERROR(step.AppendRecorded(seen, static_cast<int64_t>(slots_.size())));
  for (size_t i = 0; i < slots_.size(); ++i) {
    const auto ids = step.Positions(static_cast<int64_t>(i), 1);
    slots_[i].out.routed_experts.insert(slots_[i].out.routed_experts.end(), ids.begin(), ids.end());
  }
  return absl::OkStatus();
}

// One batch: the request's prompts [first, first + prompts.size()) with one contiguous cache.
absl::Status SampleBatch(CausalLM& model, const std::vector<std::vector<int32_t>>& prompts,
                         int64_t first, const SamplingParams& params,
                         const std::function<void(Sample)>& on_sample,
                         const std::function<bool()>& cancelled, const PackedWeight* lm_head,
                         SamplerStats& stats) {
  if (cancelled && cancelled()) return absl::CancelledError("cancelled before the prefill");
  const int64_t rows = static_cast<int64_t>(prompts.size()) * params.samples_per_prompt;
  const std::shared_ptr<const PackedWeight> own_head = OwnLmHead(model, lm_head, rows);
  BatchDecoder batch(model, params, own_head ? own_head.get() : lm_head, stats);
  RETURN_IF_ERROR(batch.Start(prompts, first));
  while (true) {
    ASSIGN_OR_RETURN(const Draws d, batch.Draw());
    const std::vector<int64_t> keep = batch.Append(d, on_sample);
    if (keep.empty()) return absl::OkStatus();
    if (cancelled && cancelled()) return absl::CancelledError("cancelled while decoding");
    RETURN_IF_ERROR(batch.Decode(keep, d.tokens));
  }
}

}  // namespace

uint64_t SampleSeed(uint64_t seed, int64_t prompt, int64_t sample) {
  return MixSeed(seed, prompt, sample);
}

Draws DrawTokens(const torch::Tensor& logits, const std::vector<std::mt19937_64*>& rngs,
                 const SamplingParams& p) {
  const int64_t B = logits.size(0);
  torch::Tensor tokens, logprobs;
  if (p.temperature == 0) {
    tokens = logits.argmax(-1);
    // 0: a point mass; NaN where the chosen logit is not finite (argmax picks a NaN), so that a
    // broken model is caught here as in sampling.
    const auto chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1);
    logprobs = torch::zeros({B}, logits.options().dtype(torch::kFloat64))
                   .masked_fill(torch::isfinite(chosen).logical_not(),
                                std::numeric_limits<double>::quiet_NaN());
  } else {
    // softmax, not exp(log_softmax): LibTorch's standalone exp is several times slower on CPU,
    // and this runs over [B, vocab] every step.
    const auto probs =
        torch::softmax(FilteredLogits(logits, p.temperature, p.top_k, p.top_p), -1).contiguous();
    std::vector<double> u(B);
    for (int64_t i = 0; i < B; ++i) u[i] = Uniform(*rngs[i]);
    tokens = InverseCdf(probs, torch::tensor(u, torch::kFloat64).to(logits.device()));
    logprobs = probs.gather(1, tokens.unsqueeze(1)).squeeze(1).to(torch::kFloat64).log();
  }
  // One copy back: token ids are exact in fp64.
  const auto host = torch::stack({tokens.to(torch::kFloat64), logprobs}).cpu().contiguous();
  const double* h = host.data_ptr<double>();
  Draws d;
  d.tokens.resize(B);
  d.logprobs.resize(B);
  for (int64_t i = 0; i < B; ++i) {
    d.tokens[i] = static_cast<int64_t>(h[i]);
    d.logprobs[i] = static_cast<float>(h[B + i]);
  }
  return d;
}

absl::Status CheckDrawn(const Sample& s, float logprob) {
  if (std::isfinite(logprob)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("prompt ", s.prompt_index, ", sample ", s.sample_index,
                   ": the log-prob of response token ", s.response_length(), " is ", logprob,
                   ": the model produced non-finite values (are its weights broken?)"));
}

std::shared_ptr<const PackedWeight> PackLmHead(CausalLM& model) {
  torch::NoGradGuard no_grad;
  const torch::Tensor& w = model.LmHeadWeight();
  const auto pack = FastPathsFor(w.device().type()).pack_lm_head;
  return pack ? pack(w) : nullptr;
}

torch::Tensor DecodeLogits(CausalLM& model, const PackedWeight* lm_head,
                           const torch::Tensor& hidden) {
  if (lm_head && hidden.size(0) <= kPackedHeadMaxRows) return (*lm_head)(hidden);
  return model.Logits(hidden);  // fp32, never rounded to bf16 (lm/model/precision.h LogitsFp32)
}

int64_t KvBytesPerToken(const ModelConfig& config, int64_t element_size) {
  return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size;
}

torch::Tensor FilteredLogits(const torch::Tensor& logits, double temperature, int64_t top_k,
                             double top_p) {
  auto x = logits.to(torch::kFloat32);
  if (temperature != 1.0) x = x / temperature;
  const int64_t V = x.size(-1);
  const bool use_k = top_k > 0 && top_k < V;
  const bool use_p = top_p > 0 && top_p < 1;
  if (!use_k && !use_p) return x;
  // Candidates, most likely first: the top k, or the whole (sorted) vocabulary for top-p alone.
  auto [vals, idx] = use_k ? x.topk(top_k, -1, /*largest=*/true, /*sorted=*/true)
                           : x.sort(-1, /*descending=*/true);
  if (use_p) {
    auto probs = vals.softmax(-1);
    // A candidate goes when the more likely ones already hold top_p of the mass; the first never.
    auto mass_before = probs.cumsum(-1) - probs;
    vals = vals.masked_fill(mass_before >= top_p, -std::numeric_limits<float>::infinity());
  }
  return torch::full_like(x, -std::numeric_limits<float>::infinity()).scatter(-1, idx, vals);
}

torch::Tensor FilteredLogprobs(const torch::Tensor& logits, double temperature, int64_t top_k,
                               double top_p) {
  return torch::log_softmax(FilteredLogits(logits, temperature, top_k, top_p), -1);
}

StaticCacheCost StaticCacheCostOf(CausalLM& model) {
  StaticCacheCost c;
  if (model.SupportsPagedKV()) {  // the same layers and state as the paged cache
    const PagedCacheSpec spec = model.PagedSpec();
    c.bytes_per_token = spec.kv_bytes_per_token;
    c.bytes_per_slot = spec.state_bytes_per_slot;
  } else {
    c.bytes_per_token = KvBytesPerToken(model.config(), model.LmHeadWeight().element_size());
  }
  return c;
}

int64_t StaticCacheCost::BatchBytes(int64_t prompts, int64_t longest,
                                    const SamplingParams& params) const {
  // The prompts' cache and its copy per sample live together while it is repeated
  // (KVCache::RepeatInterleave): (1 + n) x prompts slots of longest + max_new_tokens.
  const int64_t slots = prompts * (1 + params.samples_per_prompt);
  return slots * ((longest + params.max_new_tokens) * bytes_per_token + bytes_per_slot);
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> PlanStaticBatches(
    const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params,
    const StaticCacheCost& cost, int64_t max_batch_kv_bytes) {
  const int64_t P = static_cast<int64_t>(prompts.size());
  std::vector<std::pair<int64_t, int64_t>> batches;
  if (max_batch_kv_bytes <= 0) {
    if (P > 0) batches.emplace_back(0, P);
    return batches;
  }
  // A prompt with all its samples is the smallest batch: refused at once (before anything is
  // sampled) when even that cannot fit.
  for (int64_t p = 0; p < P; ++p) {
    const int64_t len = static_cast<int64_t>(prompts[p].size());
    const int64_t need = cost.BatchBytes(1, len, params);
    if (need > max_batch_kv_bytes)
      return absl::ResourceExhaustedError(absl::StrCat(
          "prompt ", p, ": ", len, " tokens + max_new_tokens ", params.max_new_tokens, " x ",
          params.samples_per_prompt, " samples need ", need,
          " bytes of KV cache in one batch, more than this worker's ", max_batch_kv_bytes,
          " (--kv-cache-gb): send a shorter prompt, fewer samples or a smaller max_new_tokens"));
  }
  // Greedy: consecutive prompts while the batch's cache (sized by its longest prompt) fits.
  int64_t begin = 0, longest = 0;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t len = static_cast<int64_t>(prompts[p].size());
    if (p > begin &&
        cost.BatchBytes(p + 1 - begin, std::max(longest, len), params) > max_batch_kv_bytes) {
      batches.emplace_back(begin, p);
      begin = p;
      longest = 0;
    }
    longest = std::max(longest, len);
  }
  if (P > begin) batches.emplace_back(begin, P);
  return batches;
}

absl::StatusOr<SamplerStats> SampleResponses(
    CausalLM& model, const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params,
    const std::function<void(Sample)>& on_sample, const std::function<bool()>& cancelled,
    const PackedWeight* lm_head, int64_t max_batch_kv_bytes) {
  torch::NoGradGuard no_grad;
  ASSIGN_OR_RETURN(auto batches, PlanStaticBatches(prompts, params, StaticCacheCostOf(model),
                                                   max_batch_kv_bytes));
  SamplerStats stats;
  for (const auto& [begin, end] : batches) {
    if (begin == 0 && end == static_cast<int64_t>(prompts.size())) {
      RETURN_IF_ERROR(SampleBatch(model, prompts, 0, params, on_sample, cancelled, lm_head, stats));
      continue;
    }
    const std::vector<std::vector<int32_t>> part(prompts.begin() + begin, prompts.begin() + end);
    RETURN_IF_ERROR(SampleBatch(model, part, begin, params, on_sample, cancelled, lm_head, stats));
  }
  return stats;
}

namespace {

absl::Status CheckRowTensor(const char* name, const torch::Tensor& t, int64_t B,
                            torch::ScalarType dtype, const torch::Device& device) {
  if (!t.defined() || t.dim() != 1 || t.size(0) != B || t.scalar_type() != dtype ||
      t.device() != device)
    return absl::InvalidArgumentError(
        absl::StrCat("SampleRows: ", name, " must be [", B, "] ", c10::toString(dtype), " on ",
                     device.str(), ", got ",
                     t.defined() ? absl::StrCat(c10::toString(t.scalar_type()), " ",
                                                t.device().str(), " of ", t.dim(), " dims")
                                 : std::string("an undefined tensor")));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SampledRows> SampleRows(const torch::Tensor& logits, const SamplerRows& rows) {
  if (!logits.defined() || logits.dim() != 2 || logits.size(1) < 1 ||
      logits.scalar_type() != torch::kFloat32)
    return absl::InvalidArgumentError("SampleRows: logits must be [B, V >= 1] float32");
  const int64_t B = logits.size(0);
  const torch::Device device = logits.device();
  RETURN_IF_ERROR(CheckRowTensor("keys", rows.keys, B, torch::kInt64, device));
  RETURN_IF_ERROR(CheckRowTensor("positions", rows.positions, B, torch::kInt64, device));
  RETURN_IF_ERROR(CheckRowTensor("temperature", rows.temperature, B, torch::kFloat64, device));
  RETURN_IF_ERROR(CheckRowTensor("top_k", rows.top_k, B, torch::kInt64, device));
  RETURN_IF_ERROR(CheckRowTensor("top_p", rows.top_p, B, torch::kFloat64, device));
  const torch::Tensor& stop = rows.stop_ids;
  if (!stop.defined() || stop.dim() != 2 || stop.size(0) != B ||
      stop.scalar_type() != torch::kInt64 || stop.device() != device)
    return absl::InvalidArgumentError(
        absl::StrCat("SampleRows: stop_ids must be [", B, ", S] int64 on ", device.str()));
  torch::NoGradGuard no_grad;
  SampledRows out;
  const auto fast = FastPathsFor(device.type()).sample_rows;
  if (fast && fast(logits, rows.keys, rows.positions, rows.temperature, rows.top_k, rows.top_p,
                   stop, &out.tokens, &out.logprobs, &out.stopped))
    return out;
  // A device without the kernel: the CPU's, on copies (the same bits; this waits on the device).
  const auto cpu = FastPathsFor(torch::kCPU).sample_rows;
  if (!cpu || !cpu(logits.cpu(), rows.keys.cpu(), rows.positions.cpu(), rows.temperature.cpu(),
                   rows.top_k.cpu(), rows.top_p.cpu(), stop.cpu(), &out.tokens, &out.logprobs,
                   &out.stopped))
    return absl::InternalError("SampleRows: no sampling kernel is registered");
  out.tokens = out.tokens.to(device);
  out.logprobs = out.logprobs.to(device);
  out.stopped = out.stopped.to(device);
  return out;
}

SamplerRows MakeSamplerRows(const SamplingParams& params, const std::vector<int64_t>& prompts,
                            const std::vector<int64_t>& samples,
                            const std::vector<int64_t>& positions, const torch::Device& device) {
  const int64_t B = static_cast<int64_t>(positions.size());
  TORCH_CHECK(
      static_cast<int64_t>(prompts.size()) == B && static_cast<int64_t>(samples.size()) == B,
      "MakeSamplerRows: prompts, samples and positions must have one entry per row");
  const int64_t S = static_cast<int64_t>(params.stop_ids.size());
  const auto opts = torch::TensorOptions().pinned_memory(device.is_cuda());
  auto i64 = torch::empty({3, B}, opts.dtype(torch::kInt64));    // keys, positions, top_k
  auto f64 = torch::empty({2, B}, opts.dtype(torch::kFloat64));  // temperature, top_p
  auto stop = torch::empty({B, S}, opts.dtype(torch::kInt64));
  int64_t* ip = i64.data_ptr<int64_t>();
  double* fp = f64.data_ptr<double>();
  int64_t* sp = stop.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    ip[b] = static_cast<int64_t>(SampleSeed(params.seed, prompts[b], samples[b]));
    ip[B + b] = positions[b];
    ip[2 * B + b] = params.top_k;
    fp[b] = params.temperature;
    fp[B + b] = params.top_p;
    for (int64_t j = 0; j < S; ++j) sp[b * S + j] = params.stop_ids[j];
  }
  const bool async = device.is_cuda();
  auto i64d = i64.to(device, /*non_blocking=*/async), f64d = f64.to(device, async);
  SamplerRows rows;
  rows.keys = i64d[0];
  rows.positions = i64d[1];
  rows.top_k = i64d[2];
  rows.temperature = f64d[0];
  rows.top_p = f64d[1];
  rows.stop_ids = stop.to(device, async);
  return rows;
}

absl::StatusOr<Draws> DrawKeyed(const torch::Tensor& logits, const SamplerRows& rows) {
  ASSIGN_OR_RETURN(const SampledRows s, SampleRows(logits, rows));
  // One copy back: token ids are exact in fp64.
  const auto host =
      torch::stack({s.tokens.to(torch::kFloat64), s.logprobs.to(torch::kFloat64)}).cpu();
  const int64_t B = logits.size(0);
  const double* h = host.data_ptr<double>();
  Draws d;
  d.tokens.resize(B);
  d.logprobs.resize(B);
  for (int64_t i = 0; i < B; ++i) {
    d.tokens[i] = static_cast<int64_t>(h[i]);
    d.logprobs[i] = static_cast<float>(h[B + i]);
  }
  return d;
}

absl::Status StaticSampler::Generate(const ModelSnapshot& snapshot,
                                     const std::vector<std::vector<int32_t>>& prompts,
                                     const SamplingParams& params,
                                     const std::function<void(Sample)>& on_sample,
                                     const std::function<bool()>& cancelled) {
  return SampleResponses(*snapshot.model, prompts, params, on_sample, cancelled,
                         snapshot.lm_head.get(), max_batch_kv_bytes_)
      .status();
}

}  // namespace lm
