// Paged decode attention (lm::PagedDecodeAttention): the device's kernel against the gather +
// SDPA reference it replaces (lm::PagedDecodeAttentionReference: every sequence's rows gathered,
// padded to the table's width, SDPA under a length mask), time per call (one layer of one decode
// step), for the attention shapes of Marco-Nano (16 query / 8 KV heads) and Qwen3-30B-A3B
// (32 / 4), head_dim 128, block size 16; fp32 pools on the CPU, bf16 on CUDA; every sequence at
// length L, blocks shuffled in the pool. Cases whose pools exceed --max_gb are skipped and say so
// (the reference, which holds a gathered copy besides, runs only where twice that fits).
// Bandwidth: the K/V bytes a step must read over the time, and its share of --peak_tbs (the
// H200's 4.8 TB/s by default).
//
//   build/bench/bench_paged_decode [--device cpu|cuda] [--iters N] [--max_gb G] [--threads T]
//       [--batches 64,128,256] [--lengths 2048,6144,10240] [--path auto|cores|tensor|both]
//       [--peak_tbs 4.8]
//
// Defaults: on CUDA B in {64, 128, 256} x L in {2k, 6k, 10k}; on the CPU B in {1, 64} x L in
// {512, 4k}. --path picks the CUDA split kernel's form (kernels/cuda/paged_decode.cuh) through
// OPD_PAGED_DECODE_CUDA; "both" times the CUDA-core and the tensor-core forms one after the other.
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

constexpr int64_t kD = 128, kBlock = 16;

struct Shape {
  const char* name;
  int64_t hq, hkv;
};
constexpr Shape kShapes[] = {{"Marco-Nano", 16, 8}, {"Qwen3-30B", 32, 4}};

struct Args {
  std::string device = "cpu";
  int iters = 5;
  double max_gb = 6.0;
  int threads = 0;
  std::vector<int64_t> batches, lengths;
  std::string path = "auto";
  double peak_tbs = 4.8;
};

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at < s.size()) {
    const size_t comma = s.find(',', at);
    out.push_back(std::atoll(s.substr(at, comma - at).c_str()));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--device") {
      a.device = v;
    } else if (k == "--iters") {
      a.iters = std::atoi(v.c_str());
    } else if (k == "--max_gb") {
      a.max_gb = std::atof(v.c_str());
    } else if (k == "--threads") {
      a.threads = std::atoi(v.c_str());
    } else if (k == "--batches") {
      a.batches = ParseList(v);
    } else if (k == "--lengths") {
      a.lengths = ParseList(v);
    } else if (k == "--path") {
      a.path = v;
    } else if (k == "--peak_tbs") {
      a.peak_tbs = std::atof(v.c_str());
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  const bool cuda = a.device == "cuda";
  if (a.batches.empty())
    a.batches = cuda ? std::vector<int64_t>{64, 128, 256} : std::vector<int64_t>{1, 64};
  if (a.lengths.empty())
    a.lengths = cuda ? std::vector<int64_t>{2048, 6144, 10240} : std::vector<int64_t>{512, 4096};
  if (a.path != "auto" && a.path != "cores" && a.path != "tensor" && a.path != "both") {
    std::fprintf(stderr, "--path must be auto, cores, tensor or both\n");
    std::exit(2);
  }
  return a;
}

struct Inputs {
  torch::Tensor q, k_pool, v_pool, tables, lens;
};

Inputs Make(const Shape& s, int64_t B, int64_t L, torch::Device device, torch::ScalarType dtype) {
  const int64_t per_seq = (L + kBlock - 1) / kBlock, blocks = B * per_seq + 1;
  std::vector<int32_t> ids(blocks - 1);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(1));
  auto opts = torch::TensorOptions().dtype(dtype).device(device);
  Inputs in;
  in.k_pool = torch::randn({blocks, kBlock, s.hkv, kD}, opts);
  in.v_pool = torch::randn({blocks, kBlock, s.hkv, kD}, opts);
  in.q = torch::randn({B, s.hq, kD}, opts);
  in.tables = torch::from_blob(ids.data(), {B, per_seq}, torch::kInt32).clone().to(device);
  in.lens = torch::full({B}, L, torch::kInt32).to(device);
  return in;
}

