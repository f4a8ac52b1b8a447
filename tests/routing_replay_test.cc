// Routing replay (R3): the rollout records, per fed token and MoE layer, the experts it routed to
// (SamplingParams::return_routing); the learner's forward routes through exactly those
// (ForwardOptions::replay_experts) with its own fp32 gate weights.
//
// The property the issue asks for: on a model whose router has near-ties, the learner's
// log-probs of a sampled batch equal the sampler's to fp32 rounding with replay, and without
// replay they do not (the negative control, which shows the check can fail).
//
// Tolerance. With replay the sampler (prefill + KV-cache decode, the CPU fast paths) and the
// learner (one packed forward over prompt + response, the reference MoE path under autograd)
// compute the same function of the same weights with the same experts: they differ only in
// summation order (attention over a cache vs a packed sequence, grouped expert matmuls, the
// lm-head GEMM). Each fp32 op contributes about one ulp (6e-8 relative) of its output; over 4
// layers of a 32-wide model and a 96-way log-softmax of logits of magnitude <= ~10, that is a few
// 1e-7..1e-6 on a log-prob; 2e-5 leaves an order of magnitude for unlucky accumulations. A flipped
// expert (no replay), by contrast, swaps a whole expert MLP's output and moves log-probs by
// ~1e-3..1e-1 on these random weights.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "child_process.h"
#include "lm/generate/sampler.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "lm/model/moe.h"
#include "lm/model/qwen3_moe.h"
#include "lm/model/routing_trace.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "opd_task.h"
#include "rollout/engine.h"
#include "rollout/service.h"
#include "rpc/client.h"
#include "rpc/codec.h"
#include "rpc/server.h"
#include "tests/testing.h"

