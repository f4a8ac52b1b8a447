#include "lm/model/decode_cpu.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "lm/model/cpu_kernels.h"

namespace lm {
namespace {

// Above this many tokens an expert gets enough rows for the library GEMMs to win (prefill).
constexpr int64_t kFusedMaxTokens = 64;

// LM-head panels per parallel task: a few hundred KiB of weight each.
constexpr int64_t kPanelsPerTask = 16;

}  // namespace

bool UseFusedCpuExperts(const torch::Tensor& x, const torch::Tensor& weights,
                        const torch::Tensor& gate_up, const torch::Tensor& down) {
  const bool needs_grad =
      torch::GradMode::is_enabled() && (x.requires_grad() || weights.requires_grad() ||
                                        gate_up.requires_grad() || down.requires_grad());
  auto fp32_cpu = [](const torch::Tensor& t) {
    return t.is_cpu() && t.scalar_type() == torch::kFloat32;
  };
  return !needs_grad && x.size(0) <= kFusedMaxTokens && fp32_cpu(x) && fp32_cpu(weights) &&
         fp32_cpu(gate_up) && fp32_cpu(down) && gate_up.is_contiguous() && down.is_contiguous() &&
         x.size(1) % 8 == 0 && down.size(2) % 8 == 0 && cpu::HasAvx2Fma();
}

torch::Tensor MoeExpertsFusedCpu(const torch::Tensor& x_in, const torch::Tensor& ids_in,
                                 const torch::Tensor& weights, const torch::Tensor& gate_up,
                                 const torch::Tensor& down) {
  const auto x = x_in.contiguous();
  const auto ids = ids_in.to(torch::kInt64).contiguous();
  const int64_t T = x.size(0), k = ids.size(1), E = gate_up.size(0), H = x.size(1),
                I = down.size(2);
  // The (token, slot) pairs of each expert, in token order.
  std::vector<std::vector<int64_t>> pairs(E);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "expert id ", id[p], " out of range [0, ", E, ")");
    pairs[id[p]].push_back(p);
  }
  // Busiest experts first, handed out one at a time: threads finish together (a static split of
  // unevenly loaded experts left one thread waiting at the barrier).
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (!pairs[e].empty()) active.push_back(e);
  std::stable_sort(active.begin(), active.end(),
                   [&](int64_t a, int64_t b) { return pairs[a].size() > pairs[b].size(); });
  std::atomic<int64_t> next{0};

  auto y = torch::empty({T * k, H}, x.options());  // one output row per (token, slot) pair
  const float* xp = x.data_ptr<float>();
  const float* gup = gate_up.data_ptr<float>();
  const float* dp = down.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t num_active = static_cast<int64_t>(active.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_active), 1,
                   [&](int64_t, int64_t) {
                     std::vector<float> xs, scratch, ys;
                     for (int64_t i = next++; i < num_active; i = next++) {
                       const int64_t e = active[i], m = static_cast<int64_t>(pairs[e].size());
                       xs.resize(m * H);
                       scratch.resize(m * 2 * I);
                       ys.resize(m * H);
                       for (int64_t r = 0; r < m; ++r)
                         std::copy_n(xp + (pairs[e][r] / k) * H, H, xs.data() + r * H);
                       cpu::ExpertSwiGlu(xs.data(), m, H, gup + e * 2 * I * H, dp + e * H * I, I,
                                         scratch.data(), ys.data());
                       for (int64_t r = 0; r < m; ++r)
                         std::copy_n(ys.data() + r * H, H, yp + pairs[e][r] * H);
                     }
                   });
  // Slots summed in a fixed order: the result does not depend on the thread count.
  return (y.view({T, k, H}) * weights.unsqueeze(-1)).sum(1);
}

std::optional<PackedLinear> PackedLinear::Pack(const torch::Tensor& weight) {
  if (!weight.is_cpu() || weight.scalar_type() != torch::kFloat32 || weight.dim() != 2 ||
      !cpu::HasAvx2Fma()) {
    return std::nullopt;
  }
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + cpu::kPanel - 1) / cpu::kPanel;
  auto packed = torch::empty({cpu::PackedPanelsFloats(N, K)}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, kPanelsPerTask,
                   [&](int64_t p0, int64_t p1) { cpu::PackPanels(src, N, K, p0, p1, dst); });
  return PackedLinear(std::move(packed), N, K);
}

torch::Tensor PackedLinear::operator()(const torch::Tensor& x_in) const {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k_, "PackedLinear: expected [rows, ", k_,
              "] input, got ", x_in.sizes());
  const auto x = x_in.to(torch::kFloat32).contiguous();
  const int64_t m = x.size(0), panels = (n_ + cpu::kPanel - 1) / cpu::kPanel;
  auto out = torch::empty({m, n_}, x.options());
  const float* a = x.data_ptr<float>();
  const float* packed = packed_.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, panels, kPanelsPerTask, [&](int64_t p0, int64_t p1) {
    cpu::MatmulPackedPanels(a, k_, m, packed, n_, k_, p0, p1, o, n_);
  });
  return out;
}

}  // namespace lm
