// ScoreStream: the teacher's reply in chunks of whole sequences (issue #27), against an in-process
// TeacherService on 127.0.0.1 and a tiny fixture model.
//
// Covered: a request splits into exactly the chunks ReplyBytes predicts, with the same log-probs
// and top-k as the unary Score bit for bit; a request whose whole reply is over --max-reply-mb is
// refused by Score but streamed, no chunk over the chunk budget; one sequence over the reply
// budget is refused naming it; the client falls back to Score against a server without
// ScoreStream and remembers it; a stream's later chunks are not refused by a full queue; a stream
// without the secret is UNAUTHENTICATED. Everything is checked on counters, never on timing.
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/model/model.h"
#include "opd/v1/teacher.grpc.pb.h"
#include "rpc/auth.h"
#include "rpc/client.h"
#include "rpc/codec.h"
#include "rpc/server.h"
#include "teacher_service/service.h"

namespace {

constexpr const char* kModel = "moe_tied_topk8";  // vocab 96, 256 positions
constexpr int64_t kVocab = 96;
constexpr const char* kSecret = "s3cret-for-stream-tests";

std::shared_ptr<lm::CausalLM> Model() {
  // Loaded once: every server of this file scores with the same weights.
  static const std::shared_ptr<lm::CausalLM> model = [] {
    torch::set_num_threads(1);  // tiny model; and identical arithmetic in every call
    auto m = lm::LoadModel(std::string(OPD_FIXTURES_DIR) + "/" + kModel + "/model");
    EXPECT_TRUE(m.ok()) << m.status();
    (*m)->eval();
    return *m;
  }();
  return model;
}

teacher::ScoreLimits Limits(int64_t max_reply_bytes, int64_t max_chunk_bytes) {
  teacher::ScoreLimits l;
  l.vocab_size = kVocab;
  l.max_seq_len = 256;
  l.max_reply_bytes = max_reply_bytes;
  l.max_chunk_bytes = max_chunk_bytes;
  return l;
}

// One sequence per forward (max_batch_tokens 1) and one worker: every sequence is then computed
// alone, in the same batch shape, whether it came in a unary request or in a stream's chunk, so
// the two replies must agree bit for bit rather than to a tolerance.
teacher::ScorerOptions OneSequencePerBatch(int64_t max_queue = 64) {
  teacher::ScorerOptions o;
  o.max_batch_tokens = 1;
  o.workers = 1;
  o.max_queue = max_queue;
  return o;
}

// An opd-teacher in-process: scorer, service and server on 127.0.0.1:<any>, whose send limit is
// the reply budget, as opd-teacher sets it.
struct Teacher {
  Teacher(teacher::ScoreLimits limits, teacher::ScorerOptions so,
          teacher::StreamLimits streams = {}, std::function<absl::Time()> clock = nullptr)
      : scorer(Model(), so), auth(kSecret), service(&scorer, &auth, limits, {}, streams, clock) {
    opd::rpc::ServerOptions o;
    o.has_secret = true;
    o.max_send_bytes = static_cast<int>(limits.max_reply_bytes);
    auto running = opd::rpc::StartServer(o, {&service}, {"opd.v1.Teacher"});
    EXPECT_TRUE(running.ok()) << running.status();
    if (!running.ok()) return;
    server = std::move(*running);
    address = "127.0.0.1:" + std::to_string(server.port);
  }
  ~Teacher() {
    if (server.server) server.server->Shutdown(std::chrono::system_clock::now());
    scorer.Stop();
  }
  opd::rpc::ClientOptions Options(const std::string& secret = kSecret) const {
    opd::rpc::ClientOptions o;
    o.address = address;
    o.secret = secret;
    o.timeout = absl::Seconds(300);  // a failure bound, never reached by a passing test
    return o;
  }
  std::unique_ptr<opd::rpc::TeacherClient> Client(const std::string& secret = kSecret) const {
    auto c = opd::rpc::TeacherClient::Create(Options(secret));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  teacher::Scorer scorer;
  opd::rpc::Authenticator auth;
  teacher::TeacherService service;
  opd::rpc::RunningServer server;  // last: stopped before the service and scorer go
  std::string address;
};

// `n` sequences of 12..39 random tokens, scored from position 3 (a fixed seed: the same inputs in
// every run).
std::vector<lm::Sample> Inputs(int n, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  std::vector<lm::Sample> out(n);
  for (auto& s : out) {
    const int len = 12 + static_cast<int>(rng() % 28);
    for (int i = 0; i < len; ++i) s.tokens.push_back(static_cast<int32_t>(rng() % kVocab));
    s.response_start = 3;
  }
  return out;
}

opd::v1::ScoreRequest Request(const std::vector<lm::Sample>& seqs, int32_t top_k) {
  opd::v1::ScoreRequest req;
  req.set_temperature(1.0f);
  req.set_top_k(top_k);
  for (const auto& s : seqs) {
    auto* m = req.add_sequences();
    m->mutable_tokens()->Add(s.tokens.begin(), s.tokens.end());
    m->set_response_start(s.response_start);
  }
  return req;
}

// The job the server builds from `seqs`, restricted to [begin, end).
teacher::ScoreJob Job(const std::vector<lm::Sample>& seqs, int32_t top_k, size_t begin,
                      size_t end) {
  teacher::ScoreJob j;
  j.sequences.assign(seqs.begin() + begin, seqs.begin() + end);
  j.top_k = top_k;
  return j;
}

// The chunks a stream must send, from ReplyBytes alone: the longest runs of consecutive sequences
// whose reply fits `budget`, at least one each.
int64_t ExpectedChunks(const std::vector<lm::Sample>& seqs, int32_t top_k, int64_t budget) {
  int64_t chunks = 0;
  for (size_t begin = 0; begin < seqs.size(); ++chunks) {
    size_t end = begin + 1;
    while (end < seqs.size() && teacher::ReplyBytes(Job(seqs, top_k, begin, end + 1)) <= budget)
      ++end;
    begin = end;
  }
  return chunks;
}

// A unary Score call on the raw stub (TeacherClient streams).
grpc::Status UnaryScore(const Teacher& t, const opd::v1::ScoreRequest& req,
                        opd::v1::ScoreResponse* resp) {
  auto stub =
      opd::v1::Teacher::NewStub(grpc::CreateChannel(t.address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  opd::rpc::PrepareContext(t.Options(), &ctx);
  return stub->Score(&ctx, req, resp);
}

// (a) Chunk count from ReplyBytes, and the stream's scores equal the unary reply's bytes.
TEST(ScoreStream, ChunksAsReplyBytesPredictAndScoresEqualUnaryBitForBit) {
  const auto seqs = Inputs(9);
  constexpr int32_t kTopK = 4;
  constexpr int64_t kChunkBudget = 2500;  // 2 or 3 of these sequences per chunk
  const int64_t expected = ExpectedChunks(seqs, kTopK, kChunkBudget);
  ASSERT_GE(expected, 3) << "inputs too small to split";
  EXPECT_EQ(static_cast<int64_t>(
                teacher::ChunkRanges(Job(seqs, kTopK, 0, seqs.size()), kChunkBudget).size()),
            expected);

  Teacher t(Limits(int64_t{1} << 20, kChunkBudget), OneSequencePerBatch());
  opd::v1::ScoreResponse unary;
  ASSERT_TRUE(UnaryScore(t, Request(seqs, kTopK), &unary).ok());
  ASSERT_EQ(unary.sequences_size(), static_cast<int>(seqs.size()));

  auto client = t.Client();
  auto streamed = client->Score(seqs, {1.0f, kTopK});
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(t.service.chunks_sent(), expected);
  EXPECT_EQ(t.service.streams_finished(), 1);
  EXPECT_LE(t.service.largest_chunk_bytes(), kChunkBudget);
  ASSERT_EQ(streamed->size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "sequence " << i);
    const auto& u = unary.sequences(static_cast<int>(i));
    const auto& s = (*streamed)[i];
    EXPECT_EQ(s.logprobs.size(), seqs[i].tokens.size() - seqs[i].response_start);
    // Bytes, not values: bit for bit, NaN or not.
    EXPECT_EQ(opd::rpc::PackArray(s.logprobs), u.logprobs());
    EXPECT_EQ(opd::rpc::PackArray(s.topk_ids), u.topk_ids());
    EXPECT_EQ(opd::rpc::PackArray(s.topk_logprobs), u.topk_logprobs());
  }
}

// (b) Over the reply budget as a whole: Score refuses, ScoreStream serves in chunks that each
// stay within the chunk budget.
TEST(ScoreStream, ReplyOverTheBudgetIsStreamedInBoundedChunks) {
  const auto seqs = Inputs(8, 11);
  constexpr int32_t kTopK = 8;
  constexpr int64_t kReplyBudget = 6000, kChunkBudget = 4000;
  const int64_t whole = teacher::ReplyBytes(Job(seqs, kTopK, 0, seqs.size()));
  ASSERT_GT(whole, kReplyBudget);
  Teacher t(Limits(kReplyBudget, kChunkBudget), OneSequencePerBatch());

  opd::v1::ScoreResponse unary;
  const grpc::Status refused = UnaryScore(t, Request(seqs, kTopK), &unary);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--max-reply-mb"), std::string::npos);

  auto out = t.Client()->Score(seqs, {1.0f, kTopK});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    const size_t n = seqs[i].tokens.size() - seqs[i].response_start;
    EXPECT_EQ((*out)[i].logprobs.size(), n);
    EXPECT_EQ((*out)[i].topk_ids.size(), n * kTopK);
  }
  EXPECT_EQ(t.service.chunks_sent(), ExpectedChunks(seqs, kTopK, kChunkBudget));
  EXPECT_GT(t.service.chunks_sent(), 1);
  EXPECT_GT(t.service.largest_chunk_bytes(), 0);
  EXPECT_LE(t.service.largest_chunk_bytes(), kChunkBudget);
}

// (c) One sequence whose reply alone is over the reply budget: refused before scoring, naming it.
TEST(ScoreStream, SequenceOverTheReplyBudgetIsRefusedNamingIt) {
  auto seqs = Inputs(4, 5);
  seqs[2].tokens.assign(200, 5);  // 197 positions x (4 + 8 x 8) bytes: over 6000
  Teacher t(Limits(6000, 4000), OneSequencePerBatch());
  auto out = t.Client()->Score(seqs, {1.0f, 8});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted) << out.status();
  const std::string msg(out.status().message());
  EXPECT_NE(msg.find("sequence 2:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--max-reply-mb"), std::string::npos) << msg;
  EXPECT_NE(msg.find(t.address), std::string::npos) << msg;
  EXPECT_EQ(t.service.chunks_sent(), 0);
  EXPECT_EQ(t.scorer.batches(), 0);  // refused before any work
}

// A teacher that predates ScoreStream: Score answers log-prob -1 everywhere; ScoreStream is
// counted and then answered by the generated base class, exactly as an older server answers it
// (UNIMPLEMENTED).
class UnaryOnlyTeacher final : public opd::v1::Teacher::CallbackService {
 public:
  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx,
                                  const opd::v1::ScoreRequest* req,
                                  opd::v1::ScoreResponse* resp) override {
    ++score_calls;
    resp->set_top_k(req->top_k());
    for (const auto& s : req->sequences()) {
      const size_t n = static_cast<size_t>(s.tokens_size() - s.response_start());
      *resp->add_sequences()->mutable_logprobs() =
          opd::rpc::PackArray(std::vector<float>(n, -1.0f));
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerWriteReactor<opd::v1::ScoreChunk>* ScoreStream(
      grpc::CallbackServerContext* ctx, const opd::v1::ScoreRequest* req) override {
    ++stream_calls;
    return opd::v1::Teacher::CallbackService::ScoreStream(ctx, req);
  }
  std::atomic<int> score_calls{0}, stream_calls{0};
};

// (d) Fallback to Score, remembered for the client's later calls.
TEST(ScoreStream, ClientFallsBackToUnaryScoreAndRemembers) {
  UnaryOnlyTeacher fake;
  opd::rpc::ServerOptions so;
  auto running = opd::rpc::StartServer(so, {&fake}, {"opd.v1.Teacher"});
  ASSERT_TRUE(running.ok()) << running.status();
  opd::rpc::ClientOptions co;
  co.address = "127.0.0.1:" + std::to_string(running->port);
  auto client = opd::rpc::TeacherClient::Create(co);
  ASSERT_TRUE(client.ok()) << client.status();
  const auto seqs = Inputs(3);
  for (int call = 0; call < 3; ++call) {
    auto out = (*client)->Score(seqs, {});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), seqs.size());
    EXPECT_EQ((*out)[1].logprobs,
              std::vector<float>(seqs[1].tokens.size() - seqs[1].response_start, -1.0f));
  }
  EXPECT_EQ(fake.stream_calls.load(), 1);  // tried once, then remembered
  EXPECT_EQ(fake.score_calls.load(), 3);
  running->server->Shutdown(std::chrono::system_clock::now());
}

