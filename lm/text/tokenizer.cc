#include "lm/text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace lm {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The Qwen2/Qwen3 pre-tokenizer, as written in their tokenizer.json (Oniguruma syntax).
constexpr char kQwen2Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// GPT-2's, used by a ByteLevel pre-tokenizer with use_regex=true.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Debian's Abseil has its own string_view type; this bridges std::string_view to it.
absl::string_view Av(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

constexpr int32_t kNoRank = std::numeric_limits<int32_t>::max();
constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// Largest token id accepted from a file. The id tables are dense (one entry per id up to the
// largest), so an id is also an allocation size: 2^24 is ~64x the largest published vocabulary
// (Gemma's 262,144) and keeps a hostile file from asking for gigabytes or overflowing int32.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// A token's text for an error message: quoted, shortened, and safe to print.
std::string QuoteToken(std::string_view token) {
  constexpr size_t kShown = 64;
  std::string out = "'";
  out.append(token.substr(0, kShown));
  if (token.size() > kShown) out += "...";
  return out + "'";
}

// `id` as a token id, or an error naming the token and the id.
absl::StatusOr<int32_t> CheckedTokenId(int64_t id, std::string_view token, std::string_view what,
                                       std::string_view where) {
  if (id < 0 || id > kMaxTokenId)
    return absl::InvalidArgumentError(absl::StrCat(Av(where), where.empty() ? "" : ": ", Av(what),
                                                   " ", QuoteToken(token), " has id ", id,
                                                   "; ids must be in [0, ", kMaxTokenId, "]"));
  return static_cast<int32_t>(id);
}

// A JSON id of `token`: an integer in [0, kMaxTokenId]. Unsigned values beyond int64 and floats
// are refused too (nlohmann's get<int32_t>() would silently truncate them).
absl::StatusOr<int32_t> TokenIdFromJson(const nlohmann::json& v, std::string_view token,
                                        std::string_view what, std::string_view where) {
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kMaxTokenId))
    return absl::InvalidArgumentError(absl::StrCat(Av(where), ": ", Av(what), " ",
                                                   QuoteToken(token), " has id ", v.get<uint64_t>(),
                                                   "; ids must be in [0, ", kMaxTokenId, "]"));
  if (!v.is_number_integer())
    return absl::InvalidArgumentError(absl::StrCat(Av(where), ": ", Av(what), " ",
                                                   QuoteToken(token), " has a non-integer id (",
                                                   v.type_name(), ")"));
  return CheckedTokenId(v.get<int64_t>(), token, what, where);
}

// ---------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4), for the fingerprint. Small and dependency-free.
class Sha256 {
 public:
  Sha256() { Reset(); }
  void Update(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    total_ += n;
    while (n > 0) {
      const size_t take = std::min(n, 64 - fill_);
      std::memcpy(block_ + fill_, p, take);
      fill_ += take;
      p += take;
      n -= take;
      if (fill_ == 64) {
        Compress(block_);
        fill_ = 0;
      }
    }
  }
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  void UpdateU32(uint32_t v) {
    const uint8_t b[4] = {uint8_t(v >> 24), uint8_t(v >> 16), uint8_t(v >> 8), uint8_t(v)};
    Update(b, 4);
  }
  // Length-prefixed, so that concatenations cannot collide.
  void UpdateField(std::string_view s) {
    UpdateU32(static_cast<uint32_t>(s.size()));
    Update(s);
  }
  std::string HexDigest() {
    const uint64_t bits = total_ * 8;
    const uint8_t pad = 0x80;
    Update(&pad, 1);
    const uint8_t zero = 0;
    while (fill_ != 56) Update(&zero, 1);
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = uint8_t(bits >> (56 - 8 * i));
    Update(len, 8);
    std::string hex;
    for (uint32_t h : h_) absl::StrAppend(&hex, absl::StrFormat("%08x", h));
    return hex;
  }

