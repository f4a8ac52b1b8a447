// Teacher Score / ScoreStream requests: any byte string is a serialized opd.v1.ScoreRequest as
// the teacher receives it. JobFromRequest must carry the request over as it is, and Validate
// (unary and streamed replies) must refuse it with INVALID_ARGUMENT or RESOURCE_EXHAUSTED, or
// accept only what the scorer may run on: ids inside the vocabulary, response starts in
// [1, len], a temperature it can divide by, a reply whose real serialized size fits the limit
// (ReplyBytes is an upper bound), and stream chunks that cover the request in order.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_util.h"
#include "lm/util/limits.h"
#include "opd/v1/teacher.pb.h"
#include "teacher_service/score_job.h"

namespace {

using teacher::ReplyMode;
using teacher::ScoreJob;
using teacher::ScoreLimits;

// Small limits, so that short inputs reach every bound (a 2 KiB reply is ~15 top-16 positions).
ScoreLimits Limits() {
  ScoreLimits l;
  l.vocab_size = 1000;
  l.max_seq_len = 64;
  l.max_top_k = 16;
  l.max_sequences = 16;
  l.max_reply_bytes = 2048;
  l.max_chunk_bytes = 512;
  return l;
}

void CheckCarriedOver(const opd::v1::ScoreRequest& req, const ScoreJob& job) {
  FUZZ_CHECK(job.sequences.size() == static_cast<size_t>(req.sequences_size()), "sequences");
  for (int i = 0; i < req.sequences_size(); ++i) {
    const auto& s = req.sequences(i);
    FUZZ_CHECK(
        job.sequences[i].tokens == std::vector<int32_t>(s.tokens().begin(), s.tokens().end()),
        absl::StrCat("tokens of sequence ", i));
    FUZZ_CHECK(job.sequences[i].response_start == s.response_start(), absl::StrCat("sequence ", i));
  }
  const double temperature = req.has_temperature() ? req.temperature() : 1.0;
  FUZZ_CHECK(
      job.temperature == temperature || (std::isnan(temperature) && std::isnan(job.temperature)),
      "temperature");
  FUZZ_CHECK(job.top_k == req.top_k(), "top_k");
}

// What the scorer relies on for every accepted job, whatever the reply mode.
void CheckRunnable(const ScoreJob& job, const ScoreLimits& l) {
  FUZZ_CHECK(
      !job.sequences.empty() && static_cast<int64_t>(job.sequences.size()) <= l.max_sequences,
      "sequence count");
  FUZZ_CHECK(std::isfinite(job.temperature) &&
                 static_cast<float>(job.temperature) >= static_cast<float>(lm::kMinTemperature),
             absl::StrCat("temperature ", job.temperature));
  FUZZ_CHECK(job.top_k >= 0 && job.top_k <= l.max_top_k && job.top_k <= l.vocab_size,
             absl::StrCat("top_k ", job.top_k));
  for (size_t i = 0; i < job.sequences.size(); ++i) {
    const auto& s = job.sequences[i];
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    FUZZ_CHECK(len >= 1 && len <= l.max_seq_len, absl::StrCat("sequence ", i, " length ", len));
    for (int32_t id : s.tokens)
      FUZZ_CHECK(id >= 0 && id < l.vocab_size, absl::StrCat("sequence ", i, " id ", id));
    FUZZ_CHECK(s.response_start >= 1 && s.response_start <= len,
               absl::StrCat("sequence ", i, " response_start ", s.response_start));
  }
}

// Sequences [begin, end) of `job` as a job of their own (a stream chunk's).
ScoreJob Slice(const ScoreJob& job, int64_t begin, int64_t end) {
  ScoreJob s;
  s.sequences.assign(job.sequences.begin() + begin, job.sequences.begin() + end);
  s.temperature = job.temperature;
  s.top_k = job.top_k;
  return s;
}

// The reply the scorer would send for sequences [begin, end), as filled as it gets: every
// scored position's float32 log-prob and top_k (id, log-prob) pairs.
template <typename Reply>
Reply FullReply(const ScoreJob& job, int64_t begin, int64_t end) {
  Reply r;
  r.set_top_k(static_cast<int32_t>(job.top_k));
  for (int64_t i = begin; i < end; ++i) {
    const size_t n = static_cast<size_t>(job.sequences[i].response_length());
    auto* s = r.add_sequences();
    s->set_logprobs(std::string(4 * n, '\xff'));
    s->set_topk_ids(std::string(4 * n * static_cast<size_t>(job.top_k), '\xff'));
    s->set_topk_logprobs(std::string(4 * n * static_cast<size_t>(job.top_k), '\xff'));
  }
  return r;
}

void CheckUnaryReply(const ScoreJob& job, const ScoreLimits& l) {
  const int64_t bound = teacher::ReplyBytes(job);
  FUZZ_CHECK(bound <= l.max_reply_bytes, absl::StrCat("ReplyBytes ", bound));
  const auto reply =
      FullReply<opd::v1::ScoreResponse>(job, 0, static_cast<int64_t>(job.sequences.size()));
  FUZZ_CHECK(static_cast<int64_t>(reply.ByteSizeLong()) <= bound,
             absl::StrCat("a reply of ", reply.ByteSizeLong(), " bytes, ReplyBytes ", bound));
}

// The chunks cover the sequences in order, each within max_chunk_bytes unless it is a single
// sequence, each as long as the budget allows, and each sequence alone fits max_reply_bytes.
void CheckStreamReply(const ScoreJob& job, const ScoreLimits& l) {
  const int64_t n = static_cast<int64_t>(job.sequences.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t alone = teacher::ReplyBytes(Slice(job, i, i + 1));
    FUZZ_CHECK(alone <= l.max_reply_bytes, absl::StrCat("sequence ", i, ": ", alone, " bytes"));
  }
  const auto ranges = teacher::ChunkRanges(job, l.max_chunk_bytes);
  int64_t next = 0;
  for (size_t c = 0; c < ranges.size(); ++c) {
    const auto [begin, end] = ranges[c];
    FUZZ_CHECK(begin == next && end > begin,
               absl::StrCat("chunk ", c, " [", begin, ", ", end, ")"));
    const int64_t bytes = teacher::ReplyBytes(Slice(job, begin, end));
    FUZZ_CHECK(end - begin == 1 || bytes <= l.max_chunk_bytes,
               absl::StrCat("chunk ", c, ": ", bytes, " bytes"));
    if (end < n)
      FUZZ_CHECK(teacher::ReplyBytes(Slice(job, begin, end + 1)) > l.max_chunk_bytes,
                 absl::StrCat("chunk ", c, " could have taken sequence ", end));
    auto chunk = FullReply<opd::v1::ScoreChunk>(job, begin, end);
    chunk.set_first_sequence(static_cast<int32_t>(begin));
    FUZZ_CHECK(
        static_cast<int64_t>(chunk.ByteSizeLong()) <= bytes,
        absl::StrCat("chunk ", c, " of ", chunk.ByteSizeLong(), " bytes, ReplyBytes ", bytes));
    next = end;
  }
  FUZZ_CHECK(next == n, absl::StrCat("the chunks end at sequence ", next, " of ", n));
}

bool Check(const ScoreJob& job, const ScoreLimits& l, ReplyMode mode) {
  const absl::Status st = teacher::Validate(job, l, mode);
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument ||
                   st.code() == absl::StatusCode::kResourceExhausted,
               st.ToString());
    FUZZ_CHECK(!st.message().empty(), "an error without a message");
    return false;
  }
  CheckRunnable(job, l);
  if (mode == ReplyMode::kUnary) CheckUnaryReply(job, l);
  if (mode == ReplyMode::kStream) CheckStreamReply(job, l);
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  opd::v1::ScoreRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  const ScoreJob job = teacher::JobFromRequest(req);
  CheckCarriedOver(req, job);
  const ScoreLimits limits = Limits();
  const bool unary = Check(job, limits, ReplyMode::kUnary);
  const bool stream = Check(job, limits, ReplyMode::kStream);
  // A whole reply that fits holds every one of its sequences' replies.
  FUZZ_CHECK(!unary || stream, "accepted as a unary reply but refused as a stream");
  return 0;
}
