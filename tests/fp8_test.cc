// The block-wise FP8 format and the FP8 GEMM contract (lm/model/fp8_format.h,
// kernels/cpu/fp8_gemm.h, kernels/cuda/fp8_gemm.cuh):
//   - quantization_config: parsing, its errors, and modules_to_not_convert matched as
//     transformers matches it;
//   - the e4m3 codec and the activation quantizer against c10's float8_e4m3fn and hand-computed
//     values;
//   - the CPU twin of the block-scaled GEMM against dequantized math, dense and grouped (gathered
//     rows, padding, empty experts, a fused gate/up weight split at a ragged width), within
//     bounds derived below;
//   - on a CUDA device with FP8 GEMMs (compute capability 8.9+): the kernels against the twin
//     (skip without a device, fail under OPD_REQUIRE_GPU=1).
// Loading, the fixtures and the plan: tests/fp8_model_test.cc (the same binary).
//
// Bounds (u = 2^-24, fp32's unit roundoff; S = sum_k |q_k s_g| |W_k| for one output element,
// with W the dequantized weight):
//   twin vs an fp32 GEMM of the dequantized operands (q s) W^T: the twin's block sums round at
//     most 127 times, its two scale products and its sum over the KB blocks KB + 1 times more;
//     the fp32 GEMM's operands are each rounded once and its K-term sum K - 1 times. So
//     |twin - ref| <= (K + KB + 132) u S (x 1.01 for the second-order terms);
//   twin vs the unquantized x W^T: the above plus the activation rounding: x / s is rounded once
//     in fp32, then to e4m3 (3 mantissa bits: half a unit is 2^-4 relative, or 2^-10 absolute
//     among the subnormals), so |x_k - q_k s_g| <= (2^-4 + 2^-22) |x_k| + 2^-10 s_g.
#include <c10/util/Float8_e4m3fn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/cpu/fp8_gemm.h"
#include "lm/model/config.h"
#include "lm/model/fp8.h"
#include "lm/model/fp8_format.h"
#include "nlohmann/json.hpp"
#include "tests/fp8_testing.h"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"

namespace lm {
namespace {

using namespace fp8_testing;  // NOLINT: the shared helpers of the FP8 tests
using nlohmann::json;
using testing_util::MaxAbsDiff;

// ---------------------------------------------------------------------------------------------
// quantization_config

json Qwen3Config(json quantization) {
  json j = {{"model_type", "qwen3_moe"},
            {"vocab_size", 32},
            {"hidden_size", 16},
            {"num_hidden_layers", 1},
            {"num_attention_heads", 2},
            {"num_key_value_heads", 1},
            {"head_dim", 8},
            {"num_experts", 2},
            {"num_experts_per_tok", 1},
            {"moe_intermediate_size", 8}};
  if (!quantization.is_null()) j["quantization_config"] = std::move(quantization);
  return j;
}

TEST(Fp8Config, ParsesThePublishedFormat) {
  auto c = ParseModelConfig(Qwen3Config(PublishedQuantization()));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->fp8.has_value());
  EXPECT_EQ(c->fp8->block_rows, 128);
  EXPECT_EQ(c->fp8->block_cols, 128);
  EXPECT_EQ(c->fp8->ScaleRows(136), 2);
  EXPECT_EQ(c->fp8->ScaleCols(128), 1);
  EXPECT_TRUE(c->fp8->Converts("model.layers.0.mlp.gate"));  // nothing listed: all converted

  auto plain = ParseModelConfig(Qwen3Config(nullptr));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->fp8.has_value());

  json q = PublishedQuantization();
  q.erase("weight_block_size");
  q.erase("fmt");
  q["weight_block_size"] = {64, 32};
  auto other = ParseModelConfig(Qwen3Config(q));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->fp8->block_rows, 64);
  EXPECT_EQ(other->fp8->block_cols, 32);
}

