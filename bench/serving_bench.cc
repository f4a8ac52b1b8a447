// The service side of scripts/bench/teacher.py and scripts/bench/rollout.py: times teacher
// scoring or rollout sampling either through a running service (gRPC, --addr; the secret comes
// from $OPD_SECRET) or in-process with the same domain objects (--model), on the same inputs.
//   bench_serving --mode score    --ids FILE (--addr HOST:PORT | --model DIR) [--repeats R]
//   bench_serving --mode generate --ids FILE (--addr HOST:PORT | --model DIR) [--samples 2]
//                 [--max-new-tokens 256] [--seed 0]
// FILE: token ids, JSON [[...], ...] (sequences to score, or prompts). Prints one JSON line:
// {"tokens_per_s": ..., "seconds": [...], "checksum": ...}; tokens are scored tokens, or
// generated tokens.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "rollout/sampler.h"
#include "rpc/client.h"
#include "teacher_service/scorer.h"

ABSL_FLAG(std::string, mode, "score", "score | generate");
ABSL_FLAG(std::string, ids, "", "JSON file of token id lists");
ABSL_FLAG(std::string, addr, "", "service address (through gRPC)");
ABSL_FLAG(std::string, model, "", "model directory (in-process)");
ABSL_FLAG(int, threads, 2, "intra-op threads (in-process)");
ABSL_FLAG(int, repeats, 3, "timed repeats after one warm-up");
ABSL_FLAG(int, samples, 2, "samples per prompt");
ABSL_FLAG(int, max_new_tokens, 256, "new tokens per sample");
ABSL_FLAG(uint64_t, seed, 0, "sampling seed");

namespace {

// One timed run: returns (tokens, checksum).
using RunFn = std::function<absl::StatusOr<std::pair<int64_t, double>>()>;

int Time(const RunFn& run, int repeats) {
  std::vector<double> secs;
  int64_t tokens = 0;
  double checksum = 0;
  for (int r = 0; r <= repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    auto res = run();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!res.ok()) {
      std::cerr << "bench_serving: " << res.status() << "\n";
      return 1;
    }
    std::tie(tokens, checksum) = *res;
    if (r > 0) secs.push_back(s);  // the first run warms caches and allocators
  }
  const double best = *std::min_element(secs.begin(), secs.end());
  std::cout << nlohmann::json{{"tokens_per_s", tokens / best},
                              {"seconds", secs},
                              {"checksum", checksum}}
                   .dump()
            << std::endl;
  return 0;
}

opd::rpc::ClientOptions Client() {
  opd::rpc::ClientOptions o;
  o.address = absl::GetFlag(FLAGS_addr);
  const char* secret = std::getenv("OPD_SECRET");
  o.secret = secret ? secret : "";
  o.timeout = absl::Minutes(30);
  return o;
}

std::shared_ptr<lm::CausalLM> Model() {
  torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  auto m = lm::LoadModel(absl::GetFlag(FLAGS_model));
  if (!m.ok()) {
    std::cerr << "bench_serving: " << m.status() << "\n";
    std::exit(1);
  }
  (*m)->eval();
  return *m;
}

int BenchScore(const std::vector<std::vector<int64_t>>& seqs) {
  int64_t scored = 0;
  for (const auto& s : seqs) scored += static_cast<int64_t>(s.size()) - 1;
  if (!absl::GetFlag(FLAGS_addr).empty()) {
    auto client = opd::rpc::TeacherClient::Create(Client());
    if (!client.ok()) return std::cerr << client.status() << "\n", 1;
    std::vector<opd::rpc::ScoreInput> in;
    for (const auto& s : seqs) in.push_back({std::vector<int32_t>(s.begin(), s.end()), 1});
    return Time(
        [&]() -> absl::StatusOr<std::pair<int64_t, double>> {
          auto r = (*client)->Score(in);
          if (!r.ok()) return r.status();
          double sum = 0;
          for (const auto& o : *r)
            for (float x : o.logprobs) sum += x;
          return std::make_pair(scored, sum);
        },
        absl::GetFlag(FLAGS_repeats));
  }
  teacher::ScorerOptions so;
  so.max_batch_tokens = scored + static_cast<int64_t>(seqs.size());
  teacher::Scorer scorer(Model(), so);
  return Time(
      [&]() -> absl::StatusOr<std::pair<int64_t, double>> {
        teacher::ScoreJob job;
        job.sequences = seqs;
        job.response_starts.assign(seqs.size(), 1);
        auto r = scorer.Score(std::move(job));
        if (!r.ok()) return r.status();
        double sum = 0;
        for (const auto& o : *r)
          for (float x : o.logprobs) sum += x;
        return std::make_pair(scored, sum);
      },
      absl::GetFlag(FLAGS_repeats));
}

int BenchGenerate(const std::vector<std::vector<int64_t>>& prompts) {
  if (!absl::GetFlag(FLAGS_addr).empty()) {
    auto client = opd::rpc::RolloutClient::Create(Client());
    if (!client.ok()) return std::cerr << client.status() << "\n", 1;
    std::vector<std::vector<int32_t>> in;
    for (const auto& p : prompts) in.emplace_back(p.begin(), p.end());
    opd::rpc::GenerateOptions g;
    g.samples_per_prompt = absl::GetFlag(FLAGS_samples);
    g.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
    g.seed = absl::GetFlag(FLAGS_seed);
    return Time(
        [&]() -> absl::StatusOr<std::pair<int64_t, double>> {
          auto r = (*client)->Generate(in, g);
          if (!r.ok()) return r.status();
          int64_t n = 0;
          double sum = 0;
          for (const auto& s : *r) {
            n += static_cast<int64_t>(s.tokens.size());
            for (float x : s.logprobs) sum += x;
          }
          return std::make_pair(n, sum);
        },
        absl::GetFlag(FLAGS_repeats));
  }
  auto model = Model();
  rollout::SamplingParams p;
  p.samples_per_prompt = absl::GetFlag(FLAGS_samples);
  p.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  p.seed = absl::GetFlag(FLAGS_seed);
  return Time(
      [&]() -> absl::StatusOr<std::pair<int64_t, double>> {
        int64_t n = 0;
        double sum = 0;
        auto st = rollout::SampleResponses(*model, prompts, p, [&](rollout::Sample s) {
          n += static_cast<int64_t>(s.tokens.size());
          for (float x : s.logprobs) sum += x;
        });
        if (!st.ok()) return st.status();
        return std::make_pair(n, sum);
      },
      absl::GetFlag(FLAGS_repeats));
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::ifstream in(absl::GetFlag(FLAGS_ids));
  if (!in) return std::cerr << "bench_serving: cannot read --ids\n", 1;
  const auto seqs = nlohmann::json::parse(in).get<std::vector<std::vector<int64_t>>>();
  if (absl::GetFlag(FLAGS_addr).empty() == absl::GetFlag(FLAGS_model).empty()) {
    std::cerr << "bench_serving: give exactly one of --addr and --model\n";
    return 2;
  }
  return absl::GetFlag(FLAGS_mode) == "generate" ? BenchGenerate(seqs) : BenchScore(seqs);
}
