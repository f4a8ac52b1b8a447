// Tokenizer tests: exact parity with Hugging Face `tokenizers`/`transformers` on the real Qwen
// vocabulary (tests/python/tokenizer_reference.py writes the expected ids), plus the properties
// the services rely on: round trips, streaming decode, robustness, fingerprints, thread safety.
#include "lm/text/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "lm/text/sha256.h"
#include "nlohmann/json.hpp"
#include "tests/byte_level.h"

namespace lm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kVocabDir = std::string(OPD_SOURCE_DIR) + "/../shared/tokenizers/qwen2";
const std::string kReferenceDir = std::string(OPD_BINARY_DIR) + "/tokenizer_reference";

std::vector<json> ReadJsonLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<json> rows;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) rows.push_back(json::parse(line));
  return rows;
}

// Runs the Python reference once per build (again when the script or the corpus changed).
void EnsureReference() {
  static bool done = [] {
    const std::string script = std::string(OPD_SOURCE_DIR) + "/tests/python/tokenizer_reference.py";
    const std::string corpus = std::string(OPD_SOURCE_DIR) + "/tests/data/tokenizer_corpus.jsonl";
    const fs::path stamp = fs::path(kReferenceDir) / "qwen3_decode.jsonl";
    std::error_code ec;
    const bool fresh = fs::exists(stamp) &&
                       fs::last_write_time(stamp, ec) > fs::last_write_time(script, ec) &&
                       fs::last_write_time(stamp, ec) > fs::last_write_time(corpus, ec);
    if (fresh) return true;
    const std::string cmd = std::string(OPD_PYTHON) + " " + script + " --tokenizer " + kVocabDir +
                            " --corpus " + corpus + " --out " + kReferenceDir;
    return std::system(cmd.c_str()) == 0;
  }();
  ASSERT_TRUE(done) << "tests/python/tokenizer_reference.py failed";
}

// Every test here reads the real Qwen vocabulary: without it, stop before any test runs with a
// message naming the folder (instead of dereferencing a tokenizer that failed to load).
class QwenVocabularyPresent : public ::testing::Environment {
 public:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(fs::path(kVocabDir) / "vocab.json") ||
                fs::exists(fs::path(kVocabDir) / "tokenizer.json"))
        << "the Qwen vocabulary is missing: " << kVocabDir;
  }
};
// gtest takes ownership of registered environments.
::testing::Environment* const kVocabularyCheck =
    ::testing::AddGlobalTestEnvironment(new QwenVocabularyPresent);

const Tokenizer& Qwen2() {
  static std::unique_ptr<Tokenizer> tok = [] {
    auto t = Tokenizer::Load(kVocabDir);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }();
  return *tok;
}

const Tokenizer& Qwen3() {
  static std::unique_ptr<Tokenizer> tok = [] {
    auto t = Tokenizer::Load(kVocabDir, TokenizerOptions::Qwen3());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }();
  return *tok;
}

std::string Hex(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out += "0123456789abcdef"[c >> 4], out += "0123456789abcdef"[c & 15];
  return out;
}