TEST(Fp8Config, ErrorsNameTheField) {
  struct Case {
    std::string key;
    json value;
    absl::StatusCode code;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"fmt", "e3m4", absl::StatusCode::kInvalidArgument, {"quantization_config.fmt", "e3m4"}},
      {"fmt", "e5m2", absl::StatusCode::kUnimplemented, {"fmt 'e5m2'", "only e4m3"}},
      {"fmt", 4, absl::StatusCode::kInvalidArgument, {"quantization_config.fmt"}},
      {"quant_method", "awq", absl::StatusCode::kUnimplemented, {"quant_method 'awq'"}},
      {"activation_scheme", "static", absl::StatusCode::kUnimplemented, {"'static'"}},
      {"activation_scheme", "per_tensor", absl::StatusCode::kInvalidArgument, {"per_tensor"}},
      {"scale_fmt", "ue8m0", absl::StatusCode::kUnimplemented, {"scale_fmt 'ue8m0'"}},
      {"weight_block_size", {128}, absl::StatusCode::kInvalidArgument, {"weight_block_size"}},
      {"weight_block_size", {128, 0}, absl::StatusCode::kInvalidArgument, {"weight_block_size"}},
      {"weight_block_size", {128, -4}, absl::StatusCode::kInvalidArgument, {"weight_block_size"}},
      {"modules_to_not_convert",
       "lm_head",
       absl::StatusCode::kInvalidArgument,
       {"modules_to_not_convert", "list"}},
      {"modules_to_not_convert",
       {"lm_head", 3},
       absl::StatusCode::kInvalidArgument,
       {"modules_to_not_convert[1]"}},
      {"modules_to_not_convert",
       {"layers.(0"},
       absl::StatusCode::kInvalidArgument,
       {"modules_to_not_convert[0]", "layers.(0", "regular expression"}},
  };
  for (const Case& c : cases) {
    json q = PublishedQuantization();
    q[c.key] = c.value;
    ExpectError(ParseModelConfig(Qwen3Config(q)).status(), c.code, c.words);
  }
  ExpectError(ParseModelConfig(Qwen3Config(json::array())).status(),
              absl::StatusCode::kInvalidArgument, {"quantization_config"});
}

// transformers' should_convert_module: from the start to a module boundary (as a regular
// expression), or as a suffix of the name.
TEST(Fp8Config, ModulesToNotConvertMatchAsTransformersDoes) {
  json q = PublishedQuantization();
  q["modules_to_not_convert"] = {"lm_head", "model.layers.1", "mlp.gate",
                                 "model.layers.*.self_attn.v_proj"};
  auto c = ParseModelConfig(Qwen3Config(q));
  ASSERT_TRUE(c.ok()) << c.status();
  const Fp8Format& f = *c->fp8;
  EXPECT_FALSE(f.Converts("lm_head"));
  EXPECT_FALSE(f.Converts("model.layers.1.mlp.experts.0.up_proj"));  // prefix at a boundary
  EXPECT_TRUE(f.Converts("model.layers.11.mlp.experts.0.up_proj"));  // not "layers.1" + "1"
  EXPECT_FALSE(f.Converts("model.layers.3.mlp.gate"));               // suffix
  EXPECT_TRUE(f.Converts("model.layers.3.mlp.gate_proj"));
  EXPECT_FALSE(f.Converts("model.layers.7.self_attn.v_proj"));  // regular expression
  EXPECT_TRUE(f.Converts("model.layers.7.self_attn.q_proj"));
}

// ---------------------------------------------------------------------------------------------
// The e4m3 codec and the activation quantizer

