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

#include "ctl/model_config_file.h"
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

// W [N, K] quantized by br x bc blocks as the published converter does (amax / 448).
QuantWeight QuantizeWeight(const torch::Tensor& w, int64_t br = 128, int64_t bc = 128) {
  const int64_t N = w.size(0), K = w.size(1), NB = (N + br - 1) / br, KB = (K + bc - 1) / bc;
  auto padded = torch::zeros({NB * br, KB * bc});
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  auto amax = padded.view({NB, br, KB, bc}).abs().amax({1, 3});
  auto scale = torch::where(amax.gt(0), amax / 448.0, torch::ones_like(amax));
  auto expanded = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1);
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

// ---------------------------------------------------------------------------------------------
// Loading: tiny checkpoints made here (any block size, any fault), and the fixtures

// A checkpoint tensor held in memory.
struct OwnedTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
using Tensors = std::map<std::string, OwnedTensor>;

OwnedTensor Own(const torch::Tensor& t, DType dtype) {
  auto c = t.contiguous();
  return {dtype, c.sizes().vec(), std::string(static_cast<const char*>(c.data_ptr()), c.nbytes())};
}

torch::Tensor AsTensor(const OwnedTensor& t, torch::Dtype dtype) {
  return torch::from_blob(const_cast<char*>(t.bytes.data()), t.shape,
                          torch::TensorOptions().dtype(dtype))
      .clone();
}

struct CheckpointDir {
  json config;
  Tensors tensors;
  std::map<std::string, torch::Tensor> dequantized;  // FP8 tensor -> q x scale (fp32)
};

// A tiny random Qwen3-MoE (ragged against 128: hidden 40, widths 24 and 48) as an FP8
// checkpoint: every "*_proj.weight" whose module the config converts in FP8 by br x bc blocks,
// the rest F32, per-expert names as published.
CheckpointDir TinyFp8Checkpoint(int64_t br, int64_t bc, json not_convert = json::array()) {
  CheckpointDir d;
  d.config = {{"model_type", "qwen3_moe"},
              {"vocab_size", 64},
              {"hidden_size", 40},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"head_dim", 16},
              {"num_experts", 4},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 24},
              {"intermediate_size", 48},
              {"mlp_only_layers", {1}},
              {"norm_topk_prob", true},
              {"tie_word_embeddings", false}};
  auto config = ParseModelConfig(d.config);
  EXPECT_TRUE(config.ok()) << config.status();
  auto model = CreateModel(*config);
  EXPECT_TRUE(model.ok()) << model.status();
  (*model)->InitWeights(0.2, 7);
  const fs::path tmp = testing_util::TempDir("fp8_src");
  EXPECT_TRUE(SaveModel(**model, tmp.string()).ok());
  auto files = OpenCheckpointFiles(tmp.string());
  EXPECT_TRUE(files.ok()) << files.status();
  d.config["quantization_config"] = PublishedQuantization();
  d.config["quantization_config"]["weight_block_size"] = {br, bc};
  d.config["quantization_config"]["modules_to_not_convert"] = not_convert;
  auto format = ParseFp8QuantizationConfig(d.config);
  EXPECT_TRUE(format.ok() && format->has_value()) << format.status();
  for (const auto& [name, view] : (*files)[0]->tensors()) {
    torch::Tensor t = TensorFromView(view, (*files)[0]).clone();
    const std::string suffix = "_proj.weight";
    const bool proj = name.size() > suffix.size() &&
                      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (!proj || !(*format)->Converts(name.substr(0, name.size() - 7))) {
      d.tensors[name] = Own(t, DType::kF32);
      continue;
    }
    QuantWeight q = QuantizeWeight(t, br, bc);
    d.tensors[name] = Own(q.q, DType::kF8E4M3);
    d.tensors[name + "_scale_inv"] = Own(q.scale, DType::kF32);
    d.dequantized[name] = q.deq;
  }
  fs::remove_all(tmp);
  return d;
}

fs::path Write(const CheckpointDir& d, const std::string& tag) {
  const fs::path dir = testing_util::TempDir(tag);
  std::ofstream(dir / "config.json") << d.config.dump(2);
  std::vector<TensorToWrite> out;
  for (const auto& [name, t] : d.tensors)
    out.push_back({name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()});
  EXPECT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), out).ok());
  return dir;
}

