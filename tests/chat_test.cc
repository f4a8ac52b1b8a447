// ChatML rendering and the SFT loss mask against transformers' apply_chat_template
// (tests/python/chat_reference.py), for the Qwen3 format (no default system message) and the
// Qwen2 format (default system message), multi-turn, with and without a system message.
#include "lm/text/chat.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/byte_level.h"

namespace lm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kVocabDir = std::string(OPD_SOURCE_DIR) + "/../shared/tokenizers/qwen2";
const std::string kReference = std::string(OPD_BINARY_DIR) + "/chat_reference.json";

const json& Reference() {
  static const json cases = [] {
    const std::string dir = std::string(OPD_SOURCE_DIR) + "/tests/python/";
    std::error_code ec;
    const bool fresh =
        fs::exists(kReference) &&
        fs::last_write_time(kReference, ec) > fs::last_write_time(dir + "chat_reference.py", ec) &&
        fs::last_write_time(kReference, ec) >
            fs::last_write_time(dir + "tokenizer_reference.py", ec);
    if (!fresh) {
      const std::string cmd = std::string(OPD_PYTHON) + " " + dir +
                              "chat_reference.py --tokenizer " + kVocabDir + " --out " + kReference;
      EXPECT_EQ(std::system(cmd.c_str()), 0) << "chat_reference.py failed";
    }
    std::ifstream in(kReference);
    return in ? json::parse(in) : json::array();
  }();
  return cases;
}

const Tokenizer& Tok(const std::string& name) {
  static std::unique_ptr<Tokenizer> qwen2 = *Tokenizer::Load(kVocabDir);
  static std::unique_ptr<Tokenizer> qwen3 = *Tokenizer::Load(kVocabDir, TokenizerOptions::Qwen3());
  return name == "qwen3" ? *qwen3 : *qwen2;
}

std::vector<ChatMessage> Messages(const json& j) {
  std::vector<ChatMessage> out;
  for (const json& m : j) out.push_back({m["role"], m["content"]});
  return out;
}

