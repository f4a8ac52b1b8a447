// GPT-2's byte-level alphabet: byte-level BPE vocabularies spell every byte as a printable
// character (space is "Ġ", newline "Ċ"), so vocab.json and merges.txt are text. The tokenizer keeps
// raw bytes internally and converts at load time and in TokenId / IdToToken.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace lm {

// "Ġworld" -> " world". Fails on invalid UTF-8 or a character outside the byte-level alphabet.
absl::StatusOr<std::string> ByteLevelToBytes(std::string_view token);
// " world" -> "Ġworld". Never fails: every byte has a character.
std::string BytesToByteLevel(std::string_view bytes);

}  // namespace lm
