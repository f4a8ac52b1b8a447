#include "lm/text/chat.h"

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"

namespace lm {

absl::StatusOr<std::vector<int32_t>> ChatFormat::StopIds(const Tokenizer& tokenizer) {
  ASSIGN_OR_RETURN(const int32_t im_end, tokenizer.TokenId("<|im_end|>"));
  std::vector<int32_t> ids = {im_end};
  if (auto eot = tokenizer.TokenId("<|endoftext|>"); eot.ok()) ids.push_back(*eot);
  return ids;
}

absl::StatusOr<ChatRenderer> ChatRenderer::Create(const Tokenizer& tokenizer, ChatFormat format) {
  ASSIGN_OR_RETURN(const int32_t im_start, tokenizer.TokenId("<|im_start|>"));
  ASSIGN_OR_RETURN(const int32_t im_end, tokenizer.TokenId("<|im_end|>"));
  if (!tokenizer.IsAdded(im_start) || !tokenizer.IsAdded(im_end))
    return absl::FailedPreconditionError("<|im_start|>/<|im_end|> are not added tokens");
  return ChatRenderer(tokenizer, std::move(format), im_start, im_end, tokenizer.Encode("\n"));
}

std::vector<const ChatMessage*> ChatRenderer::WithSystem(absl::Span<const ChatMessage> messages,
                                                         ChatMessage* default_system) const {
  std::vector<const ChatMessage*> out;
  out.reserve(messages.size() + 1);
  const bool has_system = !messages.empty() && messages[0].role == "system";
  if (!has_system && format_.default_system.has_value()) {
    *default_system = {"system", *format_.default_system};
    out.push_back(default_system);
  }
  for (const ChatMessage& m : messages) out.push_back(&m);
  return out;
}

void ChatRenderer::AppendMessage(const ChatMessage& m, RenderedChat* out) const {
  const bool trained = m.role == "assistant";
  out->ids.push_back(im_start_);
  out->loss_mask.push_back(0);
  // "role\ncontent" is one piece of text between two added tokens, tokenized as a whole (as in
  // the template's output). The header is ASCII and NFC cannot reach across its "\n", so the
  // content starts at the same offset in the normalised text.
  const TokenSpans spans = tokenizer_->EncodeWithSpans(absl::StrCat(m.role, "\n", m.content));
  const uint32_t content_begin = static_cast<uint32_t>(m.role.size() + 1);
  for (size_t i = 0; i < spans.ids.size(); ++i) {
    out->ids.push_back(spans.ids[i]);
    out->loss_mask.push_back(trained && spans.ends[i] > content_begin ? 1 : 0);
  }
  out->ids.push_back(im_end_);
  out->loss_mask.push_back(trained ? 1 : 0);
  out->ids.insert(out->ids.end(), newline_.begin(), newline_.end());
  out->loss_mask.insert(out->loss_mask.end(), newline_.size(), 0);
}

absl::StatusOr<RenderedChat> ChatRenderer::Render(absl::Span<const ChatMessage> messages) const {
  for (const ChatMessage& m : messages) {
    if (m.role.empty()) return absl::InvalidArgumentError("a message has an empty role");
  }
  ChatMessage default_system;
  RenderedChat out;
  for (const ChatMessage* m : WithSystem(messages, &default_system)) AppendMessage(*m, &out);
  return out;
}

absl::StatusOr<std::vector<int32_t>> ChatRenderer::RenderGenerationPrompt(
    absl::Span<const ChatMessage> messages) const {
  ASSIGN_OR_RETURN(RenderedChat chat, Render(messages));
  chat.ids.push_back(im_start_);
  for (int32_t id :
       tokenizer_->Encode(absl::StrCat("assistant\n", format_.generation_prompt_suffix)))
    chat.ids.push_back(id);
  return std::move(chat.ids);
}

std::string ChatRenderer::RenderText(absl::Span<const ChatMessage> messages,
                                     bool add_generation_prompt) const {
  ChatMessage default_system;
  std::string text;
  for (const ChatMessage* m : WithSystem(messages, &default_system))
    absl::StrAppend(&text, "<|im_start|>", m->role, "\n", m->content, "<|im_end|>\n");
  if (add_generation_prompt)
    absl::StrAppend(&text, "<|im_start|>assistant\n", format_.generation_prompt_suffix);
  return text;
}

}  // namespace lm