namespace rollout {

// The generation types and the sampler (lm/generate) the rollout code here builds on.
using lm::Sample;
using lm::SampleResponses;
using lm::SamplingParams;
namespace {

constexpr double kReplayTol = 2e-5;

std::shared_ptr<lm::CausalLM> Load(const std::string& fixture) {
  torch::set_num_threads(1);
  auto m = lm::LoadModel(std::string(OPD_FIXTURES_DIR) + "/" + fixture + "/model");
  EXPECT_TRUE(m.ok()) << m.status();
  (*m)->eval();
  return *m;
}

int64_t MoeLayers(const lm::ModelConfig& c) {
  return lm::RoutingTrace(c).layers();
}

// Every MoE router's rows made near-equal: row e = row 0 + scale * noise_e, so that the experts'
// logits differ by ~scale * |x| and rounding-level differences between two forwards decide ties.
void NearTieRouters(lm::CausalLM& model, double scale, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto& m = dynamic_cast<lm::Qwen3MoeForCausalLM&>(model);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (size_t i = 0; i < m.model->layers->size(); ++i) {
    auto layer = m.model->layers->ptr<lm::Qwen3MoeDecoderLayerImpl>(i);
    if (!layer->moe) continue;
    auto w = layer->moe->gate->weight;
    auto base = w[0].clone();
    auto noise = torch::randn(w.sizes(), gen, w.options());
    w.copy_(base.unsqueeze(0) + scale * noise);
  }
}

struct Learner {
  std::vector<float> logprobs;  // per response token, samples one after another
  double mismatch_frac = 0;     // (fed token, MoE layer) whose own top-k differs from the rollout's
};

// The learner's log-probs of the samples (prompt + response packed, as the OPD micro-batches),
// under autograd as in training; with `replay`, the samples' routing (-1 at each last token).
Learner Score(lm::CausalLM& model, const std::vector<std::vector<int32_t>>& prompts,
              const std::vector<Sample>& samples, bool replay) {
  const auto& c = model.config();
  const int64_t L = MoeLayers(c), k = c.num_experts_per_tok;
  std::vector<std::vector<int64_t>> docs;
  std::vector<int64_t> rows, targets;
  std::vector<int32_t> routing;
  int64_t at = 0;
  for (const auto& s : samples) {
    const auto& p = prompts[s.prompt_index];
    const std::vector<int64_t> response = testing_util::ResponseIds(s);
    std::vector<int64_t> doc(p.begin(), p.end());
    doc.insert(doc.end(), response.begin(), response.end());
    for (size_t t = 0; t < response.size(); ++t) {
      rows.push_back(at + static_cast<int64_t>(p.size() + t) - 1);
      targets.push_back(response[t]);
    }
    EXPECT_EQ(static_cast<int64_t>(s.routed_experts.size()),
              (static_cast<int64_t>(doc.size()) - 1) * L * k);
    routing.insert(routing.end(), s.routed_experts.begin(), s.routed_experts.end());
    routing.insert(routing.end(), L * k, -1);
    at += static_cast<int64_t>(doc.size());
    docs.push_back(std::move(doc));
  }
  auto batch = lm::PackedBatch::FromSequences(docs);
  auto replayed = torch::tensor(routing, torch::kInt32).view({at, L, k});
  lm::ForwardOptions fo;
  if (replay) fo.replay_experts = replayed;
  std::vector<torch::Tensor> own;
  torch::Tensor hidden;
  {
    lm::ScopedRoutingRecorder record(&own);
    hidden = model.Forward(batch, fo);
  }
  auto lp = lm::TokenLogprobs(hidden.index_select(0, torch::tensor(rows)), model.LmHeadWeight(),
                              torch::tensor(targets));
  Learner out;
  lp = lp.detach().contiguous();
  out.logprobs.assign(lp.data_ptr<float>(), lp.data_ptr<float>() + lp.numel());
  EXPECT_EQ(static_cast<int64_t>(own.size()), L);
  auto rollout = std::get<0>(replayed.to(torch::kInt64).sort(-1));
  auto learner = std::get<0>(torch::stack(own, 1).sort(-1));
  auto fed = (rollout >= 0).all(-1);
  out.mismatch_frac =
      ((rollout != learner).any(-1) & fed).sum().item<double>() / fed.sum().item<double>();
  return out;
}

std::vector<float> SamplerLogprobs(const std::vector<Sample>& samples) {
  std::vector<float> v;
  for (const auto& s : samples) v.insert(v.end(), s.logprobs.begin(), s.logprobs.end());
  return v;
}

double MaxGap(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, std::abs(double(a[i]) - b[i]));
  return m;
}

const std::vector<std::vector<int32_t>> kPrompts = {
    {1, 5, 9, 13, 2}, {7, 3}, {40, 41, 42, 43, 44, 45, 46, 47}, {11, 12, 13}};

SamplingParams Params() {
  SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 12;
  p.seed = 7;
  p.return_routing = true;
  return p;
}

void Sort(std::vector<Sample>& out) {
  std::sort(out.begin(), out.end(), [](const Sample& a, const Sample& b) {
    return std::tie(a.prompt_index, a.sample_index) < std::tie(b.prompt_index, b.sample_index);
  });
}

std::vector<Sample> SampleStatic(lm::CausalLM& model, const SamplingParams& p) {
  std::vector<Sample> out;
  auto st = SampleResponses(model, kPrompts, p, [&](Sample s) { out.push_back(std::move(s)); });
  EXPECT_TRUE(st.ok()) << st.status();
  Sort(out);
  return out;
}

std::vector<Sample> SampleEngine(const std::shared_ptr<lm::CausalLM>& model,
                                 const SamplingParams& p, int64_t num_blocks = 0) {
  EngineOptions o;
  if (num_blocks > 0) o.num_blocks = num_blocks;
  o.block_size = 4;
  auto engine = Engine::Create(*model, o);
  EXPECT_TRUE(engine.ok()) << engine.status();
  std::vector<Sample> out;
  absl::Status st = (*engine)->Generate(
      Snapshot{model, 0, nullptr}, kPrompts, p, [&](Sample s) { out.push_back(std::move(s)); },
      nullptr);
  EXPECT_TRUE(st.ok()) << st;
  Sort(out);
  return out;
}

// Replay with the learner's own routing is the same computation as no replay (RouteForced's
// weights are Route's): bit-identical hidden states.
TEST(RoutingReplay, ReplayingOwnRoutingIsExact) {
  auto model = Load("moe_mlp_only_gqa4");
  auto batch = lm::PackedBatch::FromSequences({{1, 2, 3, 4, 5}, {9, 8, 7}});
  std::vector<torch::Tensor> own;
  torch::Tensor plain;
  {
    lm::ScopedRoutingRecorder record(&own);
    plain = model->Forward(batch);
  }
  ASSERT_EQ(static_cast<int64_t>(own.size()), MoeLayers(model->config()));
  lm::ForwardOptions fo;
  fo.replay_experts = torch::stack(own, 1);
  auto replayed = model->Forward(batch, fo);
  EXPECT_TRUE(torch::equal(plain, replayed));
  // Wrong shape: an error naming the option.
  fo.replay_experts = fo.replay_experts.narrow(0, 0, 3);
  try {
    model->Forward(batch, fo);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("replay_experts"), std::string::npos) << e.what();
  }
}

