// The service side of scripts/bench/teacher.py and scripts/bench/rollout.py: times teacher
// scoring or rollout sampling through a running service (gRPC, --addr; the secret comes from
// $OPD_SECRET) and/or in-process with the same domain objects (--model), on the same inputs;
// with both, runs alternate so that both see the same machine load.
//   bench_serving --mode score    --ids FILE [--addr HOST:PORT] [--model DIR] [--repeats R]
//   bench_serving --mode generate --ids FILE [--addr HOST:PORT] [--model DIR] [--samples 2]
//                 [--max-new-tokens 256] [--seed 0]
// FILE: token ids, JSON [[...], ...] (sequences to score, or prompts). Prints one JSON line:
// {"grpc"|"inprocess": {"tokens_per_s": ..., "seconds": [...], "checksum": ...}}; tokens are
// scored tokens, or generated tokens.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "lm/generate/sampler.h"
#include "lm/model/model.h"
#include "lm/util/memory.h"
#include "lm/util/threads.h"
#include "nlohmann/json.hpp"
#include "rpc/client.h"
#include "rpc/server.h"
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

// One run: returns (tokens, checksum). `warmup` runs may be shortened.
using RunFn = std::function<absl::StatusOr<std::pair<int64_t, double>>(bool warmup)>;

struct Side {
  std::string name;  // "grpc" | "inprocess"
  RunFn run;
  std::vector<double> secs = {};
  int64_t tokens = 0;
  double checksum = 0;
};

// Runs the sides alternately (one warm-up each, then `repeats` timed rounds), so that a machine
// whose load drifts affects both alike; prints {name: {tokens_per_s, seconds, checksum}}.
int Time(std::vector<Side>& sides, int repeats) {
  for (int r = 0; r <= repeats; ++r) {
    for (auto& side : sides) {
      const auto t0 = std::chrono::steady_clock::now();
      auto res = side.run(r == 0);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!res.ok()) {
        std::cerr << "bench_serving (" << side.name << "): " << res.status() << "\n";
        return 1;
      }
      std::tie(side.tokens, side.checksum) = *res;
      if (r > 0) side.secs.push_back(s);  // the first run warms caches and allocators
    }
  }
  nlohmann::json out;
  for (const auto& side : sides) {
    const double best = *std::min_element(side.secs.begin(), side.secs.end());
    out[side.name] = {
        {"tokens_per_s", side.tokens / best}, {"seconds", side.secs}, {"checksum", side.checksum}};
  }
  std::cout << out.dump() << std::endl;
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
  // In-process scoring computes on the Scorer's worker thread, as the service does: the main
  // thread keeps no OpenMP pool of its own (lm/util/threads.h). Sampling runs here.
  if (absl::GetFlag(FLAGS_mode) == "score") lm::SetThreadsForThisThread(1);
  auto m = lm::LoadModel(absl::GetFlag(FLAGS_model));
  if (!m.ok()) {
    std::cerr << "bench_serving: " << m.status() << "\n";
    std::exit(1);
  }
  (*m)->eval();
  return *m;
}

double Sum(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += x;
  return s;
}

