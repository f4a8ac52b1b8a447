// bf16-mixed training (train.precision = bf16-mixed): bf16 compute copies of the matrices, fp32
// master weights and AdamW state in the optimizer.
//
// Tolerances. bf16 keeps 8 significant bits: one rounding is a relative error of at most
// u = 2^-9 ~ 2e-3. A bf16-mixed forward rounds each matmul's inputs (and the experts' hidden
// activations) once, so against fp32 arithmetic on the same bf16-rounded weights a layer's output
// differs by a few u, and a gradient (which goes through every layer twice) by some 10 u: we allow
// 3e-2 per tensor (relative L2 norm of the difference) and check it is not 0 (bf16 did run).
// Where the arithmetic is the same on both sides (rounded inputs multiplied in fp32 either way)
// only fp32 summation order differs: 1e-5.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "lm/io/safetensors.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/model/precision.h"
#include "nlohmann/json.hpp"
#include "tests/child_process.h"
#include "tests/gpu.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "trainer/common/gradient_order.h"
#include "trainer/common/learner_group.h"
#include "trainer/common/mixed_precision.h"
#include "trainer/common/optim.h"
#include "trainer/common/zero1.h"

using testing_util::TestDir;

namespace {

// ||a - b|| / ||b|| in double.
double RelNormDiff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return ((x - y).norm() / y.norm().clamp_min(1e-30)).item<double>();
}

torch::Tensor RoundBf16(const torch::Tensor& t) {
  return t.to(torch::kBFloat16).to(torch::kFloat32);
}

