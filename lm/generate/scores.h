// What a teacher says about one sequence: the log-probs of its response tokens and, when asked,
// the top-k alternatives at each position. The one scores type of the project: the teacher
// service produces it (teacher_service/scorer.h), every scoring endpoint returns it
// (rpc/teacher_endpoint.h: our gRPC teacher and the HTTP ones) and the learner consumes it
// (trainer/opd/). Torch-free and gRPC-free, next to lm::Sample, so that each side includes only
// this.
#pragma once

#include <cstdint>
#include <vector>

namespace lm {

struct SequenceScore {
  std::vector<float> logprobs;       // [n], n = tokens.size() - response_start
  std::vector<int32_t> topk_ids;     // [n * k], row-major, most likely first
  std::vector<float> topk_logprobs;  // [n * k]
};

}  // namespace lm
