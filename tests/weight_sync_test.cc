// Weight pushes from the learner to rollout workers (trainer/opd/weight_push.h,
// rollout/weight_sync.h, rollout/weights.h): in the worker's dtype, only the changed tensors, over
// gRPC streaming or collective sync over c10d Gloo on loopback.
//
// Covered: XXH64 against the reference vectors; bucket packing; a sync over Gloo (and over gRPC)
// delivers bit-identical weights for fp32 and bf16 workers and sends only changed tensors
// (counted); stale versions, wrong checksums and broadcasts that end early are refused naming the
// tensor, leaving the serving weights as they were; a learner killed mid-broadcast leaves the
// worker serving the old version and answering; a worker killed mid-broadcast is UNAVAILABLE to
// the learner, never a hang; a worker that takes full updates only gets them; a bf16 opd-rollout
// takes an fp32 learner's push and samples with it; an OPD run with rollout.weight_sync=collective
// ends with the weights of the gRPC run.
#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "child_process.h"
#include "lm/dist/process_group.h"
#include "lm/model/logprobs.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "opd_task.h"
#include "rollout/service.h"
#include "rpc/auth.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "rpc/status.h"
#include "rpc/tensor_codec.h"
#include "rpc/weight_wire.h"
#include "tests/gpu.h"
#include "tests/local_rollout.h"
#include "tests/tensor_testing.h"
#include "tests/testing.h"
#include "trainer/opd/weight_push.h"

using testing_util::TempDir;

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;
using trainer::WeightSyncMode;

constexpr const char* kModel = "moe_tied_topk8";  // vocab 96, 256 positions
constexpr const char* kSecret = "weight-sync-secret";
const std::string kBin = OPD_BINARY_DIR;

std::string FixtureModel() {
  return std::string(OPD_FIXTURES_DIR) + "/" + kModel + "/model";
}

fs::path WriteSecret(const fs::path& dir) {
  const fs::path p = dir / "secret";
  std::ofstream(p) << kSecret << "\n";
  chmod(p.c_str(), 0600);
  return p;
}

std::shared_ptr<lm::CausalLM> Load(torch::Dtype dtype = torch::kFloat32,
                                   const std::string& dir = FixtureModel()) {
  torch::set_num_threads(1);
  auto m = lm::LoadModel(dir, lm::LoadOptions{dtype, torch::kCPU});
  EXPECT_TRUE(m.ok()) << m.status();
  (*m)->eval();
  for (auto& p : (*m)->parameters()) p.set_requires_grad(false);
  return *m;
}

// The fixture's architecture with other weights (the learner's student after training).
std::shared_ptr<lm::CausalLM> ModelB() {
  auto b = Load();
  b->InitWeights(0.2, 4242);
  return b;
}

