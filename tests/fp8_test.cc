// Block-wise FP8 checkpoints (lm/model/fp8_format.h, lm/io/fp8_checkpoint.h, lm/model/fp8.h):
//   - quantization_config: parsing, its errors, and modules_to_not_convert matched as
//     transformers matches it;
//   - the e4m3 codec and the activation quantizer of the FP8 GEMM contract
//     (kernels/cpu/fp8_gemm.h) against c10's float8_e4m3fn and hand-computed values;
//   - the CPU twin of the block-scaled GEMM against dequantized math, dense and grouped (gathered
//     rows, padding, empty experts, a fused gate/up weight split at a ragged width), within
//     bounds derived below;
//   - the loader's named errors for malformed checkpoints;
//   - the tiny FP8 fixtures (tests/python/make_fp8_fixtures.py): dequantized on load, the weights
//     are exactly fp8 x scale_inv and our fp32 log-probs equal transformers' on the dequantized
//     weights to fp32 rounding (1e-4, tests/parity_test.cc's rule); kept in FP8 (the twin through
//     the whole model), within the FP8 rule below; an expert-parallel FP8 layer sums to the
//     whole layer;
//   - the memory plan's FP8 weight term;
//   - on a CUDA device with FP8 GEMMs (compute capability 8.9+): the kernels against the twin,
//     and the model in FP8 against the same checkpoint dequantized to bf16 (skip without a
//     device, fail under OPD_REQUIRE_GPU=1).
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
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <c10/util/Float8_e4m3fn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/cpu/fp8_gemm.h"
#include "lm/io/fp8_checkpoint.h"
#include "lm/io/hf_model_dir.h"
#include "lm/io/safetensors.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/fp8.h"
#include "lm/model/fp8_format.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/plan/plan.h"
#include "nlohmann/json.hpp"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"

namespace lm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_util::MaxAbsDiff;

constexpr double kU = 1.0 / (1 << 24);
const std::string kFixtures = OPD_FP8_FIXTURES_DIR;

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

void ExpectError(const absl::Status& st, absl::StatusCode code,
                 const std::vector<std::string>& words) {
  EXPECT_EQ(st.code(), code) << st;
  for (const auto& w : words) EXPECT_TRUE(Contains(std::string(st.message()), w)) << st;
}

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

json PublishedQuantization() {
  return {{"activation_scheme", "dynamic"},
          {"fmt", "e4m3"},
          {"quant_method", "fp8"},
          {"weight_block_size", {128, 128}}};
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

struct QuantWeight {
  torch::Tensor q;      // [N, K] float8_e4m3fn
  torch::Tensor scale;  // [ceil(N/128), ceil(K/128)] fp32
  torch::Tensor deq;    // [N, K] fp32: q x scale
};

// W [N, K] quantized by 128 x 128 blocks as the published converter does (amax / 448).
QuantWeight QuantizeWeight(const torch::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 127) / 128, KB = (K + 127) / 128;
  auto padded = torch::zeros({NB * 128, KB * 128});
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  auto amax = padded.view({NB, 128, KB, 128}).abs().amax({1, 3});
  auto scale = torch::where(amax.gt(0), amax / 448.0, torch::ones_like(amax));
  auto expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1);
  auto q = (padded / expanded).clamp(-448, 448).to(torch::kFloat8_e4m3fn);
  QuantWeight out;
  out.q = q.narrow(0, 0, N).narrow(1, 0, K).contiguous();
  out.scale = scale.contiguous();
  out.deq = out.q.to(torch::kFloat32) * expanded.narrow(0, 0, N).narrow(1, 0, K);
  return out;
}

// A fused gate/up weight: the two halves quantized on their own, their block grids stacked.
QuantWeight QuantizeFused(const torch::Tensor& gate, const torch::Tensor& up) {
  QuantWeight g = QuantizeWeight(gate), u = QuantizeWeight(up);
  return {torch::cat({g.q, u.q}), torch::cat({g.scale, u.scale}), torch::cat({g.deq, u.deq})};
}

struct Quantized {
  torch::Tensor q, s, deq;  // [M, K] e4m3, [M, KB], q x s in fp32
};

