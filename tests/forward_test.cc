// The one forward of each architecture over its three attention contexts (lm/model/
// attention_context.h), and routing replay's record (lm/model/routing_trace.h).
#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fixture_names.h"
#include "lm/model/model.h"
#include "lm/model/routing_trace.h"

namespace {

using lm::CausalLM;

// Every fixture of both architectures, as "<dir>/<name>".
std::vector<std::string> AllFixtures() {
  std::vector<std::string> out;
  for (const auto& n : testing_util::MoeFixtureNames())
    out.push_back(std::string(OPD_FIXTURES_DIR) + "/" + n);
  for (const auto& n : testing_util::NextFixtureNames())
    out.push_back(std::string(OPD_NEXT_FIXTURES_DIR) + "/" + n);
  return out;
}

std::string Leaf(const std::string& path) {
  return path.substr(path.rfind('/') + 1);
}

std::vector<std::vector<int64_t>> RandomDocs(int64_t vocab, const std::vector<int64_t>& lengths) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  std::vector<std::vector<int64_t>> docs;
  for (int64_t n : lengths) {
    auto t = torch::randint(vocab, {n}, gen, torch::kInt64);
    docs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  return docs;
}

double RelDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

// Tolerance between two contexts' logits, fp32: the three attentions sum the same terms in other
// orders (varlen flash tiles, the cache's masked softmax, the pool read through block tables; the
// delta rule chunked or one token at a time), each sum of n terms within ~n * 2^-24 relative of
// the other; with at most 128 keys and 4 layers of such sums feeding each other that is below
// 4 * 128 * 6e-8 = 3e-5 of the logits' scale, and 1e-4 (the parity tests' bound against
// transformers) leaves room for the residual adds and the head.
constexpr double kContextTolerance = 1e-4;

class ForwardContexts : public ::testing::TestWithParam<std::string> {};

// The same tokens through the three contexts give the same logits at every position: the packed
// forward of whole documents; a prefill into a contiguous cache followed by one-token decode
// steps; paged steps over scattered blocks and state slots that mix prefills, decodes and chunks
// continuing a context.
TEST_P(ForwardContexts, SameLogitsFromEveryContext) {
  torch::set_num_threads(1);
  auto loaded = lm::LoadModel(GetParam() + "/model");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  CausalLM& model = **loaded;
  model.eval();
  torch::NoGradGuard no_grad;
  // 70 tokens: more than one 64-token chunk of the delta rule.
  const std::vector<int64_t> lengths{5, 23, 70};
  const auto docs = RandomDocs(model.config().vocab_size, lengths);
  const int64_t B = static_cast<int64_t>(docs.size());
  const auto batch = lm::PackedBatch::FromSequences(docs);
  const torch::Tensor packed = model.Logits(model.Forward(batch));  // [T, V]
  auto packed_row = [&](int64_t b, int64_t pos) { return packed[batch.cu_seqlens[b] + pos]; };

  // Contiguous cache: prompts of 1, 19 and 66 tokens, then 4 decode steps each.
  const std::vector<int64_t> prompt{1, 19, 66};
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t b = 0; b < B; ++b)
    prompts.emplace_back(docs[b].begin(), docs[b].begin() + prompt[b]);
  lm::KVCache cache = model.NewKVCache(B, 80);
  lm::ForwardOptions fill;
  fill.cache = &cache;
  const auto prompt_batch = lm::PackedBatch::FromSequences(prompts);
  const torch::Tensor prefill = model.Logits(model.Forward(prompt_batch, fill));
  EXPECT_EQ(cache.lengths, prompt);  // Finish counts what the prefill wrote
  std::vector<torch::Tensor> got, want;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t p = 0; p < prompt[b]; ++p) {
      got.push_back(prefill[prompt_batch.cu_seqlens[b] + p]);
      want.push_back(packed_row(b, p));
    }
  }
  for (int64_t step = 0; step < 4; ++step) {
    std::vector<int64_t> next;
    for (int64_t b = 0; b < B; ++b) next.push_back(docs[b][prompt[b] + step]);
    const torch::Tensor logits = model.Logits(model.Decode(torch::tensor(next), cache));
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_EQ(cache.lengths[b], prompt[b] + step + 1);
      got.push_back(logits[b]);
      want.push_back(packed_row(b, prompt[b] + step));
    }
  }
  const double cached = RelDiff(torch::stack(got), torch::stack(want));
  EXPECT_LE(cached, kContextTolerance);

  // Paged: blocks of 4 handed out round-robin (never contiguous), state slots out of order;
  // first chunks of 3, 10 and 40 tokens, then 1, 6 and 30 a step (decodes and continued chunks
  // in one step). A step returns each sequence's last new token.
  const int64_t block = 4;
  std::vector<std::vector<int32_t>> tables(B);
  int32_t next_block = 1;
  for (int64_t j = 0; j * block < 70; ++j)
    for (int64_t b = 0; b < B; ++b)
      if (j * block < lengths[b]) tables[b].push_back(next_block++);
  lm::PagedKVCache pool = model.NewPagedKVCache(next_block, block, /*num_state_slots=*/6);
  const std::vector<int64_t> slots{4, 0, 2}, first{3, 10, 40}, chunk{1, 6, 30};
  std::vector<int64_t> done(B, 0);
  got.clear();
  want.clear();
  int64_t steps = 0;
  while (true) {
    lm::PagedStep step;
    std::vector<int64_t> ids, members;
    step.cu_seqlens.push_back(0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = std::min(done[b] == 0 ? first[b] : chunk[b], lengths[b] - done[b]);
      if (n == 0) continue;
      ids.insert(ids.end(), docs[b].begin() + done[b], docs[b].begin() + done[b] + n);
      step.cu_seqlens.push_back(static_cast<int64_t>(ids.size()));
      step.context_lens.push_back(done[b]);
      step.block_tables.push_back(tables[b]);
      step.state_slots.push_back(slots[b]);
      members.push_back(b);
      done[b] += n;
    }
    if (members.empty()) break;
    step.input_ids = torch::tensor(ids, torch::kInt64);
    const torch::Tensor logits = model.Logits(model.PagedForward(step, pool));
    ASSERT_EQ(logits.size(0), static_cast<int64_t>(members.size()));  // the last rows alone
    for (size_t i = 0; i < members.size(); ++i) {
      got.push_back(logits[i]);
      want.push_back(packed_row(members[i], done[members[i]] - 1));
    }
    ++steps;
  }
  EXPECT_EQ(steps, 4);
  const double paged = RelDiff(torch::stack(got), torch::stack(want));
  EXPECT_LE(paged, kContextTolerance);
  std::printf("[%s] vs the packed forward: cached decode %.3g, paged %.3g (relative)\n",
              Leaf(GetParam()).c_str(), cached, paged);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ForwardContexts, ::testing::ValuesIn(AllFixtures()),
                         [](const auto& info) { return Leaf(info.param); });

