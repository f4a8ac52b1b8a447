// Times per-token log-probs (teacher/learner hot path) of a packed batch on the C++ model.
//   bench_forward --model DIR --batch 8 --len 512 --threads 2 --repeats 3 [--seed 0]
// Prints one JSON line: {"tokens_per_s": ..., "seconds": [...], "checksum": ...}
#include <chrono>
#include <fstream>
#include <iostream>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "lm/model/model.h"
#include "lm/util/memory.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "model directory");
ABSL_FLAG(int, batch, 8, "sequences");
ABSL_FLAG(int, len, 512, "tokens per sequence");
ABSL_FLAG(int, threads, 2, "intra-op threads");
ABSL_FLAG(int, repeats, 3, "timed repeats (after one warm-up)");
ABSL_FLAG(int, seed, 0, "seed of the random token ids (same as the Python side)");
ABSL_FLAG(std::string, ids, "",
          "optional file of token ids (JSON [[...], ...]) instead of random ids");

int main(int argc, char** argv) {
  lm::RetainFreedMemory();
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  auto model = lm::LoadModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) {
    std::cerr << model.status() << "\n";
    return 1;
  }
  (*model)->eval();
  std::vector<std::vector<int64_t>> seqs;
  if (!absl::GetFlag(FLAGS_ids).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_ids));
    seqs = nlohmann::json::parse(in).get<std::vector<std::vector<int64_t>>>();
  } else {
    torch::manual_seed(absl::GetFlag(FLAGS_seed));
    auto ids =
        torch::randint(0, (*model)->config().vocab_size,
                       {absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_len)}, torch::kInt64);
    for (int64_t b = 0; b < ids.size(0); ++b) {
      auto row = ids[b].contiguous();
      seqs.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
    }
  }
  const int64_t vocab = (*model)->config().vocab_size;
  for (const auto& seq : seqs) {
    for (int64_t id : seq) {
      if (id < 0 || id >= vocab) {
        std::cerr << "bench_forward: token id " << id << " is outside the model's vocabulary [0, "
                  << vocab << ")\n";
        return 1;
      }
    }
  }
  auto batch = lm::PackedBatch::FromSequences(seqs);
  torch::NoGradGuard no_grad;
  std::vector<double> secs;
  double checksum = 0;
  for (int r = 0; r <= absl::GetFlag(FLAGS_repeats); ++r) {
    auto t0 = std::chrono::steady_clock::now();
    auto lp = lm::SequenceLogprobs(**model, batch);
    checksum = lp.sum().item<double>();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) secs.push_back(s);  // the first run warms caches and allocators
  }
  const double best = *std::min_element(secs.begin(), secs.end());
  std::cout << nlohmann::json{{"tokens_per_s", batch.num_tokens() / best},
                              {"seconds", secs},
                              {"checksum", checksum}}
                   .dump()
            << std::endl;
  return 0;
}
