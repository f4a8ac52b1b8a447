// tokenizer.json loading, then encoding and decoding with whatever loaded. The input is the JSON
// text, optionally followed by a NUL byte and a text to encode. A load either fails with an error
// naming the file or gives a tokenizer whose ids are in range, whose spans cover the text, whose
// stream decoder agrees with Decode, and which round-trips ASCII text.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "lm/text/tokenizer.h"
#include "spdlog/spdlog.h"

namespace {

bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

std::string Streamed(const lm::Tokenizer& tok, const std::vector<int32_t>& ids, bool skip) {
  lm::StreamDecoder stream = tok.NewStreamDecoder(skip);
  std::string out;
  for (int32_t id : ids) out += stream.Push(id);
  return out + stream.Flush();
}

void Exercise(const lm::Tokenizer& tok, const std::string& owned) {
  // An exactly sized heap copy without a terminating NUL, so that ASan sees any read past the end.
  std::unique_ptr<char[]> bytes(new char[owned.size()]);
  std::memcpy(bytes.get(), owned.data(), owned.size());
  const std::string_view text(bytes.get(), owned.size());
  const std::vector<int32_t> ids = tok.Encode(text);
  bool any_added = false;
  for (int32_t id : ids) {
    FUZZ_CHECK(id >= 0 && id < tok.vocab_size(), std::to_string(id));
    FUZZ_CHECK(tok.IdToToken(id).ok(), std::to_string(id));
    any_added |= tok.IsAdded(id);
  }
  const std::string decoded = tok.Decode(ids);
  FUZZ_CHECK(Streamed(tok, ids, false) == decoded, "stream decode differs");
  FUZZ_CHECK(Streamed(tok, ids, true) == tok.Decode(ids, true), "stream decode differs (skip)");
  const lm::TokenSpans spans = tok.EncodeWithSpans(text);
  FUZZ_CHECK(spans.ids == ids, "EncodeWithSpans ids differ from Encode");
  FUZZ_CHECK(spans.ends.size() == ids.size(), "one end per token");
  for (size_t i = 1; i < spans.ends.size(); ++i)
    FUZZ_CHECK(spans.ends[i - 1] <= spans.ends[i], "ends decrease");
  // ASCII is its own NFC form and valid UTF-8: the tokens spell the text exactly (unless an id
  // the BPE produced is also an added token's, which then decodes as that token).
  if (IsAscii(text) && !any_added) {
    FUZZ_CHECK(decoded == text, "round trip of ASCII text");
    FUZZ_CHECK(ids.empty() || spans.ends.back() == text.size(), "spans end at the text's end");
  }
  for (int32_t id : tok.EncodeOrdinary(text))
    FUZZ_CHECK(id >= 0 && id < tok.vocab_size(), std::to_string(id));
  // Arbitrary ids (the text's bytes, read as int32) decode without crashing, streamed or not.
  std::vector<int32_t> raw(text.size() / 4);
  if (!raw.empty()) std::memcpy(raw.data(), text.data(), raw.size() * 4);
  for (int32_t& id : raw) id = id % (tok.vocab_size() + 2);
  FUZZ_CHECK(Streamed(tok, raw, false) == tok.Decode(raw), "stream decode of raw ids differs");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string json = input.substr(0, nul);
  const std::string text =
      nul == std::string::npos ? "Hello hello world<|im_start|>x  \n\n" : input.substr(nul + 1);
  for (const bool qwen3 : {false, true}) {
    auto tok = lm::Tokenizer::FromTokenizerJson(json, "fuzz/tokenizer.json",
                                                lm::TokenizerOptions::Qwen3(qwen3));
    if (!tok.ok()) {
      fuzz::CheckNamed(tok.status(), "fuzz/tokenizer.json: ");
      continue;
    }
    Exercise(**tok, text);
  }
  return 0;
}