lm::ModelConfig TinyConfig() {
  std::ifstream in(std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json");
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = lm::ParseModelConfig(nlohmann::json::parse(ss.str()));
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(Precision, Bf16CopiesForMatricesNotForNormsAndRouters) {
  auto model = lm::CreateModel(TinyConfig());
  ASSERT_TRUE(model.ok());
  int bf16 = 0, fp32 = 0;
  for (const auto& p : (*model)->named_parameters()) {
    const std::string& n = p.key();
    const bool copy = lm::HoldsBf16ComputeCopy(n, p.value());
    (copy ? bf16 : fp32)++;
    if (n.find("norm") != std::string::npos || n.find("mlp.gate.weight") != std::string::npos) {
      EXPECT_FALSE(copy) << n;
    }
    if (n.find("experts") != std::string::npos || n.find("_proj") != std::string::npos ||
        n == "lm_head.weight" || n == "model.embed_tokens.weight") {
      EXPECT_TRUE(copy) << n;
    }
  }
  EXPECT_GT(bf16, 0);
  EXPECT_GT(fp32, 0);
  EXPECT_FALSE(lm::HoldsBf16ComputeCopy("model.layers.0.linear_attn.conv1d.weight",
                                        torch::zeros({8, 1, 4})));
  EXPECT_FALSE(lm::HoldsBf16ComputeCopy("model.layers.0.mlp.shared_expert_gate.weight",
                                        torch::zeros({1, 8})));
}

// The product of bf16-rounded inputs, accumulated in fp32 with an fp32 result: against the exact
// (fp64) product of the rounded inputs only the fp32 accumulation differs; a bf16 output would be
// off by up to 2^-9.
void CheckMatmulFp32(torch::Device device) {
  torch::manual_seed(3);
  auto a = torch::randn({37, 300}).to(device), b = torch::randn({300, 29}).to(device);
  auto exact = torch::mm(RoundBf16(a).to(torch::kFloat64), RoundBf16(b).to(torch::kFloat64));
  auto got = lm::MatmulFp32(a, b.to(torch::kBFloat16), torch::kBFloat16);
  EXPECT_EQ(got.scalar_type(), torch::kFloat32);
  EXPECT_LE(RelNormDiff(got, exact), 1e-6);
  auto bf16_out = torch::mm(a.to(torch::kBFloat16), b.to(torch::kBFloat16));
  EXPECT_GT(RelNormDiff(bf16_out, exact), 1e-4) << "a bf16 output would have been rounded";
  auto acc = torch::ones({37, 29}, a.options());
  lm::AddMatmulFp32(acc, a, b.to(torch::kBFloat16), torch::kBFloat16);
  EXPECT_LE(RelNormDiff(acc, exact + 1), 1e-6);
}

TEST(Precision, MatmulFp32IsABf16GemmWithFp32Accumulation) {
  CheckMatmulFp32(torch::kCPU);
}

TEST(PrecisionGpu, MatmulFp32IsABf16GemmWithFp32Accumulation) {
  SKIP_WITHOUT_CUDA();
  CheckMatmulFp32(torch::Device(torch::kCUDA, 0));
}

// The fused experts with bf16 weights and fp32 activations: output in fp32, gradients for x in
// fp32 and for the weights in bf16 (their dtype), all within the bf16 tolerance of fp32
// arithmetic on the same rounded weights.
void CheckExperts(torch::Device device) {
  torch::manual_seed(5);
  const int64_t T = 40, H = 64, I = 32, E = 8, k = 2;
  auto x = torch::randn({T, H}).to(device);
  auto gate = torch::randn({E, H}).to(device) * 0.1;
  auto gate_up = RoundBf16(torch::randn({E, 2 * I, H}) * 0.1).to(device);
  auto down = RoundBf16(torch::randn({E, H, I}) * 0.1).to(device);
  lm::Routing r = lm::Route(x, gate, k, true);
  auto dy = torch::randn({T, H}).to(device);

  auto run = [&](torch::ScalarType dt) {
    auto xi = x.clone().requires_grad_(true);
    auto gu = gate_up.to(dt).clone().requires_grad_(true);
    auto dn = down.to(dt).clone().requires_grad_(true);
    auto y = lm::MoeExperts(xi, r.ids, r.weights, gu, dn);
    y.backward(dy);
    return std::vector<torch::Tensor>{y, xi.grad(), gu.grad(), dn.grad()};
  };
  auto ref = run(torch::kFloat32), mixed = run(torch::kBFloat16);
  EXPECT_EQ(mixed[0].scalar_type(), torch::kFloat32);
  EXPECT_EQ(mixed[1].scalar_type(), torch::kFloat32);
  EXPECT_EQ(mixed[2].scalar_type(), torch::kBFloat16);
  const char* what[] = {"output", "dx", "dgate_up", "ddown"};
  for (int i = 0; i < 4; ++i) {
    const double d = RelNormDiff(mixed[i], ref[i]);
    EXPECT_LE(d, 3e-2) << what[i];
    EXPECT_GT(d, 0) << what[i] << ": bf16 did not run";
  }
}

TEST(Precision, ExpertsTakeBf16WeightsWithFp32Activations) {
  CheckExperts(torch::kCPU);
}

TEST(PrecisionGpu, ExpertsTakeBf16WeightsWithFp32Activations) {
  SKIP_WITHOUT_CUDA();
  CheckExperts(torch::Device(torch::kCUDA, 0));
}

// The router stays fp32 under autocast: its logits are those of the fp32 matmul.
TEST(Precision, TheRouterIsFp32UnderAutocast) {
  torch::manual_seed(6);
  auto x = torch::randn({16, 64}), gate = torch::randn({8, 64});
  lm::Routing plain = lm::Route(x, gate, 2, true);
  lm::Bf16Autocast autocast(true, torch::kCPU);
  EXPECT_EQ(torch::linear(x, gate).scalar_type(), torch::kBFloat16) << "autocast is on";
  lm::Routing r = lm::Route(x, gate, 2, true);
  EXPECT_EQ(r.logits.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(r.logits, plain.logits));
  EXPECT_TRUE(torch::equal(r.ids, plain.ids));
}

// The LM head in bf16 with fp32 logits: log-probs and their gradients against fp32 arithmetic on
// the same rounded weight. The logits are fp32 sums of exact products of rounded inputs on both
// sides, so the log-probs agree to fp32 summation order once the hidden states are rounded too.
TEST(Precision, LmHeadLogprobsWithABf16Weight) {
  torch::manual_seed(8);
  const int64_t N = 50, H = 64, V = 320;
  auto hidden = torch::randn({N, H});
  auto weight = RoundBf16(torch::randn({V, H}) * 0.2);
  auto targets = torch::randint(V, {N}, torch::kInt64);
  lm::LogprobOptions o;
  o.chunk_rows = 16;
  auto run = [&](const torch::Tensor& h0, torch::ScalarType dt) {
    auto h = h0.clone().requires_grad_(true);
    auto w = weight.to(dt).clone().requires_grad_(true);
    auto lp = lm::TokenLogprobs(h, w, targets, o);
    lp.sum().backward();
    return std::vector<torch::Tensor>{lp, h.grad(), w.grad()};
  };
  auto mixed = run(hidden, torch::kBFloat16);
  auto same_inputs = run(RoundBf16(hidden), torch::kFloat32);
  EXPECT_EQ(mixed[0].scalar_type(), torch::kFloat32);
  EXPECT_EQ(mixed[2].scalar_type(), torch::kBFloat16);
  EXPECT_LE(RelNormDiff(mixed[0], same_inputs[0]), 1e-5);
  auto ref = run(hidden, torch::kFloat32);
  for (int i = 0; i < 3; ++i) {
    EXPECT_LE(RelNormDiff(mixed[i], ref[i]), 3e-2) << i;
    EXPECT_GT(RelNormDiff(mixed[i], ref[i]), 0) << i;
  }
}

// The model with bf16 compute copies of its matrices, as the trainer makes it.
std::shared_ptr<lm::CausalLM> MixedModel(uint64_t seed) {
  auto model = lm::CreateModel(TinyConfig());
  EXPECT_TRUE(model.ok());
  (*model)->InitWeights(0.05, seed);
  torch::NoGradGuard no_grad;
  for (auto& p : (*model)->named_parameters()) {
    if (lm::HoldsBf16ComputeCopy(p.key(), p.value()))
      p.value().set_data(p.value().to(torch::kBFloat16));
  }
  return *model;
}

lm::PackedBatch Batch() {
  return lm::PackedBatch::FromSequences({{5, 9, 33, 2, 71, 8, 100}, {3, 17, 250, 4}});
}

// Activation checkpointing under bf16-mixed: the recomputation runs under the forward's autocast,
// so the gradients equal the plain backward's (and without the autocast state carried over the
// recomputed layer would meet fp32 activations against bf16 weights).
TEST(Precision, ActivationCheckpointingRecomputesInTheForwardsDtypes) {
  auto model = MixedModel(11);
  auto grads = [&](bool checkpoint) {
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    std::vector<torch::Tensor> router;
    lm::ForwardOptions o;
    o.checkpoint_layers = checkpoint;
    o.router_logits = &router;
    torch::Tensor loss;
    {
      lm::Bf16Autocast autocast(true, torch::kCPU);
      auto [rows, targets] = lm::NextTokenRows(Batch());
      auto h = model->Forward(Batch(), o).index_select(0, rows);
      loss = -lm::TokenLogprobs(h, model->LmHeadWeight(), targets).sum() +
             lm::LoadBalancingLoss(router, 8, 2);
    }
    loss.backward();
    std::map<std::string, torch::Tensor> out;
    for (const auto& p : model->named_parameters()) out[p.key()] = p.value().grad().clone();
    return out;
  };
  auto plain = grads(false), recomputed = grads(true);
  for (const auto& [name, g] : plain) {
    ASSERT_TRUE(recomputed.at(name).defined()) << name;
    EXPECT_LE(RelNormDiff(recomputed.at(name), g), 1e-5) << name;
  }
}

// The mechanism the optimizer relies on: a bf16 parameter whose .grad is an fp32 tensor gets each
// backward's gradient added into it in fp32 (autograd adds the bf16 gradient in place), so
// micro-batches accumulate in fp32 without a bf16 gradient tensor being kept.
TEST(Precision, Bf16ParameterAccumulatesIntoAnFp32Gradient) {
  auto w = torch::randn({4, 3}).to(torch::kBFloat16).requires_grad_(true);
  auto acc = torch::zeros({4, 3});
  w.mutable_grad() = acc;
  torch::Tensor want = torch::zeros({4, 3});
  for (int i = 0; i < 3; ++i) {
    auto x = torch::randn({2, 4});
    {
      lm::Bf16Autocast autocast(true, torch::kCPU);
      torch::mm(x, w).sum().backward();
    }
    want += x.to(torch::kBFloat16).to(torch::kFloat32).sum(0).unsqueeze(1).expand({4, 3});
  }
  ASSERT_EQ(w.grad().scalar_type(), torch::kFloat32);
  EXPECT_EQ(w.grad().data_ptr(), acc.data_ptr());
  EXPECT_LE(RelNormDiff(acc, want), 1e-2);
}

// ---------------------------------------------------------------------------------------------
// The learner: fp32 masters and AdamW state in the optimizer, bf16 compute copies in the model.

using trainer::DistributedOptimizer;
using trainer::Precision;

std::vector<std::pair<std::string, torch::Tensor>> Named(lm::CausalLM& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

std::shared_ptr<lm::CausalLM> Fp32Model(uint64_t seed) {
  auto model = lm::CreateModel(TinyConfig());
  EXPECT_TRUE(model.ok());
  (*model)->InitWeights(0.05, seed);
  return *model;
}

trainer::OptimConfig Optim() {
  trainer::OptimConfig c;
  c.weight_decay = 0.1;
  return c;
}

// Sum of -log p over a batch's next tokens plus the load-balancing loss, its gradients accumulated
// into the parameters' .grad.
void Backward(lm::CausalLM& m, const lm::PackedBatch& batch, Precision precision) {
  std::vector<torch::Tensor> router;
  lm::ForwardOptions o;
  o.router_logits = &router;
  torch::Tensor loss;
  {
    trainer::ForwardPrecision autocast(precision, torch::kCPU);
    auto [rows, targets] = lm::NextTokenRows(batch);
    auto h = m.Forward(batch, o).index_select(0, rows);
    loss = -lm::TokenLogprobs(h, m.LmHeadWeight(), targets).sum() / 10.0 +
           lm::LoadBalancingLoss(router, 8, 2) * 0.01;
  }
  loss.backward();
}

std::map<std::string, torch::Tensor> ByName(
    const std::vector<std::pair<std::string, torch::Tensor>>& v, bool grads) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [n, t] : v) out[n] = (grads ? t.grad() : t).detach().to(torch::kFloat32).clone();
  return out;
}

// The masters gathered by the optimizer, by parameter name.
std::map<std::string, torch::Tensor> Masters(
    DistributedOptimizer& opt, const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  auto flat = opt.GatherMasters();
  EXPECT_TRUE(flat.ok()) << flat.status();
  std::map<std::string, torch::Tensor> out;
  if (!flat.ok() || !flat->defined()) return out;
  const auto& layout = opt.layout();
  std::map<std::string, torch::Tensor> shapes;
  for (const auto& [n, t] : params) shapes[n] = t;
  for (const auto& e : layout.entries)
    out[e.name] = flat->narrow(0, e.offset, e.numel).view(shapes[e.name].sizes()).clone();
  return out;
}

// (a) One step of bf16-mixed against fp32 arithmetic on the same bf16-rounded weights.
//   - the gradients (accumulated in fp32) within the bf16 tolerance of the fp32 gradients, and
//     not equal to them (the forward did run in bf16);
//   - the update ran on the fp32 masters: masters' = AdamW(fp32 W, the accumulated gradients),
//     bit for bit as trainer::AdamW computes it on fp32 tensors;
//   - against the update of the fp32 reference (AdamW of fp32 W with the fp32 gradients): within
//     the gradients' 3e-2 per tensor. AdamW's first step is lr g / (|g| + eps) elementwise: with
//     the usual eps it is sign(g), which flips for every gradient within bf16 error of 0 (the
//     update then differs by 10-25% per tensor whatever the precision of the rest); with eps = 1
//     (above every |g| here) it is nearly linear in g: 5e-2 per tensor (measured 2.2e-2);
//   - the compute copies are the updated masters rounded to bf16, the fp32 parameters the masters.
TEST(MixedOptimizer, OneStepUpdatesTheFp32MastersFromFp32AccumulatedGradients) {
  torch::set_num_threads(1);
  const double lr = 1e-3;
  trainer::OptimConfig linear = Optim();
  linear.eps = 1.0;
  auto mixed = Fp32Model(21);
  const auto w0 = ByName(Named(*mixed), false);  // the fp32 masters before the step
  lm::dist::ProcessGroup single;
  auto params = Named(*mixed);
  auto opt = DistributedOptimizer::Create(params, linear, &single, 1000, torch::kFloat32,
                                          Precision::kBf16Mixed);
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (const auto& [n, t] : params) {
    const bool copy = lm::HoldsBf16ComputeCopy(n, w0.at(n));
    EXPECT_EQ(t.scalar_type(), copy ? torch::kBFloat16 : torch::kFloat32) << n;
    EXPECT_TRUE(torch::equal(t.to(torch::kFloat32), copy ? RoundBf16(w0.at(n)) : w0.at(n))) << n;
  }
  // Two micro-batches accumulate into the fp32 gradients.
  (*opt)->ZeroGrad();
  Backward(*mixed, Batch(), Precision::kBf16Mixed);
  (*opt)->ExpectLastBackward();
  Backward(*mixed, lm::PackedBatch::FromSequences({{7, 7, 40, 41, 42}}), Precision::kBf16Mixed);
  for (const auto& [n, t] : params) ASSERT_EQ(t.grad().scalar_type(), torch::kFloat32) << n;
  ASSERT_TRUE((*opt)->ReduceAndClip(0).ok());
  const auto g_mixed = ByName(params, true);
  ASSERT_TRUE((*opt)->Step(lr).ok());
  const auto masters = Masters(**opt, params);

  // The fp32 reference: an fp32 model holding the bf16-rounded weights.
  auto ref = Fp32Model(21);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : ref->named_parameters())
      if (lm::HoldsBf16ComputeCopy(p.key(), p.value())) p.value().copy_(RoundBf16(p.value()));
  }
  Backward(*ref, Batch(), Precision::kFp32);
  Backward(*ref, lm::PackedBatch::FromSequences({{7, 7, 40, 41, 42}}), Precision::kFp32);
  const auto g_ref = ByName(Named(*ref), true);

  // AdamW on fp32 copies of the masters with either gradient.
  auto adamw = [&](const std::map<std::string, torch::Tensor>& g) {
    std::vector<std::pair<std::string, torch::Tensor>> w;
    for (const auto& [n, t] : params) {
      w.emplace_back(n, w0.at(n).clone());
      w.back().second.mutable_grad() = g.at(n).clone();
    }
    trainer::AdamW a(w, linear);
    a.Step(lr);
    return ByName(w, false);
  };
  const auto want = adamw(g_mixed), want_ref = adamw(g_ref);
  double worst_grad = 0, worst_update = 0;
  for (const auto& [n, t] : params) {
    const bool copy = lm::HoldsBf16ComputeCopy(n, w0.at(n));
    const double dg = RelNormDiff(g_mixed.at(n), g_ref.at(n));
    EXPECT_LE(dg, 3e-2) << n;
    if (copy) {
      EXPECT_GT(dg, 0) << n << ": bf16 did not run";
    }
    EXPECT_TRUE(torch::equal(masters.at(n), want.at(n))) << n;
    const double du = RelNormDiff(masters.at(n) - w0.at(n), want_ref.at(n) - w0.at(n));
    EXPECT_LE(du, 5e-2) << n;
    worst_grad = std::max(worst_grad, dg);
    worst_update = std::max(worst_update, du);
    EXPECT_TRUE(
        torch::equal(t.to(torch::kFloat32), copy ? RoundBf16(masters.at(n)) : masters.at(n)))
        << n;
  }
  std::printf("bf16-mixed vs fp32 on the same rounded weights: gradients %.2e, update %.2e\n",
              worst_grad, worst_update);
}