std::vector<std::pair<std::string, torch::Tensor>> Params(lm::CausalLM& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

std::vector<opd::rpc::OutgoingTensor> Wire(lm::CausalLM& m, torch::Dtype dtype) {
  auto w = opd::rpc::OutgoingTensorsOf(Params(m), opd::rpc::WireDtypeOf(dtype).value());
  torch::Tensor staging = torch::empty({4096}, torch::kUInt8);
  opd::rpc::ComputeChecksums(&w, staging);
  return w;
}

// A rollout service in this process over the fixture's model in `dtype` (tests/local_rollout.h).
class LocalRollout : public testing_util::LocalRollout {
 public:
  explicit LocalRollout(torch::Dtype dtype)
      : testing_util::LocalRollout(Load(dtype), dtype, kSecret) {}
};

opd::rpc::ClientOptions Client(const std::string& address, const std::string& secret = kSecret) {
  opd::rpc::ClientOptions o;
  o.address = address;
  o.secret = secret;
  o.timeout = absl::Seconds(60);
  return o;
}

std::unique_ptr<trainer::WeightPusher> Pusher(const std::string& address, WeightSyncMode mode,
                                              std::function<void(int64_t)> on_bucket = nullptr,
                                              torch::Device learner = torch::kCPU) {
  auto client = opd::rpc::RolloutClient::Create(Client(address));
  EXPECT_TRUE(client.ok()) << client.status();
  auto info = (*client)->Info();
  EXPECT_TRUE(info.ok()) << info.status();
  trainer::WeightPushOptions po;
  po.mode = mode;
  po.bucket_bytes = 4096;  // many buckets, tensors split across them
  po.group_timeout = absl::Seconds(60);
  po.grpc_chunk_bytes = 1000;
  po.on_bucket = std::move(on_bucket);
  auto p = trainer::WeightPusher::Connect(Client(address), *info, po, learner);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : nullptr;
}

// Every parameter the worker serves equals the learner's cast to `dtype`, bit for bit.
void ExpectServes(rollout::WeightStore& store, lm::CausalLM& learner, torch::Dtype dtype,
                  int64_t version) {
  rollout::Snapshot s = store.Current();
  EXPECT_EQ(s.version, version);
  auto served = Params(*s.model);
  auto want = Params(learner);
  ASSERT_EQ(served.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(served[i].first, want[i].first);
    EXPECT_EQ(served[i].second.scalar_type(), dtype);
    EXPECT_TRUE(torch::equal(served[i].second, want[i].second.to(torch::kCPU).to(dtype)))
        << want[i].first;
  }
}

int64_t TotalBytes(const std::vector<opd::rpc::OutgoingTensor>& w) {
  int64_t n = 0;
  for (const auto& t : w) n += t.bytes;
  return n;
}

// ---------------------------------------------------------------------------------------------

TEST(Xxh64, MatchesTheReferenceVectorsInAnyPieces) {
  std::string big;
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 256; ++i) big.push_back(static_cast<char>(i));
  big += "xyz";
  // libxxhash's XXH64(data, len, 0).
  const std::vector<std::pair<std::string, uint64_t>> cases = {{"", 0xef46db3751d8e999ULL},
                                                               {"a", 0xd24ec4f1a98c6e5bULL},
                                                               {"abc", 0x44bc2cf5ad770999ULL},
                                                               {big, 0xe921a1b45bd779f8ULL}};
  for (const auto& [data, want] : cases) {
    EXPECT_EQ(opd::rpc::Xxh64::Of(data.data(), data.size()), want) << data.size();
    for (size_t piece : {1, 7, 31, 33, 100}) {
      opd::rpc::Xxh64 h;
      for (size_t off = 0; off < data.size(); off += piece)
        h.Update(data.data() + off, std::min(piece, data.size() - off));
      EXPECT_EQ(h.Digest(), want) << data.size() << " in pieces of " << piece;
    }
  }
}

TEST(WeightWire, BucketsHoldTheCastBytesInManifestOrder) {
  torch::manual_seed(3);
  std::vector<std::pair<std::string, torch::Tensor>> params = {{"a", torch::randn({5, 7})},
                                                               {"empty", torch::randn({0})},
                                                               {"b", torch::randn({33})},
                                                               {"c", torch::randn({2, 3, 4})}};
  for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto wire = opd::rpc::OutgoingTensorsOf(params, opd::rpc::WireDtypeOf(dtype).value());
    std::string stream;
    torch::Tensor bucket = torch::empty({24}, torch::kUInt8);
    std::vector<size_t> order = {2, 0, 1, 3};
    std::vector<int64_t> seen(params.size(), 0);
    ASSERT_TRUE(opd::rpc::PackBuckets(wire, order, bucket, [&](int64_t n, const auto& segments) {
                  EXPECT_LE(n, 24);
                  for (const auto& s : segments) {
                    EXPECT_EQ(s.offset, seen[s.tensor]);
                    seen[s.tensor] += s.bytes;
                  }
                  stream.append(static_cast<char*>(bucket.data_ptr()), n);
                  return absl::OkStatus();
                }).ok());
    std::string want;
    for (size_t i : order) {
      torch::Tensor t = params[i].second.to(dtype).contiguous();
      want.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
      EXPECT_EQ(seen[i], static_cast<int64_t>(t.nbytes()));
    }
    EXPECT_EQ(stream, want);
    // The checksums are those of the cast bytes, through a staging buffer or directly.
    torch::Tensor staging = torch::empty({16}, torch::kUInt8);
    opd::rpc::ComputeChecksums(&wire, staging);
    for (size_t i = 0; i < params.size(); ++i) {
      torch::Tensor t = params[i].second.to(dtype).contiguous();
      EXPECT_EQ(wire[i].checksum, opd::rpc::Xxh64::Of(t.data_ptr(), t.nbytes())) << i;
    }
  }
}

