// opd-ctl eval --model DIR --prompts FILE [--teachers DIR[,DIR...]] [--samples N] ...
//
// Task accuracy of a model on prompts that carry an "answer", and with --teachers the mean
// per-token reverse KL to each teacher on the same samples (trainer/common/eval.h does the work).
// Prints one JSON object.
#include <iostream>

#include <torch/torch.h>

#include "absl/strings/str_split.h"
#include "ctl/args.h"
#include "ctl/command.h"
#include "ctl/flag_ranges.h"
#include "trainer/common/eval.h"

namespace ctl {
namespace {

constexpr const char* kUsage =
    "usage: opd-ctl eval --model DIR --prompts FILE [--tokenizer DIR] [--teachers DIR,DIR]\n"
    "                    [--samples 1] [--temperature 1.0] [--max-new-tokens 32] [--seed 0] "
    "[--threads N]\n"
    "  --model DIR             the model evaluated (HF directory)\n"
    "  --prompts FILE          JSON lines of prompts with an \"answer\"\n"
    "  --tokenizer DIR         default: the model directory\n"
    "  --teachers DIR,DIR      also the per-token reverse KL to each of these models\n"
    "  --samples N             samples per prompt (1)\n"
    "  --temperature T         (1.0)\n"
    "  --max-new-tokens N      (32)\n"
    "  --seed S                sampling seed (0)\n"
    "  --threads N             compute threads (LibTorch's default)\n";

absl::Status CheckFlags(const Args& args) {
  return FirstError({
      CheckFlagRange("--samples", args.Int64("samples", 1), 1, kMillion),
      CheckFlagRange("--temperature", args.Number("temperature", 1.0), 0.0, kMaxTemperature),
      CheckFlagRange("--max-new-tokens", args.Int64("max-new-tokens", 32), 1, kMaxTokens),
      CheckFlagRange("--threads", args.Int("threads", 0), 0, opd::rpc::kMaxThreads),
  });
}

}  // namespace

int RunEval(const std::vector<std::string>& words) {
  Args args;
  const FlagSpec spec = {
      {"model", Kind::kString},         {"prompts", Kind::kString}, {"tokenizer", Kind::kString},
      {"teachers", Kind::kString},      {"samples", Kind::kInt64},  {"temperature", Kind::kNumber},
      {"max-new-tokens", Kind::kInt64}, {"seed", Kind::kUint64},    {"threads", Kind::kInt}};
  if (int rc = ParseCommandArgs("eval", words, spec, {"model", "prompts"}, kUsage, &args); rc >= 0)
    return rc;
  if (int rc = RangeExitCode("eval", CheckFlags(args), kUsage); rc >= 0) return rc;
  if (args.Int("threads", 0) > 0) torch::set_num_threads(args.Int("threads", 0));
  trainer::EvalOptions options;
  options.model = args.Get("model");
  options.prompts = args.Get("prompts");
  options.tokenizer = args.Get("tokenizer", args.Get("model"));
  if (args.Has("teachers"))
    options.teachers =
        std::vector<std::string>(absl::StrSplit(args.Get("teachers"), ',', absl::SkipEmpty()));
  options.sampling.samples_per_prompt = args.Int64("samples", 1);
  options.sampling.temperature = args.Number("temperature", 1.0);
  options.sampling.max_new_tokens = args.Int64("max-new-tokens", 32);
  options.sampling.seed = args.Uint64("seed", 0);
  auto result = trainer::RunEvaluation(options);
  if (!result.ok()) {
    std::cerr << "opd-ctl eval: " << result.status().message() << "\n";
    return 1;
  }
  std::cout << trainer::EvalResultJson(options.model, *result).dump() << std::endl;
  return 0;
}

}  // namespace ctl