int BenchScore(const std::vector<std::vector<int64_t>>& seqs) {
  int64_t scored = 0;
  for (const auto& s : seqs) scored += static_cast<int64_t>(s.size()) - 1;
  std::vector<Side> sides;
  std::unique_ptr<opd::rpc::TeacherClient> client;
  std::vector<lm::Sample> in;
  if (!absl::GetFlag(FLAGS_addr).empty()) {
    auto c = opd::rpc::TeacherClient::Create(Client());
    if (!c.ok()) return std::cerr << c.status() << "\n", 1;
    client = std::move(*c);
    for (const auto& s : seqs)
      in.push_back(lm::Sample::ToScore(std::vector<int32_t>(s.begin(), s.end()), 1));
    sides.push_back({"grpc", [&](bool warmup) -> absl::StatusOr<std::pair<int64_t, double>> {
                       auto r = client->Score(in);
                       if (!r.ok()) return r.status();
                       double sum = 0;
                       for (const auto& o : *r) sum += Sum(o.logprobs);
                       return std::make_pair(scored, sum);
                     }});
  }
  std::unique_ptr<teacher::Scorer> scorer;
  if (!absl::GetFlag(FLAGS_model).empty()) {
    teacher::ScorerOptions so;
    so.max_batch_tokens = scored + static_cast<int64_t>(seqs.size());
    scorer = std::make_unique<teacher::Scorer>(Model(), so);
    sides.push_back({"inprocess", [&](bool warmup) -> absl::StatusOr<std::pair<int64_t, double>> {
                       teacher::ScoreJob job;
                       for (const auto& s : seqs)
                         job.sequences.push_back(lm::Sample::ToScore({s.begin(), s.end()}, 1));
                       auto r = scorer->Score(std::move(job));
                       if (!r.ok()) return r.status();
                       double sum = 0;
                       for (const auto& o : *r) sum += Sum(o.logprobs);
                       return std::make_pair(scored, sum);
                     }});
  }
  return Time(sides, absl::GetFlag(FLAGS_repeats));
}

int BenchGenerate(const std::vector<std::vector<int64_t>>& prompts) {
  std::vector<Side> sides;
  std::unique_ptr<opd::rpc::RolloutClient> client;
  // Host token ids, as both sides take them.
  std::vector<std::vector<int32_t>> in;
  for (const auto& p : prompts) in.emplace_back(p.begin(), p.end());
  // The same parameters for both sides.
  lm::SamplingParams p;
  p.samples_per_prompt = absl::GetFlag(FLAGS_samples);
  p.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  p.seed = static_cast<int64_t>(absl::GetFlag(FLAGS_seed));
  // Warm-up runs generate a few tokens only: enough to touch every code path and allocation.
  lm::SamplingParams short_p = p;
  short_p.max_new_tokens = std::min<int64_t>(p.max_new_tokens, 4);
  if (!absl::GetFlag(FLAGS_addr).empty()) {
    auto c = opd::rpc::RolloutClient::Create(Client());
    if (!c.ok()) return std::cerr << c.status() << "\n", 1;
    client = std::move(*c);
    sides.push_back({"grpc", [&](bool warmup) -> absl::StatusOr<std::pair<int64_t, double>> {
                       auto r = client->Generate(in, warmup ? short_p : p);
                       if (!r.ok()) return r.status();
                       int64_t n = 0;
                       double sum = 0;
                       for (const auto& s : *r) {
                         n += s.response_length();
                         sum += Sum(s.logprobs);
                       }
                       return std::make_pair(n, sum);
                     }});
  }
  std::shared_ptr<lm::CausalLM> model;
  if (!absl::GetFlag(FLAGS_model).empty()) {
    model = Model();
    sides.push_back({"inprocess", [&](bool warmup) -> absl::StatusOr<std::pair<int64_t, double>> {
                       int64_t n = 0;
                       double sum = 0;
                       auto st =
                           lm::SampleResponses(*model, in, warmup ? short_p : p, [&](lm::Sample s) {
                             n += s.response_length();
                             sum += Sum(s.logprobs);
                           });
                       if (!st.ok()) return st.status();
                       return std::make_pair(n, sum);
                     }});
  }
  return Time(sides, absl::GetFlag(FLAGS_repeats));
}

}  // namespace

int main(int argc, char** argv) {
  lm::RetainFreedMemory();
  opd::rpc::ParseFlags(argc, argv, "bench_serving: times teacher scoring / rollout sampling");
  std::ifstream in(absl::GetFlag(FLAGS_ids));
  if (!in) return std::cerr << "bench_serving: cannot read --ids\n", 1;
  const auto seqs = nlohmann::json::parse(in).get<std::vector<std::vector<int64_t>>>();
  if (absl::GetFlag(FLAGS_addr).empty() && absl::GetFlag(FLAGS_model).empty()) {
    std::cerr << "bench_serving: give --addr, --model or both\n";
    return 2;
  }
  return absl::GetFlag(FLAGS_mode) == "generate" ? BenchGenerate(seqs) : BenchScore(seqs);
}
