// In-process fakes of the OPD services for the learner's tests: a teacher whose every reply a
// script decides, a rollout worker with hooks to hold, reorder or fail its stream, a server to
// run them on 127.0.0.1, and a clock a TeacherPool waits on, so that nothing depends on the
// machine's speed.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "opd/v1/rollout.grpc.pb.h"
#include "opd/v1/teacher.grpc.pb.h"
#include "rpc/codec.h"
#include "rpc/server.h"
#include "trainer/opd/teacher_pool.h"

namespace testing_util {

// Waits (a failure bound, not a synchronisation) for `done()`, checking every 20 ms.
inline bool WaitFor(const std::function<bool()>& done, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The scheduler state of a process ('T' when stopped), from /proc.
inline char ProcessState(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), {});
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

// A Score call that stays open until its caller cancels it (or the server shuts down). gRPC owns
// it: it deletes itself when done, as the callback API's reactors do.
class HangingReactor final : public grpc::ServerUnaryReactor {
 public:
  void OnCancel() override { Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")); }
  void OnDone() override { delete this; }
};

// An in-process opd.v1.Teacher whose Score calls do what the test's script says for each call
// (numbered from 0): answer (log-prob -1 at every position; top-k ids 0..k-1), fail with a
// status, hang until cancelled, or answer with a reply that `corrupt` damaged.
class FakeTeacher final : public opd::v1::Teacher::CallbackService {
 public:
  struct Action {
    grpc::Status status = grpc::Status::OK;
    bool hang = false;
    std::function<void(opd::v1::ScoreResponse*)> corrupt;
  };
  using Script = std::function<Action(int call)>;
  FakeTeacher(std::string fingerprint, Script script)
      : fingerprint_(std::move(fingerprint)), script_(std::move(script)) {}
  // Runs as a call starts, before the script, with its request.
  std::function<void(const opd::v1::ScoreRequest&)> on_request;

  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx,
                                  const opd::v1::ScoreRequest* req,
                                  opd::v1::ScoreResponse* resp) override {
    int call;
    {
      absl::MutexLock lock(&mu_);
      call = calls_++;
      sequences_ += req->sequences_size();
      deadlines_s_.push_back(
          absl::ToDoubleSeconds(absl::FromChrono(ctx->deadline()) - absl::Now()));
    }
    if (on_request) on_request(*req);
    const Action a = script_(call);
    if (a.hang) {
      auto* hanging = new HangingReactor();  // deletes itself in OnDone
      absl::MutexLock lock(&mu_);
      ++hung_;
      return hanging;
    }
    auto* reactor = ctx->DefaultReactor();
    if (!a.status.ok()) {
      reactor->Finish(a.status);
      return reactor;
    }
    resp->set_top_k(req->top_k());
    for (const auto& seq : req->sequences()) {
      const size_t n = static_cast<size_t>(seq.tokens_size() - seq.response_start());
      const size_t k = static_cast<size_t>(req->top_k());
      auto* m = resp->add_sequences();
      *m->mutable_logprobs() = opd::rpc::PackArray(std::vector<float>(n, -1.0f));
      std::vector<int32_t> ids;
      for (size_t i = 0; i < n * k; ++i) ids.push_back(static_cast<int32_t>(i % k));
      *m->mutable_topk_ids() = opd::rpc::PackArray(ids);
      *m->mutable_topk_logprobs() = opd::rpc::PackArray(std::vector<float>(n * k, -1.0f));
    }
    if (a.corrupt) a.corrupt(resp);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx, const opd::v1::InfoRequest*,
                                 opd::v1::ServiceInfo* info) override {
    info->set_service("opd.v1.Teacher");
    info->set_model_name("fake");
    info->set_architecture("fake");
    info->set_vocab_size(320);
    info->set_tokenizer_fingerprint(fingerprint_);
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  int calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  int64_t sequences() const {  // over every Score call received
    absl::MutexLock lock(&mu_);
    return sequences_;
  }
  std::vector<double> deadlines_s() const {
    absl::MutexLock lock(&mu_);
    return deadlines_s_;
  }
  // Blocks until a call is hanging (true), or `limit` passes (false: a failure bound).
  bool AwaitHang(absl::Duration limit) const {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(
                                    +[](const int* hung) { return *hung > 0; }, &hung_),
                                limit);
  }

 private:
  const std::string fingerprint_;
  const Script script_;
  mutable absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sequences_ ABSL_GUARDED_BY(mu_) = 0;
  int hung_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<double> deadlines_s_ ABSL_GUARDED_BY(mu_);
};

// An in-process opd.v1.Rollout: every prompt gets its samples with the response {5, 6, 7 + i}
// (i its seed index, or else its position, mod 50; log-probs -1), so a prompt's samples are the
// same bits whichever worker or call samples it, and the weight version it was last pushed; then
// `corrupt` damages them as the test wants. `reverse` writes them last first;
// `before_write(n, total)` runs before the n-th of `total` writes (a test may block there);
// `fail_after` >= 0 ends the call UNAVAILABLE after that many writes, as a worker that died
// mid-stream.
class FakeRollout final : public opd::v1::Rollout::Service {
 public:
  explicit FakeRollout(std::string fingerprint) : fingerprint_(std::move(fingerprint)) {}
  std::function<void(std::vector<opd::v1::Sample>*)> corrupt;
  std::function<void(int written, int total)> before_write;
  // Runs as a call starts, with its request (a test may block there, or note whose call it is).
  std::function<void(const opd::v1::GenerateRequest&)> on_call;
  bool reverse = false;
  int fail_after = -1;