// Holds the scorer's only worker inside a job's completion until Release(): jobs submitted
// meanwhile stay queued, so the queue's state is the test's, not the machine's speed.
class WorkerHold {
 public:
  // Submits `job` and waits until the worker is inside its completion; false if it was refused.
  bool Start(teacher::Scorer& scorer, const teacher::ScoreJob& job) {
    auto entered = entered_;
    auto released = released_;
    if (!scorer
             .Submit(job,
                     [entered, released](auto) {
                       entered->set_value();
                       released.wait();
                     })
             .ok())
      return false;
    entered_->get_future().wait();
    return true;
  }
  void Release() {
    if (!done_) release_.set_value();
    done_ = true;
  }
  ~WorkerHold() { Release(); }

 private:
  // Shared with the holding job's callback, which may still be returning when the test ends.
  std::shared_ptr<std::promise<void>> entered_ = std::make_shared<std::promise<void>>();
  std::promise<void> release_;
  std::shared_future<void> released_ = release_.get_future().share();
  bool done_ = false;
};

// (e) A stream's later chunks are queued even when the queue is full: with --max-queue 1, the
// hook fills the queue just before chunk 1 is submitted (a job holding the only worker, one more
// waiting); the stream must still complete, having queued past the bound.
TEST(ScoreStream, LaterChunksAreNotRefusedByAFullQueue) {
  const auto seqs = Inputs(6, 3);
  constexpr int32_t kTopK = 4;
  constexpr int64_t kChunkBudget = 1500;  // one or two sequences per chunk
  const int64_t expected = ExpectedChunks(seqs, kTopK, kChunkBudget);
  ASSERT_GE(expected, 3);
  Teacher t(Limits(int64_t{1} << 20, kChunkBudget), OneSequencePerBatch(/*max_queue=*/1));
  WorkerHold hold;
  std::atomic<int> filled{0}, over_bound{0};
  std::thread releaser;
  t.service.SetBeforeChunkHookForTests([&](int64_t index) {
    if (index != 1 || !hold.Start(t.scorer, Job(seqs, 0, 0, 1))) return;
    filled += t.scorer.Submit(Job(seqs, 0, 1, 2), [](auto) {}).ok();  // the queue is now full
    // Let the worker go once the stream's chunk 1 is queued behind the filler (a minute bounds a
    // failure, which would otherwise leave the worker held).
    releaser = std::thread([&] {
      for (int i = 0; i < 60000 && t.scorer.queued() < 2; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      over_bound += t.scorer.queued() == 2;
      hold.Release();
    });
  });
  auto out = t.Client()->Score(seqs, {1.0f, kTopK});
  if (releaser.joinable()) releaser.join();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(filled.load(), 1);
  EXPECT_EQ(over_bound.load(), 1) << "chunk 1 was not queued past the full queue";
  EXPECT_EQ(t.service.chunks_sent(), expected);
  EXPECT_EQ(t.service.streams_finished(), 1);
}

// The bypass is for admitted jobs only: a full queue still refuses a new request.
TEST(ScoreStream, OnlyAdmittedJobsSkipTheQueueBound) {
  const auto seqs = Inputs(3);
  teacher::Scorer scorer(Model(), OneSequencePerBatch(/*max_queue=*/1));
  WorkerHold hold;
  ASSERT_TRUE(hold.Start(scorer, Job(seqs, 0, 0, 1)));
  ASSERT_TRUE(scorer.Submit(Job(seqs, 0, 1, 2), [](auto) {}).ok());
  EXPECT_EQ(scorer.Submit(Job(seqs, 0, 2, 3), [](auto) {}).code(),
            absl::StatusCode::kResourceExhausted);
  teacher::ScoreJob admitted = Job(seqs, 0, 2, 3);
  admitted.admitted = true;
  EXPECT_TRUE(scorer.Submit(std::move(admitted), [](auto) {}).ok());
  EXPECT_EQ(scorer.queued(), 2);
  hold.Release();
  scorer.Stop();
}

// (f) Without the secret a stream is UNAUTHENTICATED (and never falls back to Score).
TEST(ScoreStream, WithoutTheSecretIsUnauthenticated) {
  Teacher t(Limits(int64_t{1} << 20, 4000), OneSequencePerBatch());
  const auto seqs = Inputs(2);
  auto out = t.Client("")->Score(seqs, {});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnauthenticated) << out.status();
  out = t.Client("wrong-secret")->Score(seqs, {});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnauthenticated) << out.status();
  EXPECT_EQ(t.service.chunks_sent(), 0);
  EXPECT_EQ(t.scorer.batches(), 0);
  out = t.Client()->Score(seqs, {});
  EXPECT_TRUE(out.ok()) << out.status();
}