LoadOptions Options(Fp8Weights fp8, torch::Dtype dtype = torch::kFloat32) {
  LoadOptions o;
  o.dtype = dtype;
  o.fp8 = fp8;
  return o;
}

// The parameter value a checkpoint tensor fills: a whole parameter, or an expert's rows.
torch::Tensor Filled(CausalLM& model, const std::string& name) {
  const std::string experts = ".mlp.experts.";
  const size_t at = name.find(experts);
  if (at == std::string::npos) return model.named_parameters()[name];
  const std::string base = name.substr(0, at + experts.size() - 1);  // "...mlp.experts"
  const std::string rest = name.substr(at + experts.size());         // "E.gate_proj.weight"
  const int64_t e = std::stoll(rest.substr(0, rest.find('.')));
  if (rest.find("down_proj") != std::string::npos)
    return model.named_parameters()[base + ".down_proj"][e];
  auto gu = model.named_parameters()[base + ".gate_up_proj"][e];
  const int64_t I = gu.size(0) / 2;
  return gu.narrow(0, rest.find("gate_proj") != std::string::npos ? 0 : I, I);
}

// Dequantized on load, with blocks of any size (16 x 24 here: several, ragged, per weight):
// every weight is exactly fp8 x scale_inv of its block, in fp32, and bf16 is that rounded once.
TEST(Fp8Load, DequantizedWeightsAreFp8TimesTheirBlockScale) {
  CheckpointDir d = TinyFp8Checkpoint(16, 24);
  const fs::path dir = Write(d, "fp8_any_block");
  auto m = LoadModel(dir.string(), Options(Fp8Weights::kAuto));
  ASSERT_TRUE(m.ok()) << m.status();
  auto bf16 = LoadModel(dir.string(), Options(Fp8Weights::kAuto, torch::kBFloat16));
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_GE(d.dequantized.size(), 20u);
  for (const auto& [name, deq] : d.dequantized) {
    EXPECT_TRUE(torch::equal(Filled(**m, name), deq)) << name;
    EXPECT_TRUE(torch::equal(Filled(**bf16, name), deq.to(torch::kBFloat16))) << name;
  }
  for (const auto& p : (*m)->named_parameters())
    EXPECT_EQ(p.value().scalar_type(), torch::kFloat32) << p.key();
  // Kept in FP8 needs the GEMMs' 128 x 128 blocks.
  ExpectError(LoadModel(dir.string(), Options(Fp8Weights::kKeep)).status(),
              absl::StatusCode::kUnimplemented, {"weight_block_size [16, 24]", "128 x 128"});
  fs::remove_all(dir);
}

