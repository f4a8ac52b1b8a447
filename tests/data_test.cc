// SFT and prompt datasets: packing (boundaries, positions, labels), mixture proportions, seeded
// determinism, exact resumption from a cursor, malformed-line errors naming file:line, the
// skip-bad-lines count, over-long truncate/drop counts, and the Parquet converter end to end.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "lm/data/jsonl.h"
#include "lm/data/mixture.h"
#include "lm/data/prompt_dataset.h"
#include "lm/data/sft_dataset.h"
#include "nlohmann/json.hpp"
#include "tests/testing.h"

using testing_util::TestDir;

namespace lm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int32_t kImStart = 151644;

const Tokenizer& Tok() {
  static std::unique_ptr<Tokenizer> tok =
      *Tokenizer::Load(std::string(OPD_SOURCE_DIR) + "/../shared/tokenizers/qwen2");
  return *tok;
}

// A fresh directory per test.
std::string WriteLines(const fs::path& path, const std::vector<std::string>& lines) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& l : lines) out << l << "\n";
  return path.string();
}

std::string Chat(const std::string& user, const std::string& assistant) {
  return json{
      {"messages",
       {{{"role", "user"}, {"content", user}}, {{"role", "assistant"}, {"content", assistant}}}}}
      .dump();
}

// n conversations "question i" / "answer i" with a growing answer, so lengths differ.
std::string WriteChats(const fs::path& path, int n, const std::string& tag = "") {
  std::vector<std::string> lines;
  for (int i = 0; i < n; ++i)
    lines.push_back(Chat(tag + "question " + std::to_string(i),
                         tag + "answer " + std::string(static_cast<size_t>(i % 7) * 3, 'x')));
  return WriteLines(path, lines);
}

std::unique_ptr<SftDataset> LoadSft(SftDatasetOptions options) {
  auto ds = SftDataset::Load(Tok(), std::move(options));
  EXPECT_TRUE(ds.ok()) << ds.status();
  return ds.ok() ? std::move(*ds) : nullptr;
}

TEST(DataTest, PackingBoundariesPositionsAndLabels) {
  const fs::path dir = TestDir();
  SftDatasetOptions o;
  o.sources = {{"chats", {WriteChats(dir / "a.jsonl", 40)}, 1.0}};
  o.max_seq_len = 100;
  o.seed = 7;
  auto ds = LoadSft(o);
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->stats().conversations, 40);
  std::multiset<int64_t> seen;
  while (ds->cursor().step < 40) {
    const PackedSequence p = ds->NextPacked();
    ASSERT_LE(p.num_tokens(), 100);
    ASSERT_EQ(p.cu_seqlens.front(), 0);
    ASSERT_EQ(p.cu_seqlens.back(), p.num_tokens());
    ASSERT_EQ(static_cast<size_t>(p.num_documents()), p.samples.size());
    ASSERT_EQ(p.labels.size(), p.input_ids.size());
    ASSERT_EQ(p.position_ids.size(), p.input_ids.size());
    for (int b = 0; b < p.num_documents(); ++b) {
      const Conversation& c = ds->conversation(p.samples[b]);
      const int32_t begin = p.cu_seqlens[b], end = p.cu_seqlens[b + 1];
      ASSERT_EQ(end - begin, static_cast<int32_t>(c.ids.size()));  // never split
      EXPECT_EQ(p.input_ids[begin], kImStart);
      for (int32_t t = begin; t < end; ++t) {
        EXPECT_EQ(p.position_ids[t], t - begin);
        EXPECT_EQ(p.input_ids[t], c.ids[t - begin]);
        EXPECT_EQ(p.loss_mask[t], c.loss_mask[t - begin]);
        EXPECT_EQ(p.labels[t], p.loss_mask[t] ? p.input_ids[t] : kIgnoreIndex);
      }
      if (seen.size() < 40) seen.insert(p.samples[b].index);  // the first epoch's draws
    }
  }
  // One epoch: every conversation exactly once.
  EXPECT_EQ(seen.size(), 40u);
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 40u);
}