// ---- clients that stop reading ----

// Waits (on a counter, a minute at most: a failure bound, never reached when passing) until
// `done()`.
bool WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 60000 && !done(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return done();
}

// A raw client on its own connection (channels to one address otherwise share one) that sends
// ScoreStream requests and reads nothing unless told; its receive window stays at gRPC's initial
// 64 KiB (no BDP probing), so a larger chunk cannot be written until it reads.
class RawClient {
 public:
  explicit RawClient(const Teacher& t) : options_(t.Options()) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetMaxReceiveMessageSize(64 << 20);
    stub_ = opd::v1::Teacher::NewStub(
        grpc::CreateCustomChannel(t.address, grpc::InsecureChannelCredentials(), args));
  }
  // Starts a stream (the call is under way when this returns; its handler may not have run yet).
  void Start(const opd::v1::ScoreRequest& req) {
    auto call = std::make_unique<Call>();
    opd::rpc::PrepareContext(options_, &call->ctx);
    call->reader = stub_->ScoreStream(&call->ctx, req);
    calls_.push_back(std::move(call));
  }
  // Reads call `i` to its end; its status.
  grpc::Status Finish(size_t i) {
    opd::v1::ScoreChunk chunk;
    while (calls_[i]->reader->Read(&chunk)) {
    }
    return calls_[i]->reader->Finish();
  }

 private:
  struct Call {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<opd::v1::ScoreChunk>> reader;
  };
  opd::rpc::ClientOptions options_;
  std::unique_ptr<opd::v1::Teacher::Stub> stub_;
  std::vector<std::unique_ptr<Call>> calls_;
};

