#include "lm/text/nfc.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "lm/text/utf8.h"

namespace lm {
namespace {

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
      if (!maybe_changes_[utf8::NextCodepoint(s, &next)]) {
        boundary = i;
        i = next;
        continue;
      }
      // A flagged run: normalise from the last starter before it to the next unflagged char.
      size_t end = next;
      while (end < s.size()) {
        size_t after = end;
        const char32_t cp = utf8::NextCodepoint(s, &after);
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
    utf8::AppendCodepoint(cp, &s);
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

const NfcTable& Table() {
  static const NfcTable table;
  return table;
}

}  // namespace

bool NfcNormalize(std::string_view s, std::string* out) {
  return Table().Normalize(s, out);
}

}  // namespace lm
