// The teacher replicas of one OPD stage.
//
// Score() spreads a step's sequences over the healthy replicas by tokens (ScoreSpread: across
// every caller of the step, not only this one), in shares of at most max_sequences_per_call
// sequences, at most two calls per replica at a time. Every sequence is scored exactly once:
// results are written to the input's own slot, and a share is either fully applied or retried
// whole. A share whose replica is out of rotation goes to another healthy one.
//
// Failures, by kind:
//  - transient (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, UNKNOWN, ABORTED, CANCELLED by the
//    server): the share is retried, on another replica when there is one, after an exponential
//    backoff (backoff_initial, doubling, at most backoff_max). The replica is taken out of
//    rotation for a cool-down (readmit_after, doubling with each consecutive failure, at most
//    readmit_max) and re-admitted only once that has passed AND its health check passes: a
//    replica whose health check passes but whose Score keeps failing does not come straight back.
//  - RESOURCE_EXHAUSTED (the replica's queue is full): the share is retried after the backoff;
//    the replica stays in rotation.
//  - anything else (INVALID_ARGUMENT, UNAUTHENTICATED, DATA_LOSS: a reply the client could not
//    read, ...), or a reply that fails validation
//    (sizes, finite log-probs <= 0, top-k ids inside the vocabulary): the step fails at once
//    with an error naming the stage, the teacher and the field.
//  - a share that has failed max_attempts times fails the step, naming the last error.
// With every replica out of rotation the pool waits (and says so) until one is re-admitted; that
// wait does not use up attempts. `stop` (and the client options' canceller) are checked before
// every round and during every wait: a stop ends Score() with CANCELLED promptly, and the
// canceller also ends the calls in flight. It never hands back partial scores.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/client.h"
#include "rpc/teacher_endpoint.h"

namespace lm {
class Tokenizer;
}

namespace trainer {

struct OpdConfig;

// What every teacher of a stage must agree on with the student, and what it must be able to serve.
// TeacherPool::Connect checks each endpoint against it before any step is spent on it.
struct TeacherRequirements {
  // Not an aggregate, so that callers naming only the first two fields need not spell the rest.
  TeacherRequirements(std::string fingerprint = {}, int64_t vocab = 0)
      : tokenizer_fingerprint(std::move(fingerprint)), vocab_size(vocab) {}
  std::string tokenizer_fingerprint;  // empty: not checked
  int64_t vocab_size = 0;             // 0: not checked (then top-k ids are only checked >= 0)
  // A text and the ids the student's tokenizer gives it (no special tokens added). An endpoint
  // that reports no fingerprint but can tokenize (SGLang, vLLM: POST /tokenize) must give the
  // same ids. Empty probe_text: not checked.
  std::string probe_text;
  std::vector<int32_t> probe_ids;
  // The stage's scoring (the defaults check nothing):
  //  - temperature != 1: a vLLM endpoint is refused (it cannot apply a temperature to prompt
  //    log-probs), and an SGLang endpoint must show on a probe sequence that it applies it (stock
  //    SGLang scores input log-probs at temperature 1 whatever the request says);
  //  - top_k > 0 (the topk loss form): every endpoint must score a probe sequence with it (a
  //    server whose limit is lower is refused, naming the flag to raise);
  //  - max_prompt_len + max_new_tokens > 0: the longest sequence the stage sends; an endpoint
  //    that reports a shorter one (ServiceInfo::max_seq_len) is refused, naming both.
  float temperature = 1.0f;
  int32_t top_k = 0;
  int64_t max_prompt_len = 0;
  int64_t max_new_tokens = 0;
};

// The text of the connect-time tokenizer probe: ChatML markers, digits, spaces, accents, CJK and
// an emoji, so that a different vocabulary, merges, pre-tokenizer, normaliser or set of added
// tokens shows in the ids.
inline constexpr const char* kTokenizerProbe =
    "<|im_start|>user\nWhat is 12345 + 678?  Caf\u00e9 na\u00efve \u4e2d\u6587 "
    "\U0001F642<|im_end|>\n";

// A student's requirements: its tokenizer's fingerprint and kTokenizerProbe as it tokenizes it,
// and its vocabulary size (the scoring fields left unchecked).
TeacherRequirements StudentRequirements(const lm::Tokenizer& tokenizer, int64_t vocab_size);

// What an OPD job's teachers must meet, from its config: StudentRequirements plus the scoring the
// stages ask for, loss.teacher_temperature, loss.top_k (when loss.form is topk, else 0), and
// prompts.max_prompt_len + rollout.max_new_tokens. The same for every stage and domain pool and
// for a swap's endpoints.
TeacherRequirements StageRequirements(const OpdConfig& c, const lm::Tokenizer& tokenizer,
                                      int64_t vocab_size);

// Where one caller's inputs sit among everything a pool's replicas score in a step, when several
// callers (the learner ranks, each with its own pool of the same replicas) score at once. The
// pool lays the step's tokens on one line, callers in order, and gives replica j the j-th of
// (replicas) equal slices: a sequence goes to the replica whose slice holds its middle. Every
// replica then receives its share of the step's tokens within one sequence, however small each
// caller's part (a rank whose inputs fit one call no longer always lands on the first replica).
// The default is a caller alone: its own tokens are the whole line.
struct ScoreSpread {
  int64_t tokens_before = 0;  // the step's tokens for this pool held by the callers before it
  int64_t total_tokens = 0;   // the step's tokens for this pool over every caller (0: its own)
  // >= 0: the whole call goes to replica replica_hint % replicas (while it is healthy). Callers
  // that score a step in many small calls as samples arrive (trainer/opd/score_stream.h) rotate
  // it from their rank and step, so the calls of every rank spread evenly over the replicas.
  int64_t replica_hint = -1;
};

// Caller `caller`'s spread when the callers hold tokens[0], tokens[1], ... for a pool (a token
// being one of a sequence's tokens.size()).
ScoreSpread SpreadAmong(const std::vector<int64_t>& tokens, size_t caller);

struct TeacherPoolOptions {
  opd::rpc::ClientOptions client;  // address is filled per replica
  absl::Duration backoff_initial = absl::Milliseconds(500);
  absl::Duration backoff_max = absl::Seconds(30);
  int max_attempts = 4;  // tries of one share, over all replicas, before the step fails
  absl::Duration readmit_after = absl::Seconds(5);
  absl::Duration readmit_max = absl::Minutes(5);
  int max_sequences_per_call = 64;  // a replica's share is sent in calls of at most this many
  // How long one Score() may take in all, waits for a healthy replica included: past it the call
  // fails DEADLINE_EXCEEDED naming the stage, its replicas and the last error (the job then ends
  // the step and checkpoints), instead of waiting for a replica that may never come back.
  absl::Duration score_deadline = absl::InfiniteDuration();
  // With every replica out of rotation, end Score() at once with UNAVAILABLE instead of waiting
  // for one to come back (a domain's pool whose stage sends its work to the default pool then:
  // stages[].on_domain_down).
  bool give_up_when_all_down = false;
  // How the pool waits `d`; returns false when `stopped()` ended the wait early. Unset: sleeps in
  // slices of at most 50 ms, checking `stopped()`. Tests set it to record the delays.
  std::function<bool(absl::Duration d, const std::function<bool()>& stopped)> wait;
  // The time backoffs and cool-downs are measured in. Unset: absl::Now. Tests pair it with `wait`
  // to drive time themselves.
  std::function<absl::Time()> clock;
};

class TeacherPool {
 public:
  TeacherPool(std::string stage, TeacherPoolOptions opts, int64_t vocab_size = 0)
      : stage_(std::move(stage)), opts_(std::move(opts)), vocab_size_(vocab_size) {}
  // Connects to every endpoint and checks it against `req` (its Info(), then the tokenizer and
  // scoring probes; see TeacherRequirements): a mismatch, a limit below what the stage asks, or an
  // endpoint that cannot be reached is an error naming the stage and the endpoint, before any
  // step is spent on it.
  static absl::StatusOr<std::unique_ptr<TeacherPool>> Connect(
      const std::string& stage, const std::vector<std::string>& endpoints,
      const TeacherRequirements& req, const TeacherPoolOptions& opts);

