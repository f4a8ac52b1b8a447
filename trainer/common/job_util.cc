#include "trainer/common/job_util.h"

#include <sys/resource.h>

#include <ATen/autocast_mode.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace trainer {

namespace fs = std::filesystem;

double PeakRssMb() {
  struct rusage ru = {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // Linux reports KiB
}

absl::StatusOr<torch::Device> PickDevice(const std::string& name) {
  const bool cuda = torch::cuda::is_available();
  if (name == "cuda" && !cuda)
    return absl::FailedPreconditionError("train.device: cuda is not available");
  return (name == "cuda" || (name == "auto" && cuda)) ? torch::Device(torch::kCUDA, 0)
                                                      : torch::Device(torch::kCPU);
}

AutocastGuard::AutocastGuard(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
}

AutocastGuard::~AutocastGuard() {
  if (!enabled_) return;
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  at::autocast::clear_cache();
}

std::vector<std::string> TokenizerFiles(const std::string& path) {
  static constexpr const char* kFiles[] = {"tokenizer.json",
                                           "tokenizer_config.json",
                                           "vocab.json",
                                           "merges.txt",
                                           "special_tokens_map.json",
                                           "chat_template.jinja",
                                           "generation_config.json"};
  if (fs::is_regular_file(path)) return {path};
  std::vector<std::string> files;
  for (const char* name : kFiles) {
    const fs::path f = fs::path(path) / name;
    if (fs::is_regular_file(f)) files.push_back(f.string());
  }
  return files;
}

}  // namespace trainer
