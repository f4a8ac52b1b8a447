// The parallel weight push (trainer/opd/weight_push.h WeightPublisher, rollout/weight_sync.h):
// every learner rank broadcasts its share of the weights to the rollout workers over one Gloo
// group.
//
// Covered: the shares and buckets of the wire stream (every byte once, in order, whatever the
// bucket and the number of senders); the verdict record; requests a worker must refuse before
// any broadcast; 2 learner processes x 2 in-process bf16 workers: after each step both workers
// hold the learner's weights cast to bf16, bit for bit, a third worker of another dtype gets them
// over gRPC (the fallback), every rank reports the same outcome, and a stale version is refused
// by every worker, which keeps its weights; 2 learner processes x 2 opd-rollout processes: a
// worker SIGKILLed mid-push is reported by name, comes back at its address and gets the next
// version with the others, its samples those of the learner's weights bit for bit (in mode auto
// the survivor gets the broken version over gRPC in the same push), and the
// versions the workers serve only grow. The learner ranks are bench_weight_publish processes
// gated by files between steps (events, not time).
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "child_process.h"
#include "lm/dist/process_group.h"
#include "lm/model/model.h"
#include "nlohmann/json.hpp"
#include "rollout/engine.h"
#include "rollout/service.h"
#include "rollout/weights.h"
#include "rpc/auth.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "rpc/status.h"
#include "rpc/tensor_codec.h"
#include "rpc/weight_wire.h"
#include "tests/local_rollout.h"
#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;
using testing_util::ChildProcess;

constexpr const char* kModel = "moe_tied_topk8";
constexpr const char* kSecret = "weight-publish-secret";
const std::string kBin = OPD_BINARY_DIR;

std::string FixtureModel() {
  return std::string(OPD_FIXTURES_DIR) + "/" + kModel + "/model";
}

std::shared_ptr<lm::CausalLM> Load(torch::Dtype dtype = torch::kFloat32) {
  torch::set_num_threads(1);
  auto m = lm::LoadModel(FixtureModel(), lm::LoadOptions{dtype, torch::kCPU});
  EXPECT_TRUE(m.ok()) << m.status();
  (*m)->eval();
  for (auto& p : (*m)->parameters()) p.set_requires_grad(false);
  return *m;
}

// The learner's weights after `steps` steps of bench_weight_publish: every parameter scaled by
// 1 + 1/64 once per step, in fp32, in the same order of operations.
std::shared_ptr<lm::CausalLM> LearnerAt(int steps) {
  auto m = Load();
  torch::NoGradGuard no_grad;
  for (int s = 0; s < steps; ++s)
    for (auto& p : m->parameters()) p.mul_(1.0f + 1.0f / 64);
  return m;
}

fs::path WriteSecret(const fs::path& dir) {
  const fs::path p = dir / "secret";
  std::ofstream(p) << kSecret << "\n";
  fs::permissions(p, fs::perms::owner_read | fs::perms::owner_write);
  return p;
}

opd::rpc::ClientOptions Client(const std::string& address) {
  opd::rpc::ClientOptions o;
  o.address = address;
  o.secret = kSecret;
  o.timeout = absl::Seconds(120);
  return o;
}

// A rollout service in this process over the fixture's model in `dtype` (tests/local_rollout.h).
class LocalRollout : public testing_util::LocalRollout {
 public:
  explicit LocalRollout(torch::Dtype dtype)
      : testing_util::LocalRollout(Load(dtype), dtype, kSecret) {}
};

// Every parameter `store` serves equals the learner's cast to the store's dtype, bit for bit.
void ExpectServes(rollout::WeightStore& store, lm::CausalLM& learner, int64_t version) {
  const rollout::Snapshot s = store.Current();
  EXPECT_EQ(s.version, version);
  auto served = s.model->named_parameters();
  for (const auto& p : learner.named_parameters()) {
    const torch::Tensor& got = served[p.key()];
    EXPECT_TRUE(torch::equal(got, p.value().to(got.scalar_type()))) << p.key();
  }
}

