// What batch-invariant scoring (lm/model/batch_invariant.h, opd-teacher --batch-invariant) costs
// on the CPU, next to the default path in one process: the teacher's whole scoring of a packed
// batch (forward and LM-head log-probs through teacher::Scorer), then x W^T alone at the model's
// projection shapes for a few row counts.
//   bench_batch_invariant --config configs/models/marco_nano.json --layers 2 --batch 4 --len 256
//       --response 128 --threads 2 --repeats 3
// A random model of the config's shapes with --layers layers (fp32). Prints one line per
// measurement: the default's time, the invariant mode's, and their ratio.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <random>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kernels/cpu/cpu_kernels.h"
#include "lm/model/batch_invariant.h"
#include "lm/model/config.h"
#include "lm/model/layers.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/util/memory.h"
#include "nlohmann/json.hpp"
#include "teacher_service/scorer.h"

ABSL_FLAG(std::string, config, "configs/models/marco_nano.json", "a model's config.json");
ABSL_FLAG(int, layers, 2, "decoder layers of the random model (the config's shapes otherwise)");
ABSL_FLAG(int, batch, 4, "sequences in the scored batch");
ABSL_FLAG(int, len, 256, "tokens per sequence");
ABSL_FLAG(int, response, 128, "scored tokens per sequence (the last ones)");
ABSL_FLAG(int, top_k, 0, "top-k log-probs per scored token");
ABSL_FLAG(int, threads, 2, "intra-op threads");
ABSL_FLAG(bool, scoring, true, "measure the whole scoring (the slow part)");
ABSL_FLAG(int, repeats, 3,
          "timed repeats of each measurement (after one warm-up), the two paths taking turns; "
          "the best counts");

namespace {

// The best of `repeats` timed runs of each of `a` and `b`, after one untimed run of each, the two
// taking turns so that both see the same load on a shared machine.
std::pair<double, double> BestSeconds(int repeats, const std::function<void()>& a,
                                      const std::function<void()>& b) {
  auto time = [](const std::function<void()>& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  a();
  b();
  double best_a = 1e30, best_b = 1e30;
  for (int r = 0; r < repeats; ++r) {
    best_a = std::min(best_a, time(a));
    best_b = std::min(best_b, time(b));
  }
  return {best_a, best_b};
}

void Row(const std::string& what, double usual, double invariant, const std::string& unit,
         double work) {
  std::printf("%-44s  default %9.1f %s  invariant %9.1f %s  invariant/default %.2f\n", what.c_str(),
              work / usual, unit.c_str(), work / invariant, unit.c_str(), usual / invariant);
}

}  // namespace

int main(int argc, char** argv) {
  lm::RetainFreedMemory();
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  std::ifstream in(absl::GetFlag(FLAGS_config));
  if (!in) {
    std::cerr << "bench_batch_invariant: cannot read " << absl::GetFlag(FLAGS_config) << "\n";
    return 1;
  }
  auto json = nlohmann::json::parse(in);
  json["num_hidden_layers"] = absl::GetFlag(FLAGS_layers);
  auto config = lm::ParseModelConfig(json);
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 1;
  }
  auto created = lm::CreateModel(*config);
  if (!created.ok()) {
    std::cerr << created.status() << "\n";
    return 1;
  }
  std::shared_ptr<lm::CausalLM> model = *created;
  model->InitWeights(0.02, 1);
  model->eval();
  const int len = absl::GetFlag(FLAGS_len), response = std::min(absl::GetFlag(FLAGS_response), len);
  std::printf("%s, %d layers, %d x %d tokens (%d scored each), top-k %d, %d threads\n",
              absl::GetFlag(FLAGS_config).c_str(), absl::GetFlag(FLAGS_layers),
              absl::GetFlag(FLAGS_batch), len, response, absl::GetFlag(FLAGS_top_k),
              absl::GetFlag(FLAGS_threads));

