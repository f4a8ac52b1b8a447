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
#include "ctl/flag_ranges.h"
#include "ctl/json_lines.h"

namespace ctl {
namespace {

const std::string kUsage =
    std::string(
        "usage: opd-ctl generate --addr HOST:PORT --input FILE|- [--samples N] [--temperature T]\n"
        "         [--top-p P] [--top-k K] [--max-new-tokens N] [--stop-ids 1,2] [--seed S]\n"
        "  --input FILE|-          JSON lines {\"tokens\": [...]}, one prompt each\n"
        "  --samples N             samples per prompt (1)\n"
        "  --temperature T         0: greedy (1.0)\n"
        "  --top-p P --top-k K     nucleus / top-k sampling (1.0, 0: off)\n"
        "  --max-new-tokens N      (256)\n"
        "  --stop-ids 1,2          token ids that end a sample\n"
        "  --seed S                sampling seed (0)\n") +
    kClientUsage;

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

// The services refuse more (samples over their --max-samples-per-prompt, top-k over the
// vocabulary); these are the values no service could take.
absl::Status CheckFlags(const Args& args) {
  return FirstError({
      CheckFlagRange("--samples", args.Int("samples", 1), 1, kMillion),
      CheckFlagRange("--temperature", args.Number("temperature", 1.0), 0.0, kMaxTemperature),
      CheckFlagRange("--top-p", args.Number("top-p", 1.0), 0.0, 1.0),
      CheckFlagRange("--top-k", args.Int("top-k", 0), 0, kMaxTokens),
      CheckFlagRange("--max-new-tokens", args.Int("max-new-tokens", 256), 1, kMaxTokens),
  });
}

}  // namespace

int RunGenerate(const std::vector<std::string>& words) {
  Args args;
  const FlagSpec spec = WithClientFlags({{"input", Kind::kString},
                                         {"samples", Kind::kInt},
                                         {"temperature", Kind::kNumber},
                                         {"top-p", Kind::kNumber},
                                         {"top-k", Kind::kInt},
                                         {"max-new-tokens", Kind::kInt},
                                         {"stop-ids", Kind::kString},
                                         {"seed", Kind::kUint64}});
  if (int rc = ParseCommandArgs("generate", words, spec, {"input"}, kUsage, &args); rc >= 0)
    return rc;
  if (int rc = RangeExitCode("generate", CheckFlags(args), kUsage); rc >= 0) return rc;
  auto stops = ParseIds(args.Get("stop-ids"));
  if (!stops.ok()) {
    std::cerr << "opd-ctl generate: " << stops.status().message() << "\n" << kUsage;
    return 2;
  }
  opd::rpc::ClientOptions opts;
  if (int rc = ClientOptionsFrom("generate", args, &opts); rc >= 0) return rc;
  lm::SamplingParams params;
  params.samples_per_prompt = args.Int("samples", 1);
  params.temperature = args.Number("temperature", 1.0);
  params.top_p = args.Number("top-p", 1.0);
  params.top_k = args.Int("top-k", 0);
  params.max_new_tokens = args.Int("max-new-tokens", 256);
  params.seed = static_cast<int64_t>(args.Uint64("seed", 0));  // the same bits on the wire
  params.stop_ids = *stops;

  std::vector<std::vector<int32_t>> prompts;
  absl::Status st =
      ForEachJsonLine(args.Get("input"), [&](const nlohmann::json& j, const std::string&) {
        auto tokens = TokensOf(j);
        if (!tokens.ok()) return tokens.status();
        prompts.push_back(std::move(*tokens));
        return absl::OkStatus();
      });
  if (!st.ok()) return Fail("generate", st);
  auto client = opd::rpc::RolloutClient::Create(opts);
  if (!client.ok()) return Fail("generate", client.status());
  auto samples = (*client)->Generate(prompts, params);
  if (!samples.ok()) return Fail("generate", samples.status());
  for (const auto& s : *samples) {
    std::cout << nlohmann::json{{"prompt_index", s.prompt_index},
                                {"sample_index", s.sample_index},
                                {"tokens",
                                 std::vector<int32_t>(s.response().begin(), s.response().end())},
                                {"logprobs", s.logprobs},
                                {"finish_reason",
                                 s.finish == lm::FinishReason::kStop ? "stop" : "length"},
                                {"weight_version", s.weight_version}}
                     .dump()
              << "\n";
  }
  return 0;
}

}  // namespace ctl
