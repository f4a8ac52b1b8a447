// External inference servers as OPD teachers: SGLang (`POST /generate`) and vLLM
// (`POST /v1/completions` with prompt_logprobs), spoken over HTTP(S) with libcurl.
//
// Endpoints: "sglang://host:port", "vllm://host:port", and "sglang+https://host:port",
// "vllm+https://host:port" (TLS, roots from ClientOptions::tls.ca_file), each optionally followed
// by "?tokenizer=none": the server has no tokenizer (SGLang's --skip-tokenizer-init), so the
// connect-time tokenizer probe is not asked of it. ClientOptions::secret, when set, is sent as
// "Authorization: Bearer <secret>" (load it with LoadSecret, rpc/auth.h: a 0600 file or
// $OPD_SECRET). ClientOptions::timeout bounds each HTTP request; the canceller ends requests in
// flight.
//
// Errors: connection errors and HTTP 5xx are UNAVAILABLE (the pool fails over), 429
// RESOURCE_EXHAUSTED, 401/403 UNAUTHENTICATED, 404 NOT_FOUND, other 4xx INVALID_ARGUMENT, a
// server certificate that the CA does not vouch for FAILED_PRECONDITION (retrying cannot help), a
// request past its timeout DEADLINE_EXCEEDED, a cancelled one CANCELLED. A reply that is not
// JSON, whose body is larger than the request can legitimately return (ReplyBytesBound), or
// whose fields are wrong (lengths, token ids, missing or mistyped fields) is DATA_LOSS naming the
// endpoint and the field: a server that sent it once will send it again, so it is not retried.
// Non-finite log-probs are passed on as such and refused by the pool's validation.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "rpc/client.h"
#include "rpc/teacher_endpoint.h"

namespace opd::rpc {

enum class HttpTeacherKind { kSglang, kVllm };

// An external endpoint as written in a config or on a command line.
struct HttpTeacherAddress {
  HttpTeacherKind kind = HttpTeacherKind::kSglang;
  std::string base_url;       // "http://host:port" or "https://host:port"
  bool has_tokenizer = true;  // false: "?tokenizer=none"
};

// True when `endpoint` has an sglang or vllm scheme (then ParseHttpTeacherAddress must accept it).
bool IsHttpTeacherEndpoint(const std::string& endpoint);
// INVALID_ARGUMENT naming the endpoint when it has no host or an option other than
// "tokenizer=none".
absl::StatusOr<HttpTeacherAddress> ParseHttpTeacherAddress(const std::string& endpoint);

// The most bytes a reply body may have. A score reply carries, for each position of each sequence
// (vLLM returns every prompt position), at most k + 1 entries (the top k and the sent token):
// an entry is at most kMaxReplyEntryBytes (a JSON key or id of <= 12 bytes, a float of <= 24, a
// rank of <= 12, the field names and punctuation: <= 96 bytes; the rest is room for the decoded
// token text vLLM adds, which SGLang leaves null), plus kReplySequenceBytes of framing per
// sequence and kReplyFixedBytes per reply. Replies to the small requests (model info, tokenize,
// health) are bounded by kMaxSmallReplyBytes.
inline constexpr int64_t kMaxReplyEntryBytes = 256;
inline constexpr int64_t kReplySequenceBytes = 4096;
inline constexpr int64_t kReplyFixedBytes = 64 << 10;
inline constexpr int64_t kMaxSmallReplyBytes = 1 << 20;
int64_t ReplyBytesBound(const std::vector<lm::Sample>& seqs, size_t begin, size_t end,
                        int32_t top_k);

struct HttpTeacherOptions {
  // A request carries sequences until their tokens would pass this (one sequence always fits).
  int64_t max_tokens_per_request = 32768;
};

class HttpTeacher : public TeacherEndpoint {
 public:
  static absl::StatusOr<std::unique_ptr<HttpTeacher>> Create(const ClientOptions& opts,
                                                             HttpTeacherOptions http = {});
  ~HttpTeacher() override;

  // SGLang: GET /get_model_info; vLLM: GET /v1/models (the served model name is kept for
  // requests). Both: max_seq_len is the longest sequence the server scores, max_model_len - 1
  // from /v1/models (it refuses a sequence that leaves no room for the one token a request must
  // allow; 0 when SGLang does not say). vocab_size and tokenizer_fingerprint are left unset (not
  // known).
  absl::StatusOr<opd::v1::ServiceInfo> Info() override;
  absl::StatusOr<std::vector<lm::SequenceScore>> Score(const std::vector<lm::Sample>& seqs,
                                                       const ScoreOptions& opts) override;
  bool Healthy() override;  // SGLang GET /health, vLLM GET /health: HTTP 200
  const std::string& address() const override { return opts_.address; }
  HttpTeacherKind kind() const { return where_.kind; }

  // POST /tokenize of `text` with add_special_tokens false (vLLM, and SGLang since it has one):
  // the ids the server's tokenizer gives. UNIMPLEMENTED when the endpoint says it has no
  // tokenizer ("?tokenizer=none") or the server has no /tokenize (HTTP 404); any other refusal
  // keeps its code (5xx UNAVAILABLE, other 4xx INVALID_ARGUMENT, ...).
  absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text) override;

 private:
  HttpTeacher(ClientOptions opts, HttpTeacherOptions http, HttpTeacherAddress where)
      : opts_(std::move(opts)), http_(http), where_(std::move(where)) {}
  // One request; `body` empty = GET. Maps transport and HTTP errors to a status; a body past
  // `max_body` bytes is DATA_LOSS, `why_max` saying what bounds it.
  absl::StatusOr<std::string> Request(const std::string& path, const std::string& body,
                                      int64_t max_body, const std::string& why_max,
                                      long* http_code = nullptr);
  absl::StatusOr<std::vector<lm::SequenceScore>> ScoreBatch(const std::vector<lm::Sample>& seqs,
                                                            size_t begin, size_t end,
                                                            const ScoreOptions& opts);
  absl::StatusOr<std::string> ModelName();
  void* TakeHandle();
  void ReturnHandle(void* h);

  ClientOptions opts_;
  HttpTeacherOptions http_;
  HttpTeacherAddress where_;
  absl::Mutex mu_;
  std::vector<void*> idle_ ABSL_GUARDED_BY(mu_);  // CURL* kept for keep-alive
  std::string model_ ABSL_GUARDED_BY(mu_);
};

}  // namespace opd::rpc