// Every id of every corpus sample equals the reference, decode equals the reference's decode,
// and decode(encode(x)) == NFC(x) (== x for the corpus, which is NFC apart from the "nfc" rows).
void ExpectParity(const Tokenizer& tok, const std::string& expected_file) {
  EnsureReference();
  const auto rows = ReadJsonLines(expected_file);
  ASSERT_GT(rows.size(), 600u);
  int mismatches = 0;
  for (const json& row : rows) {
    const std::string text = row["text"];
    const std::vector<int32_t> want = row["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tok.Encode(text);
    if (got != want && ++mismatches <= 10) {
      ADD_FAILURE() << "ids differ for [" << row["tag"] << "] " << json(text).dump() << "\n want "
                    << json(want).dump() << "\n got  " << json(got).dump();
    }
    EXPECT_EQ(tok.Decode(got), row["decoded"].get<std::string>()) << json(text).dump();
    EXPECT_EQ(tok.Decode(got, /*skip_special=*/true),
              row["decoded_skip_special"].get<std::string>());
    EXPECT_EQ(tok.Decode(got), row["nfc"].get<std::string>()) << "round trip " << Hex(text);
    if (row["tag"] != "nfc" && row["tag"] != "random") {
      EXPECT_EQ(tok.Decode(got), text) << "round trip of an NFC sample";
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(TokenizerTest, KnownVectors) {
  EXPECT_EQ(Qwen2().Encode("Hello world"), (std::vector<int32_t>{9707, 1879}));
  EXPECT_EQ(Qwen2().Encode(" Hello world"), (std::vector<int32_t>{21927, 1879}));
  EXPECT_EQ(Qwen3().Encode("Hello world"), (std::vector<int32_t>{9707, 1879}));
  EXPECT_TRUE(Qwen2().Encode("").empty());
  EXPECT_EQ(Qwen2().Decode(std::vector<int32_t>{9707, 1879}), "Hello world");
}

TEST(TokenizerTest, ParityWithHuggingFaceQwen2) {
  ExpectParity(Qwen2(), kReferenceDir + "/qwen2_expected.jsonl");
}

TEST(TokenizerTest, ParityWithHuggingFaceQwen3) {
  ExpectParity(Qwen3(), kReferenceDir + "/qwen3_expected.jsonl");
}

TEST(TokenizerTest, DecodeParityOnRandomIds) {
  EnsureReference();
  for (const auto& [name, tok] :
       {std::pair<std::string, const Tokenizer*>{"qwen2", &Qwen2()}, {"qwen3", &Qwen3()}}) {
    for (const json& row : ReadJsonLines(kReferenceDir + "/" + name + "_decode.jsonl")) {
      const auto ids = row["ids"].get<std::vector<int32_t>>();
      EXPECT_EQ(tok->Decode(ids), row["decoded"].get<std::string>()) << row["ids"].dump();
      EXPECT_EQ(tok->Decode(ids, true), row["decoded_skip_special"].get<std::string>());
      // The stream decoder must produce the same text whatever the chunking.
      StreamDecoder stream = tok->NewStreamDecoder();
      std::string streamed;
      for (int32_t id : ids) streamed += stream.Push(id);
      streamed += stream.Flush();
      EXPECT_EQ(streamed, row["decoded"].get<std::string>());
    }
  }
}

TEST(TokenizerTest, LoadsTokenizerJsonIdentically) {
  EnsureReference();
  for (const auto& [name, dir_tok] :
       {std::pair<std::string, const Tokenizer*>{"qwen2", &Qwen2()}, {"qwen3", &Qwen3()}}) {
    auto from_json = Tokenizer::Load(kReferenceDir + "/" + name + "/tokenizer.json");
    ASSERT_TRUE(from_json.ok()) << from_json.status();
    // A directory holding tokenizer.json loads it too.
    auto from_dir = Tokenizer::Load(kReferenceDir + "/" + name);
    ASSERT_TRUE(from_dir.ok()) << from_dir.status();
    EXPECT_EQ((*from_json)->Fingerprint(), dir_tok->Fingerprint()) << name;
    EXPECT_EQ((*from_dir)->Fingerprint(), dir_tok->Fingerprint()) << name;
    EXPECT_EQ((*from_json)->vocab_size(), dir_tok->vocab_size());
    for (const json& row : ReadJsonLines(kReferenceDir + "/" + name + "_expected.jsonl"))
      ASSERT_EQ((*from_json)->Encode(row["text"].get<std::string>()),
                row["ids"].get<std::vector<int32_t>>());
  }
}

TEST(TokenizerTest, Qwen3AddedTokens) {
  EnsureReference();
  const Tokenizer& q3 = Qwen3();
  EXPECT_EQ(Qwen2().vocab_size(), 151646);
  EXPECT_EQ(q3.vocab_size(), 151669);
  EXPECT_EQ(*q3.TokenId("<think>"), 151667);
  EXPECT_EQ(*q3.TokenId("</think>"), 151668);
  EXPECT_EQ(*q3.TokenId("<tool_call>"), 151657);
  EXPECT_EQ(*q3.TokenId("<|im_end|>"), 151645);
  EXPECT_FALSE(Qwen2().TokenId("<think>").ok());
  // Contents and "special" flags exactly as the Python tokenizer holds them.
  std::ifstream in(kReferenceDir + "/qwen3_added.json");
  const json added = json::parse(in);
  ASSERT_EQ(added.size(), 26u);
  ASSERT_EQ(q3.added_tokens().size(), 26u);
  for (size_t i = 0; i < added.size(); ++i) {
    EXPECT_EQ(q3.added_tokens()[i].id, added[i]["id"].get<int32_t>());
    EXPECT_EQ(q3.added_tokens()[i].content, added[i]["content"].get<std::string>());
    EXPECT_EQ(q3.added_tokens()[i].special, added[i]["special"].get<bool>());
    EXPECT_EQ(q3.IsSpecial(added[i]["id"]), added[i]["special"].get<bool>());
  }
  EXPECT_EQ(q3.Encode("<think>\nx\n</think>").front(), 151667);
  EXPECT_EQ(q3.Encode("<think>\nx\n</think>").back(), 151668);
}

TEST(TokenizerTest, LookUps) {
  const Tokenizer& tok = Qwen2();
  EXPECT_EQ(*tok.TokenId("<|im_start|>"), 151644);
  EXPECT_EQ(*tok.TokenId("Ġworld"), 1879);
  EXPECT_EQ(*tok.IdToToken(1879), "Ġworld");
  EXPECT_EQ(*tok.IdToToken(151643), "<|endoftext|>");
  EXPECT_FALSE(tok.TokenId("no such token anywhere").ok());
  EXPECT_FALSE(tok.IdToToken(-1).ok());
  EXPECT_FALSE(tok.IdToToken(tok.vocab_size()).ok());
  EXPECT_TRUE(tok.IsSpecial(151645));
  EXPECT_FALSE(tok.IsSpecial(1879));
}

TEST(TokenizerTest, FingerprintIdentifiesTheTokenSet) {
  auto again = Tokenizer::Load(kVocabDir);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->Fingerprint(), Qwen2().Fingerprint());
  EXPECT_EQ(Qwen2().Fingerprint().size(), 64u);
  EXPECT_NE(Qwen2().Fingerprint(), Qwen3().Fingerprint());
}

TEST(TokenizerTest, EncodeOrdinaryIgnoresAddedTokens) {
  const auto ids = Qwen2().EncodeOrdinary("<|im_end|>");
  EXPECT_GT(ids.size(), 1u);
  for (int32_t id : ids) EXPECT_LT(id, 151643);
  EXPECT_EQ(Qwen2().Decode(ids), "<|im_end|>");
  EXPECT_EQ(Qwen2().Encode("<|im_end|>"), std::vector<int32_t>{151645});
}

TEST(TokenizerTest, SpansCoverTheNormalisedText) {
  const std::string text = "Hi <|im_start|>e\u0301t\u00e9 中文😀  \n\n x";
  const TokenSpans spans = Qwen2().EncodeWithSpans(text);
  ASSERT_EQ(spans.ids, Qwen2().Encode(text));
  ASSERT_EQ(spans.ids.size(), spans.ends.size());
  const std::string decoded = Qwen2().Decode(spans.ids);  // == the normalised text here
  uint32_t begin = 0;
  for (size_t i = 0; i < spans.ids.size(); ++i) {
    ASSERT_GT(spans.ends[i], begin);
    begin = spans.ends[i];
  }
  EXPECT_EQ(spans.ends.back(), decoded.size());
  EXPECT_LT(decoded.size(), text.size());  // e + U+0301 became é
}

TEST(TokenizerTest, StreamDecoderHoldsSplitCharacters) {
  const Tokenizer& tok = Qwen2();
  // "😀" as four single-byte tokens: nothing comes out until the character is complete.
  const std::string emoji = "\xF0\x9F\x98\x80";
  StreamDecoder stream = tok.NewStreamDecoder();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(stream.Push(tok.ByteId(emoji[i])), "");
    EXPECT_TRUE(stream.has_pending());
  }
  EXPECT_EQ(stream.Push(tok.ByteId(emoji[3])), emoji);
  EXPECT_FALSE(stream.has_pending());
  // A cut character followed by something else is replaced, the rest kept.
  EXPECT_EQ(stream.Push(tok.ByteId(emoji[0])), "");
  EXPECT_EQ(stream.Push(tok.ByteId('A')), "\uFFFDA");
  // A stream that ends mid-character flushes U+FFFD.
  EXPECT_EQ(stream.Push(tok.ByteId(emoji[0])), "");
  EXPECT_EQ(stream.Push(tok.ByteId(emoji[1])), "");
  EXPECT_EQ(stream.Flush(), "\uFFFD");
  EXPECT_EQ(stream.Flush(), "");
  // An added token ends a pending character too (as Decode does).
  EXPECT_EQ(stream.Push(tok.ByteId(emoji[0])), "");
  EXPECT_EQ(stream.Push(151645), "\uFFFD<|im_end|>");
  EXPECT_EQ(stream.Push(151645), "<|im_end|>");
  StreamDecoder skipping = tok.NewStreamDecoder(/*skip_special=*/true);
  EXPECT_EQ(skipping.Push(151645), "");
}

TEST(TokenizerTest, StreamingEqualsDecodeOnTheCorpus) {
  EnsureReference();
  for (const json& row : ReadJsonLines(kReferenceDir + "/qwen3_expected.jsonl")) {
    const auto ids = row["ids"].get<std::vector<int32_t>>();
    for (size_t chunk : {1, 2, 5}) {
      StreamDecoder stream = Qwen3().NewStreamDecoder();
      std::string text;
      for (size_t i = 0; i < ids.size(); i += chunk) {
        const size_t n = std::min(chunk, ids.size() - i);
        text += stream.Push(absl::MakeConstSpan(ids).subspan(i, n));
      }
      text += stream.Flush();
      ASSERT_EQ(text, Qwen3().Decode(ids));
    }
  }
}

TEST(TokenizerTest, InvalidIdsAndBytesNeverCrash) {
  const Tokenizer& tok = Qwen2();
  EXPECT_EQ(tok.Decode(std::vector<int32_t>{-1, 9707, 1 << 30, tok.vocab_size(), 1879}),
            "Hello world");
  // Lone continuation bytes, overlong forms, surrogates, truncated sequences: each maximal
  // invalid subpart becomes one U+FFFD (Rust's from_utf8_lossy, Python's errors="replace").
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\x80", "\uFFFD"},
      {"a\xC0\xAF"
       "b",
       "a\uFFFD\uFFFDb"},
      {"\xED\xA0\x80", "\uFFFD\uFFFD\uFFFD"},
      {"\xF0\x9F\x98"
       "A",
       "\uFFFDA"},
      {"\xE4\xB8", "\uFFFD"},
      {"\xF4\x90\x80\x80", "\uFFFD\uFFFD\uFFFD\uFFFD"},
      {"\xFF\xFE", "\uFFFD\uFFFD"},
      {"ok \xE4\xB8\xAD", "ok \xE4\xB8\xAD"},
  };
  for (const auto& [bytes, want] : cases) {
    std::vector<int32_t> ids;
    for (char c : bytes) ids.push_back(tok.ByteId(static_cast<uint8_t>(c)));
    EXPECT_EQ(tok.Decode(ids), want) << Hex(bytes);
    std::string lossy;
    utf8::AppendLossy(bytes, /*final_chunk=*/true, &lossy);
    EXPECT_EQ(lossy, want);
    // Invalid input text is encoded as its replacement.
    EXPECT_EQ(tok.Encode(bytes), tok.Encode(want)) << Hex(bytes);
    EXPECT_EQ(utf8::FindInvalid(bytes) == std::string::npos, bytes == want);
  }
  std::string junk;
  for (int i = 0; i < 4096; ++i) junk.push_back(static_cast<char>((i * 2654435761u) >> 13));
  EXPECT_EQ(tok.Decode(tok.Encode(junk)).find('\0') != std::string::npos,
            junk.find('\0') != std::string::npos);
}

TEST(TokenizerTest, LongWordsUseTheHeapMergeIdentically) {
  // Words longer than the linear-scan limit take the heap path; both must give the same merges.
  // The parity corpus covers this against Python; here, a word's BPE must not depend on length.
  const Tokenizer& tok = Qwen2();
  for (int n = 40; n <= 60; ++n) {
    const std::string word(n, 'a');
    const auto ids = tok.Encode(word);
    EXPECT_EQ(tok.Decode(ids), word);
  }
}

TEST(TokenizerTest, ConcurrentEncodeIsConsistent) {
  EnsureReference();
  const auto rows = ReadJsonLines(kReferenceDir + "/qwen3_expected.jsonl");
  std::vector<std::thread> threads;
  std::vector<int> failures(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round)
        for (size_t i = t; i < rows.size(); i += 3)
          if (Qwen3().Encode(rows[i]["text"].get<std::string>()) !=
              rows[i]["ids"].get<std::vector<int32_t>>())
            ++failures[t];
    });
  }
  for (auto& th : threads) th.join();
  for (int f : failures) EXPECT_EQ(f, 0);
}

