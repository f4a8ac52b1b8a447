// Unicode NFC, the normaliser of Qwen's tokenizer. Most text is already NFC and utf8proc
// allocates, so a per-code-point table (built once, on first use) says which characters might
// change under NFC or make a neighbour change; text without any is returned untouched, and only
// the stretches around flagged characters go through utf8proc.
#pragma once

#include <string>
#include <string_view>

namespace lm {

// NFC of `s` (valid UTF-8) into `*out`; returns false, leaving `out` alone, when `s` is already
// NFC for sure (the common case). Thread-safe.
bool NfcNormalize(std::string_view s, std::string* out);

}  // namespace lm
