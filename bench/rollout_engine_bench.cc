// The C++ side of scripts/bench/rollout_engine.py: one rollout workload (requests of one prompt
// x --samples samples, each with its own max_new_tokens, drawn long-tailed by the script) run by
//   --mode=engine       the paged engine, every request submitted at once (continuous batching);
//   --mode=static_each  the static sampler, one request after another (today's per-request batch);
//   --mode=static_one   the static sampler, all prompts in one request run to the longest length
//                       (only each sequence's own length counts as generated).
// One warm-up run of a few requests, then one timed run. Prints one JSON line: generated tokens,
// seconds, tokens/s, the process's peak RSS, and the KV cache the run needed (the engine: peak
// blocks in use; static: the contiguous caches it allocates).
//   bench_rollout_engine --model DIR --requests FILE --mode M [--threads N] [--kv_cache_gb G]
// FILE: JSON [{"prompt": [ids], "max_new": n}, ...].
#include <sys/resource.h>

#include <chrono>
#include <fstream>
#include <iostream>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "lm/generate/sampler.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "rollout/engine.h"

ABSL_FLAG(std::string, model, "", "model directory");
ABSL_FLAG(std::string, requests, "", "JSON file of {prompt, max_new} requests");
ABSL_FLAG(std::string, mode, "engine", "engine | static_each | static_one");
ABSL_FLAG(int, threads, 2, "intra-op threads");
ABSL_FLAG(int, samples, 2, "samples per prompt");
ABSL_FLAG(double, kv_cache_gb, 1, "engine: KV cache pool");
ABSL_FLAG(uint64_t, seed, 0, "sampling seed");

namespace {

struct Req {
  std::vector<int32_t> prompt;
  int64_t max_new = 0;
};

double PeakRssMiB() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;  // KiB on Linux
}

lm::SamplingParams Params(int64_t max_new) {
  lm::SamplingParams p;
  p.samples_per_prompt = absl::GetFlag(FLAGS_samples);
  p.max_new_tokens = max_new;
  p.seed = absl::GetFlag(FLAGS_seed);
  return p;
}

// Generated tokens of one run of `reqs`; `kv_bytes` gets the KV cache it needed.
int64_t RunEngine(rollout::Engine& engine, std::shared_ptr<lm::CausalLM> model,
                  const std::vector<Req>& reqs) {
  std::atomic<int64_t> tokens{0};
  std::vector<std::shared_ptr<rollout::Engine::Request>> handles;
  engine.Pause();  // all requests arrive together
  for (const auto& r : reqs) {
    auto h = engine.Submit(rollout::Snapshot{model, 0, nullptr}, {r.prompt}, Params(r.max_new),
                           [&](lm::Sample s) { tokens += s.response_length(); });
    if (!h.ok()) {
      std::cerr << h.status() << "\n";
      std::exit(1);
    }
    handles.push_back(*h);
  }
  engine.Resume();
  for (auto& h : handles) {
    absl::Status st = rollout::Engine::Wait(*h);
    if (!st.ok()) {
      std::cerr << st << "\n";
      std::exit(1);
    }
  }
  return tokens;
}

// The LM head packed once, as the rollout worker's weight store does per version.
int64_t RunStatic(lm::CausalLM& model, const lm::PackedWeight* head, const std::vector<Req>& reqs,
                  bool one, int64_t kv_token, double* kv_bytes) {
  int64_t tokens = 0;
  auto run = [&](const std::vector<std::vector<int32_t>>& prompts, int64_t max_new,
                 const std::vector<int64_t>& own_len) {
    int64_t longest = 0;
    for (const auto& p : prompts) longest = std::max<int64_t>(longest, p.size());
    *kv_bytes = std::max(*kv_bytes, double(prompts.size()) * absl::GetFlag(FLAGS_samples) *
                                        double(longest + max_new) * kv_token);
    auto st = lm::SampleResponses(
        model, prompts, Params(max_new),
        [&](lm::Sample s) {
          tokens += std::min<int64_t>(s.response_length(), own_len[s.prompt_index]);
        },
        nullptr, head);
    if (!st.ok()) {
      std::cerr << st.status() << "\n";
      std::exit(1);
    }
  };
  if (one) {
    std::vector<std::vector<int32_t>> prompts;
    std::vector<int64_t> lens;
    int64_t longest = 0;
    for (const auto& r : reqs) {
      prompts.push_back(r.prompt);
      lens.push_back(r.max_new);
      longest = std::max(longest, r.max_new);
    }
    run(prompts, longest, lens);
  } else {
    for (const auto& r : reqs) run({r.prompt}, r.max_new, {r.max_new});
  }
  return tokens;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  torch::NoGradGuard no_grad;
  auto loaded = lm::LoadModel(absl::GetFlag(FLAGS_model));
  if (!loaded.ok()) {
    std::cerr << loaded.status() << "\n";
    return 1;
  }
  std::shared_ptr<lm::CausalLM> model = *loaded;
  model->eval();
  std::vector<Req> reqs;
  for (const auto& j : nlohmann::json::parse(std::ifstream(absl::GetFlag(FLAGS_requests))))
    reqs.push_back(Req{j["prompt"].get<std::vector<int32_t>>(), j["max_new"].get<int64_t>()});
  std::vector<Req> warm(reqs.begin(), reqs.begin() + std::min<size_t>(4, reqs.size()));
  for (auto& r : warm) r.max_new = std::min<int64_t>(r.max_new, 8);

  const std::string mode = absl::GetFlag(FLAGS_mode);
  const int64_t kv_token = model->PagedSpec().kv_bytes_per_token;
  double kv_bytes = 0;
  int64_t tokens = 0;
  double secs = 0;
  auto timed = [&](auto&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    tokens = fn();
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  nlohmann::json extra;
  if (mode == "engine") {
    rollout::EngineOptions o;
    o.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_gb) * (1 << 30);
    o.max_running = 256;
    o.max_requests = static_cast<int64_t>(reqs.size());
    auto engine = rollout::Engine::Create(*model, o);
    if (!engine.ok()) {
      std::cerr << engine.status() << "\n";
      return 1;
    }
    RunEngine(**engine, model, warm);
    const rollout::EngineStats before = (*engine)->stats();
    timed([&] { return RunEngine(**engine, model, reqs); });
    const rollout::EngineStats st = (*engine)->stats();
    kv_bytes = double(st.peak_used_blocks) * o.block_size * kv_token;
    const int64_t steps = st.decode_steps - before.decode_steps;
    extra = {{"decode_steps", steps},
             {"mean_running", double(st.decoded_tokens - before.decoded_tokens) / steps},
             {"preemptions", st.preemptions - before.preemptions},
             {"pool_mib", st.pool_bytes / double(1 << 20)}};
  } else if (mode == "static_each" || mode == "static_one") {
    auto head = lm::PackLmHead(*model);
    const lm::PackedWeight* h = head.get();
    double warm_kv = 0;
    RunStatic(*model, h, warm, mode == "static_one", kv_token, &warm_kv);
    timed([&] { return RunStatic(*model, h, reqs, mode == "static_one", kv_token, &kv_bytes); });
  } else {
    std::cerr << "--mode must be engine, static_each or static_one\n";
    return 1;
  }
  nlohmann::json out = {{"mode", mode},
                        {"tokens", tokens},
                        {"seconds", secs},
                        {"tokens_per_s", tokens / secs},
                        {"peak_rss_mib", PeakRssMiB()},
                        {"kv_mib", kv_bytes / double(1 << 20)}};
  if (!extra.is_null()) out.update(extra);
  std::cout << out.dump() << std::endl;
  return 0;
}
