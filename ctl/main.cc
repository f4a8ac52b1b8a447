// opd-ctl: one binary, many sub-commands (`opd-ctl <command> --flag value ...`).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ctl/command.h"
#include "lm/util/memory.h"
#include "rpc/last_resort.h"

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
    {"plan", "memory per device and roofline time per step of an SFT or OPD job", ctl::RunPlan},
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

// What a command works on, for the last-resort message: "model DIR" from its --model or --from
// flag (the commands that load a model), else "".
std::string ModelOf(const std::vector<std::string>& words) {
  for (size_t i = 0; i < words.size(); ++i) {
    for (const std::string flag : {"--model", "--from"}) {
      if (words[i] == flag && i + 1 < words.size()) return "model " + words[i + 1];
      if (words[i].rfind(flag + "=", 0) == 0) return "model " + words[i].substr(flag.size() + 1);
    }
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  lm::RetainFreedMemory();
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    const std::vector<std::string> words(argv + 2, argv + argc);
    return opd::rpc::ExitCodeCatchingExceptions(std::string("opd-ctl ") + c.name, ModelOf(words),
                                                [&] {
                                                  opd::rpc::DebugThrowForTests();
                                                  return c.run(words);
                                                });
  }
  std::fprintf(stderr, "opd-ctl: unknown command '%s'\n\n", argv[1]);
  PrintUsage(stderr);
  return 2;
}