TEST(Fp8Codec, DecodesEveryByteAsC10) {
  for (int b = 0; b < 256; ++b) {
    const float ours = cpu::Fp8E4m3ToFloat(static_cast<uint8_t>(b));
    const float c10v = static_cast<float>(
        c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    if (std::isnan(c10v)) {
      EXPECT_TRUE(std::isnan(ours)) << b;
    } else {
      EXPECT_EQ(ours, c10v) << b;
    }
  }
  EXPECT_EQ(cpu::Fp8E4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(cpu::Fp8E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
}

// Round to nearest even like c10's conversion wherever that is finite (c10 does not saturate:
// past 464, the midpoint above 448, it gives NaN; ours gives 448).
TEST(Fp8Codec, EncodesAsC10AndSaturates) {
  int64_t checked = 0;
  for (uint32_t bits = 0x32000000u; bits < 0x43E80000u; bits += 97) {  // 2^-27 .. 464
    float x;
    std::memcpy(&x, &bits, sizeof x);
    for (const float v : {x, -x}) {
      const uint8_t c10b = c10::Float8_e4m3fn(v).x;
      ASSERT_EQ(cpu::FloatToFp8E4m3(v), c10b) << v;
      ++checked;
    }
  }
  // Every value, and every midpoint between neighbours (ties go to the even mantissa).
  for (int b = 0; b < 0x7E; ++b) {
    const float lo = cpu::Fp8E4m3ToFloat(b), hi = cpu::Fp8E4m3ToFloat(b + 1);
    EXPECT_EQ(cpu::FloatToFp8E4m3(lo), b);
    const uint8_t even = (b % 2 == 0) ? b : b + 1;
    EXPECT_EQ(cpu::FloatToFp8E4m3(0.5f * (lo + hi)), even) << lo << " .. " << hi;
    EXPECT_EQ(cpu::FloatToFp8E4m3(-0.5f * (lo + hi)), 0x80 | even);
  }
  EXPECT_EQ(cpu::FloatToFp8E4m3(465.0f), 0x7E);
  EXPECT_EQ(cpu::FloatToFp8E4m3(1e30f), 0x7E);
  EXPECT_EQ(cpu::FloatToFp8E4m3(-INFINITY), 0xFE);
  EXPECT_EQ(cpu::FloatToFp8E4m3(NAN), 0x7F);
  EXPECT_GT(checked, 1000000);
}

std::vector<float> Dequantized(const std::vector<uint8_t>& q, const std::vector<float>& s,
                               int64_t K) {
  std::vector<float> out(q.size());
  const int64_t KB = (K + 127) / 128;
  for (size_t i = 0; i < q.size(); ++i)
    out[i] = cpu::Fp8E4m3ToFloat(q[i]) * s[(i / K) * KB + (i % K) / 128];
  return out;
}

TEST(Fp8Quantize, HandComputedRows) {
  // Row 0: amax 896 gives s = 2 exactly: 896 -> 448, 1 -> 0.5, -3.3 -> -1.65 -> -1.625.
  // Row 1: amax 448 gives s = 1: 1.0625 (between 1 and 1.125) -> 1 and 1.1875 -> 1.25 (ties to
  //        even), 3 x 2^-10 -> 2 x 2^-9 (a subnormal tie), 500 cannot appear (it is the amax).
  // Row 2: all zeros: s = 1e-10 / 448 and q = 0.
  // Row 3: 130 columns: the ragged second group has its own amax.
  const int64_t K = 130;
  std::vector<float> x(4 * K, 0.0f);
  x[0] = 896.0f, x[1] = 1.0f, x[2] = -3.3f;
  x[K + 0] = 448.0f, x[K + 1] = 1.0625f, x[K + 2] = 1.1875f, x[K + 3] = 3 * std::ldexp(1.0f, -10);
  for (int64_t k = 0; k < K; ++k) x[3 * K + k] = k < 128 ? 0.5f * k : 7.0f * (k - 127);  // 7, 14
  std::vector<uint8_t> q(4 * K);
  std::vector<float> s(4 * 2);
  cpu::Fp8QuantizeRows(x.data(), K, K, 0, 4, q.data(), s.data());
  EXPECT_EQ(s[0], 2.0f);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(cpu::Fp8E4m3ToFloat(q[1]), 0.5f);
  EXPECT_EQ(cpu::Fp8E4m3ToFloat(q[2]), -1.625f);
  EXPECT_EQ(s[2], 1.0f);
  EXPECT_EQ(cpu::Fp8E4m3ToFloat(q[K + 1]), 1.0f);
  EXPECT_EQ(cpu::Fp8E4m3ToFloat(q[K + 2]), 1.25f);
  EXPECT_EQ(cpu::Fp8E4m3ToFloat(q[K + 3]), std::ldexp(2.0f, -9));
  EXPECT_EQ(s[4], 1e-10f / 448.0f);
  for (int64_t k = 0; k < K; ++k) EXPECT_EQ(q[2 * K + k], 0);
  EXPECT_EQ(s[6], 63.5f / 448.0f);
  EXPECT_EQ(s[7], 14.0f / 448.0f);
  EXPECT_EQ(q[3 * K + 129], 0x7E);  // each group's amax maps to 448
}

TEST(Fp8Quantize, RandomRowsWithinTheRoundingBound) {
  torch::manual_seed(1);
  const int64_t M = 64, K = 300;
  // Magnitudes over 8 decades within a row, so that some groups reach e4m3's subnormals.
  auto x = torch::randn({M, K}) * torch::pow(10.0, torch::randint(-4, 4, {M, K}).to(torch::kFloat));
  std::vector<uint8_t> q(M * K);
  std::vector<float> s(M * 3);
  cpu::Fp8QuantizeRows(x.data_ptr<float>(), K, K, 0, M, q.data(), s.data());
  const std::vector<float> back = Dequantized(q, s, K);
  const float* px = x.data_ptr<float>();
  int64_t subnormal = 0;
  for (int64_t i = 0; i < M * K; ++i) {
    const double sg = s[(i / K) * 3 + (i % K) / 128];
    const double bound =
        (std::ldexp(1.0, -4) + std::ldexp(1.0, -22)) * std::fabs(px[i]) + std::ldexp(1.0, -10) * sg;
    ASSERT_LE(std::fabs(back[i] - px[i]), bound) << i << ": " << px[i];
    subnormal += (q[i] & 0x78) == 0 && q[i] != 0;
  }
  EXPECT_GT(subnormal, 0);  // the subnormal term of the bound was exercised
}

// ---------------------------------------------------------------------------------------------
// The block-scaled GEMM: the CPU twin against dequantized math

TEST(Fp8Gemm, DenseTwinAgainstDequantizedMath) {
  const Fp8Kernels& k = CpuKernels();
  torch::manual_seed(2);
  for (const auto& [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 1, 8}, {5, 200, 160}, {130, 256, 136}, {3, 129, 300}, {17, 64, 128}}) {
    const std::string shape =
        "M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K);
    auto x = torch::randn({M, K}) * 3.0;
    QuantWeight w = QuantizeWeight(torch::randn({N, K}) * 0.05);
    Quantized a = QuantizeActivations(k, x);
    auto got = k.block_gemm(a.q, a.s, {}, M, w.q.unsqueeze(0), w.scale.unsqueeze(0), {}, N,
                            torch::kFloat32);
    // Against the fp32 GEMM of the dequantized operands: only fp32 rounding apart.
    ExpectWithin(got, torch::mm(a.deq, w.deq.t()), TwinBound(a.deq, w.deq), shape);
    // Against the unquantized activations: the activation rounding on top.
    ExpectWithin(got, torch::mm(x, w.deq.t()),
                 ActivationBound(x, a, w.deq) + TwinBound(x.abs() + a.deq.abs(), w.deq),
                 shape + " (unquantized x)");
    // bf16 output: the fp32 result rounded once.
    auto bf16 = k.block_gemm(a.q, a.s, {}, M, w.q.unsqueeze(0), w.scale.unsqueeze(0), {}, N,
                             torch::kBFloat16);
    EXPECT_TRUE(torch::equal(bf16, got.to(torch::kBFloat16))) << shape;
  }
}

// A grouped GEMM's inputs: rows gathered from T tokens (some -1: padding), three experts of
// which the middle one gets no rows, groups starting at multiples of kFp8GroupRows, rows past the
// last group, and fused gate/up weights of width I = 136 (ragged halves, split at I).
struct GroupedCase {
  int64_t T = 40, H = 160, I = 136, E = 3, R = 140;
  std::vector<int64_t> expert_of_row;  // -1: past the last group
  torch::Tensor x, row_index, group_ends, w, ws;
  std::vector<QuantWeight> experts;
};

GroupedCase MakeGroupedCase(uint64_t seed) {
  GroupedCase c;
  torch::manual_seed(seed);
  c.x = torch::randn({c.T, c.H}) * 2.0;
  std::vector<torch::Tensor> qs, ss;
  for (int64_t e = 0; e < c.E; ++e) {
    c.experts.push_back(
        QuantizeFused(torch::randn({c.I, c.H}) * 0.05, torch::randn({c.I, c.H}) * 0.05));
    qs.push_back(c.experts.back().q);
    ss.push_back(c.experts.back().scale);
  }
  c.w = torch::stack(qs);
  c.ws = torch::stack(ss);
  c.row_index = torch::randint(-1, c.T, {c.R}, torch::kInt64);  // -1: padding rows
  c.group_ends = torch::tensor({64, 64, 128}, torch::kInt32);
  for (int64_t r = 0; r < c.R; ++r) c.expert_of_row.push_back(r < 64 ? 0 : r < 128 ? 2 : -1);
  return c;
}

// Every row of `got` against the dequantized math of its expert and token, within
// bound_factor x S (S = sum_k |q_k s| |W_k|); padding rows and rows past the groups exactly 0.
void ExpectGrouped(const GroupedCase& c, const Quantized& a, const torch::Tensor& got,
                   double bound_factor, const std::string& what) {
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{c.R, 2 * c.I}));
  int64_t computed = 0, padding = 0;
  for (int64_t r = 0; r < c.R; ++r) {
    const int64_t src = c.row_index[r].item<int64_t>(), e = c.expert_of_row[r];
    if (src < 0 || e < 0) {
      EXPECT_TRUE(torch::equal(got[r].cpu().to(torch::kFloat32), torch::zeros({2 * c.I})))
          << what << ": row " << r << " is padding";
      ++padding;
      continue;
    }
    auto qs_row = a.deq[src].unsqueeze(0);
    auto S =
        torch::mm(qs_row.abs().to(torch::kFloat64), c.experts[e].deq.abs().to(torch::kFloat64).t());
    ExpectWithin(got[r].unsqueeze(0).cpu(), torch::mm(qs_row, c.experts[e].deq.t()),
                 S * bound_factor + 1e-30, what + " row " + std::to_string(r));
    ++computed;
  }
  EXPECT_GT(computed, 80);
  EXPECT_GT(padding, 12);
}