 private:
  static uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
  void Reset() {
    static constexpr uint32_t kInit[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                          0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    std::memcpy(h_, kInit, sizeof(h_));
    fill_ = 0;
    total_ = 0;
  }
  void Compress(const uint8_t* b) {
    static constexpr uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t(b[4 * i]) << 24 | uint32_t(b[4 * i + 1]) << 16 | uint32_t(b[4 * i + 2]) << 8 |
             uint32_t(b[4 * i + 3]);
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h_[0], bb = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6],
             h = h_[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 =
          h + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const uint32_t t2 =
          (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & bb) ^ (a & c) ^ (bb & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = bb;
      bb = a;
      a = t1 + t2;
    }
    h_[0] += a;
    h_[1] += bb;
    h_[2] += c;
    h_[3] += d;
    h_[4] += e;
    h_[5] += f;
    h_[6] += g;
    h_[7] += h;
  }

  uint32_t h_[8];
  uint8_t block_[64];
  size_t fill_;
  uint64_t total_;
};

// ---------------------------------------------------------------------------------------------
// UTF-8 primitives.

void AppendCodepoint(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes the code point at s[i] of valid UTF-8 and advances i. Never reads or steps past the
// end of `s`, even when i is not at a character boundary.
char32_t NextCodepoint(std::string_view s, size_t* i) {
  const auto b = static_cast<uint8_t>(s[*i]);
  if (b < 0x80) {
    ++*i;
    return b;
  }
  const size_t n = std::min<size_t>(b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : 1, s.size() - *i - 1);
  char32_t cp = b & (0x3F >> n);
  for (size_t k = 1; k <= n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[*i + k]) & 0x3F);
  *i += n + 1;
  return cp;
}

// Length of the valid UTF-8 sequence starting at s[i]. Returns 0 when it is invalid, with
// `*consumed` the length of the maximal invalid subpart (>= 1) and `*truncated` set when the
// sequence was a valid prefix cut off by the end of `s`.
size_t ValidSequenceLength(std::string_view s, size_t i, size_t* consumed, bool* truncated) {
  const auto b = static_cast<uint8_t>(s[i]);
  *truncated = false;
  if (b < 0x80) return 1;
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b == 0xE0) {
    need = 2, lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    need = 2;
  } else if (b == 0xED) {
    need = 2, hi = 0x9F;  // no surrogates
  } else if (b == 0xF0) {
    need = 3, lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 3;
  } else if (b == 0xF4) {
    need = 3, hi = 0x8F;
  } else {
    *consumed = 1;
    return 0;
  }
  size_t j = i + 1;
  for (size_t k = 0; k < need; ++k, ++j) {
    if (j >= s.size()) {
      *truncated = true;
      *consumed = j - i;
      return 0;
    }
    const auto c = static_cast<uint8_t>(s[j]);
    if (c < lo || c > hi) {
      *consumed = j - i;
      return 0;
    }
    lo = 0x80, hi = 0xBF;
  }
  return need + 1;
}

bool IsAscii(std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    if (w & 0x8080808080808080ULL) return false;
  }
  for (; i < s.size(); ++i)
    if (static_cast<uint8_t>(s[i]) & 0x80) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// GPT-2's byte <-> printable-character map used by byte-level BPE vocabularies.

