// What the teacher is asked to score, and the checks a request passes before any work: the
// torch-free half of the scorer (teacher_service/scorer.h), so that it can be fuzzed and tested
// without LibTorch. Depends on absl, the generated protos, lm/generate/sampling.h,
// lm/generate/scores.h and lm/util/limits.h only.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "lm/generate/sampling.h"
#include "lm/generate/scores.h"  // lm::SequenceScore, what a job produces

namespace opd::v1 {
class ScoreRequest;
}

namespace teacher {

struct ScoreJob {
  // Prompt + response each, scored from its response_start (in [1, len]); lm/generate/sampling.h.
  std::vector<lm::Sample> sequences;
  double temperature = 1.0;
  int64_t top_k = 0;  // > 0: also the top-k ids and log-probs per scored position
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // polled before the job's sequences are packed; may be empty
  // A later slice of a request the scorer already admitted (ScoreStream): Scorer::Submit queues
  // it even when the queue is full, since refusing it would fail a stream half-way through. The
  // queue then exceeds its bound by at most one slice per stream in progress.
  bool admitted = false;
};

// What a job may ask for; Validate() turns a violation into INVALID_ARGUMENT naming the sequence.
struct ScoreLimits {
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;
  int64_t max_top_k = 1024;
  int64_t max_sequences = 4096;  // per job
  // The reply a job may cost (ReplyBytes): the server holds it whole until it is sent, and
  // protobuf cannot serialise a message of 2 GiB or more (gRPC aborts on one). For ScoreStream it
  // bounds one sequence's reply instead (the largest a chunk can be), not the whole reply.
  int64_t max_reply_bytes = int64_t{1} << 30;
  // ScoreStream: the reply bytes of one chunk (consecutive whole sequences; a sequence larger than
  // this goes alone). The server scores and holds one chunk at a time, so this bounds its memory
  // per stream. Capped at max_reply_bytes (a chunk is one reply message).
  int64_t max_chunk_bytes = int64_t{32} << 20;
};

// How the reply goes out: whole (Score, bounded by max_reply_bytes as a whole) or in chunks
// (ScoreStream, where only each sequence must fit max_reply_bytes).
enum class ReplyMode { kUnary, kStream };

// The serialised size of a job's reply, an upper bound: per scored position a float32 log-prob and
// top_k (int32 id, float32 log-prob) pairs, per sequence its field tags and lengths, and a fixed
// 16 bytes for the message's own scalar fields (ScoreResponse's top_k; ScoreChunk's
// first_sequence and top_k).
int64_t ReplyBytes(const ScoreJob& job);

// Checks a job against the limits; a reply over max_reply_bytes is RESOURCE_EXHAUSTED naming its
// size and the limit (kStream: the first sequence whose own reply is over it, by index),
// everything else INVALID_ARGUMENT naming the field.
absl::Status Validate(const ScoreJob& job, const ScoreLimits& limits,
                      ReplyMode mode = ReplyMode::kUnary);

// The chunks of a streamed reply: consecutive [begin, end) ranges of the job's sequences, in
// order, covering all of them, each the longest run whose ReplyBytes is at most `max_chunk_bytes`
// (at least one sequence, however large). Assumes one response_start per sequence (Validate).
std::vector<std::pair<int64_t, int64_t>> ChunkRanges(const ScoreJob& job, int64_t max_chunk_bytes);

// The job a request asks for (sequences, response starts, temperature, top-k), unchecked: the
// caller sets deadline and cancelled from its call and then runs Validate.
ScoreJob JobFromRequest(const opd::v1::ScoreRequest& req);

}  // namespace teacher
