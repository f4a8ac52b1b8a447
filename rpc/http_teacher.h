// External inference servers as OPD teachers: SGLang (`POST /generate`) and vLLM
// (`POST /v1/completions` with prompt_logprobs), spoken over HTTP(S) with libcurl.
//
// Endpoints: "sglang://host:port", "vllm://host:port", and "sglang+https://host:port",
// "vllm+https://host:port" (TLS, roots from ClientOptions::tls.ca_file). ClientOptions::secret,
// when set, is sent as "Authorization: Bearer <secret>" (load it with LoadSecret, rpc/auth.h: a
// 0600 file or $OPD_SECRET). ClientOptions::timeout bounds each HTTP request; the canceller ends
// requests in flight.
//
// Errors: connection errors and HTTP 5xx are UNAVAILABLE (the pool fails over), 429
// RESOURCE_EXHAUSTED, 401/403 UNAUTHENTICATED, 404 NOT_FOUND, other 4xx INVALID_ARGUMENT, a
// server certificate that the CA does not vouch for FAILED_PRECONDITION (retrying cannot help), a
// request past its timeout DEADLINE_EXCEEDED, a cancelled one CANCELLED, a body that is not JSON
// INTERNAL, and a reply whose fields are wrong (lengths, token ids, missing fields) DATA_LOSS
// naming the endpoint and the field. Non-finite log-probs are passed on as such and refused by the
// pool's validation.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "rpc/client.h"
#include "rpc/teacher_endpoint.h"

namespace opd::rpc {

enum class HttpTeacherKind { kSglang, kVllm };

// Splits "sglang://h:p" and friends; false when `endpoint` names no external server.
bool ParseHttpTeacherEndpoint(const std::string& endpoint, HttpTeacherKind* kind,
                              std::string* base_url);

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
  // requests). vocab_size and tokenizer_fingerprint are left unset (not known).
  absl::StatusOr<opd::v1::ServiceInfo> Info() override;
  absl::StatusOr<std::vector<ScoreOutput>> Score(const std::vector<lm::Sample>& seqs,
                                                 const ScoreOptions& opts) override;
  bool Healthy() override;  // SGLang GET /health, vLLM GET /health: HTTP 200
  const std::string& address() const override { return opts_.address; }
  HttpTeacherKind kind() const { return kind_; }

  // POST /tokenize of `text` with add_special_tokens false (vLLM, and SGLang since it has one):
  // the ids the server's tokenizer gives. UNIMPLEMENTED when the server answers that it cannot
  // (no such endpoint, or no tokenizer: SGLang's --skip-tokenizer-init).
  absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text) override;

 private:
  struct Reply {
    long http = 0;
    std::string body;
  };
  HttpTeacher(ClientOptions opts, HttpTeacherOptions http, HttpTeacherKind kind, std::string base)
      : opts_(std::move(opts)), http_(http), kind_(kind), base_(std::move(base)) {}
  // One request; `body` empty = GET. Maps transport and HTTP errors to a status.
  absl::StatusOr<std::string> Request(const std::string& path, const std::string& body,
                                      long* http_code = nullptr);
  absl::StatusOr<std::vector<ScoreOutput>> ScoreBatch(const std::vector<lm::Sample>& seqs,
                                                      size_t begin, size_t end,
                                                      const ScoreOptions& opts);
  absl::StatusOr<std::string> ModelName();
  void* TakeHandle();
  void ReturnHandle(void* h);

  ClientOptions opts_;
  HttpTeacherOptions http_;
  HttpTeacherKind kind_;
  std::string base_;
  absl::Mutex mu_;
  std::vector<void*> idle_ ABSL_GUARDED_BY(mu_);  // CURL* kept for keep-alive
  std::string model_ ABSL_GUARDED_BY(mu_);
};

}  // namespace opd::rpc
