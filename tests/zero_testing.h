// What the sharded-optimizer tests share (tests/zero_test.cc, tests/optimizer_state_test.cc): Gloo
// ranks as threads of one process, and a problem of five tensors whose gradients are given by hand,
// each rank holding a share of every step's gradient.
#pragma once

#include <algorithm>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/dist/process_group.h"
#include "tests/child_process.h"
#include "trainer/common/optim.h"
#include "trainer/common/zero1.h"

namespace zero_testing {

using lm::dist::LaunchEnv;
using lm::dist::ProcessGroup;
using trainer::ZeroStage;

inline void RunRanks(int world, const std::function<void(int, ProcessGroup&)>& fn) {
  const int port = testing_util::FreeLoopbackPort();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      LaunchEnv env{r, world, r, "127.0.0.1", port};
      lm::dist::GroupOptions o;
      o.timeout = absl::Seconds(60);
      auto group = ProcessGroup::Create(env, torch::kCPU, o);
      ASSERT_TRUE(group.ok()) << group.status();
      fn(r, **group);
    });
  }
  for (auto& t : threads) t.join();
}

inline const char* StageName(ZeroStage s) {
  return s == ZeroStage::kTwo ? "stage 2" : "stage 1";
}

// ---------------------------------------------------------------------------------------------
// Gradients given by hand: a problem of five tensors and each rank's share of every gradient.

struct Problem {
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<std::vector<torch::Tensor>> grads;  // [step][param]: the global gradient
};

inline Problem MakeProblem(int steps) {
  torch::manual_seed(7);
  Problem p;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"embed.weight", {13, 6}},
      {"norm.weight", {6}},
      {"proj.weight", {5, 6}},
      {"proj.bias", {5}},
      {"head.weight", {7, 5}}};
  for (const auto& [name, shape] : shapes) p.params.emplace_back(name, torch::randn(shape));
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> g;
    for (const auto& [name, t] : p.params) g.push_back(torch::randn(t.sizes()) * 0.5);
    p.grads.push_back(g);
  }
  return p;
}

inline std::vector<std::pair<std::string, torch::Tensor>> Clone(
    const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [n, t] : params) out.emplace_back(n, t.clone());
  return out;
}

inline trainer::OptimConfig Optim() {
  trainer::OptimConfig c;
  c.weight_decay = 0.1;
  c.max_grad_norm = 2.0;  // clips some steps
  return c;
}

// Rank r's share of the global gradient: the shares over all ranks sum to it. (A generator of its
// own: the ranks are threads here, and the global one would be shared by them.)
inline torch::Tensor Share(const torch::Tensor& g, int rank, int world, int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  std::vector<torch::Tensor> parts;
  torch::Tensor rest = g.clone();
  for (int r = 0; r < world - 1; ++r) {
    parts.push_back(torch::randn(g.sizes(), gen) * 0.1);
    rest -= parts.back();
  }
  parts.push_back(rest);
  return parts[static_cast<size_t>(rank)];
}

// `steps` updates from step `first` on: one rank, or `world` ranks each with its share, put into
// the parameters' .grad by hand (no backward: the reduction takes them at ReduceAndClip).
inline void Train(trainer::DistributedOptimizer& opt, const Problem& p, int first, int steps,
                  int rank, int world) {
  for (int s = first; s < first + steps; ++s) {
    opt.ZeroGrad();
    for (size_t i = 0; i < p.params.size(); ++i) {
      torch::Tensor share = Share(p.grads[s][i], rank, world, s);
      torch::Tensor param = opt.params()[i];  // a handle: its gradient is the parameter's
      if (param.grad().defined())
        param.mutable_grad().add_(share);
      else
        param.mutable_grad() = share;
    }
    ASSERT_TRUE(opt.ReduceAndClip(2.0).ok());
    ASSERT_TRUE(opt.Step(1e-2).ok());
  }
}

inline double MaxRelDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(a[i].abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

inline std::vector<torch::Tensor> Values(const trainer::DistributedOptimizer& o) {
  std::vector<torch::Tensor> out;
  for (const auto& t : o.params()) out.push_back(t.detach().to(torch::kFloat32).clone());
  return out;
}

// The weights after `steps` updates on one rank (AdamW), and its optimizer state's size.
inline std::vector<torch::Tensor> OneRank(const Problem& p, int steps,
                                          int64_t* state_bytes = nullptr) {
  ProcessGroup single;
  auto one = trainer::DistributedOptimizer::Create(Clone(p.params), Optim(), &single);
  EXPECT_TRUE(one.ok());
  if (!one.ok()) return {};
  Train(**one, p, 0, steps, 0, 1);
  if (state_bytes) *state_bytes = (*one)->state_bytes();
  return Values(**one);
}

}  // namespace zero_testing