// A learning rate so small that the bf16 copy cannot move still moves the master: after 10 steps
// the masters have travelled, the copy of an unmoved bf16 value has not (and equals the rounded
// master).
TEST(MixedOptimizer, UpdatesBelowOneBf16UlpAccumulateInTheMasters) {
  torch::set_num_threads(1);
  std::vector<std::pair<std::string, torch::Tensor>> params = {
      {"w.weight", torch::full({4, 4}, 1.0)}};
  lm::dist::ProcessGroup single;
  trainer::OptimConfig c;
  c.weight_decay = 0;
  auto opt = DistributedOptimizer::Create(params, c, &single, 1000, torch::kFloat32,
                                          Precision::kBf16Mixed);
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (int s = 0; s < 10; ++s) {
    (*opt)->ZeroGrad();
    params[0].second.mutable_grad().fill_(1.0);
    ASSERT_TRUE((*opt)->ReduceAndClip(0).ok());
    ASSERT_TRUE((*opt)->Step(1e-4).ok());  // 1e-4 per step < 2^-8 / 2 = 2e-3 (half a bf16 ulp)
  }
  const auto m = Masters(**opt, params);
  EXPECT_NEAR(m.at("w.weight")[0][0].item<double>(), 1.0 - 10 * 1e-4, 1e-6);
  EXPECT_EQ(params[0].second[0][0].item<float>(), 1.0f);  // 0.999 rounds to 1 in bf16
}