// (g) At most 2 streams per connection and 3 in all: with the scorer's worker held (so streams
// stay in progress), a third stream on one connection and a fourth in all are refused with
// RESOURCE_EXHAUSTED naming their flags; the others complete once the worker goes.
TEST(ScoreStream, CapsOnStreamsRefuseNamingTheirFlags) {
  teacher::StreamLimits caps;
  caps.max_streams = 3;
  caps.max_streams_per_connection = 2;
  Teacher t(Limits(int64_t{1} << 20, 4000), OneSequencePerBatch(), caps);
  const auto req = Request(Inputs(2), 0);
  WorkerHold hold;
  ASSERT_TRUE(hold.Start(t.scorer, Job(Inputs(1), 0, 0, 1)));
  RawClient a(t), b(t), c(t);
  a.Start(req);
  a.Start(req);
  ASSERT_TRUE(WaitFor([&] { return t.service.streams_in_progress() == 2; }));
  a.Start(req);  // a third on connection a
  grpc::Status refused = a.Finish(2);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--max-streams-per-connection=2"), std::string::npos)
      << refused.error_message();
  b.Start(req);
  ASSERT_TRUE(WaitFor([&] { return t.service.streams_in_progress() == 3; }));
  c.Start(req);  // a fourth in all, the first on connection c
  refused = c.Finish(0);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--max-streams=3"), std::string::npos)
      << refused.error_message();
  hold.Release();
  EXPECT_TRUE(a.Finish(0).ok());
  EXPECT_TRUE(a.Finish(1).ok());
  EXPECT_TRUE(b.Finish(0).ok());
  EXPECT_EQ(t.service.streams_finished(), 3);
  EXPECT_TRUE(WaitFor([&] { return t.service.streams_in_progress() == 0; }));
}