TEST(Fp8Gemm, GroupedTwinAgainstDequantizedMath) {
  const Fp8Kernels& k = CpuKernels();
  const GroupedCase c = MakeGroupedCase(3);
  ASSERT_EQ(c.ws.size(1), 4);  // 2 ceil(136 / 128)
  Quantized a = QuantizeActivations(k, c.x);
  auto got =
      k.block_gemm(a.q, a.s, c.row_index, c.R, c.w, c.ws, c.group_ends, c.I, torch::kFloat32);
  const int64_t K = c.H, KB = (K + 127) / 128;
  ExpectGrouped(c, a, got, static_cast<double>(K + KB + 132) * kU * 1.01, "twin");
  // The contract the CUDA kernel's 64-row tiles need.
  EXPECT_THROW(k.block_gemm(a.q, a.s, c.row_index, c.R, c.w, c.ws,
                            torch::tensor({60, 64, 128}, torch::kInt32), c.I, torch::kFloat32),
               c10::Error);
}

// SwiGLU then the 1 x 128 rule: q s within the rounding bound of silu(gate) * up.
TEST(Fp8Gemm, SwiGluQuantizationWithinTheRoundingBound) {
  const Fp8Kernels& k = CpuKernels();
  torch::manual_seed(4);
  const int64_t M = 9, I = 200;
  auto gu = torch::randn({M, 2 * I}) * 4.0;
  torch::Tensor q, s;
  k.quantize_swiglu(gu, &q, &s);
  auto h = torch::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
  auto sg = s.repeat_interleave(128, 1).narrow(1, 0, I);
  auto back = q.to(torch::kFloat32) * sg;
  // h itself may differ from torch's by a few ulps (another exp): 2^-20 |h| more.
  auto bound = (std::ldexp(1.0, -4) + std::ldexp(1.0, -20)) * h.abs() + std::ldexp(1.0, -10) * sg;
  ExpectWithin(back, h, bound, "silu(gate) * up");
  // The first group's scale is its amax / 448 (h's amax, up to the few ulps above).
  auto amax = std::get<0>(h.narrow(1, 0, 128).abs().max(1));
  EXPECT_LE((s.select(1, 0) * 448.0 - amax).abs().max().item<double>(),
            std::ldexp(1.0, -19) * amax.max().item<double>());
}