TEST(TokenizerTest, LoadErrorsAreClear) {
  auto missing = Tokenizer::Load("/nonexistent/dir");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  const fs::path dir = fs::path(OPD_BINARY_DIR) / "tokenizer_test_bad";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "vocab.json") << R"({"a": 0, "b": 1})";
  std::ofstream(dir / "merges.txt") << "#version: 0.2\na b\n";
  auto bad = Tokenizer::Load(dir.string());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("byte"), std::string::npos) << bad.status();
  std::ofstream(dir / "tokenizer.json") << "{ not json";
  auto bad_json = Tokenizer::Load(dir.string());
  ASSERT_FALSE(bad_json.ok());
  EXPECT_NE(bad_json.status().message().find("tokenizer.json"), std::string::npos);
}

using testing_util::ByteLevelSpelling;

// The smallest loadable tokenizer.json: the 256 byte tokens (ids 0..255), no merges, GPT-2's
// byte-level pre-tokenizer, and `added_tokens` as given.
json MinimalTokenizerJson(const json& added_tokens) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteLevelSpelling(b)] = b;
  return json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
              {"added_tokens", added_tokens},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}}};
}

absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(const json& j) {
  return Tokenizer::FromTokenizerJson(j.dump(), "test/tokenizer.json");
}

TEST(TokenizerTest, MinimalTokenizerJsonLoads) {
  auto tok =
      FromJson(MinimalTokenizerJson({{{"id", 300}, {"content", "<ok>"}, {"special", true}}}));
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 301);
  EXPECT_EQ((*tok)->Encode("a<ok>"), (std::vector<int32_t>{'a', 300}));
  EXPECT_EQ((*tok)->Decode(std::vector<int32_t>{'h', 'i', 300}, /*skip_special=*/true), "hi");
}

