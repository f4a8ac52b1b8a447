// The paged KV cache: the model-facing half of the rollout engine (rollout/engine.h).
//
// Memory is one preallocated pool per attention layer of fixed-size blocks (block_size tokens
// each); a sequence owns an ordered list of block ids, its block table, and token i of the
// sequence lives in row i % block_size of block table[i / block_size]. Who owns which block (and
// reference counts, copy-on-write, preemption) is the engine's business; the model only reads and
// writes the rows a step's block tables name. Block 0 is the null block: never handed out, kept
// zero, and every padded read points at it (so masked positions never touch uninitialised rows).
//
// Models with recurrent layers (Qwen3-Next's conv and delta-rule state) also keep a fixed-size
// state per sequence: `state` holds tensors whose first dim is the state slot, and the engine
// gives each running sequence one slot. A step with context_lens[b] == 0 starts sequence b's
// slot from zero; otherwise it continues from what the slot holds.
//
// The contract a model implements (CausalLM::SupportsPagedKV / PagedSpec / NewPagedKVCache /
// PagedForward in lm/model/model.h):
//   - a step is a set of B sequences, each with new tokens input_ids[cu_seqlens[b] ..
//     cu_seqlens[b+1]) at positions context_lens[b], context_lens[b] + 1, ...;
//   - a sequence may bring any number of new tokens after any context: a prefill (context 0), a
//     chunk of a long prompt or of a preempted sequence's recompute (the engine prefills at most
//     EngineOptions::max_prefill_tokens a step, so a long one arrives in chunks), or one token
//     after its context (a decode step); block tables already cover context + new tokens;
//   - the model writes the new tokens' keys/values (after q/k-norm and RoPE, as attention reads
//     them) into their rows, updates the state slots, and returns the final hidden states (after
//     the last norm) at each sequence's last new token, [B, H];
//   - attention of a new token sees its sequence's context and the new tokens up to itself, read
//     through the block table: the same math as the contiguous cache (CachedAttention /
//     VarlenCausalAttention in lm/model/layers.h). No step builds a mask or pads to the longest
//     sequence: decode steps read the pools in place (PagedDecodeAttention), other steps run a
//     varlen causal attention (PagedAttention below) whose scores are never held beyond one
//     kernel tile.
// The engine copies blocks (copy-on-write) and state slots (forking the samples of one prompt)
// with PagedKVCache::CopyBlock / CopyStateSlot, so a model needs nothing for either.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

namespace lm {

// What a model's paged cache costs, for sizing the pool from a memory budget.
struct PagedCacheSpec {
  int64_t kv_layers = 0;             // layers with a K/V pool (attention layers)
  int64_t kv_bytes_per_token = 0;    // keys + values of all those layers for one token
  int64_t state_bytes_per_slot = 0;  // recurrent state of one sequence (0: none)
};

struct PagedKVCache {
  int64_t block_size = 16;
  int64_t num_blocks = 0;  // including the null block 0
  int64_t num_state_slots = 0;
  std::vector<torch::Tensor> k, v;   // per attention layer: [num_blocks, block_size, n_kv, D]
  std::vector<torch::Tensor> state;  // per stateful tensor: [num_state_slots, ...] (model-defined)

  // Copies block `src` (every layer's keys and values) over block `dst`.
  void CopyBlock(int64_t src, int64_t dst);
  // Copies state slot `src` over `dst` (every state tensor).
  void CopyStateSlot(int64_t src, int64_t dst);
  // Bytes of all pools and state tensors.
  int64_t bytes() const;
};

// One forward step over a set of sequences (see the contract above).
struct PagedStep {
  torch::Tensor input_ids;                         // [T] int64, on the model's device
  std::vector<int64_t> cu_seqlens;                 // [B+1] boundaries of the new tokens
  std::vector<int64_t> context_lens;               // [B] tokens already cached per sequence
  std::vector<std::vector<int32_t>> block_tables;  // [B][n_b] covering context + new tokens
  std::vector<int64_t> state_slots;                // [B] (models with state; else empty)