TEST(Fp8Cuda, QuantizeRowsBitwiseAsTheTwin) {
  GPU_FP8_KERNELS_OR_SKIP(gpu);
  const Fp8Kernels& cpu = CpuKernels();
  torch::manual_seed(11);
  for (const int64_t K : {8, 130, 300, 2048}) {
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      auto x = (torch::randn({37, K}) *
                torch::pow(10.0, torch::randint(-3, 3, {37, K}).to(torch::kFloat)))
                   .to(dtype);
      torch::Tensor qc, sc, qg, sg;
      cpu.quantize_rows(x, &qc, &sc);
      gpu.quantize_rows(x.to(Gpu()), &qg, &sg);
      EXPECT_TRUE(torch::equal(qg.cpu().view(torch::kUInt8), qc.view(torch::kUInt8)))
          << "K " << K << " " << dtype;
      EXPECT_TRUE(torch::equal(sg.cpu(), sc)) << "K " << K << " " << dtype;
    }
  }
}

// The SwiGLU's exp is the device's (a few ulps from the CPU's): q s within the rounding bound of
// the twin's h, and the same bytes almost everywhere.
TEST(Fp8Cuda, SwiGluQuantizationAsTheTwin) {
  GPU_FP8_KERNELS_OR_SKIP(gpu);
  const Fp8Kernels& cpu = CpuKernels();
  torch::manual_seed(12);
  const int64_t M = 50, I = 200;
  auto gu = (torch::randn({M, 2 * I}) * 4.0).to(torch::kBFloat16);
  torch::Tensor qc, sc, qg, sg;
  cpu.quantize_swiglu(gu, &qc, &sc);
  gpu.quantize_swiglu(gu.to(Gpu()), &qg, &sg);
  auto h = (torch::silu(gu.narrow(1, 0, I).to(torch::kFloat32)) *
            gu.narrow(1, I, I).to(torch::kFloat32));
  auto back = qg.cpu().to(torch::kFloat32) * sg.cpu().repeat_interleave(128, 1).narrow(1, 0, I);
  auto bound = (std::ldexp(1.0, -4) + std::ldexp(1.0, -20)) * h.abs() +
               std::ldexp(1.0, -10) * sg.cpu().repeat_interleave(128, 1).narrow(1, 0, I);
  ExpectWithin(back, h, bound, "GPU silu(gate) * up");
  const double same = qg.cpu()
                          .view(torch::kUInt8)
                          .eq(qc.view(torch::kUInt8))
                          .to(torch::kFloat64)
                          .mean()
                          .item<double>();
  EXPECT_GE(same, 0.99);
}