// A push delivers the learner's weights bit for bit in the worker's dtype, over Gloo and over
// gRPC; later pushes send only the tensors whose wire bytes changed.
TEST(WeightSync, DeliversBitIdenticalWeightsAndOnlyChangedTensors) {
  for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (WeightSyncMode mode : {WeightSyncMode::kCollective, WeightSyncMode::kGrpc}) {
      const bool collective = mode == WeightSyncMode::kCollective;
      SCOPED_TRACE(std::string(opd::rpc::DtypeName(dtype)) + (collective ? " gloo" : " grpc"));
      LocalRollout worker(dtype);
      auto b = ModelB();
      auto pusher = Pusher(worker.address(), mode);
      ASSERT_NE(pusher, nullptr);
      EXPECT_EQ(opd::rpc::TorchDtype(pusher->wire_dtype()), dtype);
      EXPECT_EQ(pusher->has_group(), collective);

      auto wire = Wire(*b, dtype);
      auto r = pusher->Push(wire, 1);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->collective, collective);
      EXPECT_EQ(r->tensors, static_cast<int64_t>(wire.size()));
      EXPECT_EQ(r->bytes, TotalBytes(wire));  // bf16 on the wire for a bf16 worker
      ExpectServes(worker.store(), *b, dtype, 1);

      // One tensor changes: one tensor goes.
      torch::Tensor o_proj = b->named_parameters()["model.layers.1.self_attn.o_proj.weight"];
      o_proj.add_(0.25);
      wire = Wire(*b, dtype);
      r = pusher->Push(wire, 2);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->tensors, 1);
      EXPECT_EQ(r->bytes, o_proj.numel() * static_cast<int64_t>(c10::elementSize(dtype)));
      ExpectServes(worker.store(), *b, dtype, 2);

      // Nothing changes: the version moves on, nothing is sent.
      r = pusher->Push(Wire(*b, dtype), 3);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->tensors, 0);
      EXPECT_EQ(r->bytes, 0);
      ExpectServes(worker.store(), *b, dtype, 3);
    }
  }
}

TEST(WeightSync, StaleVersionsAndWrongChecksumsAreRefusedAndChangeNothing) {
  LocalRollout worker(torch::kFloat32);
  auto b = ModelB();
  auto pusher = Pusher(worker.address(), WeightSyncMode::kCollective);
  ASSERT_NE(pusher, nullptr);
  ASSERT_TRUE(pusher->Push(Wire(*b, torch::kFloat32), 5).ok());

  // A version not above the serving one.
  auto stale = pusher->Push(Wire(*b, torch::kFloat32), 5);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_NE(stale.status().message().find("not above the serving version 5"), std::string::npos)
      << stale.status();
  ExpectServes(worker.store(), *b, torch::kFloat32, 5);

  // A tensor whose bytes do not match the announced checksum: the whole update is dropped.
  auto changed = ModelB();
  changed->InitWeights(0.1, 99);
  auto wire = Wire(*changed, torch::kFloat32);
  const std::string victim = wire[3].name;
  *wire[3].checksum ^= 1;
  auto bad = pusher->Push(wire, 6);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_NE(bad.status().message().find("'" + victim + "'"), std::string::npos) << bad.status();
  ExpectServes(worker.store(), *b, torch::kFloat32, 5);
  EXPECT_EQ(worker.sync().stats().last_sync.code(), absl::StatusCode::kDataLoss);

  // The group still works, and after a failure everything is sent again.
  wire = Wire(*changed, torch::kFloat32);
  auto ok = pusher->Push(wire, 6);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(ok->collective);
  EXPECT_EQ(ok->tensors, static_cast<int64_t>(wire.size()));
  ExpectServes(worker.store(), *changed, torch::kFloat32, 6);
}