  grpc::Status Generate(grpc::ServerContext*, const opd::v1::GenerateRequest* req,
                        grpc::ServerWriter<opd::v1::Sample>* writer) override {
    calls_.fetch_add(1);
    if (on_call) on_call(*req);
    std::vector<opd::v1::Sample> out;
    for (int p = 0; p < req->prompts_size(); ++p) {
      const int64_t index =
          req->prompts(p).has_seed_index() ? req->prompts(p).seed_index() : int64_t{p};
      for (int s = 0; s < std::max(1, req->samples_per_prompt()); ++s) {
        opd::v1::Sample m;
        m.set_prompt_index(p);
        m.set_sample_index(s);
        m.add_tokens(5);
        m.add_tokens(6);
        m.add_tokens(static_cast<int32_t>(7 + index % 50));
        *m.mutable_logprobs() = opd::rpc::PackArray(std::vector<float>{-1.0f, -1.0f, -1.0f});
        m.set_finish_reason(opd::v1::FINISH_REASON_STOP);
        m.set_weight_version(version_.load());
        out.push_back(std::move(m));
      }
    }
    if (corrupt) corrupt(&out);
    if (reverse) std::reverse(out.begin(), out.end());
    for (int n = 0; n < static_cast<int>(out.size()); ++n) {
      if (n == fail_after) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker died");
      if (before_write) before_write(n, static_cast<int>(out.size()));
      writer->Write(out[static_cast<size_t>(n)]);
      written_.fetch_add(1);
    }
    return grpc::Status::OK;
  }
  grpc::Status UpdateWeights(grpc::ServerContext*, grpc::ServerReader<opd::v1::WeightChunk>* reader,
                             opd::v1::UpdateWeightsResponse* resp) override {
    opd::v1::WeightChunk chunk;
    int64_t version = 0;
    while (reader->Read(&chunk)) version = chunk.version();
    version_ = version;
    resp->set_version(version);
    return grpc::Status::OK;
  }
  grpc::Status Info(grpc::ServerContext*, const opd::v1::InfoRequest*,
                    opd::v1::ServiceInfo* info) override {
    info->set_service("opd.v1.Rollout");
    info->set_vocab_size(320);
    info->set_tokenizer_fingerprint(fingerprint_);
    info->set_weight_version(version_.load());
    return grpc::Status::OK;
  }
  int calls() const { return calls_.load(); }
  int written() const { return written_.load(); }

 private:
  const std::string fingerprint_;
  std::atomic<int64_t> version_{0};
  std::atomic<int> calls_{0}, written_{0};
};

// A fake service on 127.0.0.1 (any free port), shut down (calls in flight cancelled) at the end.
template <class Service>
class InProcessServer {
 public:
  template <class... Args>
  InProcessServer(const std::string& name, Args&&... args) : service(std::forward<Args>(args)...) {
    opd::rpc::ServerOptions so;
    so.listen = "127.0.0.1:0";
    auto running = opd::rpc::StartServer(so, {&service}, {name});
    EXPECT_TRUE(running.ok()) << running.status();
    if (!running.ok()) return;
    server_ = std::move(*running);
    address = "127.0.0.1:" + std::to_string(server_.port);
  }
  ~InProcessServer() { Shutdown(); }
  // Stops taking calls and cancels those in flight.
  void Shutdown() {
    if (server_.server) server_.server->Shutdown(std::chrono::system_clock::now());
  }
  Service service;
  std::string address;

 private:
  opd::rpc::RunningServer server_;
};
using FakeTeacherServer = InProcessServer<FakeTeacher>;

// Time for a TeacherPool that only moves when the pool waits: backoffs and cool-downs are then
// exact, whatever the machine's speed.
struct FakeClock {
  absl::Mutex mu;
  absl::Time now = absl::UnixEpoch();
  std::vector<absl::Duration> waits;
  void Drive(trainer::TeacherPoolOptions* o) {
    o->clock = [this] {
      absl::MutexLock lock(&mu);
      return now;
    };
    o->wait = [this](absl::Duration d, const std::function<bool()>& stopped) {
      absl::MutexLock lock(&mu);
      now += d;
      waits.push_back(d);
      return !stopped();
    };
  }
  absl::Time Now() {
    absl::MutexLock lock(&mu);
    return now;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu);
    now += d;
  }
};

}  // namespace testing_util