struct ByteLevelMap {
  std::array<char32_t, 256> to_char{};
  std::array<int16_t, 324> to_byte{};  // char -> byte, -1 if the char is not in the map
  ByteLevelMap() {
    to_byte.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      to_char[b] = printable ? b : 256 + extra++;
      to_byte[to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelMap& ByteLevel() {
  static const ByteLevelMap map;
  return map;
}

// "Ġworld" -> " world". Fails on a character outside the byte-level alphabet.
absl::StatusOr<std::string> ByteLevelToBytes(std::string_view token) {
  if (utf8::FindInvalid(token) != std::string_view::npos)
    return absl::InvalidArgumentError("token is not valid UTF-8");
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const char32_t cp = NextCodepoint(token, &i);
    const int b = cp < 324 ? ByteLevel().to_byte[cp] : -1;
    if (b < 0)
      return absl::InvalidArgumentError(
          absl::StrFormat("token '%s' has U+%04X, outside the byte-level alphabet", Av(token),
                          static_cast<uint32_t>(cp)));
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

std::string BytesToByteLevel(std::string_view bytes) {
  std::string token;
  for (char c : bytes) AppendCodepoint(ByteLevel().to_char[static_cast<uint8_t>(c)], &token);
  return token;
}

// ---------------------------------------------------------------------------------------------
// NFC. Most text is already NFC, and utf8proc allocates, so a per-code-point table says which
// characters might change under NFC (or make a neighbour change); text without any is skipped.

class NfcTable {
 public:
  NfcTable() : maybe_changes_(0x110000, false) {
    std::vector<bool> composes_as_second(0x110000, false);
    std::vector<std::pair<char32_t, char32_t>> decomposable;  // code point, first of its NFD
    for (char32_t cp = 0x80; cp < 0x110000; ++cp) {
      if (cp >= 0xD800 && cp <= 0xDFFF) continue;
      const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
      if (p->category == UTF8PROC_CATEGORY_CN) continue;
      if (p->combining_class != 0) maybe_changes_[cp] = true;
      utf8proc_int32_t buf[8];
      int boundclass = 0;
      const utf8proc_ssize_t n = utf8proc_decompose_char(static_cast<utf8proc_int32_t>(cp), buf, 8,
                                                         UTF8PROC_DECOMPOSE, &boundclass);
      if (n <= 0 || (n == 1 && static_cast<char32_t>(buf[0]) == cp)) continue;
      // Every non-initial character of a decomposition may compose with what precedes it.
      for (utf8proc_ssize_t k = 1; k < n && k < 8; ++k) composes_as_second[buf[k]] = true;
      decomposable.emplace_back(cp, static_cast<char32_t>(buf[0]));
    }
    for (const auto& [cp, first] : decomposable) {
      if (composes_as_second[first]) maybe_changes_[cp] = true;
      const bool hangul_syllable = cp >= 0xAC00 && cp <= 0xD7A3;  // always recompose
      if (!hangul_syllable && !maybe_changes_[cp] && !IsOwnNfc(cp)) maybe_changes_[cp] = true;
    }
    for (char32_t cp = 0; cp < 0x110000; ++cp)
      if (composes_as_second[cp]) maybe_changes_[cp] = true;
  }

  // NFC of `s` (valid UTF-8) into `*out`; returns false (leaving `out` alone) when `s` is
  // already NFC for sure, the common case. Only the stretches around characters that may change
  // go through utf8proc: a character that is not flagged is a starter that nothing composes
  // with, so normalisation never reaches across it.
  bool Normalize(std::string_view s, std::string* out) const {
    size_t copied = 0, boundary = 0;  // boundary: start of the last unflagged character
    bool changed = false;
    for (size_t i = 0; i < s.size();) {
      const auto b = static_cast<uint8_t>(s[i]);
      if (b < 0xCC) {  // below U+0300 nothing changes under NFC
        boundary = i;
        i += b < 0x80 ? 1 : 2;
        continue;
      }
      size_t next = i;
      if (!maybe_changes_[NextCodepoint(s, &next)]) {
        boundary = i;
        i = next;
        continue;
      }
      // A flagged run: normalise from the last starter before it to the next unflagged char.
      size_t end = next;
      while (end < s.size()) {
        size_t after = end;
        const char32_t cp = NextCodepoint(s, &after);
        if (cp < 0x300 || !maybe_changes_[cp]) break;
        end = after;
      }
      if (!changed) out->clear();
      changed = true;
      out->append(s.data() + copied, boundary - copied);
      out->append(Nfc(s.substr(boundary, end - boundary)));
      copied = boundary = i = end;
    }
    if (changed) out->append(s.data() + copied, s.size() - copied);
    return changed;
  }

 private:
  static bool IsOwnNfc(char32_t cp) {
    std::string s;
    AppendCodepoint(cp, &s);
    return Nfc(s) == s;
  }

 public:
  static std::string Nfc(std::string_view s) {
    utf8proc_uint8_t* out = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                     static_cast<utf8proc_ssize_t>(s.size()), &out,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
    if (n < 0) return std::string(s);  // cannot happen for valid UTF-8; keep the text as is
    return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  }

 private:
  std::vector<bool> maybe_changes_;
};

const NfcTable& Nfc() {
  static const NfcTable table;
  return table;
}

// ---------------------------------------------------------------------------------------------
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

std::atomic<uint64_t> g_next_instance_id{1};

absl::StatusOr<std::string> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path.string()));
  return ss.str();
}

absl::StatusOr<json> ReadJson(const fs::path& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": bad JSON: ", e.what()));
  }
}