// 6 layers, MoE where (i + 1) % 2 == 0 and i is not in mlp_only_layers {3}: layers 1 and 5.
lm::ModelConfig SparseConfig() {
  lm::ModelConfig c;
  c.model_type = "qwen3_moe";
  c.num_hidden_layers = 6;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.decoder_sparse_step = 2;
  c.mlp_only_layers = {3};
  return c;
}

TEST(RoutingTrace, LayoutMapsDecoderLayersToMoeLayers) {
  const lm::RoutingTrace t(SparseConfig());
  EXPECT_EQ(t.layers(), 2);
  EXPECT_EQ(t.top_k(), 2);
  EXPECT_EQ(t.per_position(), 4);
  EXPECT_TRUE(t.recordable());
  const std::vector<int64_t> want{-1, 0, -1, -1, -1, 1};
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(t.MoeIndex(i), want[i]) << "layer " << i;
  EXPECT_EQ(t.MoeIndex(6), -1);
  lm::ModelConfig dense = SparseConfig();
  dense.num_experts = 0;
  EXPECT_FALSE(lm::RoutingTrace(dense).recordable());
}

// Recorded per layer ([rows, k] each, as ScopedRoutingRecorder gives them), kept as ids
// [positions, layers, k], and given back per layer and as replay_experts: the same ids.
TEST(RoutingTrace, RecordedIdsRoundTrip) {
  lm::RoutingTrace t(SparseConfig());
  const auto layer0 = torch::tensor({0, 1, 2, 3, 4, 5}, torch::kInt64).view({3, 2});
  const auto layer1 = torch::tensor({7, 6, 5, 4, 3, 2}, torch::kInt64).view({3, 2});
  ASSERT_TRUE(t.AppendRecorded({layer0, layer1}, 3).ok());
  EXPECT_EQ(t.positions(), 3);
  EXPECT_EQ(t.ids(), (std::vector<int32_t>{0, 1, 7, 6, 2, 3, 5, 4, 4, 5, 3, 2}));
  const auto p1 = t.Positions(1, 1);
  EXPECT_EQ(std::vector<int32_t>(p1.begin(), p1.end()), (std::vector<int32_t>{2, 3, 5, 4}));
  t.AppendUnrouted(1);
  EXPECT_EQ(t.positions(), 4);
  const auto replay = t.ToTensor();
  ASSERT_EQ(replay.sizes(), (std::vector<int64_t>{4, 2, 2}));
  EXPECT_TRUE(t.CheckReplay(replay, 4).ok());
  EXPECT_TRUE(torch::equal(t.LayerIds(replay, 1).narrow(0, 0, 3), layer0.to(torch::kInt32)));
  EXPECT_TRUE(torch::equal(t.LayerIds(replay, 5).narrow(0, 0, 3), layer1.to(torch::kInt32)));
  EXPECT_FALSE(t.LayerIds(replay, 0).defined());  // a dense layer replays nothing
  EXPECT_TRUE(torch::equal(t.LayerIds(replay, 1)[3], torch::full({2}, -1, torch::kInt32)));
  const auto per_layer = t.PerLayer();
  ASSERT_EQ(per_layer.size(), 2u);
  EXPECT_TRUE(torch::equal(per_layer[1], t.LayerIds(replay, 5)));
  // What a sample carries goes back into a trace of the same layout unchanged.
  lm::RoutingTrace again(SparseConfig());
  ASSERT_TRUE(again.Append(t.ids()).ok());
  EXPECT_EQ(again.ids(), t.ids());
}