// A push with a NaN or an infinity in one tensor, over Gloo and over gRPC, to fp32 and bf16
// workers: refused with INVALID_ARGUMENT naming the tensor (it was served), the old weights stay;
// a version above the maximum (INT64_MAX blocked every later push) is refused naming it; then a
// healthy push goes through.
TEST(WeightSync, NonFiniteWeightsAndHugeVersionsAreRefusedAndChangeNothing) {
  const std::string victim = "model.layers.1.self_attn.o_proj.weight";
  for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (WeightSyncMode mode : {WeightSyncMode::kCollective, WeightSyncMode::kGrpc}) {
      const bool collective = mode == WeightSyncMode::kCollective;
      SCOPED_TRACE(std::string(opd::rpc::DtypeName(dtype)) + (collective ? " gloo" : " grpc"));
      LocalRollout worker(dtype);
      auto b = ModelB();
      auto pusher = Pusher(worker.address(), mode);
      ASSERT_NE(pusher, nullptr);
      ASSERT_TRUE(pusher->Push(Wire(*b, dtype), 1).ok());
      for (float bad :
           {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
        auto broken = ModelB();
        broken->InitWeights(0.1, 7);
        broken->named_parameters()[victim].detach()[2][5] = bad;
        auto r = pusher->Push(Wire(*broken, dtype), 2);
        EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
        EXPECT_NE(r.status().message().find("'" + victim + "'"), std::string::npos) << r.status();
        EXPECT_NE(r.status().message().find("not finite"), std::string::npos) << r.status();
        ExpectServes(worker.store(), *b, dtype, 1);
      }
      auto huge = pusher->Push(Wire(*b, dtype), std::numeric_limits<int64_t>::max());
      EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument) << huge.status();
      EXPECT_NE(huge.status().message().find("weight version 9223372036854775807"),
                std::string::npos)
          << huge.status();
      ExpectServes(worker.store(), *b, dtype, 1);
      auto c = ModelB();
      c->InitWeights(0.1, 8);
      auto ok = pusher->Push(Wire(*c, dtype), 2);
      ASSERT_TRUE(ok.ok()) << ok.status();
      ExpectServes(worker.store(), *c, dtype, 2);
    }
  }
}

