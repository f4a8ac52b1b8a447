// Parity with Hugging Face transformers, one suite over both architectures: the tiny random
// Qwen3-MoE / Qwen3 models of tests/python/make_fixtures.py and the Qwen3-Next models of
// tests/python/make_next_fixtures.py, each with transformers' logits, log-probs, loss and every
// parameter's gradient on the same sequences (lengths up to 130: one to three delta-rule chunks).
// Tolerances (fp32, CPU; the same arithmetic in another summation order than PyTorch eager):
//   logits and log-probs: max abs diff <= 1e-4;
//   loss (and the MoE load-balancing loss): abs diff <= 1e-5;
//   gradients: max abs diff <= 1e-4 x max(the tensor's largest reference entry, 1e-4) (the floor
//   covers gradients that are zero but for rounding: top-1 routing renormalised to 1 gives the
//   router none, and a relative comparison would compare noise);
//   a packed batch vs each sequence alone, checkpointed vs plain layers: <= 1e-5 (no state may
//   cross a document; recomputation runs the same ops);
//   decode through the cache vs the full forward: <= 1e-4 x max(1, the largest |logit|).
// Each architecture's own behaviour (the delta rule, MoE routing, loading) is tested beside its
// model: tests/model_test.cc, tests/qwen3_next_test.cc.
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/io/hf_model_dir.h"
#include "lm/io/safetensors.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "nlohmann/json.hpp"
#include "tests/fixture_names.h"
#include "tests/tensor_testing.h"

using testing_util::MaxAbsDiff;