// Reads a flat {"token": id, ...} object (vocab.json) without building a DOM of 150k entries.
class VocabSax : public json::json_sax_t {
 public:
  explicit VocabSax(std::vector<std::pair<std::string, int32_t>>* out) : out_(out) {}
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool number_unsigned(number_unsigned_t v) override {
    return Id(v > static_cast<uint64_t>(kMaxTokenId) ? kMaxTokenId + 1 : static_cast<int64_t>(v));
  }
  bool number_integer(number_integer_t v) override { return Id(v); }
  bool start_object(std::size_t) override { return Fail(depth_++ != 0, "nested object"); }
  bool end_object() override { return --depth_, true; }
  bool null() override { return Fail(true, "null"); }
  bool boolean(bool) override { return Fail(true, "boolean"); }
  bool number_float(number_float_t, const string_t&) override { return Fail(true, "float"); }
  bool string(string_t&) override { return Fail(true, "string value"); }
  bool binary(binary_t&) override { return Fail(true, "binary"); }
  bool start_array(std::size_t) override { return Fail(true, "array"); }
  bool end_array() override { return false; }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& e) override {
    error_ = absl::StrCat("bad JSON at byte ", position, ": ", e.what());
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  bool Id(int64_t v) {
    auto id = CheckedTokenId(v, key_, "token", "");
    if (!id.ok()) {
      if (error_.empty()) error_ = std::string(id.status().message());
      return false;
    }
    out_->emplace_back(std::move(key_), *id);
    return true;
  }
  bool Fail(bool failed, const char* what) {
    if (failed && error_.empty())
      error_ = absl::StrCat("not a flat {token: id} object (", what, ")");
    return !failed;
  }

  std::vector<std::pair<std::string, int32_t>>* out_;
  std::string key_;
  std::string error_;
  int depth_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// utf8 helpers.

namespace utf8 {

size_t FindInvalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (!(static_cast<uint8_t>(s[i]) & 0x80)) {
      if (i + 8 <= s.size()) {
        uint64_t w;
        std::memcpy(&w, s.data() + i, 8);
        if (!(w & 0x8080808080808080ULL)) {
          i += 8;
          continue;
        }
      }
      ++i;
      continue;
    }
    size_t consumed;
    bool truncated;
    const size_t n = ValidSequenceLength(s, i, &consumed, &truncated);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

size_t AppendLossy(std::string_view bytes, bool final_chunk, std::string* out) {
  size_t i = 0, run = 0;  // bytes[run, i) is valid and not yet copied
  while (i < bytes.size()) {
    size_t consumed;
    bool truncated;
    const size_t n = ValidSequenceLength(bytes, i, &consumed, &truncated);
    if (n > 0) {
      i += n;
      continue;
    }
    out->append(bytes.data() + run, i - run);
    if (truncated && !final_chunk) return i;  // hold back the incomplete character
    out->append(kReplacement);
    i += consumed;
    run = i;
  }
  out->append(bytes.data() + run, i - run);
  return i;
}

}  // namespace utf8

// ---------------------------------------------------------------------------------------------
// Loading.

struct Tokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() { pcre2_code_free(code); }
};

struct Tokenizer::Builder {
  std::vector<std::pair<std::string, int32_t>> vocab;       // byte-level spelling, id
  std::vector<std::pair<std::string, std::string>> merges;  // byte-level spellings, by rank
  std::vector<AddedToken> added;
  std::string pattern = kQwen2Pattern;
  bool nfc = true;
  bool ignore_merges = false;

  absl::Status ParseVocab(const json& j, const std::string& where) {
    if (!j.is_object()) return absl::InvalidArgumentError(where + ": vocab is not an object");
    vocab.reserve(j.size());
    for (const auto& [token, id_json] : j.items()) {
      ASSIGN_OR_RETURN(const int32_t id, TokenIdFromJson(id_json, token, "vocab token", where));
      vocab.emplace_back(token, id);
    }
    return absl::OkStatus();
  }