ChatRenderer Renderer(const std::string& tokenizer, const std::string& format) {
  auto r = ChatRenderer::Create(Tok(tokenizer),
                                format == "qwen2" ? ChatFormat::Qwen2() : ChatFormat::Qwen3());
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

TEST(ChatTest, MatchesApplyChatTemplate) {
  ASSERT_GE(Reference().size(), 14u);
  for (const json& c : Reference()) {
    SCOPED_TRACE(c["name"].get<std::string>() + " / " + c["format"].get<std::string>());
    const ChatRenderer renderer = Renderer(c["tokenizer"], c["format"]);
    const auto messages = Messages(c["messages"]);
    auto chat = renderer.Render(messages);
    ASSERT_TRUE(chat.ok()) << chat.status();
    const auto want_ids = c["ids"].get<std::vector<int32_t>>();
    const auto want_mask = c["mask"].get<std::vector<uint8_t>>();
    ASSERT_EQ(chat->ids, want_ids);
    EXPECT_EQ(chat->loss_mask, want_mask);
    EXPECT_EQ(renderer.RenderText(messages, false), c["text"].get<std::string>());
    auto prompt = renderer.RenderGenerationPrompt(messages);
    ASSERT_TRUE(prompt.ok());
    EXPECT_EQ(*prompt, c["prompt_ids"].get<std::vector<int32_t>>());
    if (c.contains("config_ids")) {
      // The vocabulary's own Qwen2 template opens the assistant turn after every user turn.
      const bool ends_with_user = messages.back().role == "user";
      EXPECT_EQ(ends_with_user ? *prompt : chat->ids, c["config_ids"].get<std::vector<int32_t>>());
    }
  }
}

TEST(ChatTest, MaskCoversExactlyAssistantContentAndImEnd) {
  const Tokenizer& tok = Tok("qwen3");
  const ChatRenderer renderer = Renderer("qwen3", "qwen3");
  const std::vector<ChatMessage> messages = {{"system", "Be brief."},
                                             {"user", "Capital of France?"},
                                             {"assistant", "Paris."},
                                             {"user", "And of Japan?"},
                                             {"assistant", "Tokyo <think>x</think>."}};
  auto chat = renderer.Render(messages);
  ASSERT_TRUE(chat.ok());
  ASSERT_EQ(chat->ids.size(), chat->loss_mask.size());
  std::string trained;
  for (size_t i = 0; i < chat->ids.size(); ++i)
    if (chat->loss_mask[i]) trained += tok.Decode(std::vector<int32_t>{chat->ids[i]});
  EXPECT_EQ(trained, "Paris.<|im_end|>Tokyo <think>x</think>.<|im_end|>");
  EXPECT_EQ(tok.Decode(chat->ids), renderer.RenderText(messages, false));
}

TEST(ChatTest, DefaultSystemMessageIsAnOption) {
  const std::vector<ChatMessage> messages = {{"user", "Hi"}};
  EXPECT_EQ(Renderer("qwen2", "qwen3").RenderText(messages, true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(Renderer("qwen2", "qwen2").RenderText(messages, true),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // An explicit system message replaces the default.
  const std::vector<ChatMessage> with_system = {{"system", "S"}, {"user", "Hi"}};
  EXPECT_EQ(Renderer("qwen2", "qwen2").RenderText(with_system, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatTest, GenerationPromptSuffix) {
  ChatFormat format = ChatFormat::Qwen3();
  format.generation_prompt_suffix = "<think>\n\n</think>\n\n";
  auto renderer = ChatRenderer::Create(Tok("qwen3"), format);
  ASSERT_TRUE(renderer.ok());
  auto prompt = renderer->RenderGenerationPrompt(std::vector<ChatMessage>{{"user", "Hi"}});
  ASSERT_TRUE(prompt.ok());
  const std::vector<int32_t> tail(prompt->end() - 7, prompt->end());
  EXPECT_EQ(tail, (std::vector<int32_t>{151644, 77091, 198, 151667, 271, 151668, 271}));
}

TEST(ChatTest, Errors) {
  // A vocabulary without the ChatML tokens cannot render chats.
  const fs::path dir = fs::path(OPD_BINARY_DIR) / "chat_test_no_specials";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(kVocabDir + "/vocab.json", dir / "vocab.json");
  fs::copy_file(kVocabDir + "/merges.txt", dir / "merges.txt");
  auto bare = Tokenizer::Load(dir.string());
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_FALSE(ChatRenderer::Create(**bare).ok());
  const ChatRenderer renderer = Renderer("qwen3", "qwen3");
  EXPECT_FALSE(renderer.Render(std::vector<ChatMessage>{{"", "x"}}).ok());
  EXPECT_TRUE(renderer.Render(std::vector<ChatMessage>{}).ok());
}

// The stop list every sampler gets: <|im_end|> then <|endoftext|> where the tokenizer has it;
// without <|im_end|> the format cannot end a turn, which is an error naming the token.
TEST(ChatTest, StopIds) {
  const Tokenizer& qwen3 = Tok("qwen3");
  auto ids = ChatFormat::StopIds(qwen3);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids,
            (std::vector<int32_t>{*qwen3.TokenId("<|im_end|>"), *qwen3.TokenId("<|endoftext|>")}));
  EXPECT_EQ(*ids, (std::vector<int32_t>{151645, 151643}));

  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[testing_util::ByteLevelSpelling(b)] = b;
  const auto with_added = [&](const json& added) {
    const json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
                    {"added_tokens", added},
                    {"normalizer", nullptr},
                    {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}}};
    return *Tokenizer::FromTokenizerJson(j.dump(), "test/tokenizer.json");
  };
  const auto im_end_only =
      with_added({{{"id", 300}, {"content", "<|im_end|>"}, {"special", true}}});
  EXPECT_EQ(*ChatFormat::StopIds(*im_end_only), std::vector<int32_t>{300});
  const auto eot_only =
      with_added({{{"id", 300}, {"content", "<|endoftext|>"}, {"special", true}}});
  const auto missing = ChatFormat::StopIds(*eot_only);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("<|im_end|>"), std::string::npos) << missing.status();
}

}  // namespace
}  // namespace lm
