// Small pieces every learner job needs: timing, memory, the tokenizer files that travel with a
// checkpoint.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace trainer {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Peak resident memory of this process, MiB.
double PeakRssMb();

// The tokenizer files found at `path` (a tokenizer.json, or a directory holding tokenizer files),
// to copy into a checkpoint's model/ so that it loads as a complete HF model.
std::vector<std::string> TokenizerFiles(const std::string& path);

}  // namespace trainer