// A negative added-token id used to index the id tables (an out-of-bounds write); huge ones were
// truncated to int32 or overflowed the table size. Each is refused, naming the token and the id.
TEST(TokenizerTest, OutOfRangeAddedTokenIdsAreRefused) {
  for (const std::string id : {"-5", "-1", "16777216", "2147483647", "99999999999",
                               "18446744073709551615", "1e3", "2.5"}) {
    const json added = json::parse(R"([{"id": )" + id + R"(, "content": "<bad>"}])");
    auto tok = FromJson(MinimalTokenizerJson(added));
    ASSERT_FALSE(tok.ok()) << "id " << id << " was accepted";
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << tok.status();
    const std::string message(tok.status().message());
    EXPECT_NE(message.find("'<bad>'"), std::string::npos) << tok.status();
    EXPECT_NE(message.find("test/tokenizer.json"), std::string::npos) << tok.status();
    if (id.find_first_of(".e") == std::string::npos) {
      EXPECT_NE(message.find("id " + id), std::string::npos) << tok.status();
    }
  }
  // A sparse id of a real vocabulary's size loads (the tables grow to it).
  auto sparse = FromJson(MinimalTokenizerJson({{{"id", 262143}, {"content", "<far>"}}}));
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  EXPECT_EQ((*sparse)->vocab_size(), 262144);
}

