// Decoding and look-ups. Loading is in tokenizer_load.cc, encoding in tokenizer_encode.cc; the
// units they use are byte_level, nfc, sha256 and utf8 (each a file of its own here).
#include "lm/text/tokenizer.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "lm/text/byte_level.h"
#include "lm/text/tokenizer_internal.h"
#include "lm/text/utf8.h"

namespace lm {
namespace {

std::atomic<uint64_t> g_next_instance_id{1};

}  // namespace

Tokenizer::Tokenizer() : instance_id_(g_next_instance_id.fetch_add(1)) {}
Tokenizer::~Tokenizer() = default;

bool Tokenizer::IsAdded(int32_t id) const {
  return id >= 0 && id < vocab_size() && id_kind_[id] >= 2;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size() && id_kind_[id] == 3;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special) const {
  std::string text, bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size() || id_kind_[id] == 0) continue;
    if (id_kind_[id] >= 2) {
      if (skip_special && id_kind_[id] == 3) continue;
      // As in the Rust library, the bytes before an added token are decoded on their own.
      utf8::AppendLossy(bytes, /*final_chunk=*/true, &text);
      bytes.clear();
      text += added_[id_added_[id]].content;
      continue;
    }
    bytes += id_bytes_[id];
  }
  utf8::AppendLossy(bytes, /*final_chunk=*/true, &text);
  return text;
}

StreamDecoder Tokenizer::NewStreamDecoder(bool skip_special) const {
  return StreamDecoder(*this, skip_special);
}

absl::StatusOr<int32_t> Tokenizer::TokenId(std::string_view token) const {
  auto added = added_by_content_.find(Av(token));
  if (added != added_by_content_.end()) return added_[added->second].id;
  auto bytes = ByteLevelToBytes(token);
  if (bytes.ok()) {
    auto it = vocab_.find(*bytes);
    if (it != vocab_.end()) return it->second;
  }
  return absl::NotFoundError(absl::StrCat("token '", Av(token), "' is not in the vocabulary"));
}

absl::StatusOr<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= vocab_size() || id_kind_[id] == 0)
    return absl::OutOfRangeError(absl::StrCat("no token has id ", id));
  if (id_kind_[id] >= 2) return added_[id_added_[id]].content;
  return BytesToByteLevel(id_bytes_[id]);
}

std::string StreamDecoder::Push(int32_t id) {
  std::string out;
  const Tokenizer& t = *tokenizer_;
  if (id < 0 || id >= t.vocab_size() || t.id_kind_[id] == 0) return out;
  if (t.id_kind_[id] >= 2) {
    if (skip_special_ && t.id_kind_[id] == 3) return out;
    utf8::AppendLossy(pending_, /*final_chunk=*/true, &out);
    pending_.clear();
    out += t.added_[t.id_added_[id]].content;
    return out;
  }
  pending_ += t.id_bytes_[id];
  const size_t consumed = utf8::AppendLossy(pending_, /*final_chunk=*/false, &out);
  pending_.erase(0, consumed);
  return out;
}

std::string StreamDecoder::Push(absl::Span<const int32_t> ids) {
  std::string out;
  for (int32_t id : ids) out += Push(id);
  return out;
}

std::string StreamDecoder::Flush() {
  std::string out;
  utf8::AppendLossy(pending_, /*final_chunk=*/true, &out);
  pending_.clear();
  return out;
}

}  // namespace lm