// The protocol driven by hand (rollout.proto, SyncWeightsRequest): a learner that announces two
// tensors and broadcasts one, and requests the worker must refuse before any broadcast.
TEST(WeightSync, BroadcastsThatEndEarlyAndBadRequestsAreRefused) {
  LocalRollout worker(torch::kFloat32);
  auto channel = *opd::rpc::MakeChannel(Client(worker.address()));
  auto stub = opd::v1::Rollout::NewStub(channel);
  auto call = [&](auto method, const auto& req, auto* resp, const std::string& secret = kSecret) {
    grpc::ClientContext ctx;
    opd::rpc::PrepareContext(Client(worker.address(), secret), &ctx);
    return opd::rpc::FromGrpc((stub.get()->*method)(&ctx, req, resp), worker.address());
  };
  const int port = testing_util::FreeLoopbackPort();
  opd::v1::JoinWeightGroupRequest join;
  join.set_group_id("g1");
  join.set_store_host("127.0.0.1");
  join.set_store_port(port);
  join.set_timeout_s(60);
  opd::v1::JoinWeightGroupResponse joined;
  EXPECT_EQ(call(&opd::v1::Rollout::Stub::JoinWeightGroup, join, &joined, "").code(),
            absl::StatusCode::kUnauthenticated);
  auto bad_join = join;
  bad_join.set_store_port(0);
  EXPECT_EQ(call(&opd::v1::Rollout::Stub::JoinWeightGroup, bad_join, &joined).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(call(&opd::v1::Rollout::Stub::JoinWeightGroup, join, &joined).ok());
  EXPECT_EQ(joined.backend(), "gloo");
  lm::dist::GroupOptions go;
  go.timeout = absl::Seconds(60);
  auto group = lm::dist::ProcessGroup::Create({0, 2, 0, "127.0.0.1", port}, torch::kCPU, go);
  ASSERT_TRUE(group.ok()) << group.status();

  auto b = ModelB();
  auto wire = Wire(*b, torch::kFloat32);
  opd::v1::SyncWeightsRequest req;
  req.set_group_id("g1");
  req.set_version(1);
  req.set_bucket_bytes(1 << 16);
  for (int i : {0, 1}) opd::rpc::ToProto(wire[i], req.mutable_manifest()->add_tensors());
  opd::v1::SyncWeightsResponse started;
  // Refused before any broadcast: no secret, another group, an unknown tensor, a stale version.
  EXPECT_EQ(call(&opd::v1::Rollout::Stub::SyncWeights, req, &started, "").code(),
            absl::StatusCode::kUnauthenticated);
  auto other = req;
  other.set_group_id("g2");
  EXPECT_EQ(call(&opd::v1::Rollout::Stub::SyncWeights, other, &started).code(),
            absl::StatusCode::kFailedPrecondition);
  other = req;
  other.mutable_manifest()->mutable_tensors(1)->set_name("model.no_such_weight");
  absl::Status unknown = call(&opd::v1::Rollout::Stub::SyncWeights, other, &started);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.message().find("model.no_such_weight"), std::string::npos) << unknown;
  other = req;
  other.set_version(0);
  EXPECT_EQ(call(&opd::v1::Rollout::Stub::SyncWeights, other, &started).code(),
            absl::StatusCode::kFailedPrecondition);

  // Accepted; then only the first tensor's bytes and the end frame.
  ASSERT_TRUE(call(&opd::v1::Rollout::Stub::SyncWeights, req, &started).ok());
  EXPECT_EQ(started.bytes(), wire[0].bytes + wire[1].bytes);
  torch::Tensor first = wire[0].source.contiguous().view(torch::kUInt8).reshape({-1});
  std::vector<torch::Tensor> header{torch::tensor({first.numel()}, torch::kInt64)};
  ASSERT_TRUE((*group)->Broadcast(header, 0).ok());
  std::vector<torch::Tensor> data{first.clone()};
  ASSERT_TRUE((*group)->Broadcast(data, 0).ok());
  header[0].fill_(0);
  ASSERT_TRUE((*group)->Broadcast(header, 0).ok());
  std::string verdict;
  ASSERT_TRUE((*group)->BroadcastBytes(&verdict, 1).ok());
  opd::v1::SyncWeightsResult result;
  ASSERT_TRUE(result.ParseFromString(verdict));
  EXPECT_EQ(result.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(result.message().find("1 of 2 tensors missing"), std::string::npos) << result.message();
  EXPECT_NE(result.message().find(wire[1].name), std::string::npos) << result.message();
  EXPECT_EQ(worker.store().Current().version, 0);
}

// The learner is a real process (bench_weight_sync) that SIGKILLs itself once three buckets of
// its broadcast went out; the worker's receive fails at once, and it keeps its version and serves.
TEST(WeightSync, LearnerKilledMidBroadcastLeavesTheOldVersionServing) {
  const fs::path dir = TempDir("killed_learner");
  const fs::path secret = WriteSecret(dir);
  auto b = ModelB();
  ASSERT_TRUE(lm::SaveModel(*b, (dir / "b").string()).ok());
  LocalRollout worker(torch::kFloat32);
  auto a = Load();
  {
    ChildProcess learner(
        {kBin + "/bench/bench_weight_sync", "push", "--addr=" + worker.address(),
         "--secret_file=" + secret.string(), "--model=" + (dir / "b").string(), "--sync=collective",
         "--bucket_mb=0.004", "--die_after_buckets=3", "--threads=1"},
        (dir / "learner.log").string());
    EXPECT_EQ(learner.Wait(std::chrono::seconds(120)), 128 + SIGKILL) << learner.Log();
  }
  ASSERT_TRUE(worker.sync().Await(1, 1, absl::Seconds(120)));
  EXPECT_EQ(worker.sync().stats().last_sync.code(), absl::StatusCode::kUnavailable)
      << worker.sync().stats().last_sync;
  ExpectServes(worker.store(), *a, torch::kFloat32, 0);
  auto client = *opd::rpc::RolloutClient::Create(Client(worker.address()));
  lm::SamplingParams g;
  g.max_new_tokens = 4;
  auto out = client->Generate({{1, 2, 3}}, g);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].weight_version, 0);

  // A learner that connects again forms a new group and pushes.
  auto pusher = Pusher(worker.address(), WeightSyncMode::kCollective);
  ASSERT_NE(pusher, nullptr);
  auto r = pusher->Push(Wire(*b, torch::kFloat32), 1);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectServes(worker.store(), *b, torch::kFloat32, 1);
  fs::remove_all(dir);
}

