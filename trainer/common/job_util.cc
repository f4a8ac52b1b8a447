#include "trainer/common/job_util.h"

#include <sys/resource.h>

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
