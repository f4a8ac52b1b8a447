// ChatML, as the Qwen3 instruct models use it:
//
//   <|im_start|>{role}\n{content}<|im_end|>\n      for every message
//   <|im_start|>assistant\n                        the generation prompt
//
// Rendering goes straight to token ids, with the SFT loss mask: 1 exactly on the tokens of every
// assistant message's content and its closing <|im_end|>, 0 elsewhere (role headers, the "\n"
// after <|im_end|>, system and user turns). Ids equal what `transformers`' apply_chat_template +
// encode produce for the same template, and the mask equals its assistant-token mask for a
// `{% generation %}` template: a token holding both the header's "\n" and the start of the content
// (content that begins with "\n") counts as content, as it does there.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "lm/text/tokenizer.h"

namespace lm {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

struct ChatFormat {
  // Inserted as the first message when a conversation has no system message. Qwen3: none;
  // Qwen2 templates: "You are a helpful assistant." (see Qwen2()).
  std::optional<std::string> default_system;
  // Text appended after "<|im_start|>assistant\n" in generation prompts only, e.g.
  // "<think>\n\n</think>\n\n" to ask a Qwen3 model not to think.
  std::string generation_prompt_suffix;

  static ChatFormat Qwen3() { return {}; }
  static ChatFormat Qwen2() { return {std::string("You are a helpful assistant."), ""}; }

  // The ids that end a sampled assistant turn, the one list every sampler is given: <|im_end|>,
  // which closes every message in ChatML (an error when the tokenizer lacks it), then
  // <|endoftext|> when the tokenizer has it (a model may end a document that way). The same for
  // every format here, since they differ only in system message and generation prompt.
  static absl::StatusOr<std::vector<int32_t>> StopIds(const Tokenizer& tokenizer);
};

struct RenderedChat {
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss_mask;  // same length as ids
};

class ChatRenderer {
 public:
  // Fails when the tokenizer has no <|im_start|> / <|im_end|> tokens. `tokenizer` must outlive
  // the renderer.
  static absl::StatusOr<ChatRenderer> Create(const Tokenizer& tokenizer, ChatFormat format = {});

  // Every message, each closed by <|im_end|>\n, with the SFT loss mask. Messages need a
  // non-empty role; content is tokenized as HF does (added tokens inside it are matched).
  absl::StatusOr<RenderedChat> Render(absl::Span<const ChatMessage> messages) const;
  // The messages followed by "<|im_start|>assistant\n" (+ generation_prompt_suffix).
  absl::StatusOr<std::vector<int32_t>> RenderGenerationPrompt(
      absl::Span<const ChatMessage> messages) const;
  // The same conversation as text (what the template would print).
  std::string RenderText(absl::Span<const ChatMessage> messages, bool add_generation_prompt) const;

  const ChatFormat& format() const { return format_; }
  int32_t im_start_id() const { return im_start_; }
  int32_t im_end_id() const { return im_end_; }

 private:
  ChatRenderer(const Tokenizer& tokenizer, ChatFormat format, int32_t im_start, int32_t im_end,
               std::vector<int32_t> newline)
      : tokenizer_(&tokenizer),
        format_(std::move(format)),
        im_start_(im_start),
        im_end_(im_end),
        newline_(std::move(newline)) {}

  // The messages with the default system message inserted when the format asks for it.
  std::vector<const ChatMessage*> WithSystem(absl::Span<const ChatMessage> messages,
                                             ChatMessage* default_system) const;
  void AppendMessage(const ChatMessage& m, RenderedChat* out) const;

  const Tokenizer* tokenizer_;
  ChatFormat format_;
  int32_t im_start_;
  int32_t im_end_;
  std::vector<int32_t> newline_;  // tokens of "\n"
};

}  // namespace lm