template <class F>
double MeanMs(F&& f, int iters, bool cuda) {
  f();  // warm-up (allocator, first-touch, module load)
  if (cuda) torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  if (cuda) torch::cuda::synchronize();
  const std::chrono::duration<double, std::milli> dt = std::chrono::steady_clock::now() - t0;
  return dt.count() / iters;
}

void SetPath(const std::string& path) {
  if (path == "auto") {
    unsetenv("OPD_PAGED_DECODE_CUDA");
  } else {
    setenv("OPD_PAGED_DECODE_CUDA", path.c_str(), 1);
  }
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
  std::vector<std::string> paths = {"auto"};
  if (cuda && a.path == "both") paths = {"cores", "tensor"};
  if (cuda && a.path != "both") paths = {a.path};
  torch::NoGradGuard no_grad;
  std::printf("paged decode attention, %s %s, D %lld block %lld, threads %d, peak %.2f TB/s\n",
              a.device.c_str(), cuda ? "bf16" : "fp32", (long long)kD, (long long)kBlock,
              at::get_num_threads(), a.peak_tbs);
  std::printf("%-10s %4s %4s %6s %6s %-6s %10s %12s %8s %8s %8s %10s\n", "shape", "Hq", "Hkv", "B",
              "L", "path", "kernel ms", "gather+sdpa", "ratio", "TB/s", "of peak", "max |diff|");
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  const int64_t elem = cuda ? 2 : 4;
  for (const Shape& s : kShapes)
    for (int64_t B : a.batches)
      for (int64_t L : a.lengths) {
        const double kv_gb = 2.0 * B * L * s.hkv * kD * elem / 1e9;  // K and V
        if (kv_gb > a.max_gb) {
          std::printf("%-10s %4lld %4lld %6lld %6lld   skipped: pools %.1f GB > --max_gb %.1f\n",
                      s.name, (long long)s.hq, (long long)s.hkv, (long long)B, (long long)L, kv_gb,
                      a.max_gb);
          continue;
        }
        Inputs in = Make(s, B, L, device, dtype);
        // The reference holds a gathered copy of the pools besides: only where twice fits.
        torch::Tensor want;
        double t_ref = 0.0;
        if (2 * kv_gb <= a.max_gb) {
          t_ref = MeanMs(
              [&] {
                want = lm::PagedDecodeAttentionReference(in.q, in.k_pool, in.v_pool, in.tables,
                                                         in.lens, scale);
              },
              a.iters, cuda);
        }
        for (const std::string& path : paths) {
          if (cuda) SetPath(path);
          torch::Tensor got;
          const double t_kernel =
              MeanMs([&] { got = kernel(in.q, in.k_pool, in.v_pool, in.tables, in.lens, scale); },
                     a.iters, cuda);
          if (!got.defined()) {
            std::printf("%-10s %4lld %4lld %6lld %6lld %-6s   the kernel refused these inputs\n",
                        s.name, (long long)s.hq, (long long)s.hkv, (long long)B, (long long)L,
                        path.c_str());
            continue;
          }
          const double tbs = kv_gb / 1e3 / (t_kernel / 1e3);
          char ref_ms[32] = "(skipped)", ratio[32] = "-", diff[32] = "-";
          if (want.defined()) {
            std::snprintf(ref_ms, sizeof(ref_ms), "%.3f", t_ref);
            std::snprintf(ratio, sizeof(ratio), "%.2f", t_ref / t_kernel);
            std::snprintf(
                diff, sizeof(diff), "%.2e",
                (got.to(torch::kFloat32) - want.to(torch::kFloat32)).abs().max().item<double>());
          }
          std::printf("%-10s %4lld %4lld %6lld %6lld %-6s %10.3f %12s %8s %8.3f %7.1f%% %10s\n",
                      s.name, (long long)s.hq, (long long)s.hkv, (long long)B, (long long)L,
                      path.c_str(), t_kernel, ref_ms, ratio, tbs, 100.0 * tbs / a.peak_tbs, diff);
        }
      }
  if (cuda) SetPath("auto");
  return 0;
}