Quantized QuantizeActivations(const Fp8Kernels& k, const torch::Tensor& x) {
  Quantized a;
  k.quantize_rows(x, &a.q, &a.s);
  const int64_t K = x.size(1);
  a.deq = a.q.to(torch::kFloat32) * a.s.repeat_interleave(128, 1).narrow(1, 0, K);
  return a;
}

// Elementwise |got - want| <= bound, reporting the worst ratio.
void ExpectWithin(const torch::Tensor& got, const torch::Tensor& want, const torch::Tensor& bound,
                  const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto err = (got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs();
  auto ratio = err / (bound.to(torch::kFloat64) + 1e-300);
  EXPECT_LE(ratio.max().item<double>(), 1.0) << what << ": worst |error| / bound";
}

const Fp8Kernels& CpuKernels() {
  const Fp8Kernels* k = Fp8KernelsFor(torch::kCPU);
  EXPECT_NE(k, nullptr) << "the CPU twin is not registered";
  return *k;
}

// (K + KB + 132) u S: the twin against an fp32 GEMM of the dequantized operands (header).
torch::Tensor TwinBound(const torch::Tensor& qs, const torch::Tensor& wdeq) {
  const int64_t K = qs.size(1), KB = (K + 127) / 128;
  auto S = torch::mm(qs.abs().to(torch::kFloat64), wdeq.abs().to(torch::kFloat64).t());
  return S * (static_cast<double>(K + KB + 132) * kU * 1.01) + 1e-30;
}

// The activation term of the bound against unquantized x (header).
torch::Tensor ActivationBound(const torch::Tensor& x, const Quantized& a,
                              const torch::Tensor& wdeq) {
  const int64_t K = x.size(1);
  auto sg = a.s.repeat_interleave(128, 1).narrow(1, 0, K).to(torch::kFloat64);
  auto dx = (std::ldexp(1.0, -4) + std::ldexp(1.0, -22)) * x.abs().to(torch::kFloat64) +
            std::ldexp(1.0, -10) * sg;
  return torch::mm(dx, wdeq.abs().to(torch::kFloat64).t());
}

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

// Rows gathered from the tokens (a -1 row is padding), three experts of which one gets no rows,
// rows past the last group, and a fused gate/up weight of width I = 136 (ragged halves).
TEST(Fp8Gemm, GroupedTwinAgainstDequantizedMath) {
  const Fp8Kernels& k = CpuKernels();
  torch::manual_seed(3);
  const int64_t T = 5, H = 160, I = 136, E = 3, R = 10;
  auto x = torch::randn({T, H}) * 2.0;
  std::vector<QuantWeight> experts;
  for (int64_t e = 0; e < E; ++e)
    experts.push_back(QuantizeFused(torch::randn({I, H}) * 0.05, torch::randn({I, H}) * 0.05));
  std::vector<torch::Tensor> qs, ss;
  for (const auto& e : experts) qs.push_back(e.q), ss.push_back(e.scale);
  auto w = torch::stack(qs), ws = torch::stack(ss);
  ASSERT_EQ(ws.size(1), 4);  // 2 ceil(136 / 128)
  auto row_index = torch::tensor({0, 2, -1, 1, 4, 4, 3, -1, 0, 2}, torch::kInt64);
  auto group_ends = torch::tensor({3, 3, 8}, torch::kInt32);
  const std::vector<int64_t> expert_of_row = {0, 0, 0, 2, 2, 2, 2, 2, -1, -1};
  Quantized a = QuantizeActivations(k, x);
  auto got = k.block_gemm(a.q, a.s, row_index, R, w, ws, group_ends, I, torch::kFloat32);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{R, 2 * I}));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t src = row_index[r].item<int64_t>(), e = expert_of_row[r];
    if (src < 0 || e < 0) {
      EXPECT_TRUE(torch::equal(got[r], torch::zeros({2 * I}))) << "row " << r << " is padding";
      continue;
    }
    auto qs_row = a.deq[src].unsqueeze(0);
    ExpectWithin(got[r].unsqueeze(0), torch::mm(qs_row, experts[e].deq.t()),
                 TwinBound(qs_row, experts[e].deq), "row " + std::to_string(r));
  }
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

}  // namespace
}  // namespace lm