// An opd-rollout process on the other end; started here and SIGKILLed from the learner's
// progress hook once two buckets went out.
class RolloutProcess {
 public:
  RolloutProcess(const fs::path& dir, const std::string& dtype) {
    served_ = testing_util::StartServed(
        dir, "rollout",
        {kBin + "/rollout/opd-rollout", "--model=" + FixtureModel(),
         "--secret-file=" + WriteSecret(dir).string(), "--threads=1", "--dtype=" + dtype});
    EXPECT_TRUE(opd::rpc::WaitUntilServing(Client(served_.address), absl::Seconds(60)).ok());
  }
  const std::string& address() const { return served_.address; }
  ChildProcess& child() { return *served_.process; }

 private:
  testing_util::Served served_;
};

TEST(WeightSync, WorkerKilledMidBroadcastIsUnavailableNotAHang) {
  const fs::path dir = TempDir("killed_worker");
  RolloutProcess worker(dir, "float32");
  auto pusher = Pusher(worker.address(), WeightSyncMode::kCollective, [&](int64_t bucket) {
    if (bucket == 1) worker.child().Kill(SIGKILL);
  });
  ASSERT_NE(pusher, nullptr);
  auto r = pusher->Push(Wire(*ModelB(), torch::kFloat32), 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find(worker.address()), std::string::npos) << r.status();
  EXPECT_FALSE(pusher->has_group());
  fs::remove_all(dir);
}

// In-process log-probs of `response` after `prompt` (fp32).
std::vector<float> Logprobs(lm::CausalLM& model, const std::vector<int32_t>& prompt,
                            const std::vector<int32_t>& response) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> seq(prompt.begin(), prompt.end());
  seq.insert(seq.end(), response.begin(), response.end());
  auto lp = lm::SequenceLogprobs(model, lm::PackedBatch::FromSequences({seq}), 1.0);
  auto tail =
      lp.narrow(0, static_cast<int64_t>(prompt.size()) - 1, static_cast<int64_t>(response.size()))
          .contiguous();
  return std::vector<float>(tail.data_ptr<float>(), tail.data_ptr<float>() + tail.numel());
}

