// opd-ctl score --addr ENDPOINT --input FILE|- [--top-k K] [--temperature T] [--batch N]
// ENDPOINT is any teacher a pool takes: an opd-teacher (HOST:PORT) or an external server
// (sglang://HOST:PORT, vllm://HOST:PORT, their +https variants with --tls-ca), so that a user can
// check a teacher before a job. Input: JSON lines {"tokens": [...], "response_start": S} (S
// defaults to 1: score every token after the first). Output, one line per input: {"logprobs":
// [...]} with log p(token_i | tokens_<i) for i >= S (the same numbers `opd-ctl logprobs` prints for
// S = 1), plus "topk_ids" / "topk_logprobs" ([positions][k]) with --top-k.
#include <iostream>

#include "ctl/client_args.h"
#include "ctl/command.h"
#include "ctl/flag_ranges.h"
#include "ctl/json_lines.h"

namespace ctl {
namespace {

const std::string kUsage = std::string(
                               "usage: opd-ctl score --addr ENDPOINT --input FILE|- [--top-k K] "
                               "[--temperature T] [--batch N]\n"
                               "  ENDPOINT                HOST:PORT (opd-teacher), "
                               "sglang://HOST:PORT or vllm://HOST:PORT\n"
                               "                          (sglang+https://, vllm+https:// with "
                               "--tls-ca)\n"
                               "  --input FILE|-          JSON lines {\"tokens\": [...], "
                               "\"response_start\": S}\n"
                               "  --top-k K               also the top-k ids and log-probs (0)\n"
                               "  --temperature T         scoring temperature (1.0)\n"
                               "  --batch N               sequences per call (64)\n") +
                           kClientUsage;

// A teacher takes at most 4096 sequences per call (teacher::ScoreLimits) and a top-k of at most
// its --max-top-k (a million at most); scoring needs a temperature above 0.
absl::Status CheckFlags(const Args& args) {
  return FirstError({
      CheckFlagRange("--top-k", args.Int("top-k", 0), 0, kMillion),
      CheckFlagPositive("--temperature", args.Number("temperature", 1.0), kMaxTemperature),
      CheckFlagRange("--batch", args.Int("batch", 64), 1, 4096),
  });
}

void PrintScores(const lm::SequenceScore& s, int k) {
  nlohmann::json out{{"logprobs", s.logprobs}};
  if (k > 0) {
    auto ids = nlohmann::json::array(), lps = nlohmann::json::array();
    for (size_t row = 0; row * k < s.topk_ids.size(); ++row) {
      ids.push_back(
          std::vector<int32_t>(s.topk_ids.begin() + row * k, s.topk_ids.begin() + (row + 1) * k));
      lps.push_back(std::vector<float>(s.topk_logprobs.begin() + row * k,
                                       s.topk_logprobs.begin() + (row + 1) * k));
    }
    out["topk_ids"] = std::move(ids);
    out["topk_logprobs"] = std::move(lps);
  }
  std::cout << out.dump() << "\n";
}

}  // namespace

int RunScore(const std::vector<std::string>& words) {
  Args args;
  const FlagSpec spec = WithClientFlags({{"input", Kind::kString},
                                         {"top-k", Kind::kInt},
                                         {"temperature", Kind::kNumber},
                                         {"batch", Kind::kInt}});
  if (int rc = ParseCommandArgs("score", words, spec, {"input"}, kUsage, &args); rc >= 0) return rc;
  if (int rc = RangeExitCode("score", CheckFlags(args), kUsage); rc >= 0) return rc;
  opd::rpc::ClientOptions opts;
  if (int rc = ClientOptionsFrom("score", args, &opts); rc >= 0) return rc;
  auto client = opd::rpc::CreateTeacherEndpoint(opts);
  if (!client.ok()) return Fail("score", client.status());
  opd::rpc::ScoreOptions so;
  so.top_k = args.Int("top-k", 0);
  so.temperature = static_cast<float>(args.Number("temperature", 1.0));
  const size_t batch = args.Int("batch", 64);

  std::vector<lm::Sample> pending;
  auto flush = [&]() -> absl::Status {
    if (pending.empty()) return absl::OkStatus();
    auto scores = (*client)->Score(pending, so);
    if (!scores.ok()) return scores.status();
    for (const auto& s : *scores) PrintScores(s, so.top_k);
    pending.clear();
    return absl::OkStatus();
  };
  absl::Status st =
      ForEachJsonLine(args.Get("input"), [&](const nlohmann::json& j, const std::string&) {
        auto tokens = TokensOf(j);
        if (!tokens.ok()) return tokens.status();
        if (j.contains("response_start") && !j["response_start"].is_number_integer())
          return absl::InvalidArgumentError("\"response_start\" must be an integer");
        pending.push_back(lm::Sample::ToScore(std::move(*tokens), j.value("response_start", 1)));
        return pending.size() >= batch ? flush() : absl::OkStatus();
      });
  if (st.ok()) st = flush();
  return st.ok() ? 0 : Fail("score", st);
}

}  // namespace ctl
