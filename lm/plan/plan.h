// A memory and time plan for each process of a job: what a learner rank, a rollout worker and a
// teacher replica hold on their device, and a roofline time per step for sampling, scoring and
// learning. `opd-ctl plan` prints it; the learner, rollout and teacher call the Check*Fits
// functions at start-up to refuse a configuration that cannot fit its device, naming the term that
// does not fit. Arithmetic only (no tensors): the sizes come from the model's config.json alone.
//
// Memory (bytes, P parameters, N data-parallel learner ranks; trainer/common/mixed_precision.h and
// trainer/common/zero1.h say what each rank keeps):
//   learner, bf16-mixed: weights 2 P_bf16 + 4 P_fp32 (norms, routers, conv stay fp32), fp32
//     gradients G, fp32 masters 4 P / N and AdamW moments 8 P / N (sharded over the ranks);
//   learner, fp32: weights 4 P, gradients G, AdamW 8 P / N, no masters;
//   G with one rank: 4 P; dist.zero_stage 1: 4 P (every rank's local sum) + 4 P / N (its reduced
//     slice); stage 2: 4 P / N plus 4 fp32 buckets of B elements
//     (trainer/common/gradient_reducer.h: 2 in flight, 1 filling, 1 of zeros for a rank with fewer
//     micro-batches) and the gradient of the largest parameter held until its buckets' turn (bf16
//     in bf16-mixed); auto is stage 1 when its peak fits the device, else 2;
//   activations per micro-batch: what the backward keeps per token and layer (see
//     TrainActivationBytesPerToken), or with activation checkpointing (lm/model/recompute.h) each
//     layer's input only plus one layer's full set while it is recomputed; plus one chunk of
//     [rows, vocab] fp32 logits and their gradient;
//   rollout: bf16 weights, one receive bucket of a collective weight push (an update is written
//     into place or staged in host memory, never as a second model on the device:
//     rollout/weights.h), the prefill workspace, and the paged KV pool (lm/model/paged_kv.h:
//     full-attention layers x 2 x kv_heads x head_dim x 2 B per token, plus Qwen3-Next's
//     recurrent state per running sequence), by default all the device has left after the other
//     terms (--kv-cache-gb auto); in host memory, beside the device, a weight update staged while
//     requests sample (one-step-off), every tensor in the serving dtype;
//   teacher: bf16 weights (a block-wise FP8 checkpoint's converted linear layers in FP8, 1 B per
//     parameter plus fp32 block scales), one scoring bucket's activations (max_batch_tokens) and
//     one chunk of logits (logprob_chunk_rows x vocab, fp32, with its log-softmax);
//   every CUDA process: a fixed reserve for the CUDA context, cuBLAS/NCCL workspaces and allocator
//     fragmentation (kCudaReserveBytes).
//
// Time: a roofline at 100% of the device's peak (a lower bound, never an estimate of a real run):
//   a step takes max(FLOPs / bf16 FLOP rate, bytes read / HBM bandwidth);
//   forward FLOPs per token = 2 x active parameters (the matmuls a token goes through, the LM head
//     included) + attention (causal: 2 x q_heads x head_dim x (L + 1) per full-attention layer for
//     a sequence of L tokens; 6 x v_heads x dk x dv per linear-attention layer);
//   learning = 3 x forward (forward + backward), 4 x with activation checkpointing;
//   decode reads per step the dense weights, the routed experts that a batch of B tokens touches
//     (E (1 - (1 - k/E)^B) per layer under uniform routing: an upper bound on the experts read) and
//     every running sequence's KV;
//   collectives (reduce-scatters, all-gathers, weight pushes) and host work are not counted; the
//   learner's facts say how many bytes its gradient reduction sends per step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lm/model/config.h"

