#include "teacher_service/score_job.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "lm/util/limits.h"
#include "opd/v1/teacher.pb.h"

namespace teacher {
namespace {

// The message's own scalar fields (ScoreResponse.top_k; ScoreChunk.first_sequence and top_k):
// a tag and a varint of at most 5 bytes each for a non-negative int32.
constexpr int64_t kPerMessage = 16;
// One SequenceScores entry's framing: its tag and length in the repeated field and the tags and
// varint lengths of its three bytes fields.
constexpr int64_t kPerSequence = 32;

// The reply bytes of sequence `i` of `job` on its own, framing included.
int64_t SequenceReplyBytes(const ScoreJob& job, size_t i) {
  const int64_t n = std::max<int64_t>(0, job.sequences[i].response_length());
  return kPerSequence + n * (4 + 8 * std::max<int64_t>(job.top_k, 0));
}

// The checks of one sequence, INVALID_ARGUMENT naming it.
absl::Status ValidateSequence(const ScoreJob& job, const ScoreLimits& limits, size_t i) {
  const auto& s = job.sequences[i].tokens;
  const int64_t len = static_cast<int64_t>(s.size());
  if (len == 0) return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": empty"));
  if (len > limits.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence ", i, ": ", len, " tokens, longer than the maximum ", limits.max_seq_len));
  }
  for (int64_t p = 0; p < len; ++p) {
    if (s[p] < 0 || s[p] >= limits.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", i, ": token id ", s[p], " at position ", p,
                       " is outside the vocabulary [0, ", limits.vocab_size, ")"));
    }
  }
  const int64_t start = job.sequences[i].response_start;
  if (start < 1 || start > len) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", i, ": response_start ", start, " is outside [1, ", len, "]"));
  }
  return absl::OkStatus();
}

// The reply budget: the whole reply (kUnary) or each sequence's (kStream, whose chunks hold
// whole sequences, so one sequence is the least a chunk can be).
absl::Status ValidateReplyBytes(const ScoreJob& job, const ScoreLimits& limits, ReplyMode mode) {
  if (mode == ReplyMode::kUnary) {
    if (const int64_t bytes = ReplyBytes(job); bytes > limits.max_reply_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the reply would take ", bytes, " bytes (", job.sequences.size(), " sequences, top_k ",
          job.top_k, "), over the server's limit of ", limits.max_reply_bytes,
          " bytes (--max-reply-mb): send fewer sequences per request, a smaller top_k, or use "
          "ScoreStream"));
    }
    return absl::OkStatus();
  }
  for (size_t i = 0; i < job.sequences.size(); ++i) {
    if (const int64_t bytes = kPerMessage + SequenceReplyBytes(job, i);
        bytes > limits.max_reply_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence ", i, ": its reply alone would take ", bytes, " bytes (",
          job.sequences[i].response_length(), " scored positions, top_k ", job.top_k,
          "), over the server's limit of ", limits.max_reply_bytes,
          " bytes (--max-reply-mb), which every sequence of a streamed reply must fit: send a "
          "shorter sequence or a smaller top_k"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t ReplyBytes(const ScoreJob& job) {
  int64_t bytes = kPerMessage;
  for (size_t i = 0; i < job.sequences.size(); ++i) bytes += SequenceReplyBytes(job, i);
  return bytes;
}

absl::Status Validate(const ScoreJob& job, const ScoreLimits& limits, ReplyMode mode) {
  if (job.sequences.empty())
    return absl::InvalidArgumentError("empty batch: no sequences to score");
  if (static_cast<int64_t>(job.sequences.size()) > limits.max_sequences) {
    return absl::InvalidArgumentError(absl::StrCat(
        job.sequences.size(), " sequences in one request; at most ", limits.max_sequences));
  }
  // Compared as the float it travels as, so that a client's float(1e-4) passes.
  if (!(static_cast<float>(job.temperature) >= static_cast<float>(lm::kMinTemperature)) ||
      !std::isfinite(job.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite and at least ", lm::kMinTemperature,
                     " (below it logits / temperature overflow fp32 into NaN log-probs), got ",
                     job.temperature));
  }
  if (job.top_k < 0 || job.top_k > std::min(limits.max_top_k, limits.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat("top_k ", job.top_k, " is outside [0, ",
                                                   std::min(limits.max_top_k, limits.vocab_size),
                                                   "]"));
  }
  for (size_t i = 0; i < job.sequences.size(); ++i) {
    if (absl::Status st = ValidateSequence(job, limits, i); !st.ok()) return st;
  }
  return ValidateReplyBytes(job, limits, mode);
}

std::vector<std::pair<int64_t, int64_t>> ChunkRanges(const ScoreJob& job, int64_t max_chunk_bytes) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  const int64_t n = static_cast<int64_t>(job.sequences.size());
  int64_t begin = 0, bytes = kPerMessage;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t add = SequenceReplyBytes(job, static_cast<size_t>(i));
    // Close the chunk before a sequence that would take it over the budget, unless it is empty.
    if (i > begin && bytes + add > max_chunk_bytes) {
      ranges.emplace_back(begin, i);
      begin = i;
      bytes = kPerMessage;
    }
    bytes += add;
  }
  if (begin < n) ranges.emplace_back(begin, n);
  return ranges;
}

ScoreJob JobFromRequest(const opd::v1::ScoreRequest& req) {
  ScoreJob job;
  job.sequences.reserve(req.sequences_size());
  for (const auto& s : req.sequences())
    job.sequences.push_back(
        lm::Sample::ToScore({s.tokens().begin(), s.tokens().end()}, s.response_start()));
  job.temperature = req.has_temperature() ? req.temperature() : 1.0;
  job.top_k = req.top_k();
  return job;
}

}  // namespace teacher
