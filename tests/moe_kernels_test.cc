// The CUDA MoE kernels (kernels/) against fp32 references, as vLLM, DeepGEMM and TensorRT-LLM
// test theirs:
//   top-k:        indices exact (ties to the lower id), weights within 1e-3 of CPU fp32;
//   align:        per-expert row lists exact and stable, every routed pair exactly once, padding
//                 and tile maps right, identical over 5 runs;
//   grouped GEMM: DeepGEMM's 1 - 2<x,y>/(|x|^2+|y|^2) <= 1e-5, bf16 against fp32;
//   layer:        bf16 within 2e-2 of the fp32 layer (inputs scaled by 0.1) for M = 1 .. 8192 and
//                 E in {128, 232, 256}, idle experts, all tokens on one expert;
//   CUDA graph capture and replay of a decode step; the backward (lm::MoeExpertsGrouped: the
//   kernels' forward, grouped-GEMM backward) against the CPU path, and without a host sync in bf16
//   on Hopper; a student model forward on GPU against CPU.
// The MoeKernelsBuild cases run everywhere; every other case skips without a CUDA device.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/moe_cuda.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "nlohmann/json.hpp"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"

using testing_util::MaxAbsDiff;

namespace {

constexpr int kSmall = 0, kMedium = 1, kLarge = 2, kFp32 = 3;  // kernels::TileConfig
const std::vector<int> kBf16Configs = {kSmall, kMedium, kLarge};

// SKIP_WITHOUT_CUDA (tests/gpu.h), and the fp32 references stay fp32 (no TF32).
#define REQUIRE_GPU()                                                             \
  do {                                                                            \
    SKIP_WITHOUT_CUDA();                                                          \
    at::globalContext().setAllowTF32CuBLAS(false); /* fp32 references are fp32 */ \
  } while (0)

torch::Device Gpu() {
  return torch::Device(torch::kCUDA, 0);
}

// DeepGEMM's similarity metric: 0 for identical tensors.
double CalcDiff(const torch::Tensor& x, const torch::Tensor& y) {
  auto a = x.to(torch::kFloat64), b = y.to(torch::kFloat64);
  const double denom = (a * a + b * b).sum().item<double>();
  if (denom == 0.0) return 0.0;
  return 1.0 - 2.0 * (a * b).sum().item<double>() / denom;
}

// Distinct top-k expert ids per token from random scores; experts where `allowed` is false get
// no tokens.
torch::Tensor RandomIds(int64_t T, int64_t E, int64_t k, const torch::Tensor& allowed = {}) {
  auto scores = torch::rand({T, E});
  if (allowed.defined()) scores = scores.masked_fill(allowed.logical_not(), -1.0);
  return std::get<1>(scores.topk(k, 1));
}

// ---------------------------------------------------------------------------------------------
// Cases that run without a GPU: the library links and the CPU path is untouched.
// ---------------------------------------------------------------------------------------------

TEST(MoeKernelsBuild, CompiledForSm80AndSm90) {
  const std::string archs = kernels::CompiledCudaArchitectures();
  std::printf("compiled for: %s\n", archs.c_str());
  EXPECT_NE(archs.find("800"), std::string::npos) << archs;
  EXPECT_NE(archs.find("900"), std::string::npos) << archs;
}

TEST(MoeKernelsBuild, TileConfigurations) {
  EXPECT_EQ(kernels::TileRows(kSmall), 16);
  EXPECT_EQ(kernels::TileRows(kMedium), 64);
  EXPECT_EQ(kernels::TileRows(kLarge), 128);
  EXPECT_EQ(kernels::TileRows(kFp32), 32);
  EXPECT_EQ(kernels::ChooseTileConfigFor(torch::kBFloat16, 8, 128), kSmall);       // decode
  EXPECT_EQ(kernels::ChooseTileConfigFor(torch::kBFloat16, 8000, 128), kMedium);   // M = 1000
  EXPECT_EQ(kernels::ChooseTileConfigFor(torch::kBFloat16, 131072, 128), kLarge);  // M = 16384
  EXPECT_EQ(kernels::ChooseTileConfigFor(torch::kFloat32, 131072, 128), kFp32);
}

TEST(MoeKernelsBuild, CpuTensorsTakeTheLibraryPath) {
  torch::manual_seed(0);
  const int64_t T = 9, H = 16, I = 8, E = 6, k = 2;
  auto x = torch::randn({T, H}), gu = torch::randn({E, 2 * I, H}), dn = torch::randn({E, H, I});
  auto ids = RandomIds(T, E, k);
  auto w = torch::rand({T, k});
  EXPECT_FALSE(kernels::MoeExpertsCuda(x, ids, w, gu, dn).defined());
  EXPECT_FALSE(kernels::MoeCudaSupports(x, ids, gu, dn));
  torch::Tensor rw, ri;
  EXPECT_FALSE(kernels::RouteTopkCuda(torch::randn({T, E}), k, true, &rw, &ri));
  // CPU inference takes the expert-parallel path (kernels/cpu/cpu_inference.h): same sums, other
  // order.
  EXPECT_TRUE(torch::allclose(lm::MoeExperts(x, ids, w, gu, dn),
                              lm::MoeExpertsCpu(x, ids, w, gu, dn), 1e-5, 1e-5));
}

// ---------------------------------------------------------------------------------------------
// 1. Router top-k.
// ---------------------------------------------------------------------------------------------

TEST(MoeKernels, TopkSoftmaxMatchesCpuIncludingTies) {
  REQUIRE_GPU();
  torch::manual_seed(1);
  const int64_t T = 301;
  for (int64_t E : {8, 64, 128, 232, 256, 512}) {
    for (int64_t k : {1, 2, 8, 16}) {
      if (k > E) continue;
      for (bool renorm : {false, true}) {
        for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
          // Multiples of 1/4 in [-8, 8]: many exact ties, exact in bf16 too.
          auto logits = (torch::randn({T, E}) * 4).round().clamp(-32, 32) / 4;
          logits[0].fill_(0.5);                              // a row of equal logits
          logits[1].narrow(0, E / 2, E - E / 2).fill_(3.0);  // ties across lanes and registers
          logits = logits.to(dtype);
          torch::Tensor w, ids;
          ASSERT_TRUE(kernels::RouteTopkCuda(logits.to(Gpu()), k, renorm, &w, &ids));
          auto lf = logits.to(torch::kFloat32);
          // Stable descending sort: equal logits keep increasing expert order.
          auto ref_ids =
              std::get<1>(lf.sort(/*stable=*/true, 1, /*descending=*/true)).narrow(1, 0, k);
          auto ref_w = torch::softmax(lf, 1).gather(1, ref_ids);
          if (renorm) ref_w = ref_w / ref_w.sum(1, true);
          const std::string what = "E=" + std::to_string(E) + " k=" + std::to_string(k) +
                                   " renorm=" + std::to_string(renorm) + " " +
                                   std::string(c10::toString(dtype));
          EXPECT_TRUE(torch::equal(ids.cpu(), ref_ids)) << what;
          EXPECT_LE(MaxAbsDiff(w, ref_w), 1e-3) << what;
          EXPECT_LE(MaxAbsDiff(w, ref_w), 1e-5) << what << " (fp32 softmax should be ~exact)";
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Align / permute.
// ---------------------------------------------------------------------------------------------

void CheckAligned(const kernels::AlignedRows& r, const torch::Tensor& ids_cpu, int64_t E,
                  const std::string& what) {
  const int64_t bm = r.block_m, pairs = ids_cpu.numel();
  auto flat = ids_cpu.reshape({-1}).to(torch::kInt64).contiguous();
  auto id = flat.accessor<int64_t, 1>();
  std::vector<std::vector<int32_t>> lists(E);
  for (int64_t p = 0; p < pairs; ++p) {
    if (id[p] >= 0 && id[p] < E) lists[id[p]].push_back(static_cast<int32_t>(p));
  }
  auto off_t = r.expert_offsets.cpu(), rows_t = r.sorted_rows.cpu(), tiles_t = r.tile_expert.cpu(),
       rop_t = r.row_of_pair.cpu();
  auto off = off_t.accessor<int32_t, 1>();
  auto rows = rows_t.accessor<int32_t, 1>();
  auto tiles = tiles_t.accessor<int32_t, 1>();
  auto rop = rop_t.accessor<int32_t, 1>();
  ASSERT_EQ(off[0], 0) << what;
  std::vector<int> seen(pairs, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(lists[e].size());
    const int64_t padded = (n + bm - 1) / bm * bm;
    ASSERT_EQ(off[e + 1] - off[e], padded) << what << " expert " << e;
    ASSERT_EQ(off[e] % bm, 0) << what;
    for (int64_t j = 0; j < padded; ++j) {
      const int32_t row = off[e] + static_cast<int32_t>(j);
      if (j < n) {
        ASSERT_EQ(rows[row], lists[e][j]) << what << " expert " << e << " rank " << j;
        ASSERT_EQ(rop[lists[e][j]], row) << what;
        ++seen[lists[e][j]];
      } else {
        ASSERT_EQ(rows[row], -1) << what << " padding of expert " << e;
      }
    }
    for (int64_t t = off[e] / bm; t < off[e + 1] / bm; ++t) ASSERT_EQ(tiles[t], e) << what;
  }
  ASSERT_LE(off[E], rows_t.size(0)) << what;
  for (int64_t t = off[E] / bm; t < tiles_t.size(0); ++t) ASSERT_EQ(tiles[t], -1) << what;
  for (int64_t p = 0; p < pairs; ++p) {
    const bool valid = id[p] >= 0 && id[p] < E;
    ASSERT_EQ(seen[p], valid ? 1 : 0) << what << " pair " << p;
    if (!valid) {
      ASSERT_EQ(rop[p], -1) << what;
    }
  }
}

TEST(MoeKernels, AlignIsStableExactPaddedAndDeterministic) {
  REQUIRE_GPU();
  torch::manual_seed(2);
  struct Case {
    int64_t T, E, k;
    std::string kind;
  };
  const std::vector<Case> cases = {{1, 128, 8, "random"},     {7, 232, 8, "random"},
                                   {1000, 256, 8, "idle"},    {3000, 128, 8, "one_expert"},
                                   {2000, 512, 4, "invalid"}, {300, 8, 1, "random"},
                                   {20000, 128, 8, "random"}};
  for (const auto& c : cases) {
    torch::Tensor ids;
    if (c.kind == "idle") {
      ids = RandomIds(c.T, c.E, c.k, torch::arange(c.E) % 4 == 0);  // 3/4 of the experts idle
    } else if (c.kind == "one_expert") {
      ids = torch::full({c.T, c.k}, 5, torch::kInt64);
    } else {
      ids = RandomIds(c.T, c.E, c.k);
    }
    if (c.kind == "invalid") {  // out-of-range ids are dropped
      ids[3][0] = -1;
      ids[10][1] = c.E;
      ids[11][2] = c.E + 100;
    }
    for (int config : {kSmall, kMedium, kLarge, kFp32}) {
      const std::string what = c.kind + " T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) +
                               " config=" + std::to_string(config);
      for (auto id_dtype : {torch::kInt64, torch::kInt32}) {
        auto dev_ids = ids.to(id_dtype).to(Gpu());
        auto first = kernels::AlignCuda(dev_ids, c.E, config);
        CheckAligned(first, ids, c.E, what);
        for (int run = 0; run < 5; ++run) {
          auto again = kernels::AlignCuda(dev_ids, c.E, config);
          EXPECT_TRUE(torch::equal(again.sorted_rows, first.sorted_rows)) << what;
          EXPECT_TRUE(torch::equal(again.expert_offsets, first.expert_offsets)) << what;
          EXPECT_TRUE(torch::equal(again.tile_expert, first.tile_expert)) << what;
          EXPECT_TRUE(torch::equal(again.row_of_pair, first.row_of_pair)) << what;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 3./4. Grouped GEMMs against an fp32 per-expert loop over the same (bf16-valued) inputs.
// ---------------------------------------------------------------------------------------------

struct GemmRef {
  torch::Tensor act, out;  // [rows in use, I], [rows in use, H] in fp32
};

// The fp32 reference of both GEMMs on the aligned rows; the down GEMM's reference takes the
// kernel's act (so that each GEMM is measured alone).
GemmRef ReferenceGemms(const torch::Tensor& x, const kernels::AlignedRows& r,
                       const torch::Tensor& gate_up, const torch::Tensor& down,
                       const torch::Tensor& act_kernel) {
  const int64_t E = r.experts, I = down.size(2), H = down.size(1);
  auto off_t = r.expert_offsets.cpu();
  auto off = off_t.accessor<int32_t, 1>();
  const int64_t used = off[E];
  auto x32 = x.to(torch::kFloat32);
  GemmRef ref;
  ref.act = torch::zeros({used, I}, x32.options());
  ref.out = torch::zeros({used, H}, x32.options());
  auto pairs = r.sorted_rows.narrow(0, 0, used).to(torch::kInt64);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = off[e], len = off[e + 1] - off[e];
    if (len == 0) continue;
    auto p = pairs.narrow(0, s, len);
    auto valid = p.ge(0);
    const int64_t n = valid.sum().item<int64_t>();  // rows come first, padding after
    if (n == 0) continue;
    auto tokens = torch::div(p.narrow(0, 0, n), r.top_k, "floor");
    auto xe = x32.index_select(0, tokens);
    auto w = gate_up[e].to(torch::kFloat32);
    auto g = torch::mm(xe, w.narrow(0, 0, I).t()), u = torch::mm(xe, w.narrow(0, I, I).t());
    ref.act.narrow(0, s, n).copy_(torch::silu(g) * u);
    ref.out.narrow(0, s, n).copy_(
        torch::mm(act_kernel.narrow(0, s, n).to(torch::kFloat32), down[e].to(torch::kFloat32).t()));
  }
  return ref;
}

TEST(MoeKernels, GroupedGemmsMatchFp32) {
  REQUIRE_GPU();
  torch::manual_seed(3);
  struct Case {
    int64_t T, E, H, I;
    std::string kind;
  };
  const std::vector<Case> cases = {
      {1, 128, 1024, 384, "random"},
      {7, 232, 1024, 384, "random"},
      {64, 256, 2048, 768, "random"},
      {1000, 128, 1024, 384, "idle"},
      {512, 64, 512, 256, "one_expert"},
      {300, 16, 1032, 200, "random"},  // H and I not multiples of any tile: predication
      {2048, 128, 2048, 768, "random"}};
  const int64_t k = 8;
  for (const auto& c : cases) {
    torch::Tensor ids;
    if (c.kind == "idle") {
      ids = RandomIds(c.T, c.E, k, torch::arange(c.E) < 16);
    } else if (c.kind == "one_expert") {
      ids = torch::full({c.T, k}, 3, torch::kInt64);
    } else {
      ids = RandomIds(c.T, c.E, k);
    }
    auto dev_ids = ids.to(Gpu());
    auto x = torch::randn({c.T, c.H}, Gpu());
    auto gu = torch::randn({c.E, 2 * c.I, c.H}, Gpu()) / 16;
    auto dn = torch::randn({c.E, c.H, c.I}, Gpu()) / 16;
    auto xb = x.to(torch::kBFloat16), gub = gu.to(torch::kBFloat16), dnb = dn.to(torch::kBFloat16);
    for (int config : {kSmall, kMedium, kLarge, kFp32}) {
      const bool fp32 = config == kFp32;
      const std::string what = c.kind + " T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) +
                               " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) +
                               " config=" + std::to_string(config);
      auto r = kernels::AlignCuda(dev_ids, c.E, config);
      const auto& xi = fp32 ? x : xb;
      const auto& gui = fp32 ? gu : gub;
      const auto& dni = fp32 ? dn : dnb;
      auto act = kernels::GroupedSwiGluCuda(xi, r, gui);
      auto out = kernels::GroupedDownCuda(act, r, dni);
      // The reference sees exactly the kernel's input values (bf16 upcast or fp32).
      auto ref = ReferenceGemms(xi, r, gui, dni, act);
      const int64_t used = ref.act.size(0);
      auto act_used = act.narrow(0, 0, used).to(torch::kFloat32);
      auto out_used = out.narrow(0, 0, used).to(torch::kFloat32);
      const double d_act = CalcDiff(act_used, ref.act), d_out = CalcDiff(out_used, ref.out);
      std::printf("%-60s swiglu diff %.2e  down diff %.2e\n", what.c_str(), d_act, d_out);
      EXPECT_LE(d_act, 1e-5) << what;
      EXPECT_LE(d_out, 1e-5) << what;
      // Padding rows are exact zeros (the down GEMM reads them).
      auto padding = r.sorted_rows.narrow(0, 0, used).lt(0);
      EXPECT_EQ(act_used.index({padding}).abs().sum().item<double>(), 0.0) << what;
      EXPECT_EQ(out_used.index({padding}).abs().sum().item<double>(), 0.0) << what;
      if (fp32) {  // the FMA path is exact up to summation order
        EXPECT_LE(MaxAbsDiff(act_used, ref.act), 1e-5 * ref.act.abs().max().item<double>() + 1e-6)
            << what;
        EXPECT_LE(MaxAbsDiff(out_used, ref.out), 1e-5 * ref.out.abs().max().item<double>() + 1e-6)
            << what;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The whole layer.
// ---------------------------------------------------------------------------------------------

struct Layer {
  torch::Tensor gate_up, down;  // bf16 on the GPU
  torch::Tensor gate_up32, down32;
};

Layer RandomLayer(int64_t E, int64_t H, int64_t I) {
  Layer l;
  l.gate_up = (torch::randn({E, 2 * I, H}, Gpu()) / 10).to(torch::kBFloat16);
  l.down = (torch::randn({E, H, I}, Gpu()) / 10).to(torch::kBFloat16);
  l.gate_up32 = l.gate_up.to(torch::kFloat32);
  l.down32 = l.down.to(torch::kFloat32);
  return l;
}

// bf16 layer through lm::MoeExperts (the registry must send CUDA tensors to the kernels: the
// result equals the adapter's, bit for bit) against the fp32 layer on the same values.
void CheckLayer(const Layer& l, const torch::Tensor& x, const torch::Tensor& ids,
                const torch::Tensor& w, const std::string& what, int forced_config = -1) {
  torch::NoGradGuard no_grad;
  kernels::MoeCudaOptions opts;
  opts.tile_config = forced_config;
  auto y = kernels::MoeExpertsCudaForward(x, ids, w, l.gate_up, l.down, opts);
  if (forced_config < 0) {
    auto via_lm = lm::MoeExperts(x, ids, w, l.gate_up, l.down);
    EXPECT_TRUE(torch::equal(via_lm, y)) << what << ": lm::MoeExperts did not run the kernels";
    auto again = kernels::MoeExpertsCudaForward(x, ids, w, l.gate_up, l.down, opts);
    EXPECT_TRUE(torch::equal(again, y)) << what << ": not deterministic";
    // fp32 routing weights take the other Combine instantiation; bf16 -> fp32 is exact.
    auto fp32_weights =
        kernels::MoeExpertsCudaForward(x, ids, w.to(torch::kFloat32), l.gate_up, l.down, opts);
    EXPECT_TRUE(torch::equal(fp32_weights, y)) << what << ": fp32 weights";
  }
  auto ref =
      lm::MoeExpertsCpu(x.to(torch::kFloat32), ids, w.to(torch::kFloat32), l.gate_up32, l.down32);
  const double diff = MaxAbsDiff(y, ref);
  std::printf("%-50s max |y - ref| %.2e  (max |ref| %.2e)\n", what.c_str(), diff,
              ref.abs().max().item<double>());
  EXPECT_LE(diff, 2e-2) << what;
}

// Routing as the model does it on a GPU: the fused top-k on router logits, renormalised.
std::pair<torch::Tensor, torch::Tensor> RouteOnGpu(int64_t T, int64_t E, int64_t k,
                                                   const torch::Tensor& allowed = {}) {
  auto logits = torch::randn({T, E}, Gpu());
  if (allowed.defined()) logits = logits.masked_fill(allowed.to(Gpu()).logical_not(), -1e4);
  torch::Tensor w, ids;
  EXPECT_TRUE(kernels::RouteTopkCuda(logits, k, true, &w, &ids));
  return {w.to(torch::kBFloat16), ids};
}

TEST(MoeKernels, LayerMatchesFp32AcrossBatchSizesAndExpertCounts) {
  REQUIRE_GPU();
  torch::manual_seed(4);
  const int64_t H = 1024, I = 384, k = 8;
  for (int64_t E : {128, 232, 256}) {
    Layer l = RandomLayer(E, H, I);
    for (int64_t M : {1, 7, 64, 1000, 8192}) {
      auto x = (torch::randn({M, H}, Gpu()) / 10).to(torch::kBFloat16);
      auto [w, ids] = RouteOnGpu(M, E, k);
      CheckLayer(l, x, ids, w, "E=" + std::to_string(E) + " M=" + std::to_string(M));
    }
  }
}

TEST(MoeKernels, LayerIdleExpertsOneExpertEveryTileConfigAndQwen30bShape) {
  REQUIRE_GPU();
  torch::manual_seed(5);
  const int64_t k = 8;
  {
    const int64_t E = 256, H = 1024, I = 384;
    Layer l = RandomLayer(E, H, I);
    for (int64_t M : {7, 1000}) {
      auto x = (torch::randn({M, H}, Gpu()) / 10).to(torch::kBFloat16);
      auto [w, ids] = RouteOnGpu(M, E, k, torch::arange(E) % 8 == 3);  // 7/8 of the experts idle
      CheckLayer(l, x, ids, w, "idle experts M=" + std::to_string(M));
      // Every token's every slot on one expert (the extreme of imbalance).
      auto one = torch::full({M, k}, 17, torch::TensorOptions().dtype(torch::kInt64).device(Gpu()));
      CheckLayer(l, x, one, w, "one expert M=" + std::to_string(M));
      // Slot 0 of every token on expert 0, the rest routed.
      auto first = ids.clone();
      first.select(1, 0).fill_(0);
      CheckLayer(l, x, first, w, "slot 0 on expert 0, M=" + std::to_string(M));
      for (int config : kBf16Configs) {
        CheckLayer(l, x, ids, w, "config " + std::to_string(config) + " M=" + std::to_string(M),
                   config);
      }
    }
  }
  {
    const int64_t E = 128, H = 2048, I = 768;  // the Qwen3-30B-A3B layer
    Layer l = RandomLayer(E, H, I);
    for (int64_t M : {1, 64, 1000}) {
      auto x = (torch::randn({M, H}, Gpu()) / 10).to(torch::kBFloat16);
      auto [w, ids] = RouteOnGpu(M, E, k);
      CheckLayer(l, x, ids, w, "qwen3-30b M=" + std::to_string(M));
    }
  }
}

TEST(MoeKernels, Fp32LayerEqualsCpuPath) {
  REQUIRE_GPU();
  torch::manual_seed(6);
  const int64_t T = 200, H = 256, I = 128, E = 32, k = 4;
  auto x = torch::randn({T, H}), gu = torch::randn({E, 2 * I, H}) / 16,
       dn = torch::randn({E, H, I}) / 16;
  auto ids = RandomIds(T, E, k);
  auto w = torch::rand({T, k});
  auto ref = lm::MoeExpertsCpu(x, ids, w, gu, dn);
  auto y = lm::MoeExperts(x.to(Gpu()), ids.to(Gpu()), w.to(Gpu()), gu.to(Gpu()), dn.to(Gpu()));
  EXPECT_LE(MaxAbsDiff(y, ref), 1e-5 * ref.abs().max().item<double>());
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs: a decode step (router + experts) captured once, replayed on new inputs.
// ---------------------------------------------------------------------------------------------

TEST(MoeKernels, DecodeStepCapturesIntoACudaGraph) {
  REQUIRE_GPU();
  torch::manual_seed(7);
  torch::NoGradGuard no_grad;
  const int64_t M = 4, E = 128, H = 1024, I = 384, k = 8;
  Layer l = RandomLayer(E, H, I);
  auto router = (torch::randn({E, H}, Gpu()) / 10).to(torch::kBFloat16);
  auto x = (torch::randn({M, H}, Gpu()) / 10).to(torch::kBFloat16);
  auto step = [&] {
    lm::Routing r = lm::Route(x, router, k, /*norm_topk_prob=*/true);
    return lm::MoeExperts(x, r.ids, r.weights, l.gate_up, l.down);
  };
  auto side = c10::cuda::getStreamFromPool(false, 0);
  torch::Tensor out;
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    step();  // warm-up: one-time set-up (shared-memory limits, cuBLAS handles) before capture
    step();
    side.synchronize();
    graph.capture_begin();
    out = step();
    graph.capture_end();
  }
  for (int trial = 0; trial < 3; ++trial) {
    x.copy_((torch::randn({M, H}, Gpu()) / 10).to(torch::kBFloat16));
    graph.replay();
    auto expected = step();
    torch::cuda::synchronize();
    EXPECT_TRUE(torch::equal(out, expected)) << "replay " << trial;
  }
}

// ---------------------------------------------------------------------------------------------
// Autograd: gradients of the CUDA path against the CPU path.
// ---------------------------------------------------------------------------------------------

// `t` as a leaf that needs gradients, on `d` in `dt`.
torch::Tensor Leaf(const torch::Tensor& t, torch::Device d, torch::Dtype dt) {
  return t.to(d, dt).detach().requires_grad_(true);
}

// A layer's random inputs (fp32, CPU) and the CPU reference: y = lm::MoeExpertsCpu and the
// gradients of <gy, y> with respect to x, weights, gate_up and down (in that order).
struct GradCase {
  torch::Tensor x, ids, w, gu, dn, gy, y_ref;
  std::vector<torch::Tensor> g_ref;
  // The inputs as leaves on `d` in `dt`, in the gradients' order.
  std::vector<torch::Tensor> Leaves(torch::Device d, torch::Dtype dt) const {
    return {Leaf(x, d, dt), Leaf(w, d, dt), Leaf(gu, d, dt), Leaf(dn, d, dt)};
  }
};
GradCase MakeGradCase(uint64_t seed, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k,
                      const torch::Tensor& allowed) {
  torch::manual_seed(seed);
  GradCase c;
  c.x = torch::randn({T, H});
  c.gu = torch::randn({E, 2 * I, H}) / 8;
  c.dn = torch::randn({E, H, I}) / 8;
  c.ids = RandomIds(T, E, k, allowed);
  c.w = torch::rand({T, k});
  c.gy = torch::randn({T, H});
  auto cpu = c.Leaves(torch::kCPU, torch::kFloat32);
  c.y_ref = lm::MoeExpertsCpu(cpu[0], c.ids, cpu[1], cpu[2], cpu[3]);
  c.g_ref = torch::autograd::grad({c.y_ref}, cpu, {c.gy});
  return c;
}

TEST(MoeKernels, BackwardMatchesCpuPath) {
  REQUIRE_GPU();
  const int64_t E = 12;
  const GradCase c = MakeGradCase(8, 37, 64, 32, E, 3,
                                  torch::arange(E).lt(5) | torch::arange(E).ge(9));  // 5..8 idle
  const auto &ids = c.ids, &gy = c.gy, &y_ref = c.y_ref;
  const auto& g_ref = c.g_ref;
  const char* names[] = {"x", "weights", "gate_up", "down"};
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    std::vector<torch::Tensor> dev = c.Leaves(Gpu(), dt);
    auto y = lm::MoeExperts(dev[0], ids.to(Gpu()), dev[1], dev[2], dev[3]);
    ASSERT_TRUE(y.requires_grad());
    auto g = torch::autograd::grad({y}, dev, {gy.to(Gpu(), dt)});
    const double tol = dt == torch::kFloat32 ? 1e-4 : 3e-2;
    EXPECT_LE(MaxAbsDiff(y, y_ref), tol * y_ref.abs().max().item<double>()) << c10::toString(dt);
    for (int i = 0; i < 4; ++i) {
      const double scale = g_ref[i].abs().max().item<double>();
      const double d = MaxAbsDiff(g[i], g_ref[i]);
      std::printf("%s grad %-8s max diff %.2e (max |ref| %.2e)\n", c10::toString(dt), names[i], d,
                  scale);
      EXPECT_LE(d, tol * scale) << c10::toString(dt) << " d" << names[i];
    }
    EXPECT_EQ(g[2].narrow(0, 5, 4).abs().sum().item<double>(), 0.0) << "idle experts";
  }
}

// While alive, any synchronising CUDA call that goes through c10 (.item(), .cpu(), a blocking
// copy, a stream or device synchronise) throws.
class ForbidHostSync {
 public:
  ForbidHostSync() : saved_(c10::cuda::warning_state().get_sync_debug_mode()) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  }
  ~ForbidHostSync() { c10::cuda::warning_state().set_sync_debug_mode(saved_); }

 private:
  c10::cuda::SyncDebugMode saved_;
};

// The learner's layer in bf16 on a Hopper GPU: the forward on the kernels and the backward on
// LibTorch's CUTLASS grouped GEMM, with every count and offset on the device, run with host syncs
// forbidden; the gradients against the CPU fp32 reference within bf16's tolerance (as above).
TEST(MoeKernels, TrainingLayerHasNoHostSyncOnHopper) {
  REQUIRE_GPU();
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  if (prop->major != 9 && prop->major != 10) {
    GTEST_SKIP() << "sm_" << prop->major << prop->minor
                 << ": LibTorch's grouped GEMM kernel is sm90/sm100 (its fallback elsewhere reads "
                    "the offsets on the host)";
  }
  const int64_t E = 64;
  const GradCase c = MakeGradCase(21, 1024, 256, 128, E, 8, torch::arange(E).ne(7));  // 7 idle
  const auto &ids = c.ids, &gy = c.gy, &y_ref = c.y_ref;
  const auto& g_ref = c.g_ref;
  std::vector<torch::Tensor> dev = c.Leaves(Gpu(), torch::kBFloat16);
  auto ids_dev = ids.to(Gpu());
  auto gy_dev = gy.to(Gpu(), torch::kBFloat16);
  auto step = [&] {
    auto y = lm::MoeExperts(dev[0], ids_dev, dev[1], dev[2], dev[3]);
    auto g = torch::autograd::grad({y}, dev, {gy_dev});
    g.insert(g.begin(), y);
    return g;
  };
  step();  // library handles and workspaces are created on first use
  torch::cuda::synchronize();
  std::vector<torch::Tensor> g;
  {
    ForbidHostSync forbid;
    EXPECT_NO_THROW(g = step());
  }
  ASSERT_EQ(g.size(), 5u);
  const char* names[] = {"y", "x", "weights", "gate_up", "down"};
  for (int i = 0; i < 5; ++i) {
    const auto& ref = i == 0 ? y_ref : g_ref[i - 1];
    const double scale = ref.abs().max().item<double>(), d = MaxAbsDiff(g[i], ref);
    std::printf("bf16 grouped %-8s max diff %.2e (max |ref| %.2e), calc_diff %.2e\n", names[i], d,
                scale, CalcDiff(g[i].cpu(), ref));
    EXPECT_LE(d, 3e-2 * scale) << names[i];
  }
  EXPECT_EQ(g[3].select(0, 7).abs().sum().item<double>(), 0.0) << "idle expert";
  EXPECT_EQ(g[4].select(0, 7).abs().sum().item<double>(), 0.0) << "idle expert";
}

// Expert-parallel serving on a device: each rank's partial is fixed-shape (no nonzero, no host
// sync) and in fp32. Two shards in one process, the all-reduce played by adding one partial into
// the other, against the whole layer on the kernels (bf16: within 3e-2 of the largest output).
TEST(MoeKernels, ExpertParallelPartialsHaveNoHostSync) {
  REQUIRE_GPU();
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  if (prop->major != 9 && prop->major != 10)
    GTEST_SKIP() << "the grouped GEMM kernel is sm90/sm100";
  torch::manual_seed(22);
  const int64_t T = 64, H = 256, I = 128, E = 16, k = 4;
  auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(Gpu());
  lm::ExpertsImpl all(E, H, I);
  all.to(Gpu(), torch::kBFloat16);
  for (auto& p : all.parameters()) p.data().normal_(0, 0.1);
  auto shard = [&](int64_t first) {
    auto e = std::make_shared<lm::ExpertsImpl>(E / 2, H, I);
    e->to(Gpu(), torch::kBFloat16);
    e->gate_up_proj.data().copy_(all.gate_up_proj.narrow(0, first, E / 2));
    e->down_proj.data().copy_(all.down_proj.narrow(0, first, E / 2));
    return e;
  };
  auto lo = shard(0), hi = shard(E / 2);
  auto x = torch::randn({T, H}, bf16);
  lm::Routing r;
  r.ids = RandomIds(T, E, k).to(Gpu());
  r.weights = torch::softmax(torch::randn({T, k}), -1).to(bf16);
  torch::NoGradGuard no_grad;
  torch::Tensor hi_part, got;
  torch::Dtype seen = torch::kFloat64;
  lm::ExpertParallel ep_hi{{E / 2, E / 2}, [&](torch::Tensor& y) {
                             seen = y.scalar_type();
                             hi_part = y.clone();
                             return absl::OkStatus();
                           }};
  lm::ExpertParallel ep_lo{{0, E / 2}, [&](torch::Tensor& y) {
                             y.add_(hi_part);
                             return absl::OkStatus();
                           }};
  lm::ExpertParallelExperts(ep_hi, x, r, *hi);  // first use: library handles
  {
    ForbidHostSync forbid;
    EXPECT_NO_THROW({
      lm::ExpertParallelExperts(ep_hi, x, r, *hi);
      got = lm::ExpertParallelExperts(ep_lo, x, r, *lo);
    });
  }
  EXPECT_EQ(seen, torch::kFloat32);
  auto want = lm::MoeExperts(x, r.ids, r.weights, all.gate_up_proj, all.down_proj);
  const double scale = want.abs().max().item<double>();
  std::printf("EP two shards vs one layer: max diff %.2e (max %.2e)\n", MaxAbsDiff(got, want),
              scale);
  EXPECT_LE(MaxAbsDiff(got, want), 3e-2 * scale);
}

// ---------------------------------------------------------------------------------------------
// A student model on GPU (kernels) against the same model on CPU (library path).
// ---------------------------------------------------------------------------------------------

// A tiny Marco-style student (64 experts, top-8) with random weights, and a packed batch.
struct Student {
  std::shared_ptr<lm::CausalLM> model;
  lm::PackedBatch batch;
};

Student MakeStudent() {
  auto config = lm::ParseModelConfig(nlohmann::json::parse(R"({
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 64,
    "norm_topk_prob": true, "tie_word_embeddings": false, "rms_norm_eps": 1e-6})"));
  EXPECT_TRUE(config.ok()) << config.status();
  auto created = lm::CreateModel(*config);
  EXPECT_TRUE(created.ok()) << created.status();
  Student s;
  s.model = *created;
  s.model->InitWeights(0.05, 11);
  torch::manual_seed(9);
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t len : {17, 40, 5}) {
    auto t = torch::randint(0, 512, {len}, torch::kInt64);
    seqs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + len);
  }
  s.batch = lm::PackedBatch::FromSequences(seqs);
  return s;
}

// The GPU test's student runs on the CPU (so that its set-up is checked everywhere).
TEST(MoeKernelsBuild, StudentModelRunsOnCpu) {
  Student s = MakeStudent();
  auto logits = s.model->Logits(s.model->Forward(s.batch));
  EXPECT_EQ(logits.size(0), 62);
  EXPECT_EQ(logits.size(1), 512);
  auto grads = torch::autograd::grad({logits.square().sum()}, s.model->parameters());
  EXPECT_EQ(grads.size(), s.model->parameters().size());
}

TEST(MoeKernels, StudentModelForwardAndGradientsGpuEqualCpu) {
  REQUIRE_GPU();
  Student s = MakeStudent();
  auto& model = s.model;
  auto& batch = s.batch;

  auto cpu_logits = model->Logits(model->Forward(batch));
  auto target = torch::randn(cpu_logits.sizes());
  auto cpu_loss = (cpu_logits * target).sum();
  auto cpu_grads = torch::autograd::grad({cpu_loss}, model->parameters());

  model->to(Gpu());
  lm::PackedBatch gpu_batch = batch;
  gpu_batch.input_ids = batch.input_ids.to(Gpu());
  gpu_batch.position_ids = batch.position_ids.to(Gpu());
  {
    torch::NoGradGuard no_grad;  // the rollout's path: fused router + kernels
    auto logits = model->Logits(model->Forward(gpu_batch));
    const double d = MaxAbsDiff(logits, cpu_logits);
    std::printf("fp32 inference logits max diff %.2e\n", d);
    EXPECT_LE(d, 1e-3);
  }
  // The learner's path: library router (differentiable), kernels + library backward.
  auto logits = model->Logits(model->Forward(gpu_batch));
  auto loss = (logits * target.to(Gpu())).sum();
  auto grads = torch::autograd::grad({loss}, model->parameters());
  EXPECT_LE(MaxAbsDiff(logits, cpu_logits), 1e-3);
  auto names = model->named_parameters();
  for (size_t i = 0; i < grads.size(); ++i) {
    const double scale = cpu_grads[i].abs().max().item<double>();
    EXPECT_LE(MaxAbsDiff(grads[i], cpu_grads[i]), 1e-3 * scale + 1e-6) << names[i].key();
  }

  // bf16 on the GPU against fp32 on the CPU.
  model->to(torch::kBFloat16);
  torch::NoGradGuard no_grad;
  auto bf_logits = model->Logits(model->Forward(gpu_batch)).to(torch::kFloat32);
  const double rel = MaxAbsDiff(bf_logits, cpu_logits) / cpu_logits.abs().max().item<double>();
  std::printf("bf16 logits max diff / max |logit| = %.2e\n", rel);
  EXPECT_LE(rel, 5e-2);
}

}  // namespace