  absl::Status AddMerge(std::string_view line, const std::string& where) {
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 >= line.size() ||
        line.find(' ', space + 1) != std::string_view::npos)
      return absl::InvalidArgumentError(absl::StrCat(where, ": bad merge '", Av(line), "'"));
    merges.emplace_back(std::string(line.substr(0, space)), std::string(line.substr(space + 1)));
    return absl::OkStatus();
  }

  absl::Status ParseAddedToken(const json& t, int32_t id, const std::string& where) {
    if (!t.is_object() || !t.contains("content") || !t["content"].is_string())
      return absl::InvalidArgumentError(where + ": added token without content");
    for (const char* unsupported : {"lstrip", "rstrip", "single_word"}) {
      if (t.value(unsupported, false))
        return absl::UnimplementedError(absl::StrCat(where, ": added token ", t["content"].dump(),
                                                     " uses ", unsupported, ", not supported"));
    }
    added.push_back({id, t["content"].get<std::string>(), t.value("special", false)});
    return absl::OkStatus();
  }

  absl::Status ParseTokenizerJson(const json& j, const std::string& where);
  absl::Status ParseNormalizer(const json& n, const std::string& where);
  absl::Status ParsePreTokenizer(const json& p, const std::string& where);
  absl::Status LoadVocabMerges(const fs::path& dir);
  absl::Status AddQwen3Tokens();
  absl::StatusOr<std::unique_ptr<Tokenizer>> Build();

  // The options' extra tokens, then Build; every error names `label` (the files read).
  absl::StatusOr<std::unique_ptr<Tokenizer>> Finish(const TokenizerOptions& options,
                                                    const std::string& label) {
    const absl::Status added = options.qwen3_added_tokens ? AddQwen3Tokens() : absl::OkStatus();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
        added.ok() ? Build() : absl::StatusOr<std::unique_ptr<Tokenizer>>(added);
    if (tok.ok() || absl::StartsWith(tok.status().message(), label + ": ")) return tok;
    return absl::Status(tok.status().code(), absl::StrCat(label, ": ", tok.status().message()));
  }
};

absl::Status Tokenizer::Builder::ParseNormalizer(const json& n, const std::string& where) {
  if (n.is_null()) {
    nfc = false;
    return absl::OkStatus();
  }
  const std::string type = n.value("type", "");
  if (type == "NFC") {
    nfc = true;
    return absl::OkStatus();
  }
  if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].size() <= 1) {
    if (n["normalizers"].empty()) {
      nfc = false;
      return absl::OkStatus();
    }
    return ParseNormalizer(n["normalizers"][0], where);
  }
  return absl::UnimplementedError(absl::StrCat(where, ": normalizer ", n.dump(), " not supported"));
}

absl::Status Tokenizer::Builder::ParsePreTokenizer(const json& p, const std::string& where) {
  const auto unsupported = [&] {
    return absl::UnimplementedError(
        absl::StrCat(where, ": pre_tokenizer ", p.dump().substr(0, 300), " not supported"));
  };
  const auto is_plain_byte_level = [](const json& b) {
    return b.value("type", "") == "ByteLevel" && !b.value("add_prefix_space", false);
  };
  if (is_plain_byte_level(p)) {
    if (!p.value("use_regex", true)) return unsupported();
    pattern = kGpt2Pattern;
    return absl::OkStatus();
  }
  // Split(regex, Isolated) followed by ByteLevel(use_regex=false): Qwen2/Qwen3, Llama 3, ...
  if (p.value("type", "") != "Sequence" || !p.contains("pretokenizers") ||
      p["pretokenizers"].size() != 2)
    return unsupported();
  const json& split = p["pretokenizers"][0];
  const json& byte_level = p["pretokenizers"][1];
  if (split.value("type", "") != "Split" || split.value("behavior", "") != "Isolated" ||
      split.value("invert", false) || !is_plain_byte_level(byte_level) ||
      byte_level.value("use_regex", true) || !split.contains("pattern"))
    return unsupported();
  const json& pat = split["pattern"];
  if (pat.contains("Regex") && pat["Regex"].is_string()) {
    pattern = pat["Regex"].get<std::string>();
  } else {
    return unsupported();
  }
  return absl::OkStatus();
}

// True when `key` is absent, null or "" (tokenizers writes null for unset string options).
static bool NullOrEmptyString(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty());
}

