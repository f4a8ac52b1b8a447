// JSONL reading: any input is a .jsonl file of chat conversations. Every line is accounted for
// (accepted, skipped as malformed, or blank); a malformed line without skip_bad_lines is an error
// naming file:line; accepted conversations render through ChatML with one mask entry per id.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>

#include "fuzz/fuzz_util.h"
#include "lm/data/jsonl.h"
#include "lm/text/chat.h"
#include "lm/text/tokenizer.h"
#include "spdlog/spdlog.h"

namespace {

const lm::Tokenizer* g_tokenizer = nullptr;

int64_t LineCount(const std::string& s) {
  int64_t n = 0;
  for (char c : s) n += c == '\n';
  return n + (!s.empty() && s.back() != '\n');
}

absl::Status Conversation(const nlohmann::json& row) {
  const auto messages = row.find("messages");
  if (messages == row.end()) return absl::InvalidArgumentError("no \"messages\"");
  auto chat = lm::ParseMessages(*messages, lm::FinalTurn::kAssistant);
  auto prompt = lm::ParseMessages(*messages, lm::FinalTurn::kUser);
  FUZZ_CHECK(!(chat.ok() && prompt.ok()), "a conversation cannot end with both roles");
  for (const lm::ChatFormat& format : {lm::ChatFormat::Qwen3(), lm::ChatFormat::Qwen2()}) {
    auto renderer = lm::ChatRenderer::Create(*g_tokenizer, format);
    FUZZ_CHECK(renderer.ok(), std::string(renderer.status().message()));
    if (chat.ok()) {
      auto rendered = renderer->Render(*chat);
      if (rendered.ok())
        FUZZ_CHECK(rendered->ids.size() == rendered->loss_mask.size(), "mask length");
      (void)renderer->RenderText(*chat, false);
    }
    if (prompt.ok()) {
      (void)renderer->RenderGenerationPrompt(*prompt);
      (void)renderer->RenderText(*prompt, true);
    }
  }
  return chat.ok() ? absl::OkStatus() : chat.status();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  auto tok = lm::Tokenizer::FromTokenizerJson(fuzz::TinyTokenizerJson(), "tiny");
  if (!tok.ok()) std::abort();
  g_tokenizer = tok->release();  // lives for the whole process
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const int64_t lines = LineCount(text);
  {
    std::istringstream in(text);
    lm::JsonlStats stats;
    const absl::Status s =
        lm::ForEachJsonLine(in, "fuzz.jsonl", /*skip_bad_lines=*/true, &stats, Conversation);
    FUZZ_CHECK(s.ok(), std::string(s.message()));
    FUZZ_CHECK(stats.accepted + stats.bad_skipped + stats.blank == lines, "a line unaccounted");
  }
  {
    std::istringstream in(text);
    lm::JsonlStats stats;
    const absl::Status s =
        lm::ForEachJsonLine(in, "fuzz.jsonl", /*skip_bad_lines=*/false, &stats, Conversation);
    if (s.ok()) {
      FUZZ_CHECK(stats.bad_skipped == 0 && stats.accepted + stats.blank == lines, "counts");
    } else {
      FUZZ_CHECK(absl::IsInvalidArgument(s), std::string(s.message()));
      fuzz::CheckNamed(s, "fuzz.jsonl:");
    }
  }
  return 0;
}