TEST(DataTest, PackingIsGreedyAndPaddingOptional) {
  const fs::path dir = TestDir();
  SftDatasetOptions o;
  o.sources = {{"chats", {WriteChats(dir / "a.jsonl", 30)}, 1.0}};
  o.max_seq_len = 128;
  o.pad_to_max_seq_len = true;
  auto ds = LoadSft(o);
  ASSERT_NE(ds, nullptr);
  std::vector<PackedSequence> packs;
  for (int i = 0; i < 10; ++i) packs.push_back(ds->NextPacked());
  for (size_t i = 0; i < packs.size(); ++i) {
    const PackedSequence& p = packs[i];
    EXPECT_EQ(p.num_tokens(), 128);
    // The padding is a document of its own: untrained, positions from 0.
    const int32_t real = p.cu_seqlens[p.samples.size()];
    if (real < 128) {
      ASSERT_EQ(p.num_documents(), static_cast<int>(p.samples.size()) + 1);
      EXPECT_EQ(p.position_ids[real], 0);
      for (int32_t t = real; t < 128; ++t) {
        EXPECT_EQ(p.loss_mask[t], 0);
        EXPECT_EQ(p.labels[t], kIgnoreIndex);
        EXPECT_EQ(p.input_ids[t], 151643);
      }
    }
    // Greedy: the first conversation of the next pack would not have fit in this one.
    if (i + 1 < packs.size()) {
      EXPECT_GT(real + ds->conversation(packs[i + 1].samples[0]).ids.size(), 128u);
    }
  }
}

TEST(DataTest, MixtureFollowsTheWeights) {
  const fs::path dir = TestDir();
  SftDatasetOptions o;
  o.sources = {{"a", {WriteChats(dir / "a.jsonl", 10, "a")}, 3.0},
               {"b", {WriteChats(dir / "b.jsonl", 25, "b")}, 1.0},
               {"c", {WriteChats(dir / "c.jsonl", 5, "c")}, 4.0}};
  o.max_seq_len = 256;
  auto ds = LoadSft(o);
  ASSERT_NE(ds, nullptr);
  std::map<int32_t, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    SampleRef ref;
    ds->NextConversation(&ref);
    ++counts[ref.source];
  }
  EXPECT_NEAR(counts[0] / double(n), 3.0 / 8, 0.01);
  EXPECT_NEAR(counts[1] / double(n), 1.0 / 8, 0.01);
  EXPECT_NEAR(counts[2] / double(n), 4.0 / 8, 0.01);
  // The cursor counts what each source gave (its epochs follow from it).
  EXPECT_EQ(ds->cursor().consumed[0], static_cast<uint64_t>(counts[0]));
  EXPECT_EQ(ds->cursor().step, static_cast<uint64_t>(n));
}

TEST(DataTest, ShuffleIsDeterministicFromTheSeed) {
  const fs::path dir = TestDir();
  SftDatasetOptions o;
  o.sources = {{"a", {WriteChats(dir / "a.jsonl", 50)}, 1.0},
               {"b", {WriteChats(dir / "b.jsonl", 20, "b")}, 1.0}};
  o.seed = 1234;
  const auto order = [&](uint64_t seed, bool shuffle) {
    SftDatasetOptions opt = o;
    opt.seed = seed;
    opt.shuffle = shuffle;
    auto ds = LoadSft(opt);
    std::vector<std::pair<int32_t, int64_t>> refs;
    for (int i = 0; i < 200; ++i) {
      SampleRef r;
      ds->NextConversation(&r);
      refs.emplace_back(r.source, r.index);
    }
    return refs;
  };
  EXPECT_EQ(order(1234, true), order(1234, true));
  EXPECT_NE(order(1234, true), order(1235, true));
  // Without shuffling each source is read in file order.
  int64_t expected_a = 0;
  for (const auto& [source, index] : order(1234, false)) {
    if (source == 0) {
      EXPECT_EQ(index, expected_a++ % 50);
    }
  }
}