TEST(TokenizerTest, OutOfRangeVocabIdsAreRefused) {
  json j = MinimalTokenizerJson(json::array());
  j["model"]["vocab"]["zz"] = int64_t{1} << 30;
  auto tok = FromJson(j);
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find("'zz' has id 1073741824"), std::string::npos)
      << tok.status();

  // The vocab.json + merges.txt + tokenizer_config.json form checks the same way.
  const fs::path dir = fs::path(OPD_BINARY_DIR) / "tokenizer_test_ids";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "merges.txt") << "#version: 0.2\n";
  json vocab = j["model"]["vocab"];
  vocab["zz"] = -7;
  std::ofstream(dir / "vocab.json") << vocab.dump();
  auto negative = Tokenizer::Load(dir.string());
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("'zz' has id -7"), std::string::npos)
      << negative.status();
  vocab.erase("zz");
  std::ofstream(dir / "vocab.json") << vocab.dump();
  for (const std::string id : {"-3", "2147483647", "99999999999"}) {
    std::ofstream(dir / "tokenizer_config.json")
        << json{{"added_tokens_decoder", {{id, {{"content", "<cfg>"}}}}}}.dump();
    auto tok2 = Tokenizer::Load(dir.string());
    ASSERT_FALSE(tok2.ok()) << id;
    EXPECT_NE(tok2.status().message().find("'<cfg>'"), std::string::npos) << tok2.status();
    EXPECT_NE(tok2.status().message().find(id), std::string::npos) << tok2.status();
  }
  // A tokenizer_config.json of the wrong shape is an error, not an uncaught exception.
  std::ofstream(dir / "tokenizer_config.json") << "[1, 2]";
  auto shape = Tokenizer::Load(dir.string());
  ASSERT_FALSE(shape.ok());
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument) << shape.status();
  fs::remove_all(dir);
}

