// A child process for bf16_test's memory figures: loads a model directory (or only walks its
// checkpoint tensors) and prints one JSON line with its resident memory before and its peak
// during the load, from /proc/self/status (VmRSS, VmHWM).
//
//   load_rss_probe --dir=D --mode=load|walk [--device=cpu|cuda:N] [--dtype=bfloat16|float32]
//
// The baseline is taken after LibTorch (and CUDA, for a CUDA device) is initialised, so that the
// difference is what the load itself holds. Like the model servers, it keeps freed memory
// (lm::RetainFreedMemory), which makes transient buffers count towards the peak as they would.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>

#include <torch/torch.h>

#include "lm/io/hf_model_dir.h"
#include "lm/model/model.h"
#include "lm/model/placement.h"
#include "lm/util/memory.h"

namespace {

int64_t StatusKb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string k;
  while (in >> k) {
    if (k == key) {
      int64_t kb = 0;
      in >> kb;
      return kb;
    }
  }
  return -1;
}

std::string Arg(int argc, char** argv, const std::string& name, const std::string& def) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
  }
  return def;
}

// The sum of a tensor's bytes: it reads every byte, as a load does, and allocates nothing, so the
// peak is the load's own. (A LibTorch reduction would add its own temporaries, whose size depends
// on the machine's vector width and thread count.)
uint64_t ByteSum(const torch::Tensor& t) {
  const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
  return std::accumulate(bytes, bytes + t.nbytes(), uint64_t{0});
}

}  // namespace

int main(int argc, char** argv) {
  lm::RetainFreedMemory();
  // One intra-op thread: glibc gives each thread its own malloc arena, and memory freed (and kept)
  // in one arena is not reused by another, so a peak taken with N threads grows with the machine's
  // core count instead of measuring the load.
  torch::set_num_threads(1);
  const std::string dir = Arg(argc, argv, "dir", ""), mode = Arg(argc, argv, "mode", "load");
  auto placement =
      lm::ResolvePlacement(Arg(argc, argv, "device", "cpu"), Arg(argc, argv, "dtype", "bfloat16"));
  if (dir.empty() || !placement.ok()) {
    std::fprintf(stderr, "load_rss_probe: %s\n",
                 dir.empty() ? "--dir is required" : placement.status().ToString().c_str());
    return 2;
  }
  torch::NoGradGuard no_grad;
  {  // initialise what the load uses (allocator, device context) and run, small, the kernels it
     // runs: CUDA loads a kernel's module on its first use (host memory that a process pays once,
     // whatever it loads), so a first use inside the load would count it as the load's.
    const auto options = torch::TensorOptions().dtype(placement->dtype).device(placement->device);
    auto host = torch::ones({1024}, torch::kFloat32).to(placement->dtype);  // a checkpoint tensor
    auto dest = torch::empty({1024}, options);
    dest.copy_(host);                            // LoadParameters
    const auto [lo, hi] = torch::aminmax(dest);  // CheckFinite
    (void)torch::isfinite(torch::stack({lo, hi})).all().item<bool>();
    (void)dest.to(torch::kFloat32).sum().item<double>();  // the checksum below
  }
  const int64_t baseline = StatusKb("VmRSS:"), hwm_before = StatusKb("VmHWM:");
  double checksum = 0;
  int64_t peak = -1;
  if (mode == "walk") {
    auto files = lm::OpenCheckpointFiles(dir);
    if (!files.ok()) {
      std::fprintf(stderr, "load_rss_probe: %s\n", files.status().ToString().c_str());
      return 1;
    }
    // Every byte of every tensor is read (a sum), then released.
    const absl::Status st = lm::ForEachCheckpointTensor(
        *files, [&](const lm::SafetensorsFile&, const std::string&, const torch::Tensor& t) {
          checksum += static_cast<double>(ByteSum(t));
          return absl::OkStatus();
        });
    if (!st.ok()) {
      std::fprintf(stderr, "load_rss_probe: %s\n", st.ToString().c_str());
      return 1;
    }
  } else {
    lm::LoadOptions opts;
    opts.dtype = placement->dtype;
    opts.device = placement->device;
    auto model = lm::LoadModel(dir, opts);
    if (!model.ok()) {
      std::fprintf(stderr, "load_rss_probe: %s\n", model.status().ToString().c_str());
      return 1;
    }
    for (const auto& p : (*model)->parameters()) {
      if (p.scalar_type() != opts.dtype || p.device() != opts.device) {
        std::fprintf(stderr, "load_rss_probe: a parameter is %s on %s\n",
                     c10::toString(p.scalar_type()), p.device().str().c_str());
        return 1;
      }
    }
    // Read before the checksum below, whose fp32 copy of the head is not the load's.
    peak = StatusKb("VmHWM:");
    checksum = (*model)->LmHeadWeight().to(torch::kFloat32).sum().item<double>();
  }
  std::printf(
      "{\"baseline_rss_kb\": %lld, \"hwm_before_kb\": %lld, \"peak_hwm_kb\": %lld, "
      "\"checksum\": %.6g}\n",
      static_cast<long long>(baseline), static_cast<long long>(hwm_before),
      static_cast<long long>(peak >= 0 ? peak : StatusKb("VmHWM:")), checksum);
  return 0;
}