namespace lm {
namespace {

struct ParityFixture {
  std::string arch;  // qwen3_moe (Qwen3 dense included) | qwen3_next
  std::string name;
  std::string dir;
};

// gtest names a case by its fixture (instead of dumping the struct's bytes).
void PrintTo(const ParityFixture& f, std::ostream* os) {
  *os << f.arch << " fixture " << f.name;
}

std::vector<ParityFixture> AllFixtures() {
  std::vector<ParityFixture> out;
  for (const std::string& n : testing_util::MoeFixtureNames())
    out.push_back({"qwen3_moe", n, std::string(OPD_FIXTURES_DIR) + "/" + n});
  for (const std::string& n : testing_util::NextFixtureNames())
    out.push_back({"qwen3_next", n, std::string(OPD_NEXT_FIXTURES_DIR) + "/" + n});
  return out;
}

TEST(Fixtures, IndexListsThem) {
  for (const auto& [root, names] :
       {std::pair{std::string(OPD_FIXTURES_DIR), testing_util::MoeFixtureNames()},
        std::pair{std::string(OPD_NEXT_FIXTURES_DIR), testing_util::NextFixtureNames()}}) {
    std::ifstream in(root + "/index.json");
    ASSERT_TRUE(in) << "no fixtures index in " << root;
    EXPECT_EQ(nlohmann::json::parse(in)["configs"].get<std::vector<std::string>>(), names) << root;
  }
}

struct Reference {
  std::vector<std::vector<int64_t>> seqs;
  std::map<std::string, torch::Tensor> ref;  // logits, logprobs, loss, grad.<param>, [aux_*]
};

Reference LoadReference(const std::string& dir) {
  Reference r;
  std::ifstream in(dir + "/inputs.json");
  r.seqs = nlohmann::json::parse(in)["sequences"].get<std::vector<std::vector<int64_t>>>();
  auto file = SafetensorsFile::Open(dir + "/ref.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (file.ok())
    for (const auto& [n, view] : (*file)->tensors()) r.ref[n] = TensorFromView(view, *file).clone();
  return r;
}

std::shared_ptr<CausalLM> MustLoad(const std::string& dir) {
  auto m = LoadModel(dir + "/model");
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : nullptr;
}

class Parity : public ::testing::TestWithParam<ParityFixture> {};

// Logits, log-probs through the chunked LM head, the loss transformers computed (next-token
// cross-entropy, plus aux_coef x the load-balancing loss where the fixture has one) and the
// gradient of every parameter.
TEST_P(Parity, LogitsLogprobsLossAndGradients) {
  const ParityFixture& p = GetParam();
  Reference f = LoadReference(p.dir);
  auto model = MustLoad(p.dir);
  ASSERT_TRUE(model);
  EXPECT_EQ(model->config().model_type == "qwen3_next", p.arch == "qwen3_next")
      << model->config().model_type;
  auto batch = PackedBatch::FromSequences(f.seqs);
  std::vector<torch::Tensor> router_logits;
  ForwardOptions opts;
  opts.router_logits = &router_logits;
  auto hidden = model->Forward(batch, opts);

  const double logit_diff = MaxAbsDiff(model->Logits(hidden), f.ref.at("logits"));
  EXPECT_LE(logit_diff, 1e-4) << "logits";
  auto [rows, targets] = NextTokenRows(batch);
  auto lp = TokenLogprobs(hidden.index_select(0, rows), model->LmHeadWeight(), targets);
  EXPECT_LE(MaxAbsDiff(lp, f.ref.at("logprobs")), 1e-4) << "log-probs";

  torch::Tensor loss = -lp.mean();
  if (f.ref.count("aux_loss")) {
    const auto& c = model->config();
    auto aux = LoadBalancingLoss(router_logits, c.num_experts, c.num_experts_per_tok);
    EXPECT_NEAR(aux.item<double>(), f.ref["aux_loss"].item<double>(), 1e-5) << "aux loss";
    loss = loss + f.ref["aux_coef"].item<double>() * aux;
  }
  EXPECT_NEAR(loss.item<double>(), f.ref.at("loss").item<double>(), 1e-5);
  loss.backward();
  int64_t checked = 0;
  for (const auto& param : model->named_parameters()) {
    auto it = f.ref.find("grad." + param.key());
    ASSERT_NE(it, f.ref.end()) << "no reference gradient for " << param.key();
    ASSERT_TRUE(param.value().grad().defined()) << "no gradient reached " << param.key();
    const double scale = std::max(it->second.abs().max().item<double>(), 1e-4);
    EXPECT_LE(MaxAbsDiff(param.value().grad(), it->second) / scale, 1e-4)
        << "gradient of " << param.key();
    ++checked;
  }
  EXPECT_GT(checked, 5);
  std::printf("[%s] max |logits diff| = %.3g, parameters with gradients checked: %lld\n",
              p.name.c_str(), logit_diff, static_cast<long long>(checked));
}

// Each sequence alone against transformers' rows of the packed reference, and the packed batch
// (in both orders: other chunk layouts) against the sequences alone.
TEST_P(Parity, PackedBatchEqualsEachSequenceAlone) {
  torch::NoGradGuard no_grad;
  const ParityFixture& p = GetParam();
  Reference f = LoadReference(p.dir);
  auto model = MustLoad(p.dir);
  ASSERT_TRUE(model);
  std::vector<torch::Tensor> alone;
  int64_t row = 0;
  for (const auto& s : f.seqs) {
    alone.push_back(model->Logits(model->Forward(PackedBatch::FromSequences({s}))));
    const int64_t n = static_cast<int64_t>(s.size());
    EXPECT_LE(MaxAbsDiff(alone.back(), f.ref.at("logits").narrow(0, row, n)), 1e-4)
        << "sequence of length " << n;
    row += n;
  }
  auto packed = model->Logits(model->Forward(PackedBatch::FromSequences(f.seqs)));
  EXPECT_LE(MaxAbsDiff(packed, torch::cat(alone)), 1e-5);
  std::vector<std::vector<int64_t>> reversed(f.seqs.rbegin(), f.seqs.rend());
  auto rev = model->Logits(model->Forward(PackedBatch::FromSequences(reversed)));
  EXPECT_LE(MaxAbsDiff(rev, torch::cat(std::vector<torch::Tensor>(alone.rbegin(), alone.rend()))),
            1e-5);
}

// Activation checkpointing (each decoder layer recomputed in the backward): the loss and every
// parameter's gradient equal the plain forward's, aux loss included (it flows through the router
// logits the recomputed layers return).
TEST_P(Parity, CheckpointedLayersGiveTheSameGradients) {
  const ParityFixture& p = GetParam();
  if (p.arch == "qwen3_next")
    GTEST_SKIP() << "qwen3_next (a teacher) has no activation checkpointing";
  Reference f = LoadReference(p.dir);
  auto batch = PackedBatch::FromSequences(f.seqs);
  auto [rows, targets] = NextTokenRows(batch);
  std::map<std::string, torch::Tensor> grads[2];
  double losses[2] = {0, 0};
  for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
    auto model = MustLoad(p.dir);
    ASSERT_TRUE(model);
    std::vector<torch::Tensor> router_logits;
    ForwardOptions opts;
    opts.router_logits = &router_logits;
    opts.checkpoint_layers = checkpointed == 1;
    auto hidden = model->Forward(batch, opts);
    auto lp = TokenLogprobs(hidden.index_select(0, rows), model->LmHeadWeight(), targets);
    const auto& c = model->config();
    torch::Tensor loss = -lp.mean();
    if (c.num_experts > 0)
      loss = loss + 0.01 * LoadBalancingLoss(router_logits, c.num_experts, c.num_experts_per_tok);
    loss.backward();
    losses[checkpointed] = loss.item<double>();
    for (const auto& param : model->named_parameters()) {
      ASSERT_TRUE(param.value().grad().defined())
          << param.key() << (checkpointed ? " (checkpointed)" : "");
      grads[checkpointed][param.key()] = param.value().grad().clone();
    }
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-6);
  for (const auto& [name, g] : grads[0]) {
    const double scale = std::max(g.abs().max().item<double>(), 1e-6);
    EXPECT_LE(MaxAbsDiff(g, grads[1].at(name)) / scale, 1e-5) << "gradient of " << name;
  }
}

// Prefill the first half of each sequence into the cache, then decode the rest one token per step
// with the slots at different lengths, finished sequences leaving the cache: every step's logits
// equal the full forward's (the KV cache, and Qwen3-Next's convolution and recurrent states).
TEST_P(Parity, CacheDecodeEqualsFullForward) {
  torch::NoGradGuard no_grad;
  const ParityFixture& p = GetParam();
  Reference f = LoadReference(p.dir);
  auto model = MustLoad(p.dir);
  ASSERT_TRUE(model);
  std::vector<std::vector<int64_t>> seqs;
  int64_t longest = 0;
  for (auto& s : f.seqs) {
    if (s.size() < 2) continue;
    seqs.push_back(s);
    longest = std::max<int64_t>(longest, static_cast<int64_t>(s.size()));
  }
  auto full = PackedBatch::FromSequences(seqs);
  auto full_logits = model->Logits(model->Forward(full));
  const double tol = 1e-4 * std::max(1.0, full_logits.abs().max().item<double>());

  std::vector<std::vector<int64_t>> prompts;
  for (auto& s : seqs) prompts.emplace_back(s.begin(), s.begin() + (s.size() + 1) / 2);
  KVCache cache = model->NewKVCache(static_cast<int64_t>(seqs.size()), longest);
  ForwardOptions opts;
  opts.cache = &cache;
  model->Forward(PackedBatch::FromSequences(prompts), opts);

  // `live[i]`: which sequence cache slot i holds.
  std::vector<int64_t> live(seqs.size());
  std::iota(live.begin(), live.end(), 0);
  double worst = 0;
  for (size_t step = 0;; ++step) {
    std::vector<int64_t> keep, still_live, tokens, rows;
    for (size_t i = 0; i < live.size(); ++i) {
      const auto& s = seqs[live[i]];
      const size_t pos = prompts[live[i]].size() + step;
      if (pos >= s.size()) continue;
      keep.push_back(static_cast<int64_t>(i));
      still_live.push_back(live[i]);
      tokens.push_back(s[pos]);
      rows.push_back(full.cu_seqlens[live[i]] + static_cast<int64_t>(pos));
    }
    if (keep.empty()) break;
    if (keep.size() != live.size()) cache = cache.Select(keep);
    live = still_live;
    auto h = model->Decode(torch::tensor(tokens, torch::kInt64), cache);
    worst = std::max(
        worst, MaxAbsDiff(model->Logits(h), full_logits.index_select(0, torch::tensor(rows))));
  }
  EXPECT_LE(worst, tol);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Parity, ::testing::ValuesIn(AllFixtures()),
                         [](const ::testing::TestParamInfo<ParityFixture>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace lm
