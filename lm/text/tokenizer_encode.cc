// Encoding: added tokens split out (leftmost-longest), NFC, the pre-tokenizer regex (PCRE2),
// then byte-level BPE per word with a per-thread word cache. See tokenizer.h for the pipeline.
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lm/text/nfc.h"
#include "lm/text/tokenizer.h"
#include "lm/text/tokenizer_internal.h"
#include "lm/text/utf8.h"
#include "spdlog/spdlog.h"

namespace lm {
namespace {

constexpr int32_t kNoRank = std::numeric_limits<int32_t>::max();

// Oniguruma's \s (Unicode White_Space) differs from PCRE2's (which has U+180E and lacks U+0085
// under some versions), so \s and \S are spelled out to match the Rust library exactly.
constexpr char kWhiteSpace[] =
    R"(\t\n\x0B\f\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

std::string TranslatePattern(std::string_view onig) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < onig.size(); ++i) {
    const char c = onig[i];
    if (c == '\\' && i + 1 < onig.size()) {
      const char n = onig[++i];
      if (n == 's') {
        absl::StrAppend(&out, in_class ? "" : "[", kWhiteSpace, in_class ? "" : "]");
      } else if (n == 'S' && !in_class) {
        absl::StrAppend(&out, "[^", kWhiteSpace, "]");
      } else {
        out.push_back(c);
        out.push_back(n);
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out.push_back(c);
      if (i + 1 < onig.size() && onig[i + 1] == '^') out.push_back(onig[++i]);
      if (i + 1 < onig.size() && onig[i + 1] == ']') out.push_back(onig[++i]);  // literal ']'
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out.push_back(c);
  }
  return out;
}

// Per-thread PCRE2 match state: match data and a JIT stack are not shareable across threads.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

// Per-thread cache of word -> ids, for up to a few tokenizers at once (e.g. teacher and student),
// so that concurrent Encode calls never share mutable state.
struct WordCache {
  uint64_t owner = 0;
  absl::flat_hash_map<std::string, uint64_t> words;  // word -> (offset << 32 | count) in ids
  std::vector<int32_t> ids;
  size_t key_bytes = 0;
};

// Bounds on one thread's cache for one tokenizer (it is emptied when full): ~10-20 MB.
constexpr size_t kCacheMaxWords = 1 << 17;
constexpr size_t kCacheMaxKeyBytes = 8 << 20;
constexpr size_t kCacheMaxWordBytes = 1024;

WordCache& ThreadWordCache(uint64_t owner) {
  thread_local std::array<WordCache, 4> slots;
  thread_local size_t next_victim = 0;
  thread_local WordCache* last = &slots[0];
  if (last->owner == owner) return *last;  // the usual case: one tokenizer per thread
  for (WordCache& c : slots) {
    if (c.owner == owner) return *(last = &c);
  }
  WordCache& c = *(last = &slots[next_victim++ % slots.size()]);
  c.owner = owner;
  c.words.clear();
  c.ids.clear();
  c.key_bytes = 0;
  return c;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer::Regex>> Tokenizer::Regex::Compile(
    std::string_view onig_pattern) {
  const std::string pcre_pattern = TranslatePattern(onig_pattern);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  auto regex = std::make_unique<Regex>();
  regex->code = pcre2_compile(
      reinterpret_cast<PCRE2_SPTR>(pcre_pattern.data()), pcre_pattern.size(),
      // \C (one code unit) could end a match inside a character, and every later
      // step assumes character boundaries; Oniguruma has no such escape either.
      PCRE2_UTF | PCRE2_UCP | PCRE2_NEVER_BACKSLASH_C, &error, &error_offset, nullptr);
  if (regex->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(
        absl::StrCat("pre-tokenizer regex: ", reinterpret_cast<const char*>(message), " at offset ",
                     error_offset));
  }
  regex->jit = pcre2_jit_compile(regex->code, PCRE2_JIT_COMPLETE) == 0;
  if (!regex->jit) spdlog::warn("tokenizer: PCRE2 JIT unavailable, using the interpreter");
  return regex;
}

int Tokenizer::FindAdded(std::string_view text, size_t from, size_t* at) const {
  for (size_t i = from; i < text.size(); ++i) {
    if (single_first_byte_ >= 0) {  // e.g. '<' for every Qwen token: let memchr skip ahead
      const void* hit = std::memchr(text.data() + i, single_first_byte_, text.size() - i);
      if (hit == nullptr) return -1;
      i = static_cast<size_t>(static_cast<const char*>(hit) - text.data());
    }
    const auto b = static_cast<uint8_t>(text[i]);
    if (!added_first_byte_[b]) continue;
    for (int k : added_by_first_byte_[b]) {
      const std::string& c = added_[k].content;
      if (text.size() - i >= c.size() && std::memcmp(text.data() + i, c.data(), c.size()) == 0) {
        *at = i;
        return k;
      }
    }
  }
  return -1;
}

void Tokenizer::EncodeImpl(std::string_view text, bool match_added, std::vector<int32_t>* ids,
                           std::vector<uint32_t>* ends) const {
  std::string sanitized;
  if (utf8::FindInvalid(text) != std::string_view::npos) {
    utf8::AppendLossy(text, /*final_chunk=*/true, &sanitized);
    text = sanitized;
  }
  ids->reserve(ids->size() + text.size() / 3 + 1);
  uint32_t offset = 0;
  size_t pos = 0;
  const bool any_added = match_added && !added_.empty();
  while (pos < text.size()) {
    size_t at = text.size();
    const int k = any_added ? FindAdded(text, pos, &at) : -1;
    if (at > pos) EncodeSegment(text.substr(pos, at - pos), ids, ends, &offset);
    if (k < 0) break;
    const AddedToken& token = added_[k];
    ids->push_back(token.id);
    offset += static_cast<uint32_t>(token.content.size());
    if (ends) ends->push_back(offset);
    pos = at + token.content.size();
  }
}

void Tokenizer::EncodeSegment(std::string_view segment, std::vector<int32_t>* ids,
                              std::vector<uint32_t>* ends, uint32_t* offset) const {
  std::string normalized;
  if (nfc_ && !utf8::IsAscii(segment) && NfcNormalize(segment, &normalized)) segment = normalized;
  thread_local MatchState state;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(segment.data());
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
  const auto emit = [&](size_t begin, size_t end) {
    const size_t first = ids->size();
    EncodeWord(segment.substr(begin, end - begin), ids);
    if (!ends) return;
    uint32_t at = *offset + static_cast<uint32_t>(begin);
    for (size_t t = first; t < ids->size(); ++t) {
      at += static_cast<uint32_t>(id_bytes_[(*ids)[t]].size());
      ends->push_back(at);
    }
  };
  size_t pos = 0;
  while (pos < segment.size()) {
    int rc = regex_->jit ? pcre2_jit_match(regex_->code, subject, segment.size(), pos, 0,
                                           state.data, state.context)
                         : PCRE2_ERROR_JIT_BADOPTION;
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH)  // no JIT, or its stack ran out: interpret
      rc = pcre2_match(regex_->code, subject, segment.size(), pos,
                       PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, state.data, state.context);
    if (rc < 0) {
      // Only NOMATCH is possible for this family of patterns (every character matches some
      // branch); the Isolated split keeps unmatched text as one piece, and so do we.
      emit(pos, segment.size());
      break;
    }
    size_t begin = ovector[0], end = ovector[1];
    if (begin > pos) emit(pos, begin);  // text between matches is its own piece
    if (end == begin) {                 // an empty match: step over one character
      if (begin >= segment.size()) break;
      size_t next = begin;
      utf8::NextCodepoint(segment, &next);
      emit(begin, next);
      end = next;
    } else {
      emit(begin, end);
    }
    pos = end;
  }
  *offset += static_cast<uint32_t>(segment.size());
}

void Tokenizer::EncodeWord(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.size() == 1) {
    ids->push_back(byte_ids_[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (ignore_merges_) {
    auto it = vocab_.find(Av(word));
    if (it != vocab_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  if (word.size() > kCacheMaxWordBytes) {
    BpeMerge(word, ids);
    return;
  }
  WordCache& cache = ThreadWordCache(instance_id_);
  auto hit = cache.words.find(Av(word));
  if (hit != cache.words.end()) {
    const auto begin = cache.ids.begin() + static_cast<ptrdiff_t>(hit->second >> 32);
    ids->insert(ids->end(), begin, begin + static_cast<ptrdiff_t>(hit->second & 0xFFFFFFFF));
    return;
  }
  const size_t first = ids->size();
  BpeMerge(word, ids);
  if (cache.words.size() >= kCacheMaxWords || cache.key_bytes >= kCacheMaxKeyBytes) {
    cache.words.clear();
    cache.ids.clear();
    cache.key_bytes = 0;
  }
  cache.key_bytes += word.size();
  const uint64_t where = uint64_t(cache.ids.size()) << 32 | (ids->size() - first);
  cache.ids.insert(cache.ids.end(), ids->begin() + static_cast<ptrdiff_t>(first), ids->end());
  cache.words.emplace(std::string(word), where);
}

namespace {

// One symbol of a word being merged: a doubly linked list over positions in the byte string.
struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
};

// Words up to this many bytes are merged by rescanning the pair ranks (fast for short words);
// longer ones use a heap, O(n log n).
constexpr size_t kLinearScanMax = 48;

}  // namespace

void Tokenizer::BpeMerge(std::string_view word, std::vector<int32_t>* ids) const {
  const int32_t n = static_cast<int32_t>(word.size());
  thread_local std::vector<Symbol> syms;
  thread_local std::vector<MergeInfo> pair;  // merge of the pair starting at symbol i
  syms.resize(n);
  pair.resize(n);
  for (int32_t i = 0; i < n; ++i)
    syms[i] = {byte_ids_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};
  const auto lookup = [this](int32_t left, int32_t right) -> MergeInfo {
    auto it = merges_.find(uint64_t(uint32_t(left)) << 32 | uint32_t(right));
    return it == merges_.end() ? MergeInfo{kNoRank, -1} : it->second;
  };
  // Merges symbol i with its successor into `merged` and unlinks the successor.
  const auto merge_at = [](int32_t i, int32_t merged) {
    const int32_t j = syms[i].next;
    syms[i].id = merged;
    syms[i].next = syms[j].next;
    if (syms[j].next != -1) syms[syms[j].next].prev = i;
    syms[j].id = -1;
  };

  if (static_cast<size_t>(n) <= kLinearScanMax) {
    for (int32_t i = 0; i + 1 < n; ++i) pair[i] = lookup(syms[i].id, syms[i + 1].id);
    if (n > 0) pair[n - 1] = {kNoRank, -1};
    for (;;) {
      int32_t best = -1, best_rank = kNoRank;
      for (int32_t i = 0; i != -1; i = syms[i].next) {
        if (pair[i].rank < best_rank) best_rank = pair[i].rank, best = i;
      }
      if (best < 0) break;
      merge_at(best, pair[best].merged_id);
      const int32_t next = syms[best].next, prev = syms[best].prev;
      pair[best] = next != -1 ? lookup(syms[best].id, syms[next].id) : MergeInfo{kNoRank, -1};
      if (prev != -1) pair[prev] = lookup(syms[prev].id, syms[best].id);
    }
  } else {
    // Heap of (rank << 32 | position): lowest rank first, then leftmost, like the Rust library.
    thread_local std::vector<uint64_t> heap;
    heap.clear();
    const auto push = [&](int32_t i) {
      const int32_t j = syms[i].next;
      if (j == -1) return;
      const MergeInfo m = lookup(syms[i].id, syms[j].id);
      if (m.rank == kNoRank) return;
      heap.push_back(uint64_t(uint32_t(m.rank)) << 32 | uint32_t(i));
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      const uint64_t top = heap.back();
      heap.pop_back();
      const int32_t i = static_cast<int32_t>(top & 0xFFFFFFFF);
      const int32_t rank = static_cast<int32_t>(top >> 32);
      if (syms[i].id == -1 || syms[i].next == -1) continue;  // stale entry
      const MergeInfo m = lookup(syms[i].id, syms[syms[i].next].id);
      if (m.rank != rank) continue;  // the pair at i changed since this entry was pushed
      merge_at(i, m.merged_id);
      if (syms[i].prev != -1) push(syms[i].prev);
      push(i);
    }
  }
  for (int32_t i = 0; i != -1 && n > 0; i = syms[i].next) ids->push_back(syms[i].id);
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  EncodeImpl(text, /*match_added=*/true, &ids, nullptr);
  return ids;
}

std::vector<int32_t> Tokenizer::EncodeOrdinary(std::string_view text) const {
  std::vector<int32_t> ids;
  EncodeImpl(text, /*match_added=*/false, &ids, nullptr);
  return ids;
}

TokenSpans Tokenizer::EncodeWithSpans(std::string_view text) const {
  TokenSpans spans;
  EncodeImpl(text, /*match_added=*/true, &spans.ids, &spans.ends);
  return spans;
}

}  // namespace lm