// A bf16 opd-rollout takes the push of an fp32 learner (bf16 on the wire, over gRPC and over
// Gloo) and samples with it: its log-probs are those of the pushed weights rounded to bf16.
TEST(WeightSync, Bf16RolloutAcceptsAnFp32PushAndSamplesWithIt) {
  const fs::path dir = TempDir("bf16_rollout");
  RolloutProcess worker(dir, "bfloat16");
  auto a = Load();
  const std::vector<std::vector<int32_t>> prompts = {{1, 5, 9, 13, 2}, {7, 3}};
  int64_t version = 0;
  for (auto [mode, seed] :
       {std::pair{WeightSyncMode::kGrpc, 4242}, {WeightSyncMode::kCollective, 77}}) {
    auto b = ModelB();
    b->InitWeights(0.2, seed);
    // The reference: the pushed weights rounded to bf16, evaluated in fp32.
    auto rounded = ModelB();
    {
      torch::NoGradGuard no_grad;
      auto src = Params(*b), dst = Params(*rounded);
      for (size_t i = 0; i < src.size(); ++i)
        dst[i].second.copy_(src[i].second.to(torch::kBFloat16).to(torch::kFloat32));
    }
    auto pusher = Pusher(worker.address(), mode);
    ASSERT_NE(pusher, nullptr);
    EXPECT_EQ(pusher->wire_dtype(), opd::rpc::WireDtype::kBFloat16);
    auto wire = Wire(*b, torch::kBFloat16);
    auto r = pusher->Push(wire, ++version);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->collective, mode == WeightSyncMode::kCollective);
    int64_t numel = 0;
    for (const auto& p : b->parameters()) numel += p.numel();
    EXPECT_EQ(r->bytes, 2 * numel);  // bf16 on the wire

    auto client = *opd::rpc::RolloutClient::Create(Client(worker.address()));
    lm::SamplingParams g;
    g.samples_per_prompt = 2;
    g.max_new_tokens = 12;
    g.seed = 5;
    auto out = client->Generate(prompts, g);
    ASSERT_TRUE(out.ok()) << out.status();
    double to_pushed = 0, to_old = 0;
    for (const auto& s : *out) {
      EXPECT_EQ(s.weight_version, version);
      const std::vector<int32_t> response(s.response().begin(), s.response().end());
      auto want = Logprobs(*rounded, prompts[s.prompt_index], response);
      auto old = Logprobs(*a, prompts[s.prompt_index], response);
      for (size_t i = 0; i < s.logprobs.size(); ++i) {
        to_pushed = std::max(to_pushed, std::abs(double(s.logprobs[i]) - want[i]));
        to_old = std::max(to_old, std::abs(double(s.logprobs[i]) - old[i]));
      }
    }
    // bf16 activations: the sampler's log-probs (|lp| < 8 over this 320-token vocabulary) within
    // about two bf16 ulps at that magnitude (2 x 2^-5 = 0.0625), bounded at 0.1; the old weights
    // are off by 0.3 and more.
    EXPECT_LE(to_pushed, 0.1);
    EXPECT_GE(to_old, 0.3);
  }
  fs::remove_all(dir);
}

// A worker that takes full updates only (as an expert-parallel opd-rollout does): it refuses a
// manifest, and the learner then sends every tensor of every push without one.
class FullUpdatesOnlyRollout final : public opd::v1::Rollout::Service {
 public:
  grpc::Status UpdateWeights(grpc::ServerContext*, grpc::ServerReader<opd::v1::WeightChunk>* reader,
                             opd::v1::UpdateWeightsResponse* resp) override {
    opd::v1::WeightChunk chunk;
    std::set<std::string> names;
    int64_t version = 0;
    while (reader->Read(&chunk)) {
      if (chunk.has_manifest())
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            "an expert-parallel rollout takes full updates only (no manifest): "
                            "send every tensor");
      names.insert(chunk.name());
      version = chunk.version();
    }
    resp->set_version(version);
    resp->set_tensors(static_cast<int64_t>(names.size()));
    return grpc::Status::OK;
  }
  grpc::Status Info(grpc::ServerContext*, const opd::v1::InfoRequest*,
                    opd::v1::ServiceInfo* info) override {
    info->set_service("opd.v1.Rollout");
    info->set_dtype("float32");
    return grpc::Status::OK;
  }
};

