// Small pieces every learner job needs: device choice, bf16 autocast on CUDA, timing, memory,
// the tokenizer files that travel with a checkpoint.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"

namespace trainer {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Peak resident memory of this process, MiB.
double PeakRssMb();

// "auto" (CUDA when available) | "cpu" | "cuda"; an error when CUDA is asked for and absent.
absl::StatusOr<torch::Device> PickDevice(const std::string& name);

// bf16 autocast for CUDA forwards (weights stay fp32); nothing on the CPU.
class AutocastGuard {
 public:
  explicit AutocastGuard(bool enabled);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool enabled_;
};

// The tokenizer files found at `path` (a tokenizer.json, or a directory holding tokenizer files),
// to copy into a checkpoint's model/ so that it loads as a complete HF model.
std::vector<std::string> TokenizerFiles(const std::string& path);

}  // namespace trainer