  // Scoring through the teacher's Scorer, one batch.
  const int64_t H = config->hidden_size, Q = config->num_attention_heads * config->head_dim;
  if (absl::GetFlag(FLAGS_scoring)) {
    std::mt19937 rng(0);
    teacher::ScoreJob job;
    for (int b = 0; b < absl::GetFlag(FLAGS_batch); ++b) {
      std::vector<int32_t> t(len);
      for (auto& x : t) x = static_cast<int32_t>(rng() % config->vocab_size);
      job.sequences.push_back(lm::Sample::ToScore(std::move(t), std::max(1, len - response)));
    }
    job.top_k = absl::GetFlag(FLAGS_top_k);
    auto options = [](bool invariant) {
      teacher::ScorerOptions so;
      so.workers = 1;
      so.max_batch_tokens = int64_t{1} << 30;
      so.batch_invariant = invariant;
      return so;
    };
    teacher::Scorer usual_scorer(model, options(false)), invariant_scorer(model, options(true));
    auto score = [&](teacher::Scorer& scorer) {
      return [&] {
        auto r = scorer.Score(job);
        if (!r.ok()) {
          std::cerr << r.status() << "\n";
          std::exit(1);
        }
      };
    };
    const double tokens = static_cast<double>(absl::GetFlag(FLAGS_batch)) * len;
    const auto [usual, invariant] =
        BestSeconds(absl::GetFlag(FLAGS_repeats), score(usual_scorer), score(invariant_scorer));
    Row("scoring (forward + log-probs)", usual, invariant, "tok/s", tokens);
  }

  // x W^T alone: the attention's q projection and the output projection.
  torch::NoGradGuard no_grad;
  for (auto [name, k, n] :
       {std::tuple<const char*, int64_t, int64_t>{"q_proj", H, Q}, {"o_proj", Q, H}}) {
    const auto w = torch::randn({n, k});
    for (int64_t m : {int64_t{7}, int64_t{200}, int64_t{2048}}) {
      const auto x = torch::randn({m, k});
      auto gemm = [&](bool invariant) {
        return [&x, &w, invariant] {
          lm::ScopedBatchInvariant mode(invariant);
          lm::MatmulWeightT(x, w);
        };
      };
      const auto [a, b] = BestSeconds(absl::GetFlag(FLAGS_repeats) * 5, gemm(false), gemm(true));
      Row(std::string(name) + " x W^T, " + std::to_string(m) + " x " + std::to_string(k) + " x " +
              std::to_string(n),
          a, b, "GFLOP/s", 2e-9 * m * k * n);
    }
  }

  // One expert's SwiGLU MLP on m rows (all tokens routed to expert 0, top-1, one thread's task):
  // the default (the streaming kernel up to 32 rows, the library GEMM above), the invariant mode
  // (the library GEMM on zero-padded 64-row tiles), and the streaming kernel at m rows, which
  // computes every row alike whatever m and so would be invariant too.
  const int64_t I = config->moe_intermediate_size;
  if (I > 0 && H % 8 == 0 && I % 8 == 0 && lm::cpu::HasAvx2Fma()) {
    const auto gate_up = torch::randn({1, 2 * I, H}) * 0.02, down = torch::randn({1, H, I}) * 0.02;
    for (int64_t m : {int64_t{8}, int64_t{35}, int64_t{128}, int64_t{565}}) {
      const auto x = torch::randn({m, H});
      const auto ids = torch::zeros({m, 1}, torch::kInt64), weights = torch::ones({m, 1});
      auto experts = [&](bool invariant) {
        return [&, invariant] {
          lm::ScopedBatchInvariant mode(invariant);
          lm::MoeExperts(x, ids, weights, gate_up, down);
        };
      };
      const auto [a, b] =
          BestSeconds(absl::GetFlag(FLAGS_repeats) * 5, experts(false), experts(true));
      std::vector<float> scratch(m * 2 * I), y(m * H);
      const auto [c, unused] = BestSeconds(
          absl::GetFlag(FLAGS_repeats) * 5,
          [&] {
            lm::cpu::ExpertSwiGlu(x.data_ptr<float>(), m, H, gate_up.data_ptr<float>(),
                                  down.data_ptr<float>(), I, scratch.data(), y.data());
          },
          [] {});
      const double flop = 2e-9 * m * H * 3 * I;
      std::printf(
          "expert MLP, %4lld rows: default %6.1f GFLOP/s  invariant (padded GEMM) %6.1f  "
          "streaming kernel %6.1f\n",
          static_cast<long long>(m), flop / a, flop / b, flop / c);
    }
  }
  return 0;
}