TEST(WeightSync, WorkersThatTakeFullUpdatesOnlyGetEveryTensorWithoutAManifest) {
  FullUpdatesOnlyRollout service;
  opd::rpc::ServerOptions so;
  auto server = opd::rpc::StartServer(so, {&service}, {"opd.v1.Rollout"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "127.0.0.1:" + std::to_string(server->port);
  auto pusher = Pusher(address, WeightSyncMode::kGrpc);
  ASSERT_NE(pusher, nullptr);
  auto b = ModelB();
  for (int64_t version : {1, 2}) {
    auto r = pusher->Push(Wire(*b, torch::kFloat32), version);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tensors, static_cast<int64_t>(b->parameters().size())) << version;
  }
  server->server->Shutdown();
}

// The learner on a CUDA device: each bucket is cast on the device and sent over Gloo (the worker
// is on the host) or streamed over gRPC. Skips without CUDA; fails under OPD_REQUIRE_GPU=1
// (scripts/gpu_check.sh with OPD_GPU_FULL_BUILD=1 runs it).
TEST(WeightSyncGpu, LearnerOnCudaDeliversBitIdenticalWeights) {
  SKIP_WITHOUT_CUDA();
  for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (WeightSyncMode mode : {WeightSyncMode::kCollective, WeightSyncMode::kGrpc}) {
      LocalRollout worker(dtype);
      auto b = ModelB();
      b->to(torch::Device(torch::kCUDA, 0));
      auto pusher = Pusher(worker.address(), mode, nullptr, torch::Device(torch::kCUDA, 0));
      ASSERT_NE(pusher, nullptr);
      auto r = pusher->Push(Wire(*b, dtype), 1);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->collective, mode == WeightSyncMode::kCollective);
      ExpectServes(worker.store(), *b, dtype, 1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The learner: an OPD run with rollout.weight_sync=collective against the same run over gRPC.

TEST(WeightSyncOpd, CollectiveRunEndsWithTheWeightsOfTheGrpcRun) {
  const fs::path dir = TempDir("opd_weight_sync");
  ASSERT_TRUE(testing_util::MakeOpdTask(
      dir, "--teacher-examples 100 --student-examples 20 --prompts 40 --eval 4", kSecret));
  std::vector<std::unique_ptr<ChildProcess>> services;
  auto start = [&](const std::string& tag, const std::string& binary, const std::string& model) {
    testing_util::Served s = testing_util::StartTaskService(dir, tag, binary, model);
    services.push_back(std::move(s.process));
    return s.address;
  };
  const std::string teacher =
      start("teacher", kBin + "/teacher_service/opd-teacher", (dir / "teacher_small").string());
  auto weights = [](const fs::path& model) {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    auto m = lm::LoadModel(model.string());
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) out = Params(**m);
    return out;
  };
  std::map<std::string, fs::path> runs;
  for (const std::string mode : {"grpc", "collective"}) {
    const std::string rollout =
        start("rollout_" + mode, kBin + "/rollout/opd-rollout", (dir / "student").string());
    const fs::path run = dir / ("run_" + mode);
    ChildProcess p(
        testing_util::OpdTrainerArgs(
            dir, run.string(), rollout,
            {"stages.0.teachers=[" + teacher + "]", "stages.1.teachers=[" + teacher + "]",
             "stages.0.max_steps=2", "stages.0.plateau.enabled=false", "stages.1.max_steps=1",
             "stages.1.plateau.enabled=false", "train.prompts_per_step=4",
             "rollout.max_new_tokens=8", "rollout.weight_sync=" + mode,
             "rollout.weight_sync_bucket_mb=1"}),
        (dir / ("trainer_" + mode + ".log")).string());
    ASSERT_EQ(p.Wait(std::chrono::seconds(300)), 0) << p.Log();
    // The pushes went the way asked.
    EXPECT_EQ(p.Log().find("weight group of 1 learner rank(s)") != std::string::npos,
              mode == "collective")
        << p.Log();
    runs[mode] = run;
  }
  const auto want = weights(runs["grpc"] / "checkpoints/step_000003/model");
  const auto got = weights(runs["collective"] / "checkpoints/step_000003/model");
  ASSERT_EQ(want.size(), got.size());
  ASSERT_FALSE(want.empty());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(torch::equal(want[i].second, got[i].second)) << want[i].first;
  // And they moved away from the student's start (a run that trained on something).
  const auto start_weights = weights(dir / "student");
  double moved = 0;
  for (size_t i = 0; i < want.size(); ++i)
    moved += (want[i].second - start_weights[i].second).abs().sum().item<double>();
  EXPECT_GT(moved, 0);
  for (auto& s : services) s->Stop();
  fs::remove_all(dir);
}

}  // namespace