absl::Status Tokenizer::Builder::ParseTokenizerJson(const json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("model"))
    return absl::InvalidArgumentError(where + ": not a tokenizer.json (no model)");
  const json& model = j["model"];
  if (model.value("type", "BPE") != "BPE")
    return absl::UnimplementedError(where + ": only BPE models are supported");
  if (!model.value("dropout", json()).is_null() || model.value("byte_fallback", false) ||
      !NullOrEmptyString(model, "continuing_subword_prefix") ||
      !NullOrEmptyString(model, "end_of_word_suffix"))
    return absl::UnimplementedError(where +
                                    ": BPE options (dropout, byte_fallback, prefixes) "
                                    "are not supported");
  ignore_merges = model.value("ignore_merges", false);
  RETURN_IF_ERROR(ParseVocab(model.value("vocab", json()), where));
  const json merges_json = model.value("merges", json::array());
  merges.reserve(merges_json.size());
  for (const json& m : merges_json) {
    if (m.is_string()) {
      RETURN_IF_ERROR(AddMerge(m.get<std::string>(), where));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      return absl::InvalidArgumentError(where + ": bad merge " + m.dump());
    }
  }
  for (const json& t : j.value("added_tokens", json::array())) {
    if (!t.is_object() || !t.contains("id"))
      return absl::InvalidArgumentError(where + ": added token without id");
    const json& content = t.value("content", json());
    const std::string name = content.is_string() ? content.get<std::string>() : "";
    ASSIGN_OR_RETURN(const int32_t id, TokenIdFromJson(t["id"], name, "added token", where));
    RETURN_IF_ERROR(ParseAddedToken(t, id, where));
  }
  RETURN_IF_ERROR(ParseNormalizer(j.value("normalizer", json()), where));
  const json pre = j.value("pre_tokenizer", json());
  if (pre.is_null()) return absl::UnimplementedError(where + ": no pre_tokenizer");
  return ParsePreTokenizer(pre, where);
}