// Found by fuzz/tokenizer_json_fuzzer: a pre-tokenizer regex with \C (one byte, even inside a
// UTF-8 character) ended a match mid-character, and stepping over the next character then read
// past the end of the text. Such a pattern is refused when the tokenizer loads.
TEST(TokenizerTest, RegexMatchingSingleBytesIsRefused) {
  json j = MinimalTokenizerJson(json::array());
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "a\\C|"}}}, {"behavior", "Isolated"}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  auto tok = FromJson(j);
  ASSERT_FALSE(tok.ok()) << "a pattern with \\C loaded";
  EXPECT_NE(tok.status().message().find("test/tokenizer.json: pre-tokenizer regex"),
            std::string::npos)
      << tok.status();
  EXPECT_NE(tok.status().message().find("\\C"), std::string::npos) << tok.status();
  // The same pattern without \C loads and encodes a text ending inside "é" as a whole.
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "a.|";
  auto ok = FromJson(j);
  ASSERT_TRUE(ok.ok()) << ok.status();
  const std::string text = "x a\xC3\xA9";
  EXPECT_EQ((*ok)->Decode((*ok)->Encode(text)), text);
}

// opd-ctl tokenize / detokenize, when the CLI has been built next to this test.
TEST(TokenizerTest, CommandLineRoundTrip) {
  const fs::path ctl = fs::path(OPD_BINARY_DIR) / "ctl" / "opd-ctl";
  if (!fs::exists(ctl)) GTEST_SKIP() << ctl << " is not built";
  const fs::path dir = fs::path(OPD_BINARY_DIR) / "tokenizer_test_cli";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "in.jsonl") << json{{"text", "Hello world"}}.dump() << "\n"
                                  << json{{"text", "多行\n<think>x</think>\t😀"}}.dump() << "\n";
  const std::string base = ctl.string() + " tokenize --tokenizer " + kVocabDir + " --qwen3";
  const std::string cmd = base + " --json --input " + (dir / "in.jsonl").string() + " > " +
                          (dir / "ids.jsonl").string() + " && " + ctl.string() +
                          " detokenize --qwen3 --tokenizer " + kVocabDir + " --input " +
                          (dir / "ids.jsonl").string() + " > " + (dir / "out.jsonl").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const auto ids = ReadJsonLines((dir / "ids.jsonl").string());
  const auto texts = ReadJsonLines((dir / "out.jsonl").string());
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[0]["ids"], json({9707, 1879}));
  EXPECT_EQ(ids[1]["ids"].get<std::vector<int32_t>>(), Qwen3().Encode("多行\n<think>x</think>\t😀"));
  ASSERT_EQ(texts.size(), 2u);
  EXPECT_EQ(texts[1]["text"], "多行\n<think>x</think>\t😀");
  // Bad input is an error naming the line, not a crash.
  std::ofstream(dir / "bad.jsonl") << "{\"ids\": [1]}\n{\"ids\": \"x\"}\n";
  EXPECT_NE(std::system((ctl.string() + " detokenize --tokenizer " + kVocabDir + " --input " +
                         (dir / "bad.jsonl").string() + " > /dev/null 2>&1")
                            .c_str()),
            0);
  EXPECT_NE(std::system((base + " --no-such-flag 2>/dev/null").c_str()), 0);
}

// The fingerprint's hash on the FIPS 180-2 example messages, the million-'a' one fed in odd-sized
// pieces so that block boundaries fall inside Update calls.
TEST(Sha256Test, FipsVectors) {
  const auto digest = [](std::string_view s) {
    Sha256 h;
    h.Update(s);
    return h.HexDigest();
  };
  EXPECT_EQ(digest(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(digest("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(digest("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  Sha256 million;
  const std::string a(1000, 'a');
  for (size_t done = 0, piece = 1; done < 1000000; done += piece, piece = piece % 997 + 1)
    million.Update(a.data(), std::min(piece, 1000000 - done));
  EXPECT_EQ(million.HexDigest(),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

}  // namespace
}  // namespace lm
