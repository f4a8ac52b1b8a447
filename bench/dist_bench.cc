// Collective bandwidth of the learner's process group (lm::dist::ProcessGroup over c10d), one
// process per rank launched with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; rank 0 prints one
// JSON line per measurement. scripts/bench/dist.py runs it next to torch.distributed in Python
// (the same c10d library, driven from Python) on the same sizes.
//
//   all_reduce  fp32 tensors of --sizes-mb, median of --iters
//   zero_step   one ZeRO-1 optimizer step's communication for --params-m million parameters:
//               the bucketed gradient all-reduce plus the all-gather of the updated weights
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "lm/dist/process_group.h"
#include "trainer/common/zero1.h"

ABSL_FLAG(std::string, sizes_mb, "1,16,64", "all-reduce sizes, MiB (comma-separated)");
ABSL_FLAG(int, iters, 5, "timed repetitions per size (after one warm-up)");
ABSL_FLAG(double, params_m, 50, "parameters of the ZeRO-1 step, millions");
ABSL_FLAG(double, bucket_mb, 32, "gradient bucket size, MiB");

namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double TimeIt(lm::dist::ProcessGroup& g, int iters, F&& f) {
  std::vector<double> times;
  for (int i = 0; i <= iters; ++i) {
    if (!g.Barrier().ok()) std::exit(1);
    const auto t0 = Clock::now();
    f();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) times.push_back(s);  // the first run is a warm-up
  }
  // Every rank's time of an iteration is the slowest rank's: take the max over ranks.
  auto worst = g.AllReduceDoubles({Median(times)}, lm::dist::ReduceOp::kMax);
  if (!worst.ok()) std::exit(1);
  return (*worst)[0];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  auto env = lm::dist::LaunchEnv::FromEnvironment();
  if (!env.ok()) {
    std::fprintf(stderr, "bench_dist: %s\n", std::string(env.status().message()).c_str());
    return 2;
  }
  auto group = lm::dist::ProcessGroup::Create(*env, torch::kCPU);
  if (!group.ok()) {
    std::fprintf(stderr, "bench_dist: %s\n", std::string(group.status().message()).c_str());
    return 1;
  }
  lm::dist::ProcessGroup& g = **group;
  const int n = g.size();
  const int iters = absl::GetFlag(FLAGS_iters);

  for (absl::string_view mb : absl::StrSplit(absl::GetFlag(FLAGS_sizes_mb), ',')) {
    double size_mb = 0;
    if (!absl::SimpleAtod(mb, &size_mb) || size_mb <= 0) {
      std::fprintf(stderr, "bench_dist: --sizes_mb: '%s' is not a size\n", std::string(mb).c_str());
      return 2;
    }
    const int64_t elems = static_cast<int64_t>(size_mb * (1 << 20) / 4);
    std::vector<torch::Tensor> t{torch::ones({elems})};
    const double s = TimeIt(g, iters, [&] {
      if (!g.AllReduce(t).ok()) std::exit(1);
    });
    // Bus bandwidth as nccl-tests defines it: bytes * 2 (n - 1) / n per second.
    const double bytes = static_cast<double>(elems) * 4;
    if (g.is_root())
      std::printf(
          "{\"op\": \"all_reduce\", \"ranks\": %d, \"bytes\": %.0f, \"seconds\": %.6f, "
          "\"algbw_gbps\": %.4f, \"busbw_gbps\": %.4f}\n",
          n, bytes, s, bytes / s / 1e9, bytes * 2 * (n - 1) / n / s / 1e9);
  }

  // One optimizer step's communication for a flat model of params_m million fp32 parameters.
  const int64_t count = static_cast<int64_t>(absl::GetFlag(FLAGS_params_m) * 1e6);
  std::vector<std::pair<std::string, torch::Tensor>> params;
  const int64_t per = std::max<int64_t>(count / 16, 1);
  for (int i = 0; i < 16; ++i)
    params.emplace_back("layer" + std::to_string(i) + ".weight", torch::zeros({per / 64, 64}));
  trainer::OptimConfig oc;
  auto opt = trainer::DistributedOptimizer::Create(
      params, oc, &g, static_cast<int64_t>(absl::GetFlag(FLAGS_bucket_mb) * (1 << 20) / 4));
  if (!opt.ok()) return 1;
  const double s = TimeIt(g, iters, [&] {
    (*opt)->ZeroGrad();
    if (!(*opt)->ReduceAndClip(1.0).ok() || !(*opt)->Step(1e-3).ok()) std::exit(1);
  });
  const double p = static_cast<double>(per / 64 * 64 * 16);
  // Per rank: the all-reduce moves 2 (n - 1) / n of the fp32 gradients, the all-gather (n - 1) / n
  // of the fp32 weights.
  const double volume = n > 1 ? p * 4 * 3.0 * (n - 1) / n : 0;
  if (g.is_root())
    std::printf(
        "{\"op\": \"zero_step\", \"ranks\": %d, \"params\": %.0f, \"seconds\": %.6f, "
        "\"bytes_per_rank\": %.0f, \"state_bytes_per_rank\": %lld}\n",
        n, p, s, volume, static_cast<long long>((*opt)->state_bytes()));
  return 0;
}