// (e) The bytes a rank holds, against the arithmetic of mixed_precision.h: P parameters of which
// F stay fp32, N ranks, the flat space cut into buckets (trainer::BucketSharding: padded to
// Pp >= P elements, a slice of S = Pp / N per rank):
//   weights 2 Pp (bf16 flat buffer) + 4 F,
//   gradients: one rank 4 Pp; stage 1 4 Pp + 4 S (the local sum and the reduced slice); stage 2
//     4 S, plus its staging buckets once a step has run (at most 4 of them);
//   masters 4 S, AdamW 8 S allocated (8 x the owned elements stored: 8 P over the ranks)
// and the model's parameters hold 2 bytes per matrix element, 4 per fp32 one (their fp32 values
// live on only in the masters).
TEST(MixedOptimizer, MemoryPerRankIsBf16WeightsPlusAnNthOfMastersAndState) {
  torch::set_num_threads(1);
  auto probe = Fp32Model(1);
  int64_t P = 0, F = 0;
  for (const auto& [n, t] : Named(*probe)) {
    P += t.numel();
    if (!lm::HoldsBf16ComputeCopy(n, t)) F += t.numel();
  }
  for (trainer::ZeroStage stage : {trainer::ZeroStage::kOne, trainer::ZeroStage::kTwo}) {
    for (int world : {1, 2, 4}) {
      std::vector<trainer::LearnerMemory> mem(world), fp32(world), stepped(world);
      std::vector<int64_t> state(world);
      const int port = testing_util::FreeLoopbackPort();
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          lm::dist::LaunchEnv env{r, world, r, "127.0.0.1", port};
          auto g = lm::dist::ProcessGroup::Create(env, torch::kCPU);
          ASSERT_TRUE(g.ok()) << g.status();
          auto model = Fp32Model(1);
          auto params = Named(*model);
          // The flat space in the backward's order, as the learner lays it out: each bucket's
          // gradients complete before the next one's.
          auto order = trainer::GradientArrivalOrder(*model, Precision::kBf16Mixed,
                                                     /*checkpoint_layers=*/false);
          ASSERT_TRUE(order.ok()) << order.status();
          ASSERT_EQ(order->size(), params.size()) << "every parameter has a gradient";
          auto opt = DistributedOptimizer::Create(params, Optim(), g->get(), 1000, torch::kFloat32,
                                                  Precision::kBf16Mixed, stage, *order);
          ASSERT_TRUE(opt.ok()) << opt.status();
          mem[r] = (*opt)->memory();
          state[r] = (*opt)->state_bytes();
          int64_t param_bytes = 0;
          for (const auto& [n, t] : params) param_bytes += t.numel() * t.element_size();
          EXPECT_EQ(param_bytes, 2 * (P - F) + 4 * F);
          // One step of one micro-batch per rank: stage 2's staging buckets appear.
          (*opt)->ZeroGrad();
          ASSERT_TRUE((*opt)->ExpectBackwards(1).ok());
          std::vector<torch::Tensor> router;
          lm::ForwardOptions o;
          torch::Tensor loss;
          {
            trainer::ForwardPrecision autocast(Precision::kBf16Mixed, torch::kCPU);
            auto [rows, targets] = lm::NextTokenRows(Batch());
            auto h = model->Forward(Batch(), o).index_select(0, rows);
            loss = -lm::TokenLogprobs(h, model->LmHeadWeight(), targets).sum();
          }
          ASSERT_TRUE((*opt)->Backward(loss).ok());
          ASSERT_TRUE((*opt)->ReduceAndClip(1.0).ok());
          stepped[r] = (*opt)->memory();
          auto model32 = Fp32Model(1);
          auto opt32 = DistributedOptimizer::Create(Named(*model32), Optim(), g->get(), 1000,
                                                    torch::kFloat32, Precision::kFp32, stage);
          ASSERT_TRUE(opt32.ok());
          fp32[r] = (*opt32)->memory();
        });
      }
      for (auto& t : threads) t.join();
      int64_t adamw = 0;
      for (int r = 0; r < world; ++r) {
        const trainer::BucketSharding sh = trainer::BucketSharding::Of(P, 1000, world, r);
        const int64_t Pp = sh.padded_total, S = sh.slice;
        EXPECT_EQ(S * world, Pp);
        const bool two = stage == trainer::ZeroStage::kTwo && world > 1;
        EXPECT_EQ(mem[r].weights, 2 * Pp + 4 * F) << world;
        EXPECT_EQ(mem[r].gradients, world == 1 ? 4 * Pp : two ? 4 * S : 4 * Pp + 4 * S) << world;
        EXPECT_EQ(mem[r].gradient_buckets, 0) << world;
        EXPECT_EQ(mem[r].masters, 4 * S) << world;
        EXPECT_EQ(mem[r].adamw, 8 * S) << world;
        // Stage 2 after a step: the staging buckets, a few of 1000 elements (rounded up to N).
        const int64_t bucket = sh.buckets.front().padded_length(world);
        EXPECT_EQ(stepped[r].gradients, mem[r].gradients) << world;
        if (two) {
          EXPECT_GT(stepped[r].gradient_buckets, 0) << world;
          EXPECT_LE(stepped[r].gradient_buckets, 4 * 4 * bucket) << world;
        } else {
          EXPECT_EQ(stepped[r].gradient_buckets, 0) << world;
        }
        adamw += state[r];
        // bf16-mixed holds less than fp32 from 3 ranks on (one rank holds the masters on top).
        if (world > 2) {
          EXPECT_LT(mem[r].total(), fp32[r].total()) << world;
        }
        if (world == 1) {
          EXPECT_GT(mem[r].total(), fp32[r].total());
        }
        std::printf(
            "%s, %d rank(s), rank %d: bf16-mixed %lld B (weights %lld, grads %lld + buckets %lld "
            "after a step, masters %lld, AdamW %lld); fp32 %lld B\n",
            two ? "stage 2" : "stage 1", world, r, static_cast<long long>(stepped[r].total()),
            static_cast<long long>(mem[r].weights), static_cast<long long>(mem[r].gradients),
            static_cast<long long>(stepped[r].gradient_buckets),
            static_cast<long long>(mem[r].masters), static_cast<long long>(mem[r].adamw),
            static_cast<long long>(fp32[r].total()));
      }
      EXPECT_EQ(adamw, 8 * P) << world;  // the moments of every element, once over the ranks
    }
  }
}

