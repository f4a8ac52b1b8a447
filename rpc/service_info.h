// The ServiceInfo both model servers report, built from what they loaded.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "lm/model/config.h"
#include "opd/v1/common.pb.h"

namespace opd::rpc {

// The fingerprint of `tokenizer` (a directory or tokenizer.json) when given; otherwise of the
// model directory's tokenizer files when it has some; otherwise "none".
absl::StatusOr<std::string> TokenizerFingerprint(const std::string& tokenizer,
                                                 const std::string& model_dir);

struct ServedModel {
  std::string service;  // "opd.v1.Teacher" | "opd.v1.Rollout"
  std::string model_dir;
  std::string tokenizer_fingerprint;
  int64_t max_seq_len = 0;
  std::string dtype;
  int threads = 0;
};

opd::v1::ServiceInfo MakeServiceInfo(const ServedModel& served, const lm::ModelConfig& config);

}  // namespace opd::rpc