// Each malformed checkpoint is refused before anything is allocated, naming what is wrong.
TEST(Fp8Load, MalformedCheckpointsAreNamedErrors) {
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  const std::string qs = q + "_scale_inv";
  struct Case {
    std::string what;
    std::function<void(CheckpointDir&)> mutate;
    absl::StatusCode code;
    std::vector<std::string> words;
  };
  auto set_scale = [&](float v) {
    return [&, v](CheckpointDir& d) {
      auto s = AsTensor(d.tensors[qs], torch::kFloat32);
      s.view({-1})[0] = v;
      d.tensors[qs] = Own(s, DType::kF32);
    };
  };
  const std::vector<Case> cases = {
      {"missing scale",
       [&](CheckpointDir& d) { d.tensors.erase(qs); },
       absl::StatusCode::kNotFound,
       {q, qs, "block scales"}},
      {"scale of the wrong shape",
       [&](CheckpointDir& d) {
         d.tensors[qs] = Own(torch::ones({1, 2}), DType::kF32);
       },
       absl::StatusCode::kInvalidArgument,
       {qs, "[1, 2]", "expected [1, 1]", "128 x 128"}},
      {"scale of the wrong dtype",
       [&](CheckpointDir& d) {
         d.tensors[qs] = Own(torch::ones({1, 1}).to(torch::kFloat8_e4m3fn), DType::kF8E4M3);
       },
       absl::StatusCode::kInvalidArgument,
       {qs, "F8_E4M3", "expected F32, BF16 or F16"}},
      {"NaN scale",
       set_scale(NAN),
       absl::StatusCode::kInvalidArgument,
       {qs, "NaN, infinite or negative"}},
      {"infinite scale",
       set_scale(INFINITY),
       absl::StatusCode::kInvalidArgument,
       {qs, "NaN, infinite or negative"}},
      {"negative scale",
       set_scale(-1.0f),
       absl::StatusCode::kInvalidArgument,
       {qs, "NaN, infinite or negative"}},
      {"unknown fmt",
       [&](CheckpointDir& d) { d.config["quantization_config"]["fmt"] = "e3m4"; },
       absl::StatusCode::kInvalidArgument,
       {"quantization_config.fmt", "e3m4"}},
      {"FP8 without quantization_config",
       [&](CheckpointDir& d) { d.config.erase("quantization_config"); },
       absl::StatusCode::kInvalidArgument,
       {"F8_E4M3", "no quantization_config"}},
      {"FP8 in a module left unquantized",
       [&](CheckpointDir& d) {
         d.config["quantization_config"]["modules_to_not_convert"] = {"self_attn.q_proj"};
       },
       absl::StatusCode::kInvalidArgument,
       {q, "modules_to_not_convert", "self_attn.q_proj"}},
      {"a scale without its FP8 weight",
       [&](CheckpointDir& d) {
         d.tensors["model.norm.weight_scale_inv"] = Own(torch::ones({1, 1}), DType::kF32);
       },
       absl::StatusCode::kInvalidArgument,
       {"model.norm.weight_scale_inv", "not an FP8"}},
      {"an FP8 byte that is NaN",
       [&](CheckpointDir& d) { d.tensors[q].bytes[5] = static_cast<char>(0x7F); },
       absl::StatusCode::kInvalidArgument,
       {q, "1 NaN"}},
      {"a 3-D FP8 tensor",
       [&](CheckpointDir& d) {
         d.tensors[q].shape = {1, d.tensors[q].shape[0], d.tensors[q].shape[1]};
       },
       absl::StatusCode::kUnimplemented,
       {q, "only 2-D"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    CheckpointDir d = TinyFp8Checkpoint(128, 128);
    c.mutate(d);
    const fs::path dir = Write(d, "fp8_bad");
    ExpectError(LoadModel(dir.string()).status(), c.code, c.words);
    fs::remove_all(dir);
  }
}

// The generic loader (no config) refuses FP8 tensors rather than reading bytes as floats.
TEST(Fp8Load, LoadParametersWithoutAConfigRefusesFp8) {
  CheckpointDir d = TinyFp8Checkpoint(128, 128);
  const fs::path dir = Write(d, "fp8_generic");
  auto config = ParseModelConfig(d.config);
  ASSERT_TRUE(config.ok());
  auto model = CreateModel(*config, LoadOptions{});
  ASSERT_TRUE(model.ok());
  std::map<std::string, torch::Tensor> params;
  for (auto& p : (*model)->named_parameters()) params[p.key()] = p.value();
  auto files = OpenCheckpointFiles(dir.string());
  ASSERT_TRUE(files.ok());
  ExpectError(LoadParameters(*files, params, {}, {}).status(), absl::StatusCode::kInvalidArgument,
              {"F8_E4M3", "quantization_config"});
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// The fixtures: tiny Qwen3-MoE and Qwen3-Next FP8 checkpoints in the published layout

const std::vector<std::string> kFixtureNames = {"fp8_moe", "fp8_next"};

TEST(Fp8Fixtures, IndexListsThem) {
  std::ifstream in(kFixtures + "/index.json");
  ASSERT_TRUE(in) << "no FP8 fixtures in " << kFixtures;
  EXPECT_EQ(json::parse(in)["configs"].get<std::vector<std::string>>(), kFixtureNames);
}

struct Reference {
  std::vector<std::vector<int64_t>> seqs;
  torch::Tensor logits, logprobs;
};

Reference LoadReference(const std::string& dir) {
  Reference r;
  std::ifstream in(dir + "/inputs.json");
  r.seqs = json::parse(in)["sequences"].get<std::vector<std::vector<int64_t>>>();
  auto file = SafetensorsFile::Open(dir + "/ref.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return r;
  r.logits = TensorFromView(*(*file)->Get("logits"), *file).clone();
  r.logprobs = TensorFromView(*(*file)->Get("logprobs"), *file).clone();
  return r;
}

// Logits [T, V] and next-token log-probs [T - B] of the packed sequences, in fp32.
std::pair<torch::Tensor, torch::Tensor> RunModel(CausalLM& model, const Reference& ref) {
  torch::NoGradGuard no_grad;
  auto batch = PackedBatch::FromSequences(ref.seqs);
  auto hidden = model.Forward(batch);
  auto [rows, targets] = NextTokenRows(batch);
  return {model.Logits(hidden),
          TokenLogprobs(hidden.index_select(0, rows), model.LmHeadWeight(), targets)};
}

int64_t Fp8Parameters(CausalLM& model) {
  int64_t n = 0;
  for (const auto& p : model.named_parameters())
    n += p.value().scalar_type() == torch::kFloat8_e4m3fn;
  return n;
}

class Fp8Fixture : public ::testing::TestWithParam<std::string> {
 protected:
  std::string Dir() const { return kFixtures + "/" + GetParam(); }
  std::string ModelDir() const { return Dir() + "/model"; }
};

// Our CPU forward on the checkpoint dequantized on load against transformers on the dequantized
// weights: the same fp32 weights, so fp32 rounding apart (tests/parity_test.cc's 1e-4).
TEST_P(Fp8Fixture, DequantizedOnLoadEqualsTransformers) {
  const Reference ref = LoadReference(Dir());
  auto model = LoadModel(ModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(Fp8Parameters(**model), 0);
  auto [logits, lp] = RunModel(**model, ref);
  EXPECT_LE(MaxAbsDiff(logits, ref.logits), 1e-4) << "logits";
  EXPECT_LE(MaxAbsDiff(lp, ref.logprobs), 1e-4) << "log-probs";
}

// The fixture quantized exactly the linear layers transformers' should_convert_module converts;
// our reading of modules_to_not_convert must agree on every 2-D weight (the embedding aside).
TEST_P(Fp8Fixture, ModulesToNotConvertAgreeWithTheConverter) {
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(config->fp8.has_value());
  auto files = OpenCheckpointFiles(ModelDir());
  ASSERT_TRUE(files.ok()) << files.status();
  int64_t fp8 = 0, plain = 0;
  for (const auto& file : *files) {
    for (const auto& [name, view] : file->tensors()) {
      const std::string suffix = ".weight";
      if (view.shape.size() != 2 || name == "model.embed_tokens.weight" ||
          name.size() < suffix.size() ||
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const bool is_fp8 = view.dtype == DType::kF8E4M3;
      EXPECT_EQ(config->fp8->Converts(name.substr(0, name.size() - suffix.size())), is_fp8) << name;
      ++(is_fp8 ? fp8 : plain);
    }
  }
  EXPECT_GT(fp8, 10);
  EXPECT_GT(plain, 1);  // the LM head and a projection (or the routers) left in bf16
}

// Kept in FP8 on the CPU: the whole model through the twin of the CUDA kernels (activations
// quantized per token and 128-group, FP8 GEMMs), against transformers on the dequantized
// weights. The weights are the same; only the activations' rounding to e4m3 differs, 3 mantissa
// bits where bf16 keeps 8: 2^-4 relative against bf16's 2^-8. The FP8 rule is transformers' bf16
// rule (|a - b| <= 1e-2 + 1e-2 |b|, tests/bf16_test.cc) scaled by that factor 16:
// |a - b| <= 0.16 + 0.16 |b| for every log-prob.
constexpr double kFp8Rule = 0.16;

double WorstRuleRatio(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kFloat64), w = want.to(torch::kFloat64);
  return ((g - w).abs() / (kFp8Rule + kFp8Rule * w.abs())).max().item<double>();
}

TEST_P(Fp8Fixture, KeptInFp8WithinTheFp8Rule) {
  const Reference ref = LoadReference(Dir());
  auto model = LoadModel(ModelDir(), Options(Fp8Weights::kKeep));
  ASSERT_TRUE(model.ok()) << model.status();
  // Exactly the parameters whose checkpoint tensors are FP8 are FP8: the fixtures quantize every
  // linear layer but the LM head and those modules_to_not_convert names.
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  int64_t fp8_params = 0;
  for (const auto& p : (*model)->named_parameters()) {
    const std::string& n = p.key();
    const bool fp8 = p.value().scalar_type() == torch::kFloat8_e4m3fn;
    fp8_params += fp8;
    if (n.find("mlp.experts.") != std::string::npos) {
      EXPECT_TRUE(fp8) << n;
    } else if (n.size() > 7 && n.compare(n.size() - 7, 7, ".weight") == 0 && p.value().dim() == 2 &&
               n != "model.embed_tokens.weight" && n != "lm_head.weight") {
      EXPECT_EQ(fp8, config->fp8->Converts(n.substr(0, n.size() - 7))) << n;
    } else {
      EXPECT_FALSE(fp8) << n;
    }
  }
  EXPECT_GT(fp8_params, 5);
  auto [logits, lp] = RunModel(**model, ref);
  const double diff = MaxAbsDiff(lp, ref.logprobs), ratio = WorstRuleRatio(lp, ref.logprobs);
  std::printf(
      "%s kept in FP8 (CPU twin) vs transformers on the dequantized weights: max |d "
      "log-prob| %.4f, worst / FP8 rule %.3f\n",
      GetParam().c_str(), diff, ratio);
  EXPECT_LE(ratio, 1.0);
  EXPECT_GT(diff, 1e-4);  // the activations were quantized: not the dequantized path
}

// Expert parallelism over FP8 experts: two ranks holding two experts each, their partial sums
// (the other rank's ids dropped) add up to the whole layer. With top-2 routing the sums agree
// bit for bit: each rank's partial is one product or an exact zero per slot, and every expert
// row is computed alone, whichever rank computes it.
TEST(Fp8ExpertParallel, RanksSumToTheWholeLayer) {
  auto model = LoadModel(kFixtures + "/fp8_moe/model", Options(Fp8Weights::kKeep));
  ASSERT_TRUE(model.ok()) << model.status();
  auto modules = (*model)->named_modules();
  auto* block = modules["model.layers.0.mlp"]->as<SparseMoeBlockImpl>();
  ASSERT_NE(block, nullptr);
  const ExpertsImpl& all = *block->experts;
  ASSERT_TRUE(HoldsFp8(all));
  const int64_t E = all.gate_up_proj.size(0), H = all.down_proj.size(1);
  ASSERT_EQ(E, 4);
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  auto x = torch::randn({9, H});
  Routing r = Route(x, block->gate->weight, block->top_k, block->norm_topk_prob);
  auto whole = Fp8MoeExperts(x, r.ids, r.weights, all, /*fp32_sum=*/true);
  auto sum = torch::zeros_like(whole);
  for (int64_t first : {0, 2}) {
    ExpertsImpl local(2, H, all.down_proj.size(2));
    for (const char* name : {"gate_up_proj", "down_proj"}) {
      ASSERT_TRUE(MakeFp8Holder(local, name, torch::kCPU));
      local.named_parameters()[name].copy_(all.named_parameters()[name].narrow(0, first, 2));
      const std::string scale = std::string(name) + "_scale_inv";
      local.named_buffers()[scale].copy_(all.named_buffers()[scale].narrow(0, first, 2));
    }
    ExpertParallel ep;
    ep.local = {first, 2};
    ep.all_reduce_sum = [](torch::Tensor&) { return absl::OkStatus(); };  // one rank's share
    sum += ExpertParallelExperts(ep, x, r, local);
  }
  EXPECT_TRUE(torch::equal(sum, whole)) << MaxAbsDiff(sum, whole);
}

// A model holding FP8 weights is not saved as if they were floats; a dequantized one is saved
// without the quantization_config its weights no longer follow.
TEST(Fp8Save, RefusesFp8WeightsAndDropsTheQuantizationConfig) {
  const std::string dir = kFixtures + "/fp8_moe/model";
  auto kept = LoadModel(dir, Options(Fp8Weights::kKeep));
  ASSERT_TRUE(kept.ok()) << kept.status();
  const fs::path out = testing_util::TempDir("fp8_save");
  ExpectError(SaveModel(**kept, (out / "kept").string()), absl::StatusCode::kFailedPrecondition,
              {"FP8", "kDequantize"});
  auto plain = LoadModel(dir);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(SaveModel(**plain, (out / "plain").string()).ok());
  auto config = LoadModelConfig((out / "plain").string());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->fp8.has_value());
  auto again = LoadModel((out / "plain").string());
  ASSERT_TRUE(again.ok()) << again.status();
  const Reference ref = LoadReference(kFixtures + "/fp8_moe");
  EXPECT_TRUE(torch::equal(RunModel(**again, ref).second, RunModel(**plain, ref).second));
  fs::remove_all(out);
}

// ---------------------------------------------------------------------------------------------
// The memory plan's FP8 weight term

// By hand, for TinyFp8Checkpoint's model (hidden 40, heads 2 x 16, 4 experts of width 24, a
// dense layer of width 48, vocabulary 64, untied), every linear layer converted:
//   FP8 parameters: attention 2 x (32x40 + 16x40 + 16x40 + 40x32) = 7680, experts
//     4 x 3 x 24x40 = 11520, the dense MLP 3 x 48x40 = 5760: 24960 bytes;
//   scales: one 128 x 128 block per weight: 8 + 12 + 3 = 23 fp32, 92 bytes;
//   the rest: bf16 embedding and LM head 2 x 2 x 64x40 = 10240, fp32 norms and routers
//     4 x (40 + 2 x (32 + 80) + 4x40) = 1696: 11936 bytes.
TEST(Fp8Plan, WeightBytesByHand) {
  CheckpointDir d = TinyFp8Checkpoint(128, 128);
  auto c = ParseModelConfig(d.config);
  ASSERT_TRUE(c.ok()) << c.status();
  plan::Fp8WeightBytes b = plan::CountFp8WeightBytes(*c, 2, 1);
  EXPECT_EQ(b.fp8, 24960);
  EXPECT_EQ(b.scales, 92);
  EXPECT_EQ(b.rest, 11936);
  // Two expert-parallel devices: half the experts each (5760 FP8 bytes and 6 scales less).
  b = plan::CountFp8WeightBytes(*c, 2, 2);
  EXPECT_EQ(b.fp8, 24960 - 5760);
  EXPECT_EQ(b.scales, 92 - 24);
  EXPECT_EQ(b.rest, 11936);
  // v_proj left in bf16 by the list: its 2 x 640 parameters move to the rest at 2 bytes each.
  d.config["quantization_config"]["modules_to_not_convert"] = {"model.layers.*.self_attn.v_proj"};
  c = ParseModelConfig(d.config);
  ASSERT_TRUE(c.ok()) << c.status();
  b = plan::CountFp8WeightBytes(*c, 2, 1);
  EXPECT_EQ(b.fp8, 24960 - 1280);
  EXPECT_EQ(b.scales, 92 - 8);
  EXPECT_EQ(b.rest, 11936 + 2 * 1280);
  // The loader agrees: the FP8 parameters and scale buffers of the model kept in FP8.
  d.config["quantization_config"]["modules_to_not_convert"] = json::array();
  const fs::path dir = Write(d, "fp8_plan");
  auto model = LoadModel(dir.string(), Options(Fp8Weights::kKeep, torch::kBFloat16));
  ASSERT_TRUE(model.ok()) << model.status();
  int64_t fp8 = 0, scales = 0;
  for (const auto& p : (*model)->named_parameters())
    if (p.value().scalar_type() == torch::kFloat8_e4m3fn) fp8 += p.value().nbytes();
  for (const auto& bf : (*model)->named_buffers())
    if (bf.key().find("_scale_inv") != std::string::npos) scales += bf.value().nbytes();
  EXPECT_EQ(fp8, 24960);
  EXPECT_EQ(scales, 92);
  fs::remove_all(dir);
}

lm::ModelConfig ShippedConfig(const std::string& file) {
  auto c = ctl::ReadModelConfigFile(std::string(OPD_SOURCE_DIR) + "/configs/models/" + file);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : lm::ModelConfig{};
}

// Qwen3-Next-80B-A3B in FP8 on one H200: 148 GiB of bf16 weights need two devices; in FP8 the
// converted linear layers (all but the LM head, the embedding, the routers and the shared
// experts' gates) take one byte per parameter and the model fits one with room for a bucket.
TEST(Fp8Plan, Qwen3Next80bFp8FitsOneH200) {
  const lm::ModelConfig next = ShippedConfig("fp8/qwen3_next_80b_a3b_instruct_fp8.json");
  ASSERT_TRUE(next.fp8.has_value());
  plan::TeacherSettings t;
  EXPECT_TRUE(plan::CheckTeacherFits(next, t, 139 * plan::kGiB).ok());
  const plan::Fp8WeightBytes b = plan::CountFp8WeightBytes(next, 2, 1);
  std::printf("Qwen3-Next-80B-A3B FP8: %s FP8 + %s scales + %s rest = %s\n",
              plan::FormatGiB(b.fp8).c_str(), plan::FormatGiB(b.scales).c_str(),
              plan::FormatGiB(b.rest).c_str(), plan::FormatGiB(b.total()).c_str());
  EXPECT_LT(b.total(), 80 * plan::kGiB);
  EXPECT_GT(b.fp8, 70 * plan::kGiB);
  // scales: 4 bytes per 16384 weights
  EXPECT_NEAR(static_cast<double>(b.scales), 4.0 * b.fp8 / 16384, 0.02 * b.scales);
  t.fp8_weights = false;  // the same config with its FP8 weights dequantized: two devices
  ExpectError(plan::CheckTeacherFits(next, t, 139 * plan::kGiB),
              absl::StatusCode::kResourceExhausted, {"'weights (bf16)'"});
}

#ifdef OPD_FP8_PLAN_CLI
// opd-ctl plan reads the stage's FP8 teacher config and plans the 80B teacher on one device.
TEST(Fp8Plan, OpdCtlPlanTakesAnFp8TeacherConfig) {
  const std::string src = OPD_SOURCE_DIR, log = testing_util::TestDir().string() + "/plan.log";
  const std::string cmd = std::string(OPD_BINARY_DIR) + "/ctl/opd-ctl plan --config " + src +
                          "/configs/opd/marco_nano.yaml --model-config " + src +
                          "/configs/models/marco_nano.json --teacher-config " + src +
                          "/configs/models/qwen3_30b_a3b_instruct_2507.json," + src +
                          "/configs/models/fp8/qwen3_next_80b_a3b_instruct_fp8.json > " + log +
                          " 2>&1";
  EXPECT_EQ(testing_util::Shell(cmd), 0);
  const std::string out = testing_util::ReadFile(log);
  for (const char* want : {"teacher qwen3_next_80b_a3b", "FP8 linear layers + block scales",
                           "FP8 checkpoint:", "of block scales"})
    EXPECT_TRUE(Contains(out, want)) << want << "\n" << out;
  EXPECT_FALSE(Contains(out, "1/2 of the experts")) << out;  // one device per replica
}
#endif

// ---------------------------------------------------------------------------------------------
// CUDA (compute capability 8.9+): the kernels against the twin, the model against its dequantized
// self. The GEMM bound: on top of the twin's fp32 rounding (twice, one per side), the tensor
// cores' accumulation of a block's 128 products in 4 MMAs of 32 keeps at least 13 bits per MMA
// (Hopper's FP8 path keeps about 14, DeepSeek-V3 measured; fp16 HMMA, which sm_90 runs
// mma.sync e4m3 on, keeps fp32): |gpu - twin| <= (2^-11 + 2 (K + KB + 132) u) S.

torch::Device Gpu() {
  return torch::Device(torch::kCUDA, 0);
}

// In a TEST body: `k` = the GPU's FP8 kernels, or skip (no device, or one below 8.9); under
// OPD_REQUIRE_GPU=1 a build without them (no nvcc) fails.
#define GPU_FP8_KERNELS_OR_SKIP(k)                                                       \
  SKIP_WITHOUT_CUDA();                                                                   \
  const Fp8Kernels* k##_ptr = Fp8KernelsFor(Gpu());                                      \
  if (k##_ptr == nullptr) {                                                              \
    if (opd_test::RequireGpu() && MutableFp8Kernels(torch::kCUDA).block_gemm == nullptr) \
      FAIL() << "OPD_REQUIRE_GPU=1: this build has no CUDA FP8 GEMMs";                   \
    GTEST_SKIP() << "no FP8 GEMMs on this device (they need compute capability 8.9)";    \
  }                                                                                      \
  const Fp8Kernels& k = *k##_ptr

double GpuGemmFactor(int64_t K) {
  const int64_t KB = (K + 127) / 128;
  return std::ldexp(1.0, -11) + 2.0 * static_cast<double>(K + KB + 132) * kU * 1.01;
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

// A linear layer and a MoE layer of the FP8 fixture on the GPU against the twin, fp32 activations
// (so that only the kernels differ): the linear within the GEMM bound's order (relative 2^-10 of
// the layer), the experts within one e4m3 rounding (2^-4 relative) where the SwiGLU's device exp
// moved a quantization step.
TEST(Fp8Cuda, LayersAgainstTheTwin) {
  GPU_FP8_KERNELS_OR_SKIP(gpu);
  (void)gpu;
  auto cpu_model = LoadModel(kFixtures + "/fp8_moe/model", Options(Fp8Weights::kKeep));
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  LoadOptions on_gpu = Options(Fp8Weights::kKeep);
  on_gpu.device = Gpu();
  auto gpu_model = LoadModel(kFixtures + "/fp8_moe/model", on_gpu);
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  torch::NoGradGuard no_grad;
  auto cm = (*cpu_model)->named_modules(), gm = (*gpu_model)->named_modules();
  auto* cl = cm["model.layers.0.self_attn.q_proj"]->as<LinearImpl>();
  auto* gl = gm["model.layers.0.self_attn.q_proj"]->as<LinearImpl>();
  ASSERT_TRUE(cl->weight_scale_inv.defined() && gl->weight_scale_inv.defined());
  torch::manual_seed(15);
  auto x = torch::randn({33, cl->weight.size(1)});
  auto yc = cl->forward(x), yg = gl->forward(x.to(Gpu())).cpu();
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    return ((a - b).norm() / b.norm()).item<double>();
  };
  EXPECT_LE(rel(yg, yc), std::ldexp(1.0, -10)) << "q_proj";
  auto* cb = cm["model.layers.0.mlp"]->as<SparseMoeBlockImpl>();
  auto* gb = gm["model.layers.0.mlp"]->as<SparseMoeBlockImpl>();
  auto xe = torch::randn({45, cl->weight.size(1)});
  Routing r = Route(xe, cb->gate->weight, cb->top_k, cb->norm_topk_prob);
  auto ec = Fp8MoeExperts(xe, r.ids, r.weights, *cb->experts);
  auto eg = Fp8MoeExperts(xe.to(Gpu()), r.ids.to(Gpu()), r.weights.to(Gpu()), *gb->experts).cpu();
  EXPECT_LE(rel(eg, ec), std::ldexp(1.0, -4)) << "experts";
}

// The whole model in FP8 on the GPU (bf16 activations) against the same checkpoint dequantized
// to bf16 on the GPU: within the FP8 rule against transformers' fp32 reference, and no further
// from the bf16 path than twice the CPU twin's distance from fp32 (the FP8 error this model has)
// plus the bf16 path's own distance from fp32 (tests/bf16_test.cc's yardstick, at least 1e-2).
TEST_P(Fp8Fixture, GpuFp8AgainstDequantizedBf16) {
  GPU_FP8_KERNELS_OR_SKIP(gpu);
  (void)gpu;
  const Reference ref = LoadReference(Dir());
  LoadOptions fp8 = Options(Fp8Weights::kAuto, torch::kBFloat16), bf16 = fp8;
  fp8.device = bf16.device = Gpu();
  bf16.fp8 = Fp8Weights::kDequantize;
  auto m8 = LoadModel(ModelDir(), fp8);
  ASSERT_TRUE(m8.ok()) << m8.status();
  EXPECT_GT(Fp8Parameters(**m8), 5) << "kAuto keeps FP8 on an FP8-capable device";
  auto m16 = LoadModel(ModelDir(), bf16);
  ASSERT_TRUE(m16.ok()) << m16.status();
  EXPECT_EQ(Fp8Parameters(**m16), 0);
  auto twin = LoadModel(ModelDir(), Options(Fp8Weights::kKeep));
  ASSERT_TRUE(twin.ok()) << twin.status();
  const auto lp8 = RunModel(**m8, ref).second.cpu(), lp16 = RunModel(**m16, ref).second.cpu();
  const double cpu_fp8 = MaxAbsDiff(RunModel(**twin, ref).second, ref.logprobs);
  const double bf16_own = MaxAbsDiff(lp16, ref.logprobs);
  const double gpu_fp8 = MaxAbsDiff(lp8, lp16);
  std::printf(
      "%s on the GPU: FP8 vs dequantized bf16 max |d log-prob| %.4f (CPU twin vs fp32 "
      "%.4f, bf16 vs fp32 %.4f)\n",
      GetParam().c_str(), gpu_fp8, cpu_fp8, bf16_own);
  EXPECT_LE(WorstRuleRatio(lp8, ref.logprobs), 1.0);
  EXPECT_LE(gpu_fp8, 2 * cpu_fp8 + std::max(1e-2, bf16_own));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Fp8Fixture, ::testing::ValuesIn(kFixtureNames),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace lm
