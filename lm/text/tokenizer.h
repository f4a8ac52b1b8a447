// Byte-level BPE tokenizer, bit-for-bit compatible with Hugging Face `tokenizers` for the Qwen2 /
// Qwen3 vocabulary (and GPT-2 style byte-level BPE in general).
//
// Pipeline of Encode, the same as the Rust library's:
//   1. added tokens (<|im_start|> ...) are matched on the raw text, leftmost-longest, and split
//   out;
//   2. every piece in between is NFC-normalised (utf8proc; ASCII and already-NFC text skip it);
//   3. the pre-tokenizer regex (PCRE2, JIT-compiled) cuts the piece into words;
//   4. each word's bytes are merged by lowest merge rank (BPE), with a per-thread cache of words.
// Decode maps ids back to bytes and replaces invalid UTF-8 with U+FFFD exactly as Rust's
// `String::from_utf8_lossy` does, so decoded text is identical to the Python library's.
//
// Sources: tokenizer_load.cc (files -> tables), tokenizer_encode.cc (the pipeline above),
// tokenizer.cc (decode, look-ups); byte_level, nfc, sha256 (the fingerprint) and utf8 units.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "lm/text/utf8.h"  // utf8::FindInvalid and utf8::AppendLossy, used with this class

namespace lm {

// A token matched verbatim before BPE (`added_tokens` in tokenizer.json). `special` tokens are the
// ones Decode(..., skip_special=true) leaves out.
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
};

struct TokenizerOptions {
  // Add Qwen3's added-token set (ids 151643..151668: ChatML, vision, tool-call, FIM and
  // <think>/</think>) on top of what the files declare. An id already declared with different
  // content is an error.
  bool qwen3_added_tokens = false;

  static TokenizerOptions Qwen3(bool enable = true) {
    TokenizerOptions o;
    o.qwen3_added_tokens = enable;
    return o;
  }
};

// Token ids together with where each token ends in the normalised text (byte offsets; the
// normalised text is the input with every piece between added tokens NFC-normalised).
struct TokenSpans {
  std::vector<int32_t> ids;
  std::vector<uint32_t> ends;
};

class StreamDecoder;

class Tokenizer {
 public:
  // `dir_or_file`: a tokenizer.json, or a directory holding tokenizer.json, or (if it has none)
  // vocab.json + merges.txt (+ tokenizer_config.json for added tokens; Qwen2 pre-tokenizer and
  // NFC are assumed for that form, as transformers' Qwen2Tokenizer does).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& dir_or_file,
                                                         const TokenizerOptions& options = {});

  // The same from the text of a tokenizer.json; `label` names it in errors (e.g. its path).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromTokenizerJson(
      std::string_view text, const std::string& label, const TokenizerOptions& options = {});

  // Qwen3's added tokens in id order, with their `special` flags as Qwen3 ships them.
  static std::vector<AddedToken> Qwen3AddedTokens();

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Thread-safe. Added tokens in the text are matched (like HF's default). Invalid UTF-8 in the
  // input is replaced by U+FFFD first (Python strings cannot hold it anyway).
  std::vector<int32_t> Encode(std::string_view text) const;
  // Like Encode, but added-token text is tokenized as plain text (for untrusted content).
  std::vector<int32_t> EncodeOrdinary(std::string_view text) const;
  // Encode plus the end offset of every token in the normalised text.
  TokenSpans EncodeWithSpans(std::string_view text) const;

  // Unknown ids are skipped (as in HF). Never fails.
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special = false) const;
  StreamDecoder NewStreamDecoder(bool skip_special = false) const;

  // Id of an added token ("<|im_end|>") or of a vocabulary entry in its byte-level spelling.
  absl::StatusOr<int32_t> TokenId(std::string_view token) const;
  // Byte-level spelling of an id as in vocab.json ("Ġworld"), or an added token's content.
  absl::StatusOr<std::string> IdToToken(int32_t id) const;
  // Id of the token that is the single byte `byte` (every byte-level vocabulary has all 256).
  int32_t ByteId(uint8_t byte) const { return byte_ids_[byte]; }
  bool IsAdded(int32_t id) const;
  bool IsSpecial(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const { return added_; }

  // Number of ids: 1 + the largest id of the vocabulary and the added tokens. (Qwen models pad
  // their embedding matrix to 151936 rows; that is a property of the model, not of this class.)
  int32_t vocab_size() const { return static_cast<int32_t>(id_bytes_.size()); }

  // SHA-256 (hex) of the vocabulary, merges, added tokens, pre-tokenizer regex and normaliser in a
  // canonical order: two tokenizers with equal fingerprints tokenize every text identically.
  const std::string& Fingerprint() const { return fingerprint_; }

 private:
  friend class StreamDecoder;
  struct Builder;
  struct Regex;
  struct MergeInfo {
    int32_t rank;
    int32_t merged_id;
  };

  Tokenizer();

  // Appends the tokens of `text` (a whole input); `spans` may be null.
  void EncodeImpl(std::string_view text, bool match_added, std::vector<int32_t>* ids,
                  std::vector<uint32_t>* ends) const;
  // Normalises, pre-tokenizes and BPE-encodes text that holds no added token.
  void EncodeSegment(std::string_view segment, std::vector<int32_t>* ids,
                     std::vector<uint32_t>* ends, uint32_t* offset) const;
  void EncodeWord(std::string_view word, std::vector<int32_t>* ids) const;
  void BpeMerge(std::string_view word, std::vector<int32_t>* ids) const;
  // Finds the leftmost-longest added token in text[from, end); returns its index in added_ or -1.
  int FindAdded(std::string_view text, size_t from, size_t* at) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;  // raw bytes -> id
  std::vector<std::string> id_bytes_;                // id -> raw bytes ("" when not in vocab)
  std::vector<uint8_t> id_kind_;                     // 0 none, 1 vocab, 2 added, 3 added special
  std::vector<int32_t> id_added_;                    // id -> index in added_, or -1
  absl::flat_hash_map<uint64_t, MergeInfo> merges_;  // (left id << 32 | right id) -> merge
  std::array<int32_t, 256> byte_ids_{};              // single byte -> id
  std::vector<AddedToken> added_;                    // sorted by id
  absl::flat_hash_map<std::string, int32_t> added_by_content_;  // content -> index in added_
  std::array<std::vector<int>, 256> added_by_first_byte_;       // index in added_, longest first
  std::array<bool, 256> added_first_byte_{};
  int single_first_byte_ = -1;  // the first byte of every added token, if they share one
  std::unique_ptr<Regex> regex_;
  std::string pattern_;  // the pre-tokenizer regex as written in the tokenizer files
  bool nfc_ = true;
  bool ignore_merges_ = false;
  std::string fingerprint_;
  uint64_t instance_id_ = 0;  // distinguishes tokenizers in the per-thread word caches
};

// Incremental detokenizer for streams: Push returns the text that became complete, holding back
// the bytes of a UTF-8 character split across tokens. For any id sequence, the concatenation of
// every Push and the final Flush equals Decode of the whole sequence.
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(&tokenizer), skip_special_(skip_special) {}

  std::string Push(int32_t id);
  std::string Push(absl::Span<const int32_t> ids);
  // Ends the stream: a held-back incomplete character becomes U+FFFD.
  std::string Flush();
  bool has_pending() const { return !pending_.empty(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;  // bytes of an incomplete UTF-8 character
};

}  // namespace lm