TEST(DataTest, CursorResumesWithTheExactNextSamples) {
  const fs::path dir = TestDir();
  SftDatasetOptions o;
  o.sources = {{"a", {WriteChats(dir / "a.jsonl", 13)}, 2.0},
               {"b", {WriteChats(dir / "b.jsonl", 7, "b")}, 1.0}};
  o.max_seq_len = 160;
  o.seed = 99;
  auto first = LoadSft(o);
  ASSERT_NE(first, nullptr);
  for (int i = 0; i < 9; ++i) first->NextPacked();  // into the second epoch of both sources
  const std::string saved = first->cursor().ToJson();
  std::vector<PackedSequence> expected;
  for (int i = 0; i < 12; ++i) expected.push_back(first->NextPacked());

  auto resumed = LoadSft(o);  // a new job
  auto cursor = DataCursor::FromJson(saved);
  ASSERT_TRUE(cursor.ok()) << cursor.status();
  ASSERT_TRUE(resumed->Seek(*cursor).ok());
  for (const PackedSequence& want : expected) {
    const PackedSequence got = resumed->NextPacked();
    EXPECT_EQ(got.input_ids, want.input_ids);
    EXPECT_EQ(got.cu_seqlens, want.cu_seqlens);
    EXPECT_EQ(got.samples, want.samples);
  }
  EXPECT_EQ(resumed->cursor(), first->cursor());
  // A cursor from another stream is refused.
  DataCursor wrong = *cursor;
  wrong.consumed.push_back(0);
  EXPECT_FALSE(resumed->Seek(wrong).ok());
  EXPECT_FALSE(DataCursor::FromJson("{\"step\": 1}").ok());
}

// Writes a file whose line 3 is `bad` and checks the error names file:3 and `reason`.
void ExpectBadLine(const std::string& bad, const std::string& reason) {
  const fs::path dir = TestDir();
  const std::string file =
      WriteLines(dir / "bad.jsonl", {Chat("q1", "a1"), Chat("q2", "a2"), bad, Chat("q4", "a4")});
  SftDatasetOptions o;
  o.sources = {{"s", {file}, 1.0}};
  auto ds = SftDataset::Load(Tok(), o);
  ASSERT_FALSE(ds.ok()) << "accepted: " << bad;
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ds.status().message().find(file + ":3: "), std::string::npos) << ds.status();
  EXPECT_NE(ds.status().message().find(reason), std::string::npos) << ds.status();
  // With skip_bad_lines the line is skipped and counted, nothing else lost.
  o.skip_bad_lines = true;
  auto skipping = SftDataset::Load(Tok(), o);
  ASSERT_TRUE(skipping.ok()) << skipping.status();
  EXPECT_EQ((*skipping)->stats().lines.bad_skipped, 1);
  EXPECT_EQ((*skipping)->stats().conversations, 3);
}

TEST(DataTest, MalformedLinesNameFileAndLine) {
  ExpectBadLine("{\"messages\": [", "bad JSON");
  ExpectBadLine("[1, 2]", "not a JSON object");
  ExpectBadLine("{\"text\": \"hi\"}", "no \"messages\"");
  ExpectBadLine(
      R"({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]})",
      "'bot'");
  ExpectBadLine(
      R"({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]})",
      "content is empty");
  ExpectBadLine(
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  \n"}]})",
      "content is empty");
  ExpectBadLine(
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"}, {"role": "assistant", "content": "y"}]})",
      "system message after");
  ExpectBadLine(
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]})",
      "where 'assistant' must come");
  ExpectBadLine(R"({"messages": [{"role": "user", "content": "x"}]})", "expected 'assistant'");
  ExpectBadLine(
      R"({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]})",
      "not a string");
  ExpectBadLine("{\"messages\": [{\"role\": \"user\", \"content\": \"caf\xE9\"}]}",
                "invalid UTF-8");
  ExpectBadLine(R"({"messages": []})", "empty");
}