// ---------------------------------------------------------------------------------------------
// (b) and (d): `opd-trainer sft` in bf16-mixed.

namespace fs = std::filesystem;
const std::string kBin = OPD_BINARY_DIR;
const std::string kFixtures = kBin + "/fixtures_sft";

int Run(const std::vector<std::string>& argv, const std::string& log) {
  testing_util::ChildProcess p(argv, log);
  const int code = p.Wait(std::chrono::seconds(600));
  if (code != 0) ADD_FAILURE() << p.Log();
  return code;
}

std::string MakeStudent(const std::string& dir) {
  const std::string out = dir + "/student";
  Run({kBin + "/ctl/opd-ctl", "init-model", "--config",
       std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json", "--out", out, "--tokenizer",
       kFixtures + "/tokenizer", "--std", "0.05", "--seed", "1"},
      dir + "/init.log");
  return out;
}

int RunSft(const std::string& student, const std::string& run_dir, std::vector<std::string> sets,
           const std::vector<std::string>& extra_args = {}) {
  std::vector<std::string> argv = {kBin + "/trainer/opd-trainer", "sft", "--config",
                                   std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny.yaml"};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  for (const std::string& s :
       {"model.path=" + student, "data.train.0.files=[" + kFixtures + "/data/train.jsonl]",
        "data.eval.0.files=[" + kFixtures + "/data/eval.jsonl]", "run.dir=" + run_dir,
        std::string("train.threads=1"), std::string("logging.log_every=1000")})
    sets.insert(sets.begin(), s);
  for (const auto& s : sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  return Run(argv, run_dir + ".log");
}

std::vector<double> TrainLosses(const std::string& run_dir) {
  std::vector<double> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("train/loss")) out.push_back(j["train/loss"]);
  }
  return out;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// (b) 8 steps in bf16-mixed follow the fp32 run's loss: each step's mean loss within 2% (the
