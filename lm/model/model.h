// The causal language model interface every architecture implements, and model creation,
// loading and saving by Hugging Face model directory.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "absl/status/statusor.h"
#include "lm/model/batch.h"
#include "lm/model/config.h"
#include "lm/model/layers.h"
#include "lm/model/paged_kv.h"
#include "lm/model/precision.h"

namespace lm {

struct ForwardOptions {
  KVCache* cache = nullptr;  // when set, a prefill writes each document's keys/values to slot b
  std::vector<torch::Tensor>* router_logits = nullptr;  // when set, receives [T, E] per MoE layer
  // Activation checkpointing: each decoder layer keeps only its input and is run again in the
  // backward (lm/model/recompute.h). Same gradients, less memory, one more forward. Training only
  // (not with a cache).
  bool checkpoint_layers = false;
  // Routing replay (R3): [T, moe_layers, top_k] integer expert ids; MoE layer j (in layer order)
  // routes token t to replay_experts[t, j] with the router's own fp32 gate weights at those ids
  // (lm/model/moe.h RouteForced). Only where SupportsRoutingReplay().
  torch::Tensor replay_experts;
};

class CausalLM : public torch::nn::Module {
 public:
  explicit CausalLM(ModelConfig config) : config_(std::move(config)) {}
  const ModelConfig& config() const { return config_; }

  // Final hidden states [T, H] (after the last norm) for a packed batch.
  virtual torch::Tensor Forward(const PackedBatch& batch, const ForwardOptions& opts = {}) = 0;
  // One decode step: tokens [B] (one per cache slot) at positions cache.lengths; appends to the
  // cache and returns hidden states [B, H].
  virtual torch::Tensor Decode(const torch::Tensor& tokens, KVCache& cache) = 0;
  virtual bool SupportsKVCache() const { return true; }
  // Whether Forward honours ForwardOptions::replay_experts and ScopedRoutingRecorder sees every
  // MoE layer (lm/model/moe.h): the architectures built on SparseMoeBlock.
  virtual bool SupportsRoutingReplay() const { return false; }
  // An empty cache for `batch` slots of `capacity` tokens, on the model's device and dtype.
  virtual KVCache NewKVCache(int64_t batch, int64_t capacity) const = 0;

  // The paged KV cache of the rollout engine (contract in lm/model/paged_kv.h). A model that does
  // not implement it keeps these defaults: SupportsPagedKV() false, the others throw.
  virtual bool SupportsPagedKV() const { return false; }
  virtual PagedCacheSpec PagedSpec() const { throw std::logic_error("no paged KV cache"); }
  // Pools of `num_blocks` blocks (block 0 the null block, zero) of `block_size` tokens, in the
  // model's device and dtype, and `num_state_slots` zero state slots (models with state).
  virtual PagedKVCache NewPagedKVCache(int64_t /*num_blocks*/, int64_t /*block_size*/,
                                       int64_t /*num_state_slots*/) const {
    throw std::logic_error("no paged KV cache");
  }
  // Runs one step: writes the new tokens' keys/values (and state) into `cache` and returns the
  // final hidden states [B, H] at each sequence's last new token.
  virtual torch::Tensor PagedForward(const PagedStep& /*step*/, PagedKVCache& /*cache*/) {
    throw std::logic_error("no paged KV cache");
  }

  // The output projection [V, H]: lm_head.weight, or the embedding matrix when tied (a model
  // that wraps another, e.g. an expert-parallel driver, forwards to the wrapped one).
  virtual torch::Tensor LmHeadWeight() { return lm_head ? lm_head->weight : embed_tokens_->weight; }
  // Logits [..., V], always fp32: from a bf16 head with fp32 accumulation and no bf16 rounding
  // (lm/model/precision.h LogitsFp32, the arithmetic of every process's LM head).
  torch::Tensor Logits(const torch::Tensor& hidden) { return LogitsFp32(hidden, LmHeadWeight()); }

  // Names of parameters that are the same tensor under another name (a tied lm_head).
  virtual std::vector<std::string> TiedAliases() const;

  Linear lm_head{nullptr};  // null when tie_word_embeddings

  // Normal(0, std) init of every matrix, ones/zeros for norms (random models for tests/demos).
  void InitWeights(double std, uint64_t seed);

 protected:
  // Called by each architecture's constructor after it registered its body (so that lm_head
  // comes last, as in the checkpoints): registers lm_head unless the config ties it to `embed`.
  void AddLmHead(const Embedding& embed);

  ModelConfig config_;

 private:
  Embedding embed_tokens_{nullptr};  // the body's embedding (not registered twice)
};

// A model with uninitialised weights for `config` (by model_type).
absl::StatusOr<std::shared_ptr<CausalLM>> CreateModel(const ModelConfig& config);

// What the loader does with a block-wise FP8 checkpoint's quantized weights (lm/model/fp8.h).
enum class Fp8Weights {
  kAuto,  // kept in FP8 where FP8 GEMMs run (CUDA, compute capability >= 8.9), else kDequantize
  kDequantize,  // dequantized on load to LoadOptions::dtype
  kKeep,        // kept in FP8 on any device with FP8 GEMMs (the CPU's are the GPU kernels' twin,
                // for tests); an error where there are none
};

struct LoadOptions {
  torch::Dtype dtype = torch::kFloat32;  // FP8 weights kept in FP8 stay so; the rest is this dtype
  torch::Device device = torch::kCPU;
  Fp8Weights fp8 = Fp8Weights::kAuto;
};

// A model for `config` whose parameters are uninitialised tensors of `placement.dtype` on
// `placement.device` (never materialised in fp32 on the host first).
absl::StatusOr<std::shared_ptr<CausalLM>> CreateModel(const ModelConfig& config,
                                                      const LoadOptions& placement);

// Loads config.json and the safetensors weights of an HF model directory straight into tensors of
// `opts.dtype` on `opts.device`: shard by shard, tensor by tensor (lm/io/hf_model_dir.h), so peak
// host memory is the host-resident model (CPU) plus about one tensor, never an fp32 copy.
absl::StatusOr<std::shared_ptr<CausalLM>> LoadModel(const std::string& dir,
                                                    const LoadOptions& opts = {});

struct SaveOptions {
  int64_t max_shard_bytes = int64_t{5} << 30;  // above this, shards + model.safetensors.index.json
  torch::Dtype dtype = torch::kFloat32;        // on-disk dtype (config.json's torch_dtype follows)
};

// Writes config.json and safetensors (per-expert tensor names, as published checkpoints have
// them) into `dir`, loadable by transformers' from_pretrained.
absl::Status SaveModel(CausalLM& model, const std::string& dir, const SaveOptions& opts = {});

// Per-token log-probs of each document's own tokens: for document b with tokens t_0..t_{L-1},
// entries log p(t_i | t_<i) for i = 1..L-1, concatenated over documents ([T - B]).
torch::Tensor SequenceLogprobs(CausalLM& model, const PackedBatch& batch, double temperature = 1.0);

// Index helpers for the packed layout: rows whose next token is in the same document, and those
// next tokens ([T - B] each).
std::pair<torch::Tensor, torch::Tensor> NextTokenRows(const PackedBatch& batch);

}  // namespace lm
