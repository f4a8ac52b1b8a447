// opd-ctl logprobs --model DIR --input FILE [--threads N]
// FILE: JSON lines {"tokens":[...]}; prints one JSON line {"logprobs":[...]} per input, entry i-1
// being log p(token_i | tokens_<i) for i >= 1, computed in-process with the C++ model.
#include <fstream>
#include <iostream>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "ctl/args.h"
#include "ctl/command.h"
#include "ctl/flag_ranges.h"
#include "lm/model/model.h"
#include "lm/util/limits.h"
#include "nlohmann/json.hpp"

namespace ctl {
namespace {

constexpr const char* kUsage =
    "usage: opd-ctl logprobs --model DIR --input FILE|- [--threads N] [--temperature T]\n"
    "  --model DIR             HF model directory\n"
    "  --input FILE|-          JSON lines {\"tokens\": [...]}\n"
    "  --threads N             compute threads (LibTorch's default)\n"
    "  --temperature T         (1.0)\n";

// The same ranges the services take (a temperature of 1e-45 printed NaN log-probs with exit 0;
// --threads 100000 hung creating the threads).
absl::Status CheckFlags(const Args& args) {
  return FirstError({
      CheckFlagRange("--temperature", args.Number("temperature", 1.0), lm::kMinTemperature,
                     lm::kMaxTemperature),
      CheckFlagRange("--threads", args.Int("threads", 0), 0, opd::rpc::kMaxThreads),
  });
}

// Parses one input line into token ids, checked against the vocabulary.
absl::StatusOr<std::vector<int64_t>> ParseTokens(const std::string& line, int64_t vocab) {
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("tokens") || !j["tokens"].is_array()) {
    return absl::InvalidArgumentError("expected a JSON object {\"tokens\": [ids...]}");
  }
  std::vector<int64_t> ids;
  for (const auto& t : j["tokens"]) {
    if (!t.is_number_integer()) return absl::InvalidArgumentError("token ids must be integers");
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary [0, ", vocab, ")"));
    }
    ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError("empty token list");
  return ids;
}

}  // namespace

int RunLogprobs(const std::vector<std::string>& words) {
  Args args;
  const FlagSpec spec = {{"model", Kind::kString},
                         {"input", Kind::kString},
                         {"threads", Kind::kInt},
                         {"temperature", Kind::kNumber}};
  if (int rc = ParseCommandArgs("logprobs", words, spec, {"model", "input"}, kUsage, &args);
      rc >= 0)
    return rc;
  if (int rc = RangeExitCode("logprobs", CheckFlags(args), kUsage); rc >= 0) return rc;
  if (args.Int("threads", 0) > 0) torch::set_num_threads(args.Int("threads", 0));
  auto model = lm::LoadModel(args.Get("model"));
  if (!model.ok()) {
    std::cerr << "opd-ctl logprobs: " << model.status().message() << "\n";
    return 1;
  }
  (*model)->eval();
  const double temperature = args.Number("temperature", 1.0);

  std::ifstream file;
  const std::string input = args.Get("input");
  if (input != "-") {
    file.open(input);
    if (!file) {
      std::cerr << "opd-ctl logprobs: cannot open " << input << "\n";
      return 1;
    }
  }
  std::istream& in = input == "-" ? std::cin : file;
  torch::NoGradGuard no_grad;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.empty()) continue;
    auto ids = ParseTokens(line, (*model)->config().vocab_size);
    if (!ids.ok()) {
      std::cerr << "opd-ctl logprobs: " << input << ":" << lineno << ": " << ids.status().message()
                << "\n";
      return 1;
    }
    auto lp = lm::SequenceLogprobs(**model, lm::PackedBatch::FromSequences({*ids}), temperature);
    auto* p = lp.data_ptr<float>();
    std::cout << nlohmann::json{{"logprobs", std::vector<float>(p, p + lp.numel())}}.dump() << "\n";
  }
  return 0;
}

}  // namespace ctl