// Gradients flow through the replayed gate weights into the router (and the experts).
TEST(RoutingReplay, BackwardReachesRouter) {
  auto model = Load("moe_untied_top1_sparse2");
  auto batch = lm::PackedBatch::FromSequences({{1, 2, 3, 4, 5}});
  const auto& c = model->config();
  lm::ForwardOptions fo;
  fo.replay_experts = torch::zeros({5, MoeLayers(c), c.num_experts_per_tok}, torch::kInt32);
  fo.checkpoint_layers = true;
  model->Forward(batch, fo).pow(2).sum().backward();
  auto& m = dynamic_cast<lm::Qwen3MoeForCausalLM&>(*model);
  for (size_t i = 0; i < m.model->layers->size(); ++i) {
    auto layer = m.model->layers->ptr<lm::Qwen3MoeDecoderLayerImpl>(i);
    if (!layer->moe) continue;
    auto g = layer->moe->gate->weight.grad();
    ASSERT_TRUE(g.defined());
    EXPECT_GT(g.abs().sum().item<double>(), 0);
    // Only expert 0 was routed to: the others' weights get no gradient.
    auto ge = layer->moe->experts->gate_up_proj.grad();
    EXPECT_GT(ge[0].abs().sum().item<double>(), 0);
    EXPECT_EQ(ge.narrow(0, 1, ge.size(0) - 1).abs().sum().item<double>(), 0);
  }
}

// The sampler's and the engine's routing: every fed position, shared prompt prefix per prompt.
TEST(RoutingReplay, RecordsEveryFedPosition) {
  auto model = Load("moe_mlp_only_gqa4");
  const int64_t L = MoeLayers(model->config()), k = model->config().num_experts_per_tok;
  for (bool engine : {false, true}) {
    auto samples = engine ? SampleEngine(model, Params()) : SampleStatic(*model, Params());
    ASSERT_EQ(samples.size(), kPrompts.size() * 2);
    for (const auto& s : samples) {
      const int64_t positions =
          static_cast<int64_t>(kPrompts[s.prompt_index].size()) + s.response_length() - 1;
      EXPECT_EQ(s.routing_layers, L);
      EXPECT_EQ(s.routing_top_k, k);
      ASSERT_EQ(static_cast<int64_t>(s.routed_experts.size()), positions * L * k) << engine;
    }
    // Two samples of a prompt share its prefill.
    const int64_t prompt = static_cast<int64_t>(kPrompts[0].size()) * L * k;
    EXPECT_TRUE(std::equal(samples[0].routed_experts.begin(),
                           samples[0].routed_experts.begin() + prompt,
                           samples[1].routed_experts.begin()));
  }
  // Off by default: nothing recorded.
  SamplingParams p = Params();
  p.return_routing = false;
  for (const auto& s : SampleStatic(*model, p)) EXPECT_TRUE(s.routed_experts.empty());
}

// The property, with a negative control. Several near-tie scales: with replay every one
// stays at fp32 rounding; without replay at least one of them flips experts between the
// sampler's and the learner's forwards, and moves the log-probs visibly.
TEST(RoutingReplay, LearnerMatchesSamplerOnNearTies) {
  for (const char* fixture : {"moe_untied_top1_sparse2", "moe_mlp_only_gqa4"}) {
    for (bool engine : {false, true}) {
      double worst_no_replay_gap = 0, worst_mismatch = 0;
      for (double scale : {1e-5, 1e-6, 1e-7}) {
        auto model = Load(fixture);
        NearTieRouters(*model, scale, 3);
        auto samples = engine ? SampleEngine(model, Params()) : SampleStatic(*model, Params());
        const auto sampler = SamplerLogprobs(samples);
        const Learner with = Score(*model, kPrompts, samples, /*replay=*/true);
        const Learner without = Score(*model, kPrompts, samples, /*replay=*/false);
        const double gap_with = MaxGap(with.logprobs, sampler);
        const double gap_without = MaxGap(without.logprobs, sampler);
        EXPECT_LE(gap_with, kReplayTol)
            << fixture << (engine ? " engine" : " sampler") << " scale " << scale;
        worst_no_replay_gap = std::max(worst_no_replay_gap, gap_without);
        worst_mismatch = std::max(worst_mismatch, without.mismatch_frac);
        std::printf("%s %s scale %g: max |gap| replay %.3g, no replay %.3g, mismatch %.4f\n",
                    fixture, engine ? "engine" : "sampler", scale, gap_with, gap_without,
                    without.mismatch_frac);
      }
      // The negative control: the same check without replay fails on these near-ties.
      EXPECT_GT(worst_mismatch, 0) << fixture;
      EXPECT_GT(worst_no_replay_gap, 10 * kReplayTol) << fixture;
    }
  }
}