TEST(DataTest, SkippedAndBlankLinesAreCounted) {
  const fs::path dir = TestDir();
  const std::string file = WriteLines(
      dir / "mixed.jsonl", {Chat("q", "a"), "", "not json", "   ", Chat("q2", "a2"), "{}", "\xFF"});
  SftDatasetOptions o;
  o.sources = {{"s", {file}, 1.0}};
  o.skip_bad_lines = true;
  auto ds = LoadSft(o);
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->stats().lines.accepted, 2);
  EXPECT_EQ(ds->stats().lines.bad_skipped, 3);
  EXPECT_EQ(ds->stats().lines.blank, 2);
  EXPECT_NE(ds->stats().Summary().find("malformed lines skipped: 3"), std::string::npos);
  // A source with nothing usable is an error, not an empty stream.
  o.sources = {{"s", {WriteLines(dir / "none.jsonl", {"bad"})}, 1.0}};
  EXPECT_FALSE(SftDataset::Load(Tok(), o).ok());
}

// The stream form of ForEachJsonLine (what fuzz/jsonl_fuzzer drives) reads like the file form:
// every line counted once, a last line without "\n" included, errors naming label:line.
TEST(DataTest, JsonLinesFromAStreamNameTheLabel) {
  std::istringstream in(Chat("q", "a") + "\r\n\n{\"x\": 1}\n" + Chat("q2", "a2"));
  JsonlStats stats;
  int calls = 0;
  const auto fn = [&](const nlohmann::json& j) {
    ++calls;
    return j.contains("messages") ? absl::OkStatus() : absl::InvalidArgumentError("no messages");
  };
  EXPECT_TRUE(ForEachJsonLine(in, "mem.jsonl", /*skip_bad_lines=*/true, &stats, fn).ok());
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(stats.accepted, 2);
  EXPECT_EQ(stats.bad_skipped, 1);
  EXPECT_EQ(stats.blank, 1);
  std::istringstream again(Chat("q", "a") + "\n\n{\"x\": 1}\n");
  JsonlStats strict;
  const absl::Status s = ForEachJsonLine(again, "mem.jsonl", false, &strict, fn);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()), "mem.jsonl:3: no messages");
}

TEST(DataTest, OverlongConversationsAreTruncatedOrDropped) {
  const fs::path dir = TestDir();
  std::string long_answer;
  for (int i = 0; i < 200; ++i) long_answer += "word" + std::to_string(i) + " ";
  const std::string file = WriteLines(
      dir / "a.jsonl", {Chat("short", "ok"), Chat("long one", long_answer), Chat("s2", "ok2")});
  SftDatasetOptions o;
  o.sources = {{"s", {file}, 1.0}};
  o.max_seq_len = 64;
  o.shuffle = false;
  auto truncating = LoadSft(o);
  ASSERT_NE(truncating, nullptr);
  EXPECT_EQ(truncating->stats().truncated, 1);
  EXPECT_EQ(truncating->stats().dropped_overlong, 0);
  EXPECT_EQ(truncating->stats().conversations, 3);
  EXPECT_EQ(truncating->conversation({0, 1}).ids.size(), 64u);
  o.overlong = OverlongPolicy::kDrop;
  auto dropping = LoadSft(o);
  ASSERT_NE(dropping, nullptr);
  EXPECT_EQ(dropping->stats().dropped_overlong, 1);
  EXPECT_EQ(dropping->stats().truncated, 0);
  EXPECT_EQ(dropping->stats().conversations, 2);
  // A cut that leaves no assistant token is a drop, not a useless sample.
  o.overlong = OverlongPolicy::kTruncate;
  o.sources = {{"s", {WriteLines(dir / "b.jsonl", {Chat(long_answer, "a"), Chat("q", "a")})}, 1.0}};
  auto nothing_left = LoadSft(o);
  ASSERT_NE(nothing_left, nullptr);
  EXPECT_EQ(nothing_left->stats().dropped_overlong, 1);
}