absl::Status Tokenizer::Builder::LoadVocabMerges(const fs::path& dir) {
  const std::string vocab_path = (dir / "vocab.json").string();
  ASSIGN_OR_RETURN(const std::string vocab_text, ReadFile(vocab_path));
  vocab.reserve(vocab_text.size() / 16);
  VocabSax sax(&vocab);
  if (!json::sax_parse(vocab_text, &sax) || !sax.error().empty())
    return absl::InvalidArgumentError(absl::StrCat(vocab_path, ": ", sax.error()));
  const std::string merges_path = (dir / "merges.txt").string();
  ASSIGN_OR_RETURN(std::string text, ReadFile(merges_path));
  merges.reserve(text.size() / 12);
  std::string_view rest(text);
  for (size_t line_no = 1; !rest.empty(); ++line_no) {
    const size_t eol = rest.find('\n');
    std::string_view line = rest.substr(0, eol);
    rest = eol == std::string_view::npos ? std::string_view() : rest.substr(eol + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    RETURN_IF_ERROR(AddMerge(line, absl::StrCat(merges_path, ":", line_no)));
  }
  const fs::path config_path = dir / "tokenizer_config.json";
  if (!fs::exists(config_path)) return absl::OkStatus();
  ASSIGN_OR_RETURN(json config, ReadJson(config_path));
  const json decoder = config.value("added_tokens_decoder", json::object());
  for (const auto& [id_text, t] : decoder.items()) {
    const json& content = t.is_object() ? t.value("content", json()) : json();
    const std::string name = content.is_string() ? content.get<std::string>() : "";
    int64_t wide = 0;
    if (!absl::SimpleAtoi(id_text, &wide))
      return absl::InvalidArgumentError(absl::StrCat(config_path.string(), ": added token ",
                                                     QuoteToken(name), " has a bad id '", id_text,
                                                     "'"));
    ASSIGN_OR_RETURN(const int32_t id,
                     CheckedTokenId(wide, name, "added token", config_path.string()));
    RETURN_IF_ERROR(ParseAddedToken(t, id, config_path.string()));
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::Builder::AddQwen3Tokens() {
  for (const AddedToken& q : Tokenizer::Qwen3AddedTokens()) {
    auto same_id =
        std::find_if(added.begin(), added.end(), [&](const AddedToken& a) { return a.id == q.id; });
    if (same_id != added.end()) {
      if (same_id->content != q.content)
        return absl::InvalidArgumentError(absl::StrCat("Qwen3 token ", q.id, " is '", q.content,
                                                       "' but the files declare '",
                                                       same_id->content, "'"));
      same_id->special = q.special;
      continue;
    }
    added.push_back(q);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Builder::Build() {
  std::unique_ptr<Tokenizer> tok(new Tokenizer());  // private constructor
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab) max_id = std::max(max_id, id);
  for (const AddedToken& a : added) max_id = std::max(max_id, a.id);
  if (max_id < 0) return absl::InvalidArgumentError("empty vocabulary");
  tok->id_bytes_.assign(max_id + 1, std::string());
  tok->id_kind_.assign(max_id + 1, 0);
  tok->id_added_.assign(max_id + 1, -1);

  tok->vocab_.reserve(vocab.size());
  for (const auto& [token, id] : vocab) {
    ASSIGN_OR_RETURN(std::string bytes, ByteLevelToBytes(token));
    if (tok->id_kind_[id] != 0)
      return absl::InvalidArgumentError(absl::StrCat("id ", id, " appears twice in the vocab"));
    tok->id_kind_[id] = 1;
    tok->id_bytes_[id] = bytes;
    tok->vocab_.emplace(std::move(bytes), id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = tok->vocab_.find(std::string(1, static_cast<char>(b)));
    if (it == tok->vocab_.end())
      return absl::InvalidArgumentError(absl::StrFormat("vocab lacks the byte 0x%02x", b));
    tok->byte_ids_[b] = it->second;
  }

  tok->merges_.reserve(merges.size());
  std::vector<std::pair<int32_t, int32_t>> merge_ids;  // for the fingerprint
  merge_ids.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    ASSIGN_OR_RETURN(std::string lb, ByteLevelToBytes(left));
    ASSIGN_OR_RETURN(std::string rb, ByteLevelToBytes(right));
    auto l = tok->vocab_.find(lb), r = tok->vocab_.find(rb), m = tok->vocab_.find(lb + rb);
    if (l == tok->vocab_.end() || r == tok->vocab_.end() || m == tok->vocab_.end())
      return absl::InvalidArgumentError(
          absl::StrCat("merge ", rank, " '", left, " ", right, "' uses tokens not in the vocab"));
    // Like the Rust library, a repeated pair keeps its last rank.
    tok->merges_[uint64_t(uint32_t(l->second)) << 32 | uint32_t(r->second)] = {
        static_cast<int32_t>(rank), m->second};
    merge_ids.emplace_back(l->second, r->second);
  }

  std::sort(added.begin(), added.end(),
            [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& a = added[i];
    if (a.content.empty()) return absl::InvalidArgumentError("empty added token");
    if (utf8::FindInvalid(a.content) != std::string::npos)
      return absl::InvalidArgumentError("added token is not valid UTF-8");
    if (i > 0 && added[i - 1].id == a.id)
      return absl::InvalidArgumentError(absl::StrCat("added token id ", a.id, " declared twice"));
    if (!tok->added_by_content_.emplace(a.content, static_cast<int32_t>(i)).second)
      return absl::InvalidArgumentError(absl::StrCat("added token '", a.content, "' twice"));
    tok->id_kind_[a.id] = a.special ? 3 : 2;
    tok->id_added_[a.id] = static_cast<int32_t>(i);
    tok->added_by_first_byte_[static_cast<uint8_t>(a.content[0])].push_back(static_cast<int>(i));
    tok->added_first_byte_[static_cast<uint8_t>(a.content[0])] = true;
  }
  tok->added_ = added;
  for (int b = 0; b < 256; ++b) {
    if (!tok->added_first_byte_[b]) continue;
    tok->single_first_byte_ = tok->single_first_byte_ == -1 ? b : -2;
  }
  if (tok->single_first_byte_ == -2) tok->single_first_byte_ = -1;
  for (auto& candidates : tok->added_by_first_byte_) {
    std::stable_sort(candidates.begin(), candidates.end(), [&](int a, int b) {
      return tok->added_[a].content.size() > tok->added_[b].content.size();
    });
  }

  tok->pattern_ = pattern;
  tok->nfc_ = nfc;
  tok->ignore_merges_ = ignore_merges;
  const std::string pcre_pattern = TranslatePattern(pattern);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  tok->regex_ = std::make_unique<Regex>();
  tok->regex_->code = pcre2_compile(
      reinterpret_cast<PCRE2_SPTR>(pcre_pattern.data()), pcre_pattern.size(),
      // \C (one code unit) could end a match inside a character, and every later
      // step assumes character boundaries; Oniguruma has no such escape either.
      PCRE2_UTF | PCRE2_UCP | PCRE2_NEVER_BACKSLASH_C, &error, &error_offset, nullptr);
  if (tok->regex_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(
        absl::StrCat("pre-tokenizer regex: ", reinterpret_cast<const char*>(message), " at offset ",
                     error_offset));
  }
  tok->regex_->jit = pcre2_jit_compile(tok->regex_->code, PCRE2_JIT_COMPLETE) == 0;
  if (!tok->regex_->jit) spdlog::warn("tokenizer: PCRE2 JIT unavailable, using the interpreter");

  Sha256 sha;
  sha.UpdateField("opd-tokenizer-fingerprint-v1");
  sha.UpdateField(pattern);
  sha.UpdateU32(nfc ? 1 : 0);
  sha.UpdateU32(ignore_merges ? 1 : 0);
  sha.UpdateU32(static_cast<uint32_t>(tok->id_bytes_.size()));
  for (size_t id = 0; id < tok->id_bytes_.size(); ++id) {
    if (tok->id_kind_[id] == 0) continue;
    sha.UpdateU32(static_cast<uint32_t>(id));
    sha.UpdateU32(tok->id_kind_[id]);
    const bool is_added = tok->id_kind_[id] >= 2;
    sha.UpdateField(is_added ? tok->added_[tok->id_added_[id]].content : tok->id_bytes_[id]);
  }
  sha.UpdateU32(static_cast<uint32_t>(merge_ids.size()));
  for (const auto& [l, r] : merge_ids) {
    sha.UpdateU32(static_cast<uint32_t>(l));
    sha.UpdateU32(static_cast<uint32_t>(r));
  }
  tok->fingerprint_ = sha.HexDigest();
  return tok;
}

Tokenizer::Tokenizer() : instance_id_(g_next_instance_id.fetch_add(1)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir_or_file,
                                                           const TokenizerOptions& options) {
  const fs::path path(dir_or_file);
  std::error_code ec;
  if (fs::is_regular_file(path, ec) || fs::exists(path / "tokenizer.json", ec)) {
    const fs::path file = fs::is_regular_file(path, ec) ? path : path / "tokenizer.json";
    ASSIGN_OR_RETURN(const std::string text, ReadFile(file));
    return FromTokenizerJson(text, file.string(), options);
  }
  Builder builder;
  if (fs::exists(path / "vocab.json", ec) && fs::exists(path / "merges.txt", ec)) {
    // A field of an unexpected JSON type (tokenizer_config.json) must be an error, never a crash.
    try {
      RETURN_IF_ERROR(builder.LoadVocabMerges(path));
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir_or_file, ": malformed tokenizer files: ", e.what()));
    }
  } else {
    return absl::NotFoundError(absl::StrCat(
        dir_or_file, ": no tokenizer.json, and no vocab.json + merges.txt, found there"));
  }
  return builder.Finish(options, dir_or_file);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTokenizerJson(
    std::string_view text, const std::string& label, const TokenizerOptions& options) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": bad JSON: ", e.what()));
  }
  Builder builder;
  // A field of an unexpected JSON type must be an error naming the file, never a crash.
  try {
    RETURN_IF_ERROR(builder.ParseTokenizerJson(j, label));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": malformed tokenizer.json: ", e.what()));
  }
  return builder.Finish(options, label);
}