// losses differ by the bf16 rounding of the forward, a few u = 2^-9 of the logits, and the
// trajectories drift apart slowly as the updates differ), and the checkpoint's model is fp32
// holding the masters: F32 tensors, some of whose values bf16 cannot represent.
TEST(MixedSft, TracksTheFp32LossAndCheckpointsFp32Masters) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::vector<std::string> sets = {"train.max_steps=8", "eval.every=0", "optim.lr=1e-3"};
  auto mixed = sets, fp32 = sets;
  mixed.push_back("train.precision=bf16-mixed");
  fp32.push_back("train.precision=fp32");
  ASSERT_EQ(RunSft(student, dir + "/mixed", mixed), 0);
  ASSERT_EQ(RunSft(student, dir + "/fp32", fp32), 0);
  const auto a = TrainLosses(dir + "/mixed"), b = TrainLosses(dir + "/fp32");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / b[i]);
    EXPECT_NEAR(a[i], b[i], 2e-2 * b[i]) << "step " << i + 1;
  }
  EXPECT_GT(worst, 0) << "the runs are identical: bf16 did not run";
  EXPECT_LT(a.back(), a.front()) << "it learns";
  std::printf("bf16-mixed vs fp32 loss over 8 steps: worst relative difference %.2e\n", worst);

  auto file =
      lm::SafetensorsFile::Open(dir + "/mixed/checkpoints/step_000008/model/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  int64_t not_bf16 = 0, tensors = 0;
  auto model = lm::LoadModel(dir + "/mixed/checkpoints/step_000008/model");
  ASSERT_TRUE(model.ok()) << model.status();
  for (const auto& p : (*model)->named_parameters()) {
    ++tensors;
    EXPECT_EQ(p.value().scalar_type(), torch::kFloat32);
    if (!torch::equal(p.value(), RoundBf16(p.value()))) ++not_bf16;
  }
  EXPECT_EQ(not_bf16, tensors) << "every tensor holds fp32 masters, not bf16 copies";
  ASSERT_FALSE((*file)->tensors().empty());
  for (const auto& [name, v] : (*file)->tensors()) EXPECT_EQ(v.dtype, lm::DType::kF32) << name;
}