// The learner ranks: bench_weight_publish processes gated by done_s / go_s files in `gate`.
class Learners {
 public:
  Learners(const fs::path& dir, int ranks, const std::vector<std::string>& workers,
           const std::vector<std::string>& flags)
      : gate_(dir / "gate") {
    fs::create_directories(gate_);
    const int port = testing_util::FreeLoopbackPort();
    for (int r = 0; r < ranks; ++r) {
      std::vector<std::string> argv = {kBin + "/bench/bench_weight_publish",
                                       "push",
                                       absl::StrCat("--rank=", r),
                                       absl::StrCat("--world=", ranks),
                                       absl::StrCat("--master_port=", port),
                                       "--workers=" + absl::StrJoin(workers, ","),
                                       "--model=" + FixtureModel(),
                                       "--secret_file=" + WriteSecret(dir).string(),
                                       "--gate_dir=" + gate_.string(),
                                       "--threads=1",
                                       "--timeout_s=60"};
      argv.insert(argv.end(), flags.begin(), flags.end());
      ranks_.push_back(std::make_unique<ChildProcess>(
          argv, (dir / absl::StrCat("learner_", r, ".log")).string()));
    }
  }

  // Rank 0's report of step `s` (waits for its file: a bound on failure, not a synchronisation).
  std::optional<nlohmann::json> Report(int s) {
    const fs::path done = gate_ / absl::StrCat("done_", s);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(300);
    while (!fs::exists(done)) {
      for (auto& r : ranks_)
        if (!r->Running()) {
          ADD_FAILURE() << "a learner rank ended before step " << s << ": " << r->Log();
          return std::nullopt;
        }
      if (std::chrono::steady_clock::now() > end) {
        ADD_FAILURE() << "no report of step " << s << ": " << ranks_[0]->Log();
        return std::nullopt;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::ifstream in(done);
    return nlohmann::json::parse(in);
  }
  void Go(int s) { std::ofstream(gate_ / absl::StrCat("go_", s)) << "go\n"; }
  // Every rank's JSON lines, once they have exited (0 each).
  std::vector<std::vector<nlohmann::json>> Finish() {
    std::vector<std::vector<nlohmann::json>> out;
    for (auto& r : ranks_) {
      EXPECT_EQ(r->Wait(std::chrono::seconds(300)), 0) << r->Log();
      std::vector<nlohmann::json> lines;
      std::istringstream in(r->Log());
      for (std::string line; std::getline(in, line);)
        if (!line.empty() && line[0] == '{') lines.push_back(nlohmann::json::parse(line));
      out.push_back(std::move(lines));
    }
    return out;
  }

 private:
  fs::path gate_;
  std::vector<std::unique_ptr<ChildProcess>> ranks_;
};

int64_t Params(lm::CausalLM& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// ---------------------------------------------------------------------------------------------

// Every byte of the stream goes once, in order, whatever the senders and the bucket; a range
// that splits an element is refused.
TEST(ParallelWire, SharesAndBucketsCoverTheStreamOnce) {
  torch::manual_seed(5);
  std::vector<std::pair<std::string, torch::Tensor>> params = {{"a", torch::randn({5, 7})},
                                                               {"empty", torch::randn({0})},
                                                               {"b", torch::randn({33})},
                                                               {"c", torch::randn({2, 3, 4})}};
  for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16}) {
    const auto wire = opd::rpc::OutgoingTensorsOf(params, opd::rpc::WireDtypeOf(dtype).value());
    std::string want;
    int64_t total = 0;
    for (const auto& [name, t] : params) {
      torch::Tensor c = t.to(dtype).contiguous();
      want.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
      total += static_cast<int64_t>(c.nbytes());
    }
    for (int senders : {1, 2, 3, 7}) {
      const auto shares = opd::rpc::SenderShares(total, senders);
      ASSERT_EQ(shares.size(), static_cast<size_t>(senders));
      for (int64_t bucket_bytes : {8, 24, 64, 4096}) {
        std::string got;
        int64_t begin = 0;
        for (int r = 0; r < senders; ++r) {
          if (r + 1 < senders) EXPECT_EQ((begin + shares[r]) % 8, 0);
          torch::Tensor bucket = torch::empty({bucket_bytes}, torch::kUInt8);
          int64_t left = shares[r];
          ASSERT_TRUE(opd::rpc::PackRange(wire, begin, begin + shares[r], bucket, [&](int64_t n) {
                        EXPECT_EQ(n, std::min(left, bucket_bytes));  // what the workers expect
                        left -= n;
                        got.append(static_cast<const char*>(bucket.data_ptr()), n);
                        return absl::OkStatus();
                      }).ok());
          EXPECT_EQ(left, 0);
          begin += shares[r];
        }
        EXPECT_EQ(got, want) << senders << " senders, buckets of " << bucket_bytes;
      }
    }
    torch::Tensor bucket = torch::empty({64}, torch::kUInt8);
    const absl::Status split =
        opd::rpc::PackRange(wire, 2, total, bucket, [](int64_t) { return absl::OkStatus(); });
    if (dtype == torch::kFloat32) {
      EXPECT_EQ(split.code(), absl::StatusCode::kInvalidArgument) << split;
      EXPECT_NE(split.message().find("tensor 'a'"), std::string::npos) << split;
    }
  }
}

TEST(ParallelWire, VerdictRecordsRoundTrip) {
  opd::rpc::SyncVerdict v{true, 9, 12, 34, 5678, std::string(2000, 'x')};
  std::vector<uint8_t> record(opd::rpc::kVerdictBytes);
  opd::rpc::EncodeVerdict(v, record.data());
  const opd::rpc::SyncVerdict back = opd::rpc::DecodeVerdict(record.data());
  EXPECT_TRUE(back.present);
  EXPECT_EQ(back.code, 9);
  EXPECT_EQ(back.version, 12);
  EXPECT_EQ(back.tensors, 34);
  EXPECT_EQ(back.bytes, 5678);
  EXPECT_GT(back.message.size(), 400u);
  EXPECT_EQ(back.message, v.message.substr(0, back.message.size()));
  opd::rpc::EncodeVerdict(opd::rpc::SyncVerdict{}, record.data());
  EXPECT_FALSE(opd::rpc::DecodeVerdict(record.data()).present);
}

// A worker refuses a bad join or sync of the parallel kind before anything is broadcast.
TEST(ParallelWorker, BadJoinsAndSyncsAreRefusedBeforeAnyBroadcast) {
  LocalRollout worker(torch::kFloat32);
  auto stub = opd::v1::Rollout::NewStub(*opd::rpc::MakeChannel(Client(worker.address())));
  auto call = [&](auto method, const auto& req, auto* resp) {
    grpc::ClientContext ctx;
    opd::rpc::PrepareContext(Client(worker.address()), &ctx);
    return opd::rpc::FromGrpc((stub.get()->*method)(&ctx, req, resp), worker.address());
  };
  const int port = testing_util::FreeLoopbackPort();
  opd::v1::JoinWeightGroupRequest join;
  join.set_group_id("p1");
  join.set_store_host("127.0.0.1");
  join.set_store_port(port);
  join.set_timeout_s(60);
  join.set_world_size(2);
  join.set_rank(1);
  join.set_backend("gloo");
  opd::v1::JoinWeightGroupResponse joined;
  for (auto [rank, world, backend, code] :
       {std::tuple{0, 2, "gloo", absl::StatusCode::kInvalidArgument},
        {2, 2, "gloo", absl::StatusCode::kInvalidArgument},
        {1, 1, "gloo", absl::StatusCode::kInvalidArgument},
        {1, 2, "mpi", absl::StatusCode::kInvalidArgument},
        {1, 2, "nccl", absl::StatusCode::kFailedPrecondition}}) {
    auto bad = join;
    bad.set_rank(rank);
    bad.set_world_size(world);
    bad.set_backend(backend);
    EXPECT_EQ(call(&opd::v1::Rollout::Stub::JoinWeightGroup, bad, &joined).code(), code)
        << rank << " of " << world << " " << backend;
  }
  ASSERT_TRUE(call(&opd::v1::Rollout::Stub::JoinWeightGroup, join, &joined).ok());
  lm::dist::GroupOptions go;
  go.timeout = absl::Seconds(60);
  auto group = lm::dist::ProcessGroup::Create({0, 2, 0, "127.0.0.1", port}, torch::kCPU, go);
  ASSERT_TRUE(group.ok()) << group.status();

  auto b = Load();
  opd::v1::SyncWeightsRequest req;
  req.set_group_id("p1");
  req.set_version(1);
  req.set_bucket_bytes(4096);
  int64_t total = 0;
  for (const auto& p : b->named_parameters()) {
    auto* t = req.mutable_manifest()->add_tensors();
    t->set_name(p.key());
    t->mutable_shape()->Add(p.value().sizes().begin(), p.value().sizes().end());
    t->set_dtype("float32");
    total += p.value().numel() * 4;
  }
  opd::v1::SyncWeightsResponse started;
  auto expect_refused = [&](const opd::v1::SyncWeightsRequest& r, const std::string& needle) {
    const absl::Status st = call(&opd::v1::Rollout::Stub::SyncWeights, r, &started);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st;
  };
  expect_refused(req, "sender_bytes is empty");
  auto bad = req;
  bad.add_sender_bytes(total - 8);
  expect_refused(bad, "add up to");
  bad = req;
  bad.add_sender_bytes(total / 2);
  bad.add_sender_bytes(total - total / 2);
  expect_refused(bad, "learner ranks come first");  // 2 senders, but this worker is rank 1
  EXPECT_EQ(worker.store().Current().version, 0);
  // The group still works: one sender, the whole stream in place, the verdict all-gathered.
  req.add_sender_bytes(total);
  ASSERT_TRUE(call(&opd::v1::Rollout::Stub::SyncWeights, req, &started).ok());
  EXPECT_EQ(started.bytes(), total);
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : b->named_parameters()) params.emplace_back(p.key(), p.value());
  const auto wire = opd::rpc::OutgoingTensorsOf(params, opd::rpc::WireDtype::kFloat32);
  torch::Tensor bucket = torch::empty({4096}, torch::kUInt8);
  ASSERT_TRUE(opd::rpc::PackRange(wire, 0, total, bucket, [&](int64_t n) {
                std::vector<torch::Tensor> data{bucket.narrow(0, 0, n)};
                return (*group)->Broadcast(data, 0);
              }).ok());
  torch::Tensor all = torch::empty({2 * opd::rpc::kVerdictBytes}, torch::kUInt8);
  torch::Tensor mine = torch::zeros({opd::rpc::kVerdictBytes}, torch::kUInt8);
  ASSERT_TRUE((*group)->AllGather(all, mine).ok());
  const auto verdict = opd::rpc::DecodeVerdict(all.data_ptr<uint8_t>() + opd::rpc::kVerdictBytes);
  EXPECT_TRUE(verdict.present);
  EXPECT_EQ(verdict.code, 0) << verdict.message;
  EXPECT_EQ(verdict.version, 1);
  ExpectServes(worker.store(), *b, 1);
}

