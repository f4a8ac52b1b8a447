// train.precision: how the learner holds and computes with its weights.
//
//   fp32        every weight, gradient, master and AdamW moment in fp32 (the CPU default).
//   bf16-mixed  the matrices (lm/model/precision.h: projections, experts, embedding, LM head) are
//               bf16 compute copies; norms and routers stay fp32. The forward runs under bf16
//               autocast; the experts and the LM head take the bf16 weights with fp32 activations
//               and accumulate in fp32 (the LM head's logits and the loss are fp32). Gradients
//               are accumulated in fp32: each bf16 parameter's .grad is an fp32 view of the
//               optimizer's flat gradient buffer, so autograd adds every micro-batch's gradient
//               (rounded once to bf16 by the backward's GEMM, as any bf16 step's is) into fp32.
//               The optimizer keeps the fp32 master weights and AdamW state (with N ranks only
//               its 1/N slice of each), updates the masters, and refreshes the bf16 copies from
//               them after every step. Checkpoints hold the fp32 masters. (The CUDA default.)
//
// Memory per rank, P parameters (nearly all of them matrices), N > 1 ranks, G the gradients:
//   fp32:        weights 4P + G + AdamW 8P/N
//   bf16-mixed:  weights 2P + G + masters 4P/N + AdamW 8P/N
//   G, dist.zero_stage 1: 4P (the local sum) + 4P/N (the reduced slice)
//   G, dist.zero_stage 2: 4P/N + 3 staging buckets (trainer/common/gradient_reducer.h)
// (one rank: G = 4P; LearnerMemory counts the actual bytes.)
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "lm/model/precision.h"
#include "trainer/common/sections.h"

namespace trainer {

enum class Precision { kFp32, kBf16Mixed };

// train.precision on `device`: auto is bf16-mixed on CUDA, fp32 on the CPU.
Precision ResolvePrecision(PrecisionSetting setting, torch::Device device);
const char* PrecisionName(Precision p);

// The scope of a training or evaluation forward: bf16 autocast on the device in bf16-mixed, nothing
// in fp32.
class ForwardPrecision {
 public:
  ForwardPrecision(Precision p, torch::Device device)
      : autocast_(p == Precision::kBf16Mixed, device) {}

 private:
  lm::Bf16Autocast autocast_;
};

// Bytes one learner rank holds for training state (activations not included).
struct LearnerMemory {
  int64_t weights = 0;           // the model's parameters as the forward reads them
  int64_t gradients = 0;         // the gradient buffers
  int64_t gradient_buckets = 0;  // stage 2's staging buckets at their peak so far
  int64_t masters = 0;           // fp32 master weights beyond the model's own (bf16-mixed)
  int64_t adamw = 0;             // AdamW moments
  int64_t total() const { return weights + gradients + gradient_buckets + masters + adamw; }
};

}  // namespace trainer