// (d) Resuming a bf16-mixed run from its step-3 checkpoint ends at step 6 with the same files as
// the uninterrupted run: the masters (the model) and AdamW moments are restored exactly, and the
// compute copies are their rounding, so every later step repeats bit for bit.
TEST(MixedSft, ResumeEqualsTheUninterruptedRun) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  const std::vector<std::string> sets = {"train.max_steps=6",      "eval.every=0",
                                         "optim.lr=1e-3",          "checkpoint.every=3",
                                         "checkpoint.keep_last=0", "train.precision=bf16-mixed"};
  ASSERT_EQ(RunSft(student, dir + "/straight", sets), 0);
  ASSERT_EQ(RunSft(student, dir + "/resumed", sets,
                   {"--resume=" + dir + "/straight/checkpoints/step_000003"}),
            0);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir + "/straight/checkpoints/step_000006"))
    if (e.path().extension() == ".safetensors") files.push_back(e.path().filename());
  files.push_back("model/model.safetensors");
  ASSERT_GE(files.size(), 2u);
  for (const auto& f : files)
    EXPECT_EQ(ReadBytes(dir + "/straight/checkpoints/step_000006/" + f),
              ReadBytes(dir + "/resumed/checkpoints/step_000006/" + f))
        << f;
  const auto a = TrainLosses(dir + "/straight"), b = TrainLosses(dir + "/resumed");
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a[3 + i], b[i]) << "step " << 4 + i;
}

TEST(MixedSft, PrecisionAndDeviceAreValidated) {
  const std::string dir = TestDir();
  const std::string student = MakeStudent(dir);
  for (const auto& [set, names] : std::vector<std::pair<std::string, std::string>>{
           {"train.precision=bf16", "train.precision: 'bf16' is not one of auto, fp32, bf16-mixed"},
           {"train.device=gpu", "train.device"},
           {"train.device=cuda:x", "train.device"}}) {
    testing_util::ChildProcess p(
        {kBin + "/trainer/opd-trainer", "sft", "--config",
         std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny.yaml", "--set", "model.path=" + student,
         "--set", "data.train.0.files=[" + kFixtures + "/data/train.jsonl]", "--set",
         "run.dir=" + dir + "/run", "--set", set},
        dir + "/bad.log");
    EXPECT_NE(p.Wait(std::chrono::seconds(120)), 0) << set;
    EXPECT_NE(p.Log().find(names), std::string::npos) << set << ": " << p.Log();
  }
}

// dist.allgather_dtype: auto follows train.precision. It used to be bf16 on any CUDA device, so
// `train.precision: fp32` on N CUDA ranks gathered its weights in bf16.
TEST(AllGatherDtype, AutoFollowsThePrecision) {
  using trainer::AllGatherDtype;
  using trainer::Precision;
  using trainer::PrecisionSetting;
  using trainer::ResolveAllGatherDtype;
  using trainer::ResolvePrecision;
  EXPECT_EQ(ResolveAllGatherDtype(AllGatherDtype::kAuto, Precision::kFp32), torch::kFloat32);
  EXPECT_EQ(ResolveAllGatherDtype(AllGatherDtype::kAuto, Precision::kBf16Mixed), torch::kBFloat16);
  // train.precision: auto on CUDA resolves to bf16-mixed, so the default there is still bf16.
  const torch::Device cuda(torch::kCUDA, 0);
  EXPECT_EQ(
      ResolveAllGatherDtype(AllGatherDtype::kAuto, ResolvePrecision(PrecisionSetting::kAuto, cuda)),
      torch::kBFloat16);
  EXPECT_EQ(
      ResolveAllGatherDtype(AllGatherDtype::kAuto, ResolvePrecision(PrecisionSetting::kFp32, cuda)),
      torch::kFloat32);
  EXPECT_EQ(ResolveAllGatherDtype(AllGatherDtype::kAuto,
                                  ResolvePrecision(PrecisionSetting::kAuto, torch::kCPU)),
            torch::kFloat32);
  for (Precision p : {Precision::kFp32, Precision::kBf16Mixed}) {
    EXPECT_EQ(ResolveAllGatherDtype(AllGatherDtype::kFloat32, p), torch::kFloat32);
    EXPECT_EQ(ResolveAllGatherDtype(AllGatherDtype::kBfloat16, p), torch::kBFloat16);
  }
}