// 2 learner ranks x 2 bf16 workers in the group, and a third worker of another dtype outside it
// (gRPC). After each step every worker holds the learner's weights in its dtype, bit for bit.
TEST(WeightPublish, TwoRanksTwoWorkersHoldTheLearnersWeightsAfterEachStep) {
  const fs::path dir = testing_util::TempDir("weight_publish_bitwise");
  LocalRollout a(torch::kBFloat16), b(torch::kBFloat16), c(torch::kFloat32);
  Learners learners(dir, 2, {a.address(), b.address(), c.address()},
                    {"--sync=collective", "--versions=1,2,3,2", "--bucket_mb=0.004"});
  const int64_t n = Params(*Load());
  for (int s = 1; s <= 3; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s));
    auto report = learners.Report(s);
    ASSERT_TRUE(report.has_value());
    EXPECT_TRUE((*report)["status"]["ok"].get<bool>()) << report->dump();
    EXPECT_EQ((*report)["senders"], 2);
    EXPECT_EQ((*report)["group_formed"], s == 1);
    const auto& w = (*report)["workers"];
    ASSERT_EQ(w.size(), 3u);
    for (int i : {0, 1}) {
      EXPECT_TRUE(w[i]["collective"].get<bool>()) << w[i].dump();
      EXPECT_EQ(w[i]["tensors"], static_cast<int64_t>(Load()->parameters().size()));
      EXPECT_EQ(w[i]["bytes"], 2 * n);  // bf16 on the wire
    }
    EXPECT_FALSE(w[2]["collective"].get<bool>()) << w[2].dump();  // another dtype: gRPC
    EXPECT_TRUE(w[2]["status"]["ok"].get<bool>()) << w[2].dump();
    auto learner = LearnerAt(s);
    ExpectServes(a.store(), *learner, s);
    ExpectServes(b.store(), *learner, s);
    ExpectServes(c.store(), *learner, s);
    learners.Go(s);
  }
  // Version 2 again: every worker refuses it, naming why, and keeps version 3.
  auto stale = learners.Report(4);
  ASSERT_TRUE(stale.has_value());
  EXPECT_FALSE((*stale)["status"]["ok"].get<bool>());
  EXPECT_EQ((*stale)["status"]["code"], "FAILED_PRECONDITION") << stale->dump();
  for (const auto& w : (*stale)["workers"]) {
    EXPECT_EQ(w["status"]["code"], "FAILED_PRECONDITION") << w.dump();
    EXPECT_NE(w["status"]["message"].get<std::string>().find("not above the serving version 3"),
              std::string::npos)
        << w.dump();
  }
  auto learner = LearnerAt(3);
  ExpectServes(a.store(), *learner, 3);
  ExpectServes(b.store(), *learner, 3);
  ExpectServes(c.store(), *learner, 3);
  learners.Go(4);
  // Every rank printed the same reports.
  const auto lines = learners.Finish();
  ASSERT_EQ(lines.size(), 2u);
  ASSERT_EQ(lines[0].size(), 4u);
  EXPECT_EQ(lines[0], lines[1]);
  fs::remove_all(dir);
}

