// The CUDA MoE kernels (kernels/) on the two layers that matter, bf16, next to the simple
// per-expert loop of library GEMMs (lm::MoeExpertsCpu run on CUDA tensors: sort, then torch::mm
// per expert that received tokens):
//   Mini student layer:  hidden 1024, 256 experts of 768, top-8
//   Qwen3-30B-A3B layer: hidden 2048, 128 experts of 768, top-8
// Decode sizes (M = 1, 16, 64): latency against the memory roofline, i.e. the bytes of the
// weights of the experts actually hit, read once, at kHbmBytesPerSecond. Prefill / training
// sizes (M = 4096, 16384): TFLOP/s against kPeakFlops. The L2 cache is flushed before every timed
// call (the weights of a decode step fit in an H200's 60 MB L2). Without a GPU it says so and
// exits 0.
//
//   build/bench/bench_moe_kernels [--iters N] [--json FILE]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "kernels/cuda/moe_cuda.h"
#include "lm/model/moe.h"
#include "lm/model/moe_grouped.h"

namespace {

constexpr double kHbmBytesPerSecond = 4.8e12;  // H200
constexpr double kPeakFlops = 790e12;          // dense bf16 GEMM measured on an H200
constexpr int64_t kL2FlushBytes = int64_t{256} << 20;

struct Shape {
  const char* name;
  int64_t hidden, experts, inter, top_k;
};

struct Args {
  int iters = 20;
  std::string json;
};

void CudaCheck(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// Mean time in microseconds of `f` on the current stream over `iters` calls, each after an L2
// flush that is not timed.
template <class F>
double TimeUs(F&& f, int iters, torch::Tensor& flush) {
  for (int i = 0; i < 2; ++i) f();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<cudaEvent_t> start(iters), stop(iters);
  for (int i = 0; i < iters; ++i) {
    CudaCheck(cudaEventCreate(&start[i]), "cudaEventCreate");
    CudaCheck(cudaEventCreate(&stop[i]), "cudaEventCreate");
  }
  for (int i = 0; i < iters; ++i) {
    flush.zero_();
    CudaCheck(cudaEventRecord(start[i], stream), "cudaEventRecord");
    f();
    CudaCheck(cudaEventRecord(stop[i], stream), "cudaEventRecord");
  }
  CudaCheck(cudaEventSynchronize(stop[iters - 1]), "cudaEventSynchronize");
  double total_ms = 0.0;
  for (int i = 0; i < iters; ++i) {
    float ms = 0.0f;
    CudaCheck(cudaEventElapsedTime(&ms, start[i], stop[i]), "cudaEventElapsedTime");
    total_ms += ms;
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
  return total_ms * 1000.0 / iters;
}

std::string ConfigName(int c) {
  static const char* names[] = {"bf16-16", "bf16-64", "bf16-128", "fp32-32"};
  return c >= 0 && c < 4 ? names[c] : "?";
}

// A layer's random bf16 weights on `gpu` (scaled by 0.1, as the inputs).
struct LayerWeights {
  torch::Tensor gate_up, down, router;
};
LayerWeights RandomLayer(const Shape& s, const torch::Device& gpu) {
  auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(gpu);
  return {torch::randn({s.experts, 2 * s.inter, s.hidden}, bf16) / 10,
          torch::randn({s.experts, s.hidden, s.inter}, bf16) / 10,
          torch::randn({s.experts, s.hidden}, bf16) / 10};
}

// The learner's step on the experts: forward and backward in bf16 through lm::MoeExperts (the
// kernels' forward, grouped-GEMM backward) next to the per-expert loop with autograd
// (lm::MoeExpertsCpu on CUDA tensors). Model FLOPs: 3x the forward's 6 M k H I (the grouped
// backward also recomputes the first GEMM, 4 M k H I, not counted).
void Train(const Args& args, const torch::Device& gpu, torch::Tensor& flush, std::ofstream& json) {
  torch::AutoGradMode grad(true);
  const std::vector<Shape> shapes = {{"marco-nano", 1024, 232, 384, 8},
                                     {"qwen3-30b", 2048, 128, 768, 8}};
  std::printf("\ntraining step (forward + backward, bf16)\n  %-10s %6s %10s %10s %10s %10s\n",
              "layer", "M", "ours_ms", "TFLOP/s", "loop_ms", "loop/ours");
  for (const Shape& s : shapes) {
    const int64_t H = s.hidden, I = s.inter, k = s.top_k;
    auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(gpu);
    // Named copies: lambdas below capture them (C++17 cannot capture structured bindings).
    const LayerWeights weights = RandomLayer(s, gpu);
    auto gate_up = weights.gate_up.requires_grad_(true), down = weights.down.requires_grad_(true);
    const auto& router = weights.router;
    for (int64_t M : {4096, 16384}) {
      auto x = (torch::randn({M, H}, bf16) / 10).requires_grad_(true);
      lm::Routing r;
      {
        torch::NoGradGuard no_grad;
        r = lm::Route(x, router, k, true);
      }
      auto w = r.weights.detach().requires_grad_(true);
      auto dy = torch::randn({M, H}, bf16);
      auto step = [&](auto experts) {
        auto y = experts(x, r.ids, w, gate_up, down);
        return torch::autograd::grad({y}, {x, w, gate_up, down}, {dy});
      };
      const int iters = std::max(2, args.iters / 4);
      const double ours = TimeUs([&] { step(lm::MoeExperts); }, iters, flush);
      const double loop_us = TimeUs([&] { step(lm::MoeExpertsCpu); }, iters, flush);
      const double tflops = 18.0 * M * k * H * I / (ours * 1e-6) / 1e12;
      std::printf("  %-10s %6ld %10.3f %10.1f %10.3f %9.2fx\n", s.name, static_cast<long>(M),
                  ours / 1e3, tflops, loop_us / 1e3, loop_us / ours);
      if (json.is_open()) {
        json << "{\"layer\":\"" << s.name << "\",\"M\":" << M << ",\"train_step_us\":" << ours
             << ",\"train_tflops\":" << tflops << ",\"train_loop_us\":" << loop_us << "}\n";
      }
    }
  }
}

// Prefill-sized layers: the kernels' forward next to the same layer on LibTorch's CUTLASS grouped
// GEMM (lm::MoeExpertsGroupedFp32: sort on the device, two at::_grouped_mm, fp32 combine), to
// choose between them by size.
void Prefill(const Args& args, const torch::Device& gpu, torch::Tensor& flush,
             std::ofstream& json) {
  torch::NoGradGuard no_grad;
  const std::vector<Shape> shapes = {{"marco-nano", 1024, 232, 384, 8},
                                     {"qwen3-30b", 2048, 128, 768, 8}};
  std::printf(
      "\nprefill forward: kernels vs grouped GEMM (bf16)\n  %-10s %6s %10s %10s %10s %10s\n",
      "layer", "M", "kernels_ms", "TFLOP/s", "grouped_ms", "TFLOP/s");
  for (const Shape& s : shapes) {
    const int64_t H = s.hidden, I = s.inter, k = s.top_k;
    auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(gpu);
    const LayerWeights weights = RandomLayer(s, gpu);
    const auto &gate_up = weights.gate_up, &down = weights.down, &router = weights.router;
    for (int64_t M : {512, 4096, 16384}) {
      auto x = torch::randn({M, H}, bf16) / 10;
      lm::Routing r = lm::Route(x, router, k, true);
      const int iters = std::max(3, args.iters / 2);
      const double ours = TimeUs(
          [&] { kernels::MoeExpertsCuda(x, r.ids, r.weights, gate_up, down); }, iters, flush);
      const double grouped = TimeUs(
          [&] { lm::MoeExpertsGroupedFp32(x, r.ids, r.weights, gate_up, down); }, iters, flush);
      const double flops = 6.0 * M * k * H * I;
      std::printf("  %-10s %6ld %10.3f %10.1f %10.3f %10.1f\n", s.name, static_cast<long>(M),
                  ours / 1e3, flops / (ours * 1e-6) / 1e12, grouped / 1e3,
                  flops / (grouped * 1e-6) / 1e12);
      if (json.is_open()) {
        json << "{\"layer\":\"" << s.name << "\",\"M\":" << M << ",\"prefill_kernels_us\":" << ours
             << ",\"prefill_grouped_us\":" << grouped << "}\n";
      }
    }
  }
}

int Run(const Args& args) {
  const torch::Device gpu(torch::kCUDA, 0);
  cudaDeviceProp prop{};
  CudaCheck(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("GPU: %s (%d SMs, sm_%d%d), kernels compiled for %s\n", prop.name,
              prop.multiProcessorCount, prop.major, prop.minor,
              kernels::CompiledCudaArchitectures().c_str());
  std::printf("roofline %.1f TB/s, peak %.0f TFLOP/s (H200 figures); L2 flushed before each call\n",
              kHbmBytesPerSecond / 1e12, kPeakFlops / 1e12);
  std::ofstream json;
  if (!args.json.empty()) json.open(args.json, std::ios::app);
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  auto flush =
      torch::empty({kL2FlushBytes / 4}, torch::TensorOptions().dtype(torch::kInt32).device(gpu));

  const std::vector<Shape> shapes = {{"mini", 1024, 256, 768, 8}, {"qwen3-30b", 2048, 128, 768, 8}};
  for (const Shape& s : shapes) {
    const int64_t H = s.hidden, E = s.experts, I = s.inter, k = s.top_k;
    auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(gpu);
    const LayerWeights weights = RandomLayer(s, gpu);
    const auto &gate_up = weights.gate_up, &down = weights.down, &router = weights.router;
    const double expert_bytes = static_cast<double>(3 * I * H) * 2.0;

    std::printf("\n%s: hidden %ld, %ld experts of %ld, top-%ld\n", s.name, static_cast<long>(H),
                static_cast<long>(E), static_cast<long>(I), static_cast<long>(k));
    std::printf("  %6s %9s %10s %10s %12s %10s %10s %10s\n", "M", "config", "layer_us", "graph_us",
                "roofline_us", "graph/roof", "loop_us", "loop/ours");
    for (int64_t M : {1, 16, 64}) {
      auto x = torch::randn({M, H}, bf16) / 10;
      lm::Routing r = lm::Route(x, router, k, true);  // fused top-k on CUDA
      const int64_t hit = torch::bincount(r.ids.reshape({-1}), {}, E).gt(0).sum().item<int64_t>();
      const double roofline_us = hit * expert_bytes / kHbmBytesPerSecond * 1e6;
      const int config = kernels::ChooseTileConfigFor(torch::kBFloat16, M * k, E);
      auto layer = [&] {
        lm::Routing rr = lm::Route(x, router, k, true);
        return lm::MoeExperts(x, rr.ids, rr.weights, gate_up, down);
      };
      const double ours = TimeUs(layer, args.iters, flush);
      // The same step replayed from a CUDA graph (no launch overhead).
      at::cuda::CUDAGraph graph;
      auto side = c10::cuda::getStreamFromPool(false, 0);
      {
        c10::cuda::CUDAStreamGuard guard(side);
        layer();
        side.synchronize();
        graph.capture_begin();
        layer();
        graph.capture_end();
      }
      const double graph_us = TimeUs([&] { graph.replay(); }, args.iters, flush);
      auto loop = [&] {
        lm::Routing rr = lm::Route(x, router, k, true);
        return lm::MoeExpertsCpu(x, rr.ids, rr.weights, gate_up, down);
      };
      const double loop_us = TimeUs(loop, args.iters, flush);
      std::printf("  %6ld %9s %10.1f %10.1f %12.1f %9.2fx %10.1f %9.2fx\n", static_cast<long>(M),
                  ConfigName(config).c_str(), ours, graph_us, roofline_us, graph_us / roofline_us,
                  loop_us, loop_us / ours);
      if (json.is_open()) {
        json << "{\"layer\":\"" << s.name << "\",\"M\":" << M << ",\"experts_hit\":" << hit
             << ",\"layer_us\":" << ours << ",\"graph_us\":" << graph_us
             << ",\"roofline_us\":" << roofline_us << ",\"loop_us\":" << loop_us << "}\n";
      }
    }
    std::printf("  %6s %9s %10s %10s %7s %10s %10s\n", "M", "config", "layer_ms", "TFLOP/s",
                "%peak", "loop_ms", "loop/ours");
    for (int64_t M : {4096, 16384}) {
      auto x = torch::randn({M, H}, bf16) / 10;
      lm::Routing r = lm::Route(x, router, k, true);
      const int config = kernels::ChooseTileConfigFor(torch::kBFloat16, M * k, E);
      const double flops = 6.0 * M * k * H * I;  // 2 * (H x 2I + I x H) per routed row
      const int iters = std::max(3, args.iters / 4);
      const double ours = TimeUs(
          [&] { kernels::MoeExpertsCuda(x, r.ids, r.weights, gate_up, down); }, iters, flush);
      const double loop_us =
          TimeUs([&] { lm::MoeExpertsCpu(x, r.ids, r.weights, gate_up, down); }, iters, flush);
      const double tflops = flops / (ours * 1e-6) / 1e12;
      std::printf("  %6ld %9s %10.3f %10.1f %6.1f%% %10.3f %9.2fx\n", static_cast<long>(M),
                  ConfigName(config).c_str(), ours / 1e3, tflops,
                  100.0 * tflops * 1e12 / kPeakFlops, loop_us / 1e3, loop_us / ours);
      if (json.is_open()) {
        json << "{\"layer\":\"" << s.name << "\",\"M\":" << M << ",\"experts_us\":" << ours
             << ",\"tflops\":" << tflops << ",\"loop_us\":" << loop_us << "}\n";
      }
    }
  }
  Train(args, gpu, flush, json);
  Prefill(args, gpu, flush, json);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      args.iters = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      args.json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--iters N] [--json FILE]\n", argv[0]);
      return 2;
    }
  }
  if (!torch::cuda::is_available()) {
    std::printf("no GPU: CUDA MoE kernel benchmark skipped\n");
    return std::getenv("OPD_REQUIRE_GPU") != nullptr ? 1 : 0;  // gpu_check.sh on a GPU machine
  }
  return Run(args);
}