// Under preemption the engine recomputes a sequence from its prompt and tokens; the routing
// returned is still the one each token was drawn under, so replay stays at rounding.
TEST(RoutingReplay, EngineRoutingSurvivesPreemption) {
  auto model = Load("moe_untied_top1_sparse2");
  NearTieRouters(*model, 1e-7, 3);
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 10;  // 9 usable blocks: 8 sequences of up to 20 tokens preempt each other
  auto engine = Engine::Create(*model, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<Sample> samples;
  absl::Status st = (*engine)->Generate(
      Snapshot{model, 0, nullptr}, kPrompts, Params(),
      [&](Sample s) { samples.push_back(std::move(s)); }, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  Sort(samples);
  EXPECT_GT((*engine)->stats().preemptions, 0);
  const Learner with = Score(*model, kPrompts, samples, /*replay=*/true);
  EXPECT_LE(MaxGap(with.logprobs, SamplerLogprobs(samples)), kReplayTol);
}

// A model whose MoE does not record refuses return_routing (here: a dense model).
TEST(RoutingReplay, RefusedWithoutMoeRouting) {
  auto model = Load("dense_qwen3");
  SamplingParams p = Params();
  auto st = SampleResponses(*model, kPrompts, p, [](Sample) {});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("return_routing"), std::string::npos) << st.status();
}

// A rollout service on a loopback port and a client of it; the test shuts the server down.
struct LocalRollout {
  opd::rpc::RunningServer running;
  std::unique_ptr<opd::rpc::RolloutClient> client;
};

absl::StatusOr<LocalRollout> ServeOnLoopback(grpc::Service* service) {
  opd::rpc::ServerOptions server_opts;
  server_opts.listen = "127.0.0.1:0";
  LocalRollout local;
  ASSIGN_OR_RETURN(local.running,
                   opd::rpc::StartServer(server_opts, {service}, {"opd.v1.Rollout"}));
  opd::rpc::ClientOptions co;
  co.address = "127.0.0.1:" + std::to_string(local.running.port);
  ASSIGN_OR_RETURN(local.client, opd::rpc::RolloutClient::Create(co));
  return local;
}

// Routing survives the wire: Generate with return_routing over gRPC (an in-process rollout
// service on the static sampler) returns each sample's routed_experts as the sampler made them.
TEST(RoutingReplay, SurvivesTheWire) {
  auto model = Load("moe_mlp_only_gqa4");
  WeightStore store(model);
  opd::rpc::Authenticator auth("");
  ServiceOptions so;
  so.limits.vocab_size = model->config().vocab_size;
  so.limits.max_seq_len = 256;
  opd::v1::ServiceInfo info;
  info.set_service("opd.v1.Rollout");
  info.set_vocab_size(model->config().vocab_size);
  RolloutService service(&store, &auth, so, info);
  auto served = ServeOnLoopback(&service);
  ASSERT_TRUE(served.ok()) << served.status();
  auto& client = served->client;

  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : kPrompts) prompts.emplace_back(p.begin(), p.end());
  lm::SamplingParams g;
  g.samples_per_prompt = 2;
  g.max_new_tokens = 12;
  g.seed = 7;
  g.return_routing = true;
  auto got = client->Generate(prompts, g);
  ASSERT_TRUE(got.ok()) << got.status();
  const auto local = SampleStatic(*model, Params());
  ASSERT_EQ(got->size(), local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    EXPECT_EQ((*got)[i].routing_layers, local[i].routing_layers);
    EXPECT_EQ((*got)[i].routing_top_k, local[i].routing_top_k);
    EXPECT_EQ((*got)[i].routed_experts, local[i].routed_experts) << i;
    EXPECT_FALSE((*got)[i].routed_experts.empty());
  }
  g.return_routing = false;  // off: nothing on the wire
  auto plain = client->Generate(prompts, g);
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (const auto& s : *plain) EXPECT_TRUE(s.routed_experts.empty());
  served->running.server->Shutdown(std::chrono::system_clock::now());
}

