// A scoring endpoint of an OPD teacher pool: our gRPC opd-teacher (TeacherClient, rpc/client.h)
// or an external inference server (SGLang / vLLM, rpc/http_teacher.h). The pool only sees this.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lm/generate/sampling.h"
#include "lm/generate/scores.h"
#include "opd/v1/teacher.pb.h"

namespace opd::rpc {

struct ClientOptions;
struct ScoreOptions;

class TeacherEndpoint {
 public:
  virtual ~TeacherEndpoint() = default;
  // What the endpoint serves (model name, vocabulary size, tokenizer fingerprint when known).
  // An external server fills what it can; an empty tokenizer_fingerprint means "not known".
  virtual absl::StatusOr<opd::v1::ServiceInfo> Info() = 0;
  // One output per input, in order: the log-probs of each sequence's response tokens (from its
  // response_start, in [1, tokens.size()]); the samples' own log-probs are not read.
  virtual absl::StatusOr<std::vector<lm::SequenceScore>> Score(const std::vector<lm::Sample>& seqs,
                                                               const ScoreOptions& opts) = 0;
  // True when the endpoint answers its health check (used to re-admit a replica).
  virtual bool Healthy() = 0;
  // The ids the endpoint's own tokenizer gives `text`, no special tokens added: the pool compares
  // them with the student's at connect. UNIMPLEMENTED where the endpoint cannot tell (our
  // opd-teacher reports a tokenizer fingerprint instead, which says more).
  virtual absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text) {
    (void)text;
    return absl::UnimplementedError(address() + ": cannot tokenize");
  }
  virtual const std::string& address() const = 0;
};

// The endpoint for `opts.address`: "sglang://host:port", "vllm://host:port" (and the
// "sglang+https://", "vllm+https://" variants, CA from opts.tls.ca_file) are external servers;
// anything else ("host:port") is our gRPC opd-teacher.
absl::StatusOr<std::unique_ptr<TeacherEndpoint>> CreateTeacherEndpoint(const ClientOptions& opts);

}  // namespace opd::rpc