  // Scores every input (one output per input, in order); see the top of the file for failures
  // and ScoreSpread for which replica scores what.
  absl::StatusOr<std::vector<lm::SequenceScore>> Score(const std::vector<lm::Sample>& inputs,
                                                       const opd::rpc::ScoreOptions& score_opts,
                                                       const std::function<bool()>& stop = nullptr,
                                                       const ScoreSpread& spread = {});

  const std::string& stage() const { return stage_; }
  const TeacherPoolOptions& options() const { return opts_; }
  std::vector<std::string> endpoints() const;
  int healthy_count() const;
  int64_t failovers() const { return failovers_.load(); }
  // Sequences whose scores have come back (over all Score calls).
  int64_t sequences_scored() const { return scored_.load(); }

 private:
  struct Replica {
    std::unique_ptr<opd::rpc::TeacherEndpoint> client;  // opd-teacher, SGLang or vLLM
    opd::rpc::ClientOptions opts;
    bool healthy = true;
    int consecutive_failures = 0;
    absl::Time readmit_at = absl::InfinitePast();
  };
  struct Share;
  class ScoreRun;  // one Score() call's rounds of shares (teacher_pool.cc)
  // The connect-time checks of one endpoint against `req` (see TeacherRequirements).
  absl::Status CheckEndpoint(const std::string& ep, opd::rpc::TeacherEndpoint& client,
                             const TeacherRequirements& req) const;
  absl::Status CheckTokenizerProbe(const std::string& ep, opd::rpc::TeacherEndpoint& client,
                                   const TeacherRequirements& req) const;
  absl::Status CheckScoringProbe(const std::string& ep, opd::rpc::TeacherEndpoint& client,
                                 const opd::v1::ServiceInfo& info,
                                 const TeacherRequirements& req) const;
  // The inputs in shares of at most max_sequences_per_call, each with its replica (ScoreSpread).
  std::vector<Share> MakeShares(const std::vector<lm::Sample>& inputs,
                                const ScoreSpread& spread) const;
  std::vector<int> HealthyReplicas();  // re-admits replicas whose cool-down and health check pass
  absl::Time NextReadmission() const;  // the earliest cool-down end of a replica out of rotation
  void TakeOutOfRotation(int replica, const absl::Status& why);
  bool Wait(absl::Duration d, const std::function<bool()>& stopped) const;
  absl::Time Now() const { return opts_.clock ? opts_.clock() : absl::Now(); }
  absl::Status Validate(const std::vector<lm::SequenceScore>& out, const Share& share,
                        const std::vector<lm::Sample>& inputs, int32_t top_k,
                        const std::string& address) const;

  std::string stage_;
  TeacherPoolOptions opts_;
  int64_t vocab_size_ = 0;
  mutable absl::Mutex mu_;
  std::vector<Replica> replicas_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> failovers_{0};
  std::atomic<int64_t> scored_{0};
};

// True for statuses worth retrying (on another replica when there is one).
bool IsTransient(const absl::Status& s);

// The backoff before attempt `attempt` (1 = the first retry): initial * 2^(attempt - 1), at most
// `max`.
absl::Duration RetryBackoff(int attempt, absl::Duration initial, absl::Duration max);

}  // namespace trainer