// A worker whose routed_experts does not fit the sample (prompt + response - 1 positions x
// layers x top_k): the client refuses it, naming the field.
class BadRoutingRollout final : public opd::v1::Rollout::Service {
 public:
  grpc::Status Generate(grpc::ServerContext*, const opd::v1::GenerateRequest* req,
                        grpc::ServerWriter<opd::v1::Sample>* writer) override {
    opd::v1::Sample m;
    m.add_tokens(5);
    m.add_tokens(6);
    *m.mutable_logprobs() = opd::rpc::PackArray(std::vector<float>{-1.0f, -1.0f});
    m.set_finish_reason(opd::v1::FINISH_REASON_STOP);
    // Prompt of 3 tokens + 2 response tokens - 1 = 4 positions x 2 layers x 2: 16 ids; send 15.
    *m.mutable_routed_experts() = opd::rpc::PackArray(std::vector<int32_t>(15, 0));
    m.set_routing_layers(2);
    m.set_routing_top_k(2);
    writer->Write(m);
    return grpc::Status::OK;
  }
};

TEST(RoutingReplay, WrongSizeIsRefusedNamingTheField) {
  BadRoutingRollout service;
  auto served = ServeOnLoopback(&service);
  ASSERT_TRUE(served.ok()) << served.status();
  auto& client = served->client;
  lm::SamplingParams g;
  g.max_new_tokens = 256;
  g.return_routing = true;
  auto got = client->Generate({{1, 2, 3}}, g);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("routed_experts"), std::string::npos) << got.status();
  served->running.server->Shutdown(std::chrono::system_clock::now());
}

// A short OPD run with rollout.routing_replay on against real services (the demo task's
// Qwen3-MoE student): it trains, and every step logs the routing mismatch share next to the
// sampler/learner gap of the replayed forward.
TEST(RoutingReplay, OpdRunLogsTheReplayMetrics) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("routing_replay_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string secret = "routing-replay-secret-91";
  ASSERT_TRUE(testing_util::MakeOpdTask(
      dir, "--teacher-examples 50 --student-examples 10 --prompts 16 --eval 4", secret));
  std::vector<std::unique_ptr<testing_util::ChildProcess>> services;
  auto start = [&](const std::string& tag, const std::string& binary, const std::string& model) {
    testing_util::Served s = testing_util::StartTaskService(dir, tag, binary, model);
    services.push_back(std::move(s.process));
    return s.address;
  };
  const std::string bin = OPD_BINARY_DIR;
  const std::string teacher =
      start("teacher", bin + "/teacher_service/opd-teacher", (dir / "teacher_small").string());
  const std::string ro = start("rollout", bin + "/rollout/opd-rollout", (dir / "student").string());
  ASSERT_FALSE(teacher.empty() || ro.empty());
  const fs::path run = dir / "run";
  auto args = testing_util::OpdTrainerArgs(
      dir, run.string(), ro,
      {"stages.0.teachers=[" + teacher + "]", "stages.0.max_steps=1",
       "stages.0.plateau.enabled=false", "stages.1.teachers=[" + teacher + "]",
       "stages.1.max_steps=1", "train.prompts_per_step=4", "rollout.routing_replay=true"});
  testing_util::ChildProcess trainer(args, (dir / "opd.log").string());
  ASSERT_EQ(trainer.Wait(std::chrono::seconds(300)), 0) << trainer.Log();
  int steps = 0;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto m = nlohmann::json::parse(line);
    if (!m.contains("opd/reverse_kl")) continue;
    ++steps;
    ASSERT_TRUE(m.contains("opd/routing_mismatch_frac")) << m.dump();
    const double frac = m["opd/routing_mismatch_frac"].get<double>();
    EXPECT_GE(frac, 0.0);
    EXPECT_LE(frac, 1.0);
    EXPECT_TRUE(m["opd/sampler_learner_abs_diff"].is_number()) << m.dump();
    std::printf("step %d: routing_mismatch_frac %.4f, sampler_learner_abs_diff %.3g\n",
                m["step"].get<int>(), frac, m["opd/sampler_learner_abs_diff"].get<double>());
  }
  EXPECT_EQ(steps, 2);
  services.clear();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rollout