// Samples of `prompts` from a worker (seeded: the same tokens for the same weights).
std::vector<lm::Sample> Samples(const std::string& address) {
  auto client = opd::rpc::RolloutClient::Create(Client(address));
  EXPECT_TRUE(client.ok()) << client.status();
  lm::SamplingParams g;
  g.samples_per_prompt = 2;
  g.max_new_tokens = 12;
  g.seed = 7;
  auto out = (*client)->Generate({{1, 5, 9, 13, 2}, {7, 3}}, g);
  EXPECT_TRUE(out.ok()) << out.status();
  std::vector<lm::Sample> s = out.ok() ? *out : std::vector<lm::Sample>();
  std::sort(s.begin(), s.end(), [](const lm::Sample& x, const lm::Sample& y) {
    return std::tie(x.prompt_index, x.sample_index) < std::tie(y.prompt_index, y.sample_index);
  });
  return s;
}

int64_t ServedVersion(const std::string& address) {
  auto client = opd::rpc::RolloutClient::Create(Client(address));
  auto info = (*client)->Info();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->weight_version() : -1;
}

// A worker SIGKILLed by learner rank 0 after the first bucket of step 2: the push reports it by
// name (mode auto: the other worker gets version 2 over gRPC in the same push; mode collective:
// it is reported too); it restarts at its address; step 3 forms the group again and both workers
// serve the learner's weights (their samples equal an in-process engine's over them, bit for bit).
void WorkerDiesMidPush(const std::string& mode) {
  const fs::path dir = testing_util::TempDir("weight_publish_death_" + mode);
  const fs::path secret = WriteSecret(dir);
  auto rollout = [&](const std::string& tag, const std::string& listen) {
    std::vector<std::string> argv = {kBin + "/rollout/opd-rollout", "--model=" + FixtureModel(),
                                     "--secret-file=" + secret.string(), "--threads=1"};
    if (!listen.empty()) argv.push_back("--listen=" + listen);
    return testing_util::StartServed(dir, tag, argv);
  };
  testing_util::Served a = rollout("a", ""), b = rollout("b", "");
  ASSERT_FALSE(a.address.empty());
  ASSERT_FALSE(b.address.empty());
  Learners learners(
      dir, 2, {a.address, b.address},
      {"--sync=" + mode, "--versions=1,2,3", "--bucket_mb=0.004",
       absl::StrCat("--kill_pid=", b.process->pid()), "--kill_step=2", "--kill_after_buckets=1"});
  std::vector<int64_t> served_a;
  auto first = learners.Report(1);
  ASSERT_TRUE(first.has_value());
  EXPECT_TRUE((*first)["status"]["ok"].get<bool>()) << first->dump();
  served_a.push_back(ServedVersion(a.address));
  learners.Go(1);

  auto broken = learners.Report(2);
  ASSERT_TRUE(broken.has_value());
  EXPECT_FALSE((*broken)["status"]["ok"].get<bool>());
  const auto& w = (*broken)["workers"];
  EXPECT_FALSE(w[1]["status"]["ok"].get<bool>());
  EXPECT_NE(w[1]["status"]["message"].get<std::string>().find(b.address), std::string::npos);
  EXPECT_NE(w[1]["status"]["message"].get<std::string>().find("died during the push of version 2"),
            std::string::npos)
      << w[1].dump();
  EXPECT_NE((*broken)["status"]["message"].get<std::string>().find(b.address), std::string::npos);
  if (mode == "auto") {  // the survivor got the version over gRPC in the same push
    EXPECT_TRUE(w[0]["status"]["ok"].get<bool>()) << w[0].dump();
    EXPECT_FALSE(w[0]["collective"].get<bool>()) << w[0].dump();
    EXPECT_EQ(ServedVersion(a.address), 2);
  } else {
    EXPECT_FALSE(w[0]["status"]["ok"].get<bool>()) << w[0].dump();
    EXPECT_NE(w[0]["status"]["message"].get<std::string>().find("broke"), std::string::npos)
        << w[0].dump();
  }
  std::printf("the push that lost a worker ended after %.2f s\n",
              (*broken)["seconds"].get<double>());
  EXPECT_EQ(b.process->Wait(std::chrono::seconds(60)), 128 + SIGKILL);
  served_a.push_back(ServedVersion(a.address));
  // The worker comes back where it was.
  testing_util::Served back = rollout("b_again", b.address);
  ASSERT_EQ(back.address, b.address);
  learners.Go(2);

  auto again = learners.Report(3);
  ASSERT_TRUE(again.has_value());
  EXPECT_TRUE((*again)["status"]["ok"].get<bool>()) << again->dump();
  EXPECT_TRUE((*again)["group_formed"].get<bool>());
  for (const auto& x : (*again)["workers"]) EXPECT_TRUE(x["collective"].get<bool>()) << x.dump();
  served_a.push_back(ServedVersion(a.address));
  EXPECT_EQ(ServedVersion(back.address), 3);
  EXPECT_TRUE(std::is_sorted(served_a.begin(), served_a.end())) << absl::StrJoin(served_a, ",");
  EXPECT_EQ(served_a.back(), 3);

  // Both serve the learner's step-3 weights: their samples are those of an in-process engine
  // over them (fp32 on one thread: bit for bit).
  rollout::WeightStore store(LearnerAt(3));
  auto engine = rollout::Engine::Create(*store.Current().model, rollout::EngineOptions{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  lm::SamplingParams p;
  p.samples_per_prompt = 2;
  p.max_new_tokens = 12;
  p.seed = 7;
  std::vector<lm::Sample> want;
  ASSERT_TRUE((*engine)
                  ->Generate(
                      *store.Acquire(absl::InfiniteFuture()), {{1, 5, 9, 13, 2}, {7, 3}}, p,
                      [&](lm::Sample s) { want.push_back(std::move(s)); }, nullptr)
                  .ok());
  std::sort(want.begin(), want.end(), [](const lm::Sample& x, const lm::Sample& y) {
    return std::tie(x.prompt_index, x.sample_index) < std::tie(y.prompt_index, y.sample_index);
  });
  for (const std::string& address : {a.address, back.address}) {
    const auto got = Samples(address);
    ASSERT_EQ(got.size(), want.size()) << address;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].response().size(), want[i].response().size()) << address << " " << i;
      EXPECT_TRUE(std::equal(got[i].response().begin(), got[i].response().end(),
                             want[i].response().begin()))
          << address << " " << i;
      EXPECT_EQ(got[i].logprobs, want[i].logprobs) << address << " " << i;
      EXPECT_EQ(got[i].weight_version, 3);
    }
  }
  learners.Go(3);
  learners.Finish();
  fs::remove_all(dir);
}

TEST(WeightPublish, AWorkerThatDiesMidPushIsReportedAndGetsTheNextPush) {
  WorkerDiesMidPush("collective");
}

TEST(WeightPublish, InModeAutoTheSurvivorsGetTheVersionOverGrpc) {
  WorkerDiesMidPush("auto");
}

}  // namespace