TEST(Fp8Cuda, DenseGemmAgainstTheTwin) {
  GPU_FP8_KERNELS_OR_SKIP(gpu);
  const Fp8Kernels& cpu = CpuKernels();
  torch::manual_seed(13);
  // Ragged tiles in every direction, K not a multiple of 16 (the byte-load path), and a layer of
  // Qwen3-30B-A3B's width.
  for (const auto& [M, N, K] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 8},
                                                          {5, 200, 160},
                                                          {130, 256, 136},
                                                          {3, 129, 300},
                                                          {70, 72, 2056},
                                                          {257, 768, 2048}}) {
    const std::string shape =
        "M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K);
    auto x = torch::randn({M, K}) * 3.0;
    QuantWeight w = QuantizeWeight(torch::randn({N, K}) * 0.05);
    Quantized a = QuantizeActivations(cpu, x);
    auto want = cpu.block_gemm(a.q, a.s, {}, M, w.q.unsqueeze(0), w.scale.unsqueeze(0), {}, N,
                               torch::kFloat32);
    auto S = torch::mm(a.deq.abs().to(torch::kFloat64), w.deq.abs().to(torch::kFloat64).t());
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      auto got = gpu.block_gemm(a.q.to(Gpu()), a.s.to(Gpu()), {}, M, w.q.unsqueeze(0).to(Gpu()),
                                w.scale.unsqueeze(0).to(Gpu()), {}, N, dtype);
      ASSERT_EQ(got.scalar_type(), dtype);
      // bf16 output: one more rounding, half a unit of 2^-8 of the result.
      auto bound = S * GpuGemmFactor(K) +
                   (dtype == torch::kBFloat16 ? want.abs().to(torch::kFloat64) * std::ldexp(1.0, -8)
                                              : torch::zeros_like(S));
      ExpectWithin(got.cpu().to(torch::kFloat32), want, bound + 1e-30,
                   shape + " " + c10::toString(dtype));
    }
  }
}

TEST(Fp8Cuda, GroupedGemmAgainstDequantizedMath) {
  GPU_FP8_KERNELS_OR_SKIP(gpu);
  const GroupedCase c = MakeGroupedCase(14);
  Quantized a = QuantizeActivations(CpuKernels(), c.x);
  auto got = gpu.block_gemm(a.q.to(Gpu()), a.s.to(Gpu()), c.row_index.to(Gpu()), c.R, c.w.to(Gpu()),
                            c.ws.to(Gpu()), c.group_ends.to(Gpu()), c.I, torch::kFloat32);
  ExpectGrouped(c, a, got.cpu(), GpuGemmFactor(c.H), "GPU");
}

}  // namespace
}  // namespace lm
