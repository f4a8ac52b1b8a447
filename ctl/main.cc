// opd-ctl: one binary, many sub-commands (`opd-ctl <command> --flag value ...`).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ctl/command.h"
#include "lm/util/memory.h"

namespace {

constexpr ctl::Command kCommands[] = {
    {"logprobs", "per-token log-probs of token sequences, computed in-process", ctl::RunLogprobs},
    {"tokenize", "text lines in, JSON token ids out", ctl::RunTokenize},
    {"detokenize", "JSON token ids in, text lines out", ctl::RunDetokenize},
    {"info", "what a running teacher or rollout worker serves", ctl::RunInfo},
    {"health", "standard gRPC health check of a running service", ctl::RunHealth},
    {"score", "teacher log-probs of token sequences, through a running teacher", ctl::RunScore},
    {"generate", "samples from a running rollout worker", ctl::RunGenerate},
    {"push-weights", "send a model directory's weights to a rollout worker", ctl::RunPushWeights},
    {"init-model", "a random model (HF directory) from a config.json", ctl::RunInitModel},
    {"eval", "task accuracy (and reverse KL to teachers) of a model on prompts with answers",
     ctl::RunEval},
    {"swap-teacher", "make a running OPD learner use other teacher replicas for a stage",
     ctl::RunSwapTeacher},
};

void PrintUsage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: opd-ctl <command> [flags]   (opd-ctl <command> --help: its flags)\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-12s %s\n", c.name, c.summary);
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
  std::fprintf(stderr, "opd-ctl: unknown command '%s'\n\n", argv[1]);
  PrintUsage(stderr);
  return 2;
}