  int64_t num_sequences() const { return static_cast<int64_t>(context_lens.size()); }
  int64_t num_tokens() const { return cu_seqlens.empty() ? 0 : cu_seqlens.back(); }
};

// Index tensors for paged attention, built once per step and shared by every layer.
struct PagedAttentionMeta {
  int64_t batch = 0, max_new = 0, max_len = 0;  // B, longest new tokens, longest context + new
  // A decode step: one new token per sequence. Its attention reads the pools in place through
  // block_tables and seq_lens (PagedDecodeAttention); none of the varlen indices below are
  // built. (OPD_PAGED_DECODE=gather in the environment sends decode steps down the varlen path
  // instead, for benchmarks.)
  bool decode = false;
  torch::Tensor positions;  // [T] int64: position of every new token
  torch::Tensor
      slot_mapping;  // [T] int64: pool row (block * block_size + offset) of each new token
  torch::Tensor block_tables;  // [B, max_blocks] int32 (0, the null block, past a table's end)
  torch::Tensor seq_lens;      // [B] int32: context + new tokens of each sequence
  torch::Tensor last_rows;     // [B] row (in [T]) of each sequence's last new token
  // Steps other than decode (the varlen path):
  std::vector<int64_t> cu_seqlens;    // [B+1] the new tokens' boundaries (the step's)
  std::vector<int64_t> context_lens;  // [B] the step's
  bool all_fresh = false;             // no sequence has a context (plain prefills)
  // On the CPU: the pool rows of every continued sequence's context, sequence after sequence
  // (sequence b's from context_offsets[b]); undefined when all_fresh.
  torch::Tensor context_rows;
  std::vector<int64_t> context_offsets;
  // On CUDA: the pool rows of every sequence's keys, context then new, packed (key_rows), and
  // the int32 boundaries of the queries (cu_q, the step's cu_seqlens) and of the keys (cu_k).
  torch::Tensor key_rows, cu_q, cu_k;
};

PagedAttentionMeta BuildPagedAttentionMeta(const PagedStep& step, int64_t block_size,
                                           torch::Device device);

// Writes the new tokens' keys/values k, v [T, n_kv, D] into their rows of the pools
// [num_blocks, block_size, n_kv, D].
void WritePagedKV(torch::Tensor& k_pool, torch::Tensor& v_pool, const torch::Tensor& k,
                  const torch::Tensor& v, const PagedAttentionMeta& meta);

// Causal attention of the new tokens q [T, Hq, D] over their sequences' context and new tokens
// (Hq a multiple of n_kv: GQA); k, v [T, Hkv, D] are the new tokens' keys and values, already
// written to the pools (call after WritePagedKV). Returns [T, Hq, D]. No mask, no padding to the
// longest sequence, no score matrix beyond a kernel's tile:
//   - decode steps: PagedDecodeAttention, in place through the block tables;
//   - on CUDA: one varlen causal launch over the step (the queries against each sequence's keys,
//     context then new, gathered from the pools once per step and layer, bottom-right aligned):
//     FlashAttention-2 for bf16/fp16 (head_dim % 8 == 0, <= 256), the memory-efficient kernel
//     otherwise (fp32; KV heads repeated for it);
//   - on the CPU: sequences without context as one VarlenCausalAttention (bucketed flash, no
//     mask), each continued one as two flash calls, its new tokens over its gathered context (no
//     mask: every context key is visible) and causally over themselves, merged by their
//     log-sum-exps (PagedContinuedAttention).
torch::Tensor PagedAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                             const PagedAttentionMeta& meta, double scale);

// One continued sequence on the CPU: its n new queries q [n, Hq, D] at positions c .. c + n - 1
// over its context's keys/values k_ctx, v_ctx [c, Hkv, D] and its new ones k_new, v_new
// [n, Hkv, D]: softmax over all c + i + 1 visible keys of query i, computed as the two parts'
// flash attentions merged by their log-sum-exps (fp32), so no [n, c + n] matrix exists.
torch::Tensor PagedContinuedAttention(const torch::Tensor& q, const torch::Tensor& k_ctx,
                                      const torch::Tensor& v_ctx, const torch::Tensor& k_new,
                                      const torch::Tensor& v_new, double scale);

// Decode attention read in place through the block tables: the one new token of each sequence b,
// q[b] [Hq, D], attends to its sequence's first seq_lens[b] tokens (context and itself; keys and
// values already written), token i in row i % block_size of block block_tables[b][i / block_size]
// of the pools [num_blocks, block_size, Hkv, D]. block_tables [B, max_blocks] and seq_lens [B]
// are int32 on q's device (1 <= seq_lens[b] <= max_blocks * block_size); query head h reads KV
// head h / (Hq / Hkv). Returns [B, Hq, D] in q's dtype, accumulated in fp32 (online softmax).
// Takes the device's kernel (kernels/cpu/paged_decode.h, kernels/cuda/paged_decode_cuda.h) where
// it applies, the reference below elsewhere. No host synchronisation on CUDA.
torch::Tensor PagedDecodeAttention(const torch::Tensor& q, const torch::Tensor& k_pool,
                                   const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                                   const torch::Tensor& seq_lens, double scale);

// The same by library ops on the device: every sequence's rows gathered, padded to the table's
// width with the null block, and SDPA under a length mask (differentiable, any dtype).
torch::Tensor PagedDecodeAttentionReference(const torch::Tensor& q, const torch::Tensor& k_pool,
                                            const torch::Tensor& v_pool,
                                            const torch::Tensor& block_tables,
                                            const torch::Tensor& seq_lens, double scale);

}  // namespace lm