// (h) A stream whose client reads nothing: its first chunk (~2 MB, past the client's 64 KiB
// window) waits to be written, holding an admission slot (with --max-queue 1 a new request is
// refused naming the flag) and its memory. Once the fake clock passes the write timeout the
// stream is cancelled: the client sees CANCELLED, the slot and every byte the call held are
// released, and new requests are served again.
TEST(ScoreStream, AnUnreadStreamIsCancelledAfterTheWriteTimeoutAndItsMemoryFreed) {
  std::atomic<int64_t> now_ns{absl::ToUnixNanos(absl::FromUnixSeconds(1000))};
  auto clock = [&now_ns] { return absl::FromUnixNanos(now_ns.load()); };
  teacher::StreamLimits streams;
  streams.write_timeout = absl::Seconds(10);
  Teacher t(Limits(int64_t{64} << 20, int64_t{2} << 20), OneSequencePerBatch(/*max_queue=*/1),
            streams, clock);
  std::vector<lm::Sample> seqs = Inputs(40, 13);
  for (auto& s : seqs) s.tokens.resize(200, 7);  // 197 positions x (4 + 8 x 96) bytes: ~150 KB
  RawClient reader(t);
  reader.Start(Request(seqs, 96));
  ASSERT_TRUE(WaitFor([&] { return t.service.replies_waiting() == 1; }));
  EXPECT_EQ(t.scorer.held_slots(), 1);
  EXPECT_GT(t.service.held_bytes(), int64_t{2} << 20);  // the request and the chunk (twice)
  // The unread chunk holds the only slot: a new request is refused.
  opd::v1::ScoreResponse resp;
  grpc::Status full = UnaryScore(t, Request(Inputs(1), 0), &resp);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  EXPECT_NE(full.error_message().find("--max-queue"), std::string::npos) << full.error_message();

  now_ns += absl::ToInt64Nanoseconds(absl::Seconds(9));
  EXPECT_EQ(t.service.CancelStalledWrites(), 0);  // not yet
  now_ns += absl::ToInt64Nanoseconds(absl::Seconds(1));
  EXPECT_EQ(t.service.CancelStalledWrites(), 1);
  ASSERT_TRUE(WaitFor([&] {
    return t.service.streams_in_progress() == 0 && t.service.held_bytes() == 0 &&
           t.scorer.held_slots() == 0 && t.service.replies_waiting() == 0;
  })) << t.service.streams_in_progress()
      << " streams, " << t.service.held_bytes() << " bytes";
  EXPECT_EQ(reader.Finish(0).error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(t.service.streams_finished(), 0);
  EXPECT_TRUE(UnaryScore(t, Request(Inputs(1), 0), &resp).ok());
  // The unary reply held its bytes until its call was done (on the server, after the client's).
  EXPECT_TRUE(WaitFor([&] { return t.service.held_bytes() == 0; })) << t.service.held_bytes();
}

}  // namespace
