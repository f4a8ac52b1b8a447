#include "lm/data/prompt_dataset.h"

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace lm {
namespace {

using json = nlohmann::json;

// The messages of a prompt line, in either accepted form.
absl::StatusOr<std::vector<ChatMessage>> PromptMessages(const json& line,
                                                        bool drop_final_assistant) {
  const auto messages = line.find("messages");
  const auto prompt = line.find("prompt");
  if ((messages == line.end()) == (prompt == line.end()))
    return absl::InvalidArgumentError("need exactly one of \"messages\" and \"prompt\"");
  if (prompt != line.end()) {
    if (!prompt->is_string()) return absl::InvalidArgumentError("\"prompt\" is not a string");
    json converted = json::array();
    if (const auto system = line.find("system"); system != line.end()) {
      if (!system->is_string()) return absl::InvalidArgumentError("\"system\" is not a string");
      converted.push_back({{"role", "system"}, {"content", *system}});
    }
    converted.push_back({{"role", "user"}, {"content", *prompt}});
    return ParseMessages(converted, FinalTurn::kUser);
  }
  json trimmed = *messages;
  if (drop_final_assistant && trimmed.is_array() && !trimmed.empty() &&
      trimmed.back().is_object() && trimmed.back().value("role", "") == "assistant")
    trimmed.erase(trimmed.size() - 1);
  return ParseMessages(trimmed, FinalTurn::kUser);
}

// Reads the optional "domain" and "answer" fields.
absl::Status ReadTags(const json& line, PromptExample* ex) {
  if (const auto domain = line.find("domain"); domain != line.end()) {
    if (!domain->is_string()) return absl::InvalidArgumentError("\"domain\" is not a string");
    ex->domain = domain->get<std::string>();
  }
  if (const auto answer = line.find("answer"); answer != line.end() && !answer->is_null()) {
    if (answer->is_string()) {
      ex->answer = answer->get<std::string>();
    } else if (answer->is_number()) {
      ex->answer = answer->dump();
    } else {
      return absl::InvalidArgumentError("\"answer\" is not a string or a number");
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string PromptStats::Summary() const {
  return absl::StrCat(prompts, " prompts; over-long dropped: ", dropped_overlong,
                      "; malformed lines skipped: ", lines.bad_skipped,
                      "; blank lines: ", lines.blank);
}

absl::StatusOr<std::unique_ptr<PromptDataset>> PromptDataset::Load(const Tokenizer& tokenizer,
                                                                   PromptDatasetOptions options) {
  RETURN_IF_ERROR(NormalizeSources(&options.sources));
  if (options.max_prompt_len < 1) return absl::InvalidArgumentError("max_prompt_len < 1");
  ASSIGN_OR_RETURN(const ChatRenderer renderer,
                   ChatRenderer::Create(tokenizer, options.chat_format));
  std::vector<std::vector<PromptExample>> sources(options.sources.size());
  PromptStats total;
  std::vector<size_t> sizes;
  std::vector<double> weights;
  for (size_t i = 0; i < options.sources.size(); ++i) {
    const DataSource& source = options.sources[i];
    PromptStats stats;
    ASSIGN_OR_RETURN(const std::vector<std::string> files, ExpandDataFiles(source.files));
    for (const std::string& file : files) {
      RETURN_IF_ERROR(ForEachJsonLine(
          file, options.skip_bad_lines, &stats.lines, [&](const json& line) -> absl::Status {
            PromptExample ex;
            ASSIGN_OR_RETURN(ex.messages, PromptMessages(line, options.drop_final_assistant));
            RETURN_IF_ERROR(ReadTags(line, &ex));
            ASSIGN_OR_RETURN(ex.prompt_ids, renderer.RenderGenerationPrompt(ex.messages));
            if (ex.prompt_ids.size() > static_cast<size_t>(options.max_prompt_len)) {
              ++stats.dropped_overlong;
              return absl::OkStatus();
            }
            ex.source = static_cast<int32_t>(i);
            ex.index = static_cast<int64_t>(sources[i].size());
            sources[i].push_back(std::move(ex));
            ++stats.prompts;
            return absl::OkStatus();
          }));
    }
    spdlog::info("prompt source '{}' (weight {}): {}", source.name, source.weight, stats.Summary());
    if (sources[i].empty())
      return absl::InvalidArgumentError(
          absl::StrCat("prompt source '", source.name, "' has no usable prompt"));
    total.lines.Add(stats.lines);
    total.prompts += stats.prompts;
    total.dropped_overlong += stats.dropped_overlong;
    sizes.push_back(sources[i].size());
    weights.push_back(source.weight);
  }
  ASSIGN_OR_RETURN(MixtureSampler sampler,
                   MixtureSampler::Create(sizes, weights, options.seed, options.shuffle));
  std::unique_ptr<PromptDataset> ds(new PromptDataset(std::move(options), std::move(sampler)));
  ds->sources_ = std::move(sources);
  ds->stats_ = total;
  return ds;
}

const PromptExample& PromptDataset::Next() {
  const MixtureSampler::Draw d = sampler_.Next();
  return sources_[d.source][d.index];
}

std::vector<PromptExample> PromptDataset::NextBatch(size_t n) {
  std::vector<PromptExample> batch;
  batch.reserve(n);
  for (size_t i = 0; i < n; ++i) batch.push_back(Next());
  return batch;
}

}  // namespace lm