TEST(DataTest, SourcesMayBeManyFilesOrADirectory) {
  const fs::path dir = TestDir();
  fs::create_directories(dir / "shards");
  WriteChats(dir / "shards" / "part-0.jsonl", 3);
  WriteChats(dir / "shards" / "part-1.jsonl", 4);
  WriteLines(dir / "shards" / "README.txt", {"not data"});
  SftDatasetOptions o;
  o.sources = {{"", {(dir / "shards").string(), WriteChats(dir / "extra.jsonl", 2)}, 1.0}};
  auto ds = LoadSft(o);
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->stats().conversations, 9);
  EXPECT_EQ(ds->options().sources[0].name, "shards");
  o.sources = {{"", {(dir / "missing").string()}, 1.0}};
  EXPECT_EQ(SftDataset::Load(Tok(), o).status().code(), absl::StatusCode::kNotFound);
}

TEST(DataTest, PromptDatasetCarriesDomainAndAnswer) {
  const fs::path dir = TestDir();
  const std::string file = WriteLines(
      dir / "p.jsonl",
      {R"({"prompt": "What is 6*7?", "domain": "math", "answer": 42})",
       R"({"prompt": "Name a color.", "system": "Be brief."})",
       R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Translate 'cat' to French."}], "domain": "translation", "answer": "chat"})",
       R"({"prompt": ")" + std::string(3000, 'z') + R"("})"});
  PromptDatasetOptions o;
  o.sources = {{"p", {file}, 1.0}};
  o.max_prompt_len = 512;
  o.shuffle = false;
  auto ds = PromptDataset::Load(Tok(), o);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->stats().prompts, 3);
  EXPECT_EQ((*ds)->stats().dropped_overlong, 1);
  const std::vector<PromptExample> batch = (*ds)->NextBatch(3);
  EXPECT_EQ(batch[0].domain, "math");
  EXPECT_EQ(batch[0].answer, std::optional<std::string>("42"));
  EXPECT_EQ(Tok().Decode(batch[0].prompt_ids),
            "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(batch[1].domain, "");
  EXPECT_FALSE(batch[1].answer.has_value());
  EXPECT_EQ(batch[1].messages.size(), 2u);
  EXPECT_EQ(batch[2].domain, "translation");
  EXPECT_EQ(batch[2].answer, std::optional<std::string>("chat"));
  const std::vector<int32_t> tail(batch[2].prompt_ids.end() - 3, batch[2].prompt_ids.end());
  EXPECT_EQ(tail, (std::vector<int32_t>{kImStart, 77091, 198}));
}

TEST(DataTest, PromptDatasetValidatesAndResumes) {
  const fs::path dir = TestDir();
  const std::string with_answer_turn = WriteLines(
      dir / "a.jsonl",
      {R"({"prompt": "p0"})",
       R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ref"}]})"});
  PromptDatasetOptions o;
  o.sources = {{"a", {with_answer_turn}, 1.0}};
  auto strict = PromptDataset::Load(Tok(), o);
  ASSERT_FALSE(strict.ok());
  EXPECT_NE(strict.status().message().find("a.jsonl:2: "), std::string::npos) << strict.status();
  o.drop_final_assistant = true;
  auto lenient = PromptDataset::Load(Tok(), o);
  ASSERT_TRUE(lenient.ok()) << lenient.status();
  EXPECT_EQ((*lenient)->stats().prompts, 2);

  for (const char* bad : {R"({"prompt": "x", "messages": []})", R"({"prompt": 3})",
                          R"({"prompt": "x", "domain": 1})", R"({"prompt": "x", "answer": [1]})"}) {
    o.sources = {{"b", {WriteLines(dir / "b.jsonl", {bad})}, 1.0}};
    auto ds = PromptDataset::Load(Tok(), o);
    EXPECT_FALSE(ds.ok()) << bad;
    EXPECT_NE(ds.status().message().find("b.jsonl:1: "), std::string::npos) << ds.status();
  }

  std::vector<std::string> lines;
  for (int i = 0; i < 17; ++i) lines.push_back(json{{"prompt", "p" + std::to_string(i)}}.dump());
  o.sources = {{"c", {WriteLines(dir / "c.jsonl", lines)}, 1.0}};
  o.seed = 5;
  auto a = *PromptDataset::Load(Tok(), o);
  a->NextBatch(23);
  const DataCursor saved = a->cursor();
  const auto want = a->NextBatch(20);
  auto b = *PromptDataset::Load(Tok(), o);
  ASSERT_TRUE(b->Seek(saved).ok());
  const auto got = b->NextBatch(20);
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_EQ(got[i].messages[0].content, want[i].messages[0].content);
}

