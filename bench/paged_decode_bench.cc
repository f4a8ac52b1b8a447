// Paged decode attention (lm::PagedDecodeAttention): the device's kernel against the gather +
// SDPA reference it replaces (lm::PagedDecodeAttentionReference: every sequence's rows gathered,
// padded to the table's width, SDPA under a length mask), time per call (one layer of one decode
// step) at B = 1, 64, 256 x L = 512, 4k, 8k. Attention shape of Qwen3-30B-A3B: 32 query heads,
// 4 KV heads, head_dim 128; block size 16; fp32 pools on the CPU, bf16 on CUDA; every sequence at
// length L, blocks shuffled in the pool. Cases whose pools (plus the reference's gathered copy)
// exceed --max_gb are skipped and say so. GB/s: the K/V bytes a step must read, over the time.
//
//   build/bench/bench_paged_decode [--device cpu|cuda] [--iters N] [--max_gb G] [--threads T]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "lm/model/fast_paths.h"
#include "lm/model/paged_kv.h"

namespace {

constexpr int64_t kHq = 32, kHkv = 4, kD = 128, kBlock = 16;

struct Args {
  std::string device = "cpu";
  int iters = 5;
  double max_gb = 6.0;
  int threads = 0;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--device")
      a.device = v;
    else if (k == "--iters")
      a.iters = std::atoi(v.c_str());
    else if (k == "--max_gb")
      a.max_gb = std::atof(v.c_str());
    else if (k == "--threads")
      a.threads = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

struct Inputs {
  torch::Tensor q, k_pool, v_pool, tables, lens;
};

Inputs Make(int64_t B, int64_t L, torch::Device device, torch::ScalarType dtype) {
  const int64_t per_seq = (L + kBlock - 1) / kBlock, blocks = B * per_seq + 1;
  std::vector<int32_t> ids(blocks - 1);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(1));
  auto opts = torch::TensorOptions().dtype(dtype).device(device);
  Inputs in;
  in.k_pool = torch::randn({blocks, kBlock, kHkv, kD}, opts);
  in.v_pool = torch::randn({blocks, kBlock, kHkv, kD}, opts);
  in.q = torch::randn({B, kHq, kD}, opts);
  in.tables = torch::from_blob(ids.data(), {B, per_seq}, torch::kInt32).clone().to(device);
  in.lens = torch::full({B}, L, torch::kInt32).to(device);
  return in;
}

template <class F>
double MeanMs(F&& f, int iters, bool cuda) {
  f();  // warm-up (allocator, first-touch)
  if (cuda) torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  if (cuda) torch::cuda::synchronize();
  const std::chrono::duration<double, std::milli> dt = std::chrono::steady_clock::now() - t0;
  return dt.count() / iters;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  const bool cuda = a.device == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::printf("no GPU: nothing to time\n");
    return 0;
  }
  if (a.threads > 0) torch::set_num_threads(a.threads);
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  const auto dtype = cuda ? torch::kBFloat16 : torch::kFloat32;
  const auto kernel = lm::FastPathsFor(device.type()).paged_decode;
  if (kernel == nullptr) {
    std::printf("no paged decode kernel registered for %s\n", a.device.c_str());
    return 1;
  }
  torch::NoGradGuard no_grad;
  std::printf("paged decode attention, %s %s, Hq %lld Hkv %lld D %lld block %lld, threads %d\n",
              a.device.c_str(), cuda ? "bf16" : "fp32", (long long)kHq, (long long)kHkv,
              (long long)kD, (long long)kBlock, at::get_num_threads());
  std::printf("%6s %6s %12s %12s %8s %10s %12s\n", "B", "L", "kernel ms", "gather+sdpa", "ratio",
              "kernel GB/s", "max |diff|");
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  const int64_t elem = cuda ? 2 : 4;
  for (int64_t B : {1, 64, 256})
    for (int64_t L : {512, 4096, 8192}) {
      const double kv_gb = 2.0 * B * L * kHkv * kD * elem / 1e9;  // K and V
      if (kv_gb > a.max_gb) {
        std::printf("%6lld %6lld   skipped: pools %.1f GB > --max_gb %.1f\n", (long long)B,
                    (long long)L, kv_gb, a.max_gb);
        continue;
      }
      Inputs in = Make(B, L, device, dtype);
      torch::Tensor got, want;
      const double t_kernel =
          MeanMs([&] { got = kernel(in.q, in.k_pool, in.v_pool, in.tables, in.lens, scale); },
                 a.iters, cuda);
      if (!got.defined()) {
        std::printf("%6lld %6lld   the kernel refused these inputs\n", (long long)B, (long long)L);
        continue;
      }
      // The reference holds a gathered copy of the pools besides: skip it past the budget.
      double t_ref = 0.0, diff = 0.0;
      if (2 * kv_gb <= a.max_gb) {
        t_ref = MeanMs(
            [&] {
              want = lm::PagedDecodeAttentionReference(in.q, in.k_pool, in.v_pool, in.tables,
                                                       in.lens, scale);
            },
            a.iters, cuda);
        diff = (got.to(torch::kFloat32) - want.to(torch::kFloat32)).abs().max().item<double>();
      }
      if (t_ref > 0)
        std::printf("%6lld %6lld %12.3f %12.3f %8.2f %10.1f %12.2e\n", (long long)B, (long long)L,
                    t_kernel, t_ref, t_ref / t_kernel, kv_gb / (t_kernel / 1e3), diff);
      else
        std::printf("%6lld %6lld %12.3f %12s %8s %10.1f %12s\n", (long long)B, (long long)L,
                    t_kernel, "(skipped)", "-", kv_gb / (t_kernel / 1e3), "-");
    }
  return 0;
}
