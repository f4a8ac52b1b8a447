// Clients of the OPD services, for the learner and for opd-ctl.
//
// Every call has a deadline (ClientOptions::timeout) and returns absl::Status(Or): the gRPC code
// is kept, and the message starts with the server's address ("127.0.0.1:7001: ...") so that an
// error names the server it came from. Clients are thread-safe: one per server is enough.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "lm/generate/sampling.h"
#include "opd/v1/rollout.grpc.pb.h"
#include "opd/v1/teacher.grpc.pb.h"
#include "rpc/teacher_endpoint.h"
#include "rpc/tls.h"

namespace opd::rpc {

// Cancels calls in flight from another thread (the learner's stop path, where a call's deadline
// can be an hour): every call made with ClientOptions::canceller registers its context while it
// runs. After Cancel(), calls in flight end CANCELLED at once and later calls fail CANCELLED
// without waiting for the server.
class CallCanceller {
 public:
  void Cancel();
  bool cancelled() const;

  // Registers `ctx` (a call about to start) for the scope's lifetime; `c` may be null.
  class Scope {
   public:
    Scope(CallCanceller* c, grpc::ClientContext* ctx);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CallCanceller* c_;
    grpc::ClientContext* ctx_;
  };

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
};

struct ClientOptions {
  std::string address;  // host:port
  std::string secret;   // sent as "authorization: Bearer <secret>"; empty sends nothing
  TlsClientOptions tls;
  absl::Duration timeout = absl::Seconds(120);  // deadline of each call
  int max_message_bytes = 256 << 20;
  std::shared_ptr<CallCanceller> canceller;  // when set, Cancel() ends this client's calls
};

// --- teacher ---

struct ScoreOptions {
  float temperature = 1.0f;
  int32_t top_k = 0;  // > 0: also the top-k ids and log-probs per position
};

class TeacherClient : public TeacherEndpoint {
 public:
  static absl::StatusOr<std::unique_ptr<TeacherClient>> Create(const ClientOptions& opts);

  absl::StatusOr<opd::v1::ServiceInfo> Info() override;
  // One output per input, in order. Asks for the reply as a ScoreStream (chunks of whole
  // sequences, so that no reply message has to hold the whole batch), and falls back to the unary
  // Score when the server has no ScoreStream (UNIMPLEMENTED: an older opd-teacher), remembering
  // that for this client's later calls. One deadline (ClientOptions::timeout) covers both tries.
  absl::StatusOr<std::vector<lm::SequenceScore>> Score(const std::vector<lm::Sample>& seqs,
                                                       const ScoreOptions& opts = {}) override;
  // The standard gRPC health check (2 s deadline) answers SERVING.
  bool Healthy() override;
  const std::string& address() const override { return opts_.address; }

 private:
  TeacherClient(ClientOptions opts, std::shared_ptr<grpc::Channel> channel);
  // The two ways of asking; `unimplemented` is set when the server has no ScoreStream.
  absl::StatusOr<std::vector<lm::SequenceScore>> ScoreStreamed(const opd::v1::ScoreRequest& req,
                                                               const std::vector<lm::Sample>& seqs,
                                                               absl::Time deadline,
                                                               bool* unimplemented);
  absl::StatusOr<std::vector<lm::SequenceScore>> ScoreUnary(const opd::v1::ScoreRequest& req,
                                                            const std::vector<lm::Sample>& seqs,
                                                            absl::Time deadline);
  ClientOptions opts_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<opd::v1::Teacher::Stub> stub_;
  std::atomic<bool> unary_only_{false};  // the server answered ScoreStream with UNIMPLEMENTED
};

// --- rollout ---

class RolloutClient {
 public:
  static absl::StatusOr<std::unique_ptr<RolloutClient>> Create(const ClientOptions& opts);

  absl::StatusOr<opd::v1::ServiceInfo> Info();
  // Samples `params.samples_per_prompt` responses for every prompt with `params` (every member:
  // the settings, the stop ids, the seed, per-prompt seed indices and return_routing; the
  // request's one conversion to the wire). All samples, in (prompt, sample) order, each with its
  // prompt (the wire carries only the response) and the server's log-probs, finish reason and
  // weight version; the routing, when asked for, is checked to cover every fed position.
  // `on_sample`, when set, also sees each sample as it arrives (the server streams them as they
  // finish).
  absl::StatusOr<std::vector<lm::Sample>> Generate(
      absl::Span<const std::vector<int32_t>> prompts, const lm::SamplingParams& params,
      const std::function<void(const lm::Sample&)>& on_sample = nullptr);
  // The samples one at a time as they arrive, each with its prompt (prompt_index: its position in
  // `prompts`, which are only read, and must outlive the call), nothing kept here. An error from
  // `on_sample` cancels the call and is returned.
  absl::Status StreamGenerate(absl::Span<const absl::Span<const int32_t>> prompts,
                              const lm::SamplingParams& params,
                              const std::function<absl::Status(lm::Sample)>& on_sample);
  // Weight updates: rpc/weight_stream.h StreamWeights, the one streamer.
  const std::string& address() const { return opts_.address; }

 private:
  RolloutClient(ClientOptions opts, std::shared_ptr<grpc::Channel> channel);
  ClientOptions opts_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<opd::v1::Rollout::Stub> stub_;
};

// --- shared helpers ---

// A channel with the options' credentials and message limits (connects lazily).
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& opts);
// Sets the deadline and the bearer secret on a call.
void PrepareContext(const ClientOptions& opts, grpc::ClientContext* ctx);

// The standard health check of `service` ("" = the whole server). NOT_FOUND when the server
// does not know the service.
absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
    const ClientOptions& opts, const std::string& service = "");
// Polls CheckHealth until SERVING or `timeout` passes (servers that are still starting).
absl::Status WaitUntilServing(const ClientOptions& opts, absl::Duration timeout,
                              const std::string& service = "");

}  // namespace opd::rpc