TEST(RoutingTrace, WrongShapesNameWhatIsWrong) {
  lm::RoutingTrace t(SparseConfig());
  // A partial position.
  auto st = t.Append(std::vector<int32_t>{1, 2, 3});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("3 ids are not whole positions of 2 MoE layers x top_k 2"),
            std::string::npos)
      << st;
  // A recorder that saw one MoE layer of the two, or rows of another forward.
  const auto ids = torch::zeros({3, 2}, torch::kInt64);
  st = t.AppendRecorded({ids}, 3);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_NE(st.message().find("recorded 1 MoE layers in a forward, expected 2"), std::string::npos)
      << st;
  st = t.AppendRecorded({ids, ids}, 4);
  EXPECT_NE(st.message().find("of shape [3, 2, 2], expected [4, 2, 2]"), std::string::npos) << st;
  EXPECT_EQ(t.positions(), 0);  // nothing was appended
  // A sample's record: another layout, a wrong count, an expert out of range.
  const std::vector<int32_t> two(2 * 4, 1);
  st = t.Check("sample 3", two, 3, 2, 2);
  EXPECT_NE(st.message().find("sample 3 holds 8 ids as [3 layers, top_k 2], expected 2 positions "
                              "x 2 MoE layers x top_k 2"),
            std::string::npos)
      << st;
  st = t.Check("sample 3", two, 2, 2, 3);
  EXPECT_NE(st.message().find("expected 3 positions"), std::string::npos) << st;
  std::vector<int32_t> bad = two;
  bad[5] = 8;
  st = t.Check("sample 3", bad, 2, 2, 2);
  EXPECT_NE(st.message().find("sample 3 names expert 8 of 8"), std::string::npos) << st;
  EXPECT_TRUE(t.Check("sample 3", two, 2, 2, 2).ok());
  // replay_experts of another shape.
  st = t.CheckReplay(torch::zeros({5, 3, 2}, torch::kInt32), 5);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("replay_experts must be [tokens=5, moe_layers=2, top_k=2], got "
                              "[5, 3, 2]"),
            std::string::npos)
      << st;
}

}  // namespace