namespace lm::plan {

inline constexpr int64_t kGiB = int64_t{1} << 30;
// The CUDA context (~0.5 GiB), cuBLAS and NCCL workspaces and the caching allocator's
// fragmentation: memory a CUDA process loses before its own tensors.
inline constexpr int64_t kCudaReserveBytes = 2 * kGiB;

// One kind of accelerator and how many the job has. Defaults: the H200 (141 GB of HBM3e, of which
// about 139 GiB is free to a process; 4.8 TB/s; 989 TFLOP/s dense bf16).
struct DeviceSpec {
  int64_t count = 64;
  int64_t memory_bytes = 139 * kGiB;
  double hbm_bytes_per_s = 4.8e12;
  double bf16_flops_per_s = 989e12;
};

// One resident buffer of a process. `knob` says which setting shrinks it (for refusals).
struct Term {
  std::string name;
  int64_t bytes = 0;
  std::string knob;
};

struct MemoryPlan {
  std::vector<Term> terms;         // resident together at the peak, in allocation order
  std::vector<Term> alternatives;  // printed for comparison, not part of the peak
  std::vector<Term> host;          // the process's host memory beside the device's (not the peak)
  int64_t peak() const;
};

struct TimeTerm {
  std::string name;
  double seconds = 0;
  std::string bound;  // "compute" | "HBM": which roof sets it
};

struct TimePlan {
  std::vector<TimeTerm> terms;  // sequential parts of one step
  double total() const;
};

// The plan of one process kind: `replicas` identical processes, one device each.
struct ProcessPlan {
  std::string process;  // "learner rank", "rollout worker", "teacher <stage>"
  int64_t replicas = 1;
  MemoryPlan memory;
  TimePlan time;
  std::vector<std::string> facts;  // one line each: what the numbers are built from
};

// Parameter counts from a config.json, as the architecture registers its parameters
// (lm/io/hf_model_dir.cc ExpectedParameterShapes; fused experts, no lm_head when tied).
struct ParameterCounts {
  int64_t total = 0;
  int64_t fp32 = 0;        // kept in fp32 under bf16-mixed: 1-D tensors, routers, convolutions
  int64_t embedding = 0;   // vocab x hidden (also the LM head when tied)
  int64_t lm_head = 0;     // an untied LM head; 0 when tied
  int64_t experts = 0;     // routed experts of all MoE layers
  int64_t one_expert = 0;  // one routed expert of one layer: 3 x hidden x moe_intermediate
  int64_t moe_layers = 0;
  int64_t active = 0;        // matmul parameters one token goes through, the LM head included
  int64_t dense_matmul = 0;  // active less the routed experts: what every decode step reads
  int64_t largest = 0;       // elements of the largest single parameter tensor
};
ParameterCounts CountParameters(const ModelConfig& c);

// A block-wise FP8 checkpoint's weights (config.fp8: its quantization_config) as a CUDA process
// holds them (lm/model/fp8.h): every linear layer's weight that the config converts in FP8, one
// byte per parameter plus one fp32 scale per weight block; the rest (the LM head and the
// embedding always, and what modules_to_not_convert names) as the unquantized count holds it,
// `weight_bytes` per matrix parameter and fp32 norms and routers. `expert_parallel`: devices
// sharing the routed experts (each holds 1/N). Without config.fp8, everything is `rest`.
struct Fp8WeightBytes {
  int64_t fp8 = 0;     // FP8 weights: one byte per parameter
  int64_t scales = 0;  // their fp32 block scales
  int64_t rest = 0;    // everything else
  int64_t total() const { return fp8 + scales + rest; }
};
Fp8WeightBytes CountFp8WeightBytes(const ModelConfig& c, int64_t weight_bytes,
                                   int64_t expert_parallel);

// KV cache bytes of one token: full-attention layers x 2 (K and V) x kv_heads x head_dim x bytes.
int64_t KvBytesPerToken(const ModelConfig& c, int64_t element_bytes);
// Qwen3-Next's recurrent state of one sequence (conv window in the model dtype, delta-rule state
// in fp32), as its paged cache allocates it; 0 for models without linear attention.
int64_t StateBytesPerSequence(const ModelConfig& c, int64_t element_bytes);
// Forward FLOPs of one sequence of `len` tokens.
double ForwardFlops(const ModelConfig& c, int64_t len);
// Activation bytes the backward keeps per token, all layers, in `act_bytes`-byte activations
// (2 under bf16 autocast, 4 in fp32); with checkpointing only each layer's input.
int64_t TrainActivationBytesPerToken(const ModelConfig& c, int64_t act_bytes, bool checkpointing);
// What a no-grad forward holds at once per token, in `act_bytes`-byte activations: the residual
// and its normed copy plus the larger of one layer's attention or MLP intermediates (the serving
// prefill's and a scoring bucket's workspace).
int64_t InferenceActivationBytesPerToken(const ModelConfig& c, int64_t act_bytes);
// Routed experts of one MoE layer that `tokens` tokens touch, expected under uniform routing.
double ExpectedExpertsTouched(const ModelConfig& c, int64_t tokens);

struct LearnerSettings {
  int64_t ranks = 1;
  bool bf16_mixed = true;
  bool cuda = true;  // adds kCudaReserveBytes
  int64_t micro_batch_tokens = 8192;
  int64_t sequence_len = 8192;  // longest sequence: the attention FLOPs' L
  int64_t tokens_per_step = 0;  // all ranks together
  bool activation_checkpointing = true;
  int64_t logits_chunk_rows = 512;  // SFT's fused NLL chunk; OPD's log-prob chunk is 1024
  // dist.zero_stage: 0 auto, 1 or 2 (trainer/common/zero1.h); dist.bucket_mb in fp32 elements.
  int64_t zero_stage = 0;
  int64_t bucket_elements = int64_t{8} << 20;
};
// dist.zero_stage as the learner resolves it: 1 with one rank; auto is 1 when the plan with stage
// 1 fits `device_bytes`, else 2.
int64_t ResolveZeroStage(const ModelConfig& c, const LearnerSettings& s, int64_t device_bytes);
// The elements of one gradient bucket: the bucket size rounded up to a multiple of the ranks, at
// most the whole model (trainer/common/optimizer_state.h BucketSharding).
int64_t BucketElements(const ModelConfig& c, const LearnerSettings& s);
ProcessPlan PlanLearner(const ModelConfig& c, const LearnerSettings& s, const DeviceSpec& d);
absl::Status CheckLearnerFits(const ModelConfig& c, const LearnerSettings& s, int64_t device_bytes);

struct RolloutSettings {
  int64_t workers = 1;
  int64_t weight_bytes = 2;    // bf16 serving
  int64_t kv_cache_bytes = 0;  // the pool (--kv-cache-gb); 0: all the device has left (auto)
  // A collective weight push lands in one bucket of this size on the device
  // (rollout.weight_sync_bucket_mb); 0: pushes over gRPC only, staged in host memory.
  int64_t update_bucket_bytes = int64_t{64} << 20;
  int64_t block_size = 16;
  int64_t max_running = 256;
  int64_t max_prefill_tokens = 8192;
  int64_t prompt_tokens = 2048;
  int64_t response_tokens = 8192;
  int64_t sequences_per_step = 1024;  // all workers together
};
ProcessPlan PlanRollout(const ModelConfig& c, const RolloutSettings& s, const DeviceSpec& d);
absl::Status CheckRolloutFits(const ModelConfig& c, const RolloutSettings& s, int64_t device_bytes);
// The KV pool opd-rollout allocates (its recurrent-state slots included): s.kv_cache_bytes when
// set, else what a device of `device_bytes` has left after the plan's other terms (0 when
// nothing is left).
int64_t RolloutKvPoolBytes(const ModelConfig& c, const RolloutSettings& s, int64_t device_bytes);
// The whole sequences (prompt_tokens + response_tokens) that pool holds at once.
int64_t RolloutKvPoolSequences(const ModelConfig& c, const RolloutSettings& s,
                               int64_t device_bytes);

struct TeacherSettings {
  std::string stage;
  int64_t replicas = 1;
  // Devices of one replica, expert parallel (--world-size): each holds 1/N of the routed experts
  // and all of the rest.
  int64_t devices_per_replica = 1;
  int64_t weight_bytes = 2;
  // A model whose config has an FP8 quantization_config keeps its FP8 weights in FP8 (the
  // loader's default on a CUDA device that runs FP8 GEMMs): CountFp8WeightBytes.
  bool fp8_weights = true;
  int64_t workers = 1;               // scoring threads (--workers), each with its own bucket
  int64_t max_batch_tokens = 16384;  // teacher_service/scorer.h ScorerOptions
  int64_t logprob_chunk_rows = 512;
  int64_t sequence_tokens = 10240;  // prompt + response
  int64_t sequences_per_step = 1024;
};
ProcessPlan PlanTeacher(const ModelConfig& c, const TeacherSettings& s, const DeviceSpec& d);
absl::Status CheckTeacherFits(const ModelConfig& c, const TeacherSettings& s, int64_t device_bytes);

// OK when the plan's peak fits `device_bytes`; else RESOURCE_EXHAUSTED naming `process`, the term
// that does not fit (the first whose running sum passes the device), the largest term, and the
// setting that shrinks each.
absl::Status CheckFits(const MemoryPlan& plan, int64_t device_bytes, const std::string& process);

std::string FormatGiB(int64_t bytes);  // "16.00 GiB"
std::string FormatSeconds(double s);   // "12.3 s" from one second up, else "45.6 ms"
// The plan as a table: memory terms, peak against the device, time terms, facts.
std::string FormatPlan(const ProcessPlan& p, const DeviceSpec& d);

}  // namespace lm::plan
