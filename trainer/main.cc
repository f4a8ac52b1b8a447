// opd-trainer: the learner's jobs (`opd-trainer <job> --config FILE [--set k=v ...]`).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "lm/util/memory.h"
#include "trainer/common/command.h"

namespace {

// One line per job.
constexpr trainer::Command kCommands[] = {
    {"sft", "supervised fine-tuning on chat data (configs/sft/*.yaml)", trainer::SftMain},
    {"opd", "cascaded on-policy distillation (configs/opd/*.yaml)", trainer::OpdMain},
};

void PrintUsage(std::FILE* out) {
  std::fprintf(
      out, "usage: opd-trainer <job> --config FILE [--set key=value ...] [--resume]\n\njobs:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-6s %s\n", c.name, c.summary);
}

}  // namespace

int main(int argc, char** argv) {
  lm::RetainFreedMemory();
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kCommands) {
    if (std::strcmp(argv[1], c.name) == 0)
      return c.run(std::vector<std::string>(argv + 2, argv + argc));
  }
  std::fprintf(stderr, "opd-trainer: unknown job '%s'\n\n", argv[1]);
  PrintUsage(stderr);
  return 2;
}