std::vector<AddedToken> Tokenizer::Qwen3AddedTokens() {
  // Ids 151643.. in order; the first 14 are "special" (skipped by skip_special), the tool-call,
  // FIM and think tokens are not, exactly as in Qwen3's tokenizer.json.
  static const char* const kContents[] = {"<|endoftext|>",
                                          "<|im_start|>",
                                          "<|im_end|>",
                                          "<|object_ref_start|>",
                                          "<|object_ref_end|>",
                                          "<|box_start|>",
                                          "<|box_end|>",
                                          "<|quad_start|>",
                                          "<|quad_end|>",
                                          "<|vision_start|>",
                                          "<|vision_end|>",
                                          "<|vision_pad|>",
                                          "<|image_pad|>",
                                          "<|video_pad|>",
                                          "<tool_call>",
                                          "</tool_call>",
                                          "<|fim_prefix|>",
                                          "<|fim_middle|>",
                                          "<|fim_suffix|>",
                                          "<|fim_pad|>",
                                          "<|repo_name|>",
                                          "<|file_sep|>",
                                          "<tool_response>",
                                          "</tool_response>",
                                          "<think>",
                                          "</think>"};
  std::vector<AddedToken> tokens;
  int32_t id = 151643;
  for (const char* content : kContents) {
    tokens.push_back({id, content, id <= 151656});
    ++id;
  }
  return tokens;
}

// ---------------------------------------------------------------------------------------------
// Encoding.

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
  if (nfc_ && !IsAscii(segment) && Nfc().Normalize(segment, &normalized)) segment = normalized;
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
      NextCodepoint(segment, &next);
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

// ---------------------------------------------------------------------------------------------
// Decoding and look-ups.

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
