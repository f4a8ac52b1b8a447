// The keyed token draw on the device (lm::SampleRows, lm/generate/sampler.h) as a pure CUDA C++
// API: raw device pointers, one cudaStream_t, no LibTorch, no host synchronisation. The LibTorch
// adapter is kernels/cuda/sampler_cuda.h; the CPU twin kernels/cpu/sampler_cpu.h runs the same
// algorithm serially with the same arithmetic (kernels/cpu/draw_math.h), so both return the same
// tokens and log-probs bit for bit.
//
// One block of kSampleThreads per row:
//   1. the max, the first argmax and whether the row is broken (NaN, +inf, all -inf), one
//      coalesced pass; greedy rows end here;
//   2. top-k: four passes of an 8-bit radix select over the logits' order keys (a shared
//      histogram of counts), the k-th largest key and, when it is tied, the index of the last
//      kept tie (a block scan in token order);
//   3. top-p: the kept weights' total, then four radix passes over histograms of integer
//      weights (shared-memory atomics of integers: exact in any order), the cut key and the
//      last kept tie;
//   4. the kept total, the Philox target, and a scan in token order for the first kept token
//      whose running weight exceeds it.
// Weights are recomputed from the logits in every pass that needs them (fp64 exp, ~20 flops)
// rather than stored: a pass reads the row once.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace kernels {

inline constexpr int kSampleThreads = 512;

struct SampleRowsArgs {
  const float* logits = nullptr;  // [batch, vocab]
  const int64_t* keys = nullptr;  // [batch] (uint64 bits)
  const int64_t* positions = nullptr;
  const double* temperature = nullptr;
  const int64_t* top_k = nullptr;
  const double* top_p = nullptr;
  const int64_t* stop_ids = nullptr;  // [batch, num_stop]
  int64_t num_stop = 0;
  int64_t* tokens = nullptr;  // [batch]
  float* logprobs = nullptr;  // [batch]
  bool* stopped = nullptr;    // [batch]
  int64_t batch = 0, vocab = 0;
};

// cudaErrorInvalidValue for vocab < 1 or more rows than a grid holds.
cudaError_t SampleRows(const SampleRowsArgs& args, cudaStream_t stream);

}  // namespace kernels