TEST(DataTest, ParquetConverterFeedsTheReaders) {
  const fs::path dir = TestDir();
  const std::string script = std::string(OPD_SOURCE_DIR) + "/scripts/parquet_to_jsonl.py";
  const std::string py = std::string(OPD_PYTHON);
  if (std::system((py + " -c 'import pyarrow' 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "pyarrow is not installed in " << py;
  // Parquet files in three common shapes: a messages column, ShareGPT, prompt/response columns.
  const std::string make = py + " -c '" + R"(
import pyarrow as pa, pyarrow.parquet as pq, sys
d = sys.argv[1]
pq.write_table(pa.table({"messages": [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]],
    "id": [1, 2]}), d + "/chat.parquet")
pq.write_table(pa.table({"conversations": [
    [{"from": "human", "value": "Ping"}, {"from": "gpt", "value": "Pong"}]]}), d + "/sharegpt.parquet")
pq.write_table(pa.table({"question": ["What is 6*7?", "Capital of France?"],
    "answer": ["42", "Paris"], "topic": ["math", "geo"]}), d + "/qa.parquet")
)" + "' " + dir.string();
  ASSERT_EQ(std::system(make.c_str()), 0);
  const auto convert = [&](const std::string& args) {
    return std::system((py + " " + script + " " + args + " 2>/dev/null").c_str());
  };
  const std::string d = dir.string();
  ASSERT_EQ(convert(d + "/chat.parquet --out " + d + "/chat.jsonl"), 0);
  ASSERT_EQ(convert(d + "/sharegpt.parquet --messages-column conversations --out " + d +
                    "/sharegpt.jsonl"),
            0);
  ASSERT_EQ(convert(d + "/qa.parquet --prompt-column question --response-column answer --out " + d +
                    "/qa.jsonl"),
            0);
  ASSERT_EQ(convert(d +
                    "/qa.parquet --format prompt --prompt-column question --answer-column "
                    "answer --domain-column topic --out " +
                    d + "/prompts.jsonl"),
            0);
  EXPECT_NE(convert(d + "/qa.parquet --out " + d + "/none.jsonl"), 0);  // no messages column

  SftDatasetOptions o;
  o.sources = {{"chat", {d + "/chat.jsonl", d + "/sharegpt.jsonl", d + "/qa.jsonl"}, 1.0}};
  o.shuffle = false;
  auto sft = SftDataset::Load(Tok(), o);
  ASSERT_TRUE(sft.ok()) << sft.status();
  EXPECT_EQ((*sft)->stats().conversations, 5);
  EXPECT_EQ(Tok().Decode((*sft)->conversation({0, 2}).ids),
            "<|im_start|>user\nPing<|im_end|>\n<|im_start|>assistant\nPong<|im_end|>\n");
  PromptDatasetOptions p;
  p.sources = {{"qa", {d + "/prompts.jsonl"}, 1.0}};
  p.shuffle = false;
  auto prompts = PromptDataset::Load(Tok(), p);
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  const PromptExample& first = (*prompts)->Next();
  EXPECT_EQ(first.domain, "math");
  EXPECT_EQ(first.answer, std::optional<std::string>("42"));
  EXPECT_EQ(first.messages[0].content, "What is 6*7?");
}

}  // namespace
}  // namespace lm
