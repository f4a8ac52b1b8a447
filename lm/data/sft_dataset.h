// SFT data: chat conversations from JSON lines, tokenized with the ChatML loss mask, drawn from a
// weighted mixture of sources in a seeded order, and packed into sequences of at most max_seq_len
// tokens in the varlen format the model consumes (flat ids, per-conversation position ids,
// cu_seqlens boundaries: no attention across conversations, no padding by default).
//
// Input lines: {"messages": [{"role": "system|user|assistant", "content": "..."}, ...]} with an
// optional system message first, then user/assistant turns alternating and ending with an
// assistant turn. Other keys are ignored.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/data/jsonl.h"
#include "lm/data/mixture.h"
#include "lm/text/chat.h"
#include "lm/text/tokenizer.h"

namespace lm {

// Label of a position that is not trained (PyTorch's cross-entropy ignore_index).
constexpr int32_t kIgnoreIndex = -100;

// What to do with a conversation longer than max_seq_len tokens.
enum class OverlongPolicy {
  kTruncate,  // keep its first max_seq_len tokens (dropped if no trained token is left)
  kDrop,
};

struct SftDatasetOptions {
  std::vector<DataSource> sources;
  int32_t max_seq_len = 4096;
  OverlongPolicy overlong = OverlongPolicy::kTruncate;
  bool skip_bad_lines = false;  // else the first malformed line is an error naming file:line
  bool shuffle = true;
  uint64_t seed = 0;
  ChatFormat chat_format;
  // Pad every packed sequence to max_seq_len (the padding is a document of its own, untrained);
  // off by default: the varlen model needs no padding.
  bool pad_to_max_seq_len = false;
  std::optional<int32_t> pad_id;  // default: the id of <|endoftext|>
};

struct SftStats {
  JsonlStats lines;
  int64_t conversations = 0;     // usable conversations
  int64_t truncated = 0;         // over-long, cut to max_seq_len
  int64_t dropped_overlong = 0;  // over-long, dropped (kDrop, or nothing trained left)
  int64_t tokens = 0;            // in the usable conversations
  int64_t trained_tokens = 0;    // of which loss_mask == 1
  std::string Summary() const;
};

// One tokenized conversation.
struct Conversation {
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss_mask;
};

// Identifies a conversation: its source and its index among the source's usable conversations.
struct SampleRef {
  int32_t source = 0;
  int64_t index = 0;
  bool operator==(const SampleRef& o) const { return source == o.source && index == o.index; }
};

// Several conversations concatenated: T = input_ids.size() <= max_seq_len.
struct PackedSequence {
  std::vector<int32_t> input_ids;     // [T]
  std::vector<int32_t> labels;        // [T] input_ids[t] where trained, else kIgnoreIndex
  std::vector<uint8_t> loss_mask;     // [T] 1 where trained
  std::vector<int32_t> position_ids;  // [T] 0, 1, ... restarting for every conversation
  std::vector<int32_t> cu_seqlens;    // [B+1] document boundaries: 0, len0, len0+len1, ..., T
  std::vector<SampleRef> samples;     // [B'] the conversations (B' = B, or B - 1 with padding)

  int32_t num_tokens() const { return static_cast<int32_t>(input_ids.size()); }
  int32_t num_documents() const { return static_cast<int32_t>(cu_seqlens.size()) - 1; }
};
// labels are not shifted: the logits at t-1 predict labels[t]. The first token of every
// conversation is <|im_start|>, never trained, so no prediction crosses a document boundary.

class SftDataset {
 public:
  // Reads and tokenizes every source (logging the counts of skipped, truncated and dropped
  // conversations). Fails on the first malformed line unless skip_bad_lines, or when a source
  // has no usable conversation.
  static absl::StatusOr<std::unique_ptr<SftDataset>> Load(const Tokenizer& tokenizer,
                                                          SftDatasetOptions options);

  // The next conversation of the mixture (for callers that pack themselves).
  const Conversation& NextConversation(SampleRef* ref = nullptr);
  // The next packed sequence: conversations in stream order while they fit in max_seq_len.
  PackedSequence NextPacked();

  // Where the stream stands; after Seek(cursor()) of a saved cursor, a new dataset object yields
  // exactly the conversations (and packs) that would have followed.
  const DataCursor& cursor() const { return sampler_.cursor(); }
  absl::Status Seek(const DataCursor& cursor) { return sampler_.Seek(cursor); }

  const SftStats& stats() const { return stats_; }
  const std::vector<SftStats>& source_stats() const { return source_stats_; }
  const SftDatasetOptions& options() const { return options_; }
  size_t num_sources() const { return sources_.size(); }
  size_t source_size(size_t source) const { return sources_[source].size(); }
  const Conversation& conversation(const SampleRef& ref) const {
    return sources_[ref.source][ref.index];
  }

 private:
  SftDataset(SftDatasetOptions options, MixtureSampler sampler) noexcept
      : options_(std::move(options)), sampler_(std::move(sampler)) {}

  SftDatasetOptions options_;
  MixtureSampler sampler_;
  int32_t pad_id_ = 0;
  std::vector<std::vector<Conversation>> sources_;
  SftStats stats_;
  std::vector<SftStats> source_stats_;
};

}  // namespace lm
