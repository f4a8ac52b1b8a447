// OPD prompts: conversations without the final assistant turn, rendered with the generation
// prompt, drawn from a weighted mixture in a seeded, resumable order.
//
// Input lines, either
//   {"messages": [{"role": "system|user|assistant", "content": "..."}, ...]}   ending with a user
//   {"prompt": "...", "system": "..."}                                        ("system" optional)
// plus optional "domain" (a string, carried along) and "answer" (a string or a number, carried
// along for tasks whose answers can be checked). Other keys are ignored.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/data/jsonl.h"
#include "lm/data/mixture.h"
#include "lm/text/chat.h"
#include "lm/text/tokenizer.h"

namespace lm {

struct PromptDatasetOptions {
  std::vector<DataSource> sources;
  // Prompts longer than this (in tokens, generation prompt included) are dropped and counted.
  int32_t max_prompt_len = 2048;
  bool skip_bad_lines = false;
  bool shuffle = true;
  uint64_t seed = 0;
  ChatFormat chat_format;
  // A conversation ending with an assistant turn (a reference answer) has that turn removed;
  // otherwise it is a malformed line.
  bool drop_final_assistant = false;
};

struct PromptExample {
  std::vector<int32_t> prompt_ids;  // ends with "<|im_start|>assistant\n"
  std::vector<ChatMessage> messages;
  std::string domain;                 // "" when the line has none
  std::optional<std::string> answer;  // numbers are kept as their JSON text
  int32_t source = 0;
  int64_t index = 0;  // among the source's usable prompts
};

struct PromptStats {
  JsonlStats lines;
  int64_t prompts = 0;           // usable
  int64_t dropped_overlong = 0;  // longer than max_prompt_len
  std::string Summary() const;
};

class PromptDataset {
 public:
  static absl::StatusOr<std::unique_ptr<PromptDataset>> Load(const Tokenizer& tokenizer,
                                                             PromptDatasetOptions options);

  const PromptExample& Next();
  std::vector<PromptExample> NextBatch(size_t n);

  const DataCursor& cursor() const { return sampler_.cursor(); }
  absl::Status Seek(const DataCursor& cursor) { return sampler_.Seek(cursor); }

  const PromptStats& stats() const { return stats_; }
  size_t num_sources() const { return sources_.size(); }
  size_t source_size(size_t source) const { return sources_[source].size(); }

 private:
  PromptDataset(PromptDatasetOptions options, MixtureSampler sampler) noexcept
      : options_(std::move(options)), sampler_(std::move(sampler)) {}

  PromptDatasetOptions options_;
  MixtureSampler sampler_;
  std::vector<std::vector<PromptExample>> sources_;
  PromptStats stats_;
};

}  // namespace lm
