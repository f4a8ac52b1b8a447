// opd-ctl generate --addr HOST:PORT --input FILE|- [--samples N] [--temperature T] [--top-p P]
//                  [--top-k K] [--max-new-tokens N] [--stop-ids 1,2] [--seed S]
// Input: JSON lines {"tokens": [...]}, one prompt each, sent as one request. Output: one line per
// sample, in (prompt, sample) order: {"prompt_index", "sample_index", "tokens" (the response),
// "logprobs", "finish_reason" ("stop" | "length"), "weight_version"}.
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "ctl/client_args.h"
#include "ctl/command.h"
#include "ctl/json_lines.h"

namespace ctl {
namespace {

constexpr const char* kUsage =
    "usage: opd-ctl generate --addr HOST:PORT --input FILE|- [--samples N] [--temperature T]\n"
    "         [--top-p P] [--top-k K] [--max-new-tokens N] [--stop-ids 1,2] [--seed S]\n";

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& csv) {
  std::vector<int32_t> ids;
  for (absl::string_view w : absl::StrSplit(csv, ',', absl::SkipEmpty())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(w, &id))
      return absl::InvalidArgumentError("--stop-ids: comma-separated ids expected");
    ids.push_back(id);
  }
  return ids;
}

}  // namespace

int RunGenerate(const std::vector<std::string>& words) {
  auto args = Args::Parse(words, WithClientFlags({"input", "samples", "temperature", "top-p",
                                                  "top-k", "max-new-tokens", "stop-ids", "seed"}));
  if (!args.ok() || !args->Has("input")) {
    std::cerr << (args.ok() ? "" : std::string(args.status().message()) + "\n") << kUsage
              << kClientUsage;
    return 2;
  }
  auto opts = ClientOptionsFrom(*args);
  if (!opts.ok()) return Fail("generate", opts.status());
  opd::rpc::GenerateOptions go;
  go.samples_per_prompt = std::stoi(args->Get("samples", "1"));
  go.temperature = std::stof(args->Get("temperature", "1.0"));
  go.top_p = std::stof(args->Get("top-p", "1.0"));
  go.top_k = std::stoi(args->Get("top-k", "0"));
  go.max_new_tokens = std::stoi(args->Get("max-new-tokens", "256"));
  go.seed = std::stoull(args->Get("seed", "0"));
  auto stops = ParseIds(args->Get("stop-ids"));
  if (!stops.ok()) return Fail("generate", stops.status());
  go.stop_token_ids = *stops;

  std::vector<std::vector<int32_t>> prompts;
  absl::Status st =
      ForEachJsonLine(args->Get("input"), [&](const nlohmann::json& j, const std::string&) {
        auto tokens = TokensOf(j);
        if (!tokens.ok()) return tokens.status();
        prompts.push_back(std::move(*tokens));
        return absl::OkStatus();
      });
  if (!st.ok()) return Fail("generate", st);
  auto client = opd::rpc::RolloutClient::Create(*opts);
  if (!client.ok()) return Fail("generate", client.status());
  auto samples = (*client)->Generate(prompts, go);
  if (!samples.ok()) return Fail("generate", samples.status());
  for (const auto& s : *samples) {
    std::cout << nlohmann::json{{"prompt_index", s.prompt_index},
                                {"sample_index", s.sample_index},
                                {"tokens", s.tokens},
                                {"logprobs", s.logprobs},
                                {"finish_reason", s.finish_reason == opd::v1::FINISH_REASON_STOP
                                                      ? "stop"
                                                      : "length"},
                                {"weight_version", s.weight_version}}
                     .dump()
              << "\n";
  }
  return 0;
}

}  // namespace ctl
