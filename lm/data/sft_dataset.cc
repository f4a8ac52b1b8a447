#include "lm/data/sft_dataset.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace lm {
namespace {

using json = nlohmann::json;

// Applies the over-long policy and records the conversation (or its dropping) in `stats`.
void AddConversation(RenderedChat chat, const SftDatasetOptions& options,
                     std::vector<Conversation>* out, SftStats* stats) {
  const size_t max_len = static_cast<size_t>(options.max_seq_len);
  if (chat.ids.size() > max_len) {
    if (options.overlong == OverlongPolicy::kDrop) {
      ++stats->dropped_overlong;
      return;
    }
    chat.ids.resize(max_len);
    chat.loss_mask.resize(max_len);
    if (std::find(chat.loss_mask.begin(), chat.loss_mask.end(), 1) == chat.loss_mask.end()) {
      ++stats->dropped_overlong;  // the cut left nothing to train on
      return;
    }
    ++stats->truncated;
  }
  ++stats->conversations;
  stats->tokens += static_cast<int64_t>(chat.ids.size());
  stats->trained_tokens += std::count(chat.loss_mask.begin(), chat.loss_mask.end(), 1);
  out->push_back({std::move(chat.ids), std::move(chat.loss_mask)});
}

absl::Status ReadSource(const DataSource& source, const ChatRenderer& renderer,
                        const SftDatasetOptions& options, std::vector<Conversation>* out,
                        SftStats* stats) {
  ASSIGN_OR_RETURN(const std::vector<std::string> files, ExpandDataFiles(source.files));
  for (const std::string& file : files) {
    RETURN_IF_ERROR(ForEachJsonLine(
        file, options.skip_bad_lines, &stats->lines, [&](const json& line) -> absl::Status {
          const auto messages = line.find("messages");
          if (messages == line.end()) return absl::InvalidArgumentError("no \"messages\" key");
          ASSIGN_OR_RETURN(std::vector<ChatMessage> parsed,
                           ParseMessages(*messages, FinalTurn::kAssistant));
          ASSIGN_OR_RETURN(RenderedChat chat, renderer.Render(parsed));
          AddConversation(std::move(chat), options, out, stats);
          return absl::OkStatus();
        }));
  }
  return absl::OkStatus();
}

void AddStats(const SftStats& s, SftStats* total) {
  total->lines.Add(s.lines);
  total->conversations += s.conversations;
  total->truncated += s.truncated;
  total->dropped_overlong += s.dropped_overlong;
  total->tokens += s.tokens;
  total->trained_tokens += s.trained_tokens;
}

}  // namespace

std::string SftStats::Summary() const {
  return absl::StrCat(conversations, " conversations (", tokens, " tokens, ", trained_tokens,
                      " trained); over-long: ", truncated, " truncated, ", dropped_overlong,
                      " dropped; malformed lines skipped: ", lines.bad_skipped,
                      "; blank lines: ", lines.blank);
}

absl::StatusOr<std::unique_ptr<SftDataset>> SftDataset::Load(const Tokenizer& tokenizer,
                                                             SftDatasetOptions options) {
  RETURN_IF_ERROR(NormalizeSources(&options.sources));
  if (options.max_seq_len < 8)
    return absl::InvalidArgumentError(absl::StrCat("max_seq_len ", options.max_seq_len, " < 8"));
  ASSIGN_OR_RETURN(const ChatRenderer renderer,
                   ChatRenderer::Create(tokenizer, options.chat_format));
  int32_t pad_id = 0;
  if (options.pad_id.has_value()) {
    pad_id = *options.pad_id;
  } else {
    ASSIGN_OR_RETURN(pad_id, tokenizer.TokenId("<|endoftext|>"));
  }

  std::vector<std::vector<Conversation>> sources(options.sources.size());
  std::vector<SftStats> source_stats(options.sources.size());
  SftStats total;
  std::vector<size_t> sizes;
  std::vector<double> weights;
  for (size_t i = 0; i < options.sources.size(); ++i) {
    const DataSource& source = options.sources[i];
    RETURN_IF_ERROR(ReadSource(source, renderer, options, &sources[i], &source_stats[i]));
    spdlog::info("sft source '{}' (weight {}): {}", source.name, source.weight,
                 source_stats[i].Summary());
    if (sources[i].empty())
      return absl::InvalidArgumentError(
          absl::StrCat("sft source '", source.name, "' has no usable conversation"));
    AddStats(source_stats[i], &total);
    sizes.push_back(sources[i].size());
    weights.push_back(source.weight);
  }
  ASSIGN_OR_RETURN(MixtureSampler sampler,
                   MixtureSampler::Create(sizes, weights, options.seed, options.shuffle));
  std::unique_ptr<SftDataset> ds(new SftDataset(std::move(options), std::move(sampler)));
  ds->pad_id_ = pad_id;
  ds->sources_ = std::move(sources);
  ds->stats_ = total;
  ds->source_stats_ = std::move(source_stats);
  return ds;
}

const Conversation& SftDataset::NextConversation(SampleRef* ref) {
  const MixtureSampler::Draw d = sampler_.Next();
  if (ref != nullptr) *ref = {static_cast<int32_t>(d.source), static_cast<int64_t>(d.index)};
  return sources_[d.source][d.index];
}

PackedSequence SftDataset::NextPacked() {
  PackedSequence p;
  const size_t max_len = static_cast<size_t>(options_.max_seq_len);
  p.cu_seqlens.push_back(0);
  for (;;) {
    // Peek first: a conversation that does not fit stays in the stream (and in the cursor) for
    // the next pack, so a resumed job packs exactly as an uninterrupted one.
    const MixtureSampler::Draw d = sampler_.Peek();
    const Conversation& c = sources_[d.source][d.index];
    if (!p.input_ids.empty() && p.input_ids.size() + c.ids.size() > max_len) break;
    sampler_.Next();
    p.samples.push_back({static_cast<int32_t>(d.source), static_cast<int64_t>(d.index)});
    for (size_t t = 0; t < c.ids.size(); ++t) {
      p.input_ids.push_back(c.ids[t]);
      p.loss_mask.push_back(c.loss_mask[t]);
      p.labels.push_back(c.loss_mask[t] ? c.ids[t] : kIgnoreIndex);
      p.position_ids.push_back(static_cast<int32_t>(t));
    }
    p.cu_seqlens.push_back(static_cast<int32_t>(p.input_ids.size()));
  }
  if (options_.pad_to_max_seq_len && p.input_ids.size() < max_len) {
    const size_t pad = max_len - p.input_ids.size();
    p.input_ids.insert(p.input_ids.end(), pad, pad_id_);
    p.loss_mask.insert(p.loss_mask.end(), pad, 0);
    p.labels.insert(p.labels.end(), pad, kIgnoreIndex);
    for (size_t t = 0; t < pad; ++t) p.position_ids.push_back(static_cast<int32_t>(t));
    p.cu_seqlens.push_back(static_cast<int32_t>(max_len));
  }
  return p;
}

}  // namespace lm