TEST(LearnerDevice, CudaIsTheLocalRanksGpuAndCudaNIsKept) {
  using trainer::ResolveLearnerDevice;
  EXPECT_EQ(ResolveLearnerDevice("cpu", 3, 8).value(), torch::Device(torch::kCPU));
  EXPECT_EQ(ResolveLearnerDevice("auto", 0, 0).value(), torch::Device(torch::kCPU));
  EXPECT_EQ(ResolveLearnerDevice("cuda", 3, 8).value(), torch::Device(torch::kCUDA, 3));
  EXPECT_EQ(ResolveLearnerDevice("auto", 5, 8).value(), torch::Device(torch::kCUDA, 5));
  EXPECT_EQ(ResolveLearnerDevice("cuda", 0, 1).value(), torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(ResolveLearnerDevice("cuda:2", 7, 8).value(), torch::Device(torch::kCUDA, 2));
  struct Bad {
    std::string spec;
    int local_rank, devices;
    std::string says;
  };
  for (const Bad& b : std::vector<Bad>{
           {"cuda", 0, 0, "CUDA is not available"},
           {"cuda:1", 0, 0, "CUDA is not available"},
           {"cuda", 4, 2, "LOCAL_RANK=4 needs cuda:4 but this node has 2 CUDA device(s)"},
           {"cuda:3", 0, 2, "needs cuda:3 but this node has 2"},
           {"cuda:-1", 0, 2, "is not cuda:N"},
           {"tpu", 0, 2, "is not one of auto, cpu, cuda, cuda:N"}}) {
    auto d = ResolveLearnerDevice(b.spec, b.local_rank, b.devices);
    ASSERT_FALSE(d.ok()) << b.spec;
    EXPECT_NE(std::string(d.status().message()).find(b.says), std::string::npos) << d.status();
  }
}

// On a GPU: one bf16-mixed step on cuda:0 against the same step on the CPU (bf16 GEMMs with fp32
// accumulation on both, other kernels and summation orders): each tensor's update within 5e-2 of
// the CPU's (relative norm: a few bf16 roundings' drift through the layers). With eps = 1 and no
// weight decay, as in OneStepUpdatesTheFp32MastersFromFp32AccumulatedGradients: AdamW's first step
// at the usual eps is lr sign(g), and the signs of gradients within rounding of 0 differ between
// any two kernels (an H200 measured 0.06-0.25 relative at eps 1e-8 for every tensor).
TEST(MixedOptimizerGpu, OneStepOnCudaMatchesTheCpu) {
  SKIP_WITHOUT_CUDA();
  auto step = [](torch::Device device) {
    auto model = Fp32Model(21);
    model->to(device);
    lm::dist::ProcessGroup single;
    auto params = Named(*model);
    const auto w0 = ByName(params, false);
    trainer::OptimConfig linear = Optim();
    linear.eps = 1.0;
    linear.weight_decay = 0.0;
    auto opt = DistributedOptimizer::Create(params, linear, &single, 1000, torch::kFloat32,
                                            Precision::kBf16Mixed);
    EXPECT_TRUE(opt.ok()) << opt.status();
    (*opt)->ZeroGrad();
    lm::PackedBatch b = Batch();
    b.input_ids = b.input_ids.to(device);
    b.position_ids = b.position_ids.to(device);
    std::vector<torch::Tensor> router;
    lm::ForwardOptions o;
    torch::Tensor loss;
    {
      trainer::ForwardPrecision autocast(Precision::kBf16Mixed, device);
      auto [rows, targets] = lm::NextTokenRows(b);
      auto h = model->Forward(b, o).index_select(0, rows);
      loss = -lm::TokenLogprobs(h, model->LmHeadWeight(), targets).sum();
    }
    loss.backward();
    EXPECT_TRUE((*opt)->ReduceAndClip(0).ok());
    EXPECT_TRUE((*opt)->Step(1e-3).ok());
    auto m = Masters(**opt, params);
    for (auto& [n, t] : m) t = (t.cpu() - w0.at(n).cpu());
    return m;
  };
  auto cpu = step(torch::kCPU), gpu = step(torch::Device(torch::kCUDA, 0));
  double worst = 0;
  for (const auto& [n, d] : cpu) {
    worst = std::max(worst, RelNormDiff(gpu.at(n), d));
    EXPECT_LE(RelNormDiff(gpu.at(n), d), 5e-2) << n;
  }
  std::printf("bf16-mixed step, cuda:0 vs cpu: worst relative update difference %.3g\n", worst);
}

}  // namespace
