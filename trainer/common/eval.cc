#include "trainer/common/eval.h"

#include <algorithm>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "lm/model/model.h"
#include "lm/text/chat.h"

namespace trainer {
namespace {

// `status` with its message prefixed by `stage` ("sampling: ..."), the code kept.
absl::Status InStage(const char* stage, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(stage, ": ", status.message()));
}

bool Matches(const std::string& text, const std::string& answer) {
  return absl::StripAsciiWhitespace(text) == absl::StripAsciiWhitespace(answer);
}

}  // namespace

absl::StatusOr<EvalResult> SampleAndScore(lm::CausalLM& model, const lm::Tokenizer& tokenizer,
                                          const std::vector<lm::PromptExample>& prompts,
                                          const EvalSampling& sampling) {
  lm::SamplingParams sp;
  sp.samples_per_prompt = sampling.samples_per_prompt;
  sp.temperature = sampling.temperature;
  sp.max_new_tokens = sampling.max_new_tokens;
  sp.seed = sampling.seed;
  // The prompts were rendered in ChatML (PromptDataset), so <|im_end|> exists.
  auto stops = lm::ChatFormat::StopIds(tokenizer);
  if (!stops.ok()) return InStage("tokenizer", stops.status());
  sp.stop_ids = *std::move(stops);

  std::vector<std::vector<int32_t>> ids;
  for (const auto& p : prompts) ids.emplace_back(p.prompt_ids.begin(), p.prompt_ids.end());
  EvalResult result;
  result.prompts = prompts.size();
  torch::NoGradGuard no_grad;
  auto stats = lm::SampleResponses(model, ids, sp, [&](lm::Sample s) {
    s.domain = prompts[s.prompt_index].domain;
    result.responses.push_back({std::move(s), "", false});
  });
  if (!stats.ok()) return InStage("sampling", stats.status());

  int64_t correct = 0, with_answer = 0, tokens = 0;
  for (EvalResponse& r : result.responses) {
    tokens += r.sample.response_length();
    const auto response = r.sample.response();
    r.text = tokenizer.Decode(std::vector<int32_t>(response.begin(), response.end()),
                              /*skip_special=*/true);
    const auto& answer = prompts[r.sample.prompt_index].answer;
    if (!answer) continue;
    ++with_answer;
    r.correct = Matches(r.text, *answer);
    correct += r.correct;
  }
  result.samples = result.responses.size();
  result.accuracy = with_answer ? static_cast<double>(correct) / with_answer : 0.0;
  result.mean_response_tokens = result.samples ? static_cast<double>(tokens) / result.samples : 0.0;
  return result;
}

double ReverseKl(lm::CausalLM& teacher, const std::vector<EvalResponse>& responses) {
  constexpr size_t kBatch = 256;
  torch::NoGradGuard no_grad;
  double sum = 0;
  int64_t n = 0;
  for (size_t begin = 0; begin < responses.size(); begin += kBatch) {
    const size_t end = std::min(responses.size(), begin + kBatch);
    std::vector<std::vector<int64_t>> seqs;
    for (size_t i = begin; i < end; ++i) {
      const lm::Sample& s = responses[i].sample;
      seqs.emplace_back(s.tokens.begin(), s.tokens.end());
    }
    auto lp = lm::SequenceLogprobs(teacher, lm::PackedBatch::FromSequences(seqs));
    const float* t = lp.data_ptr<float>();
    for (size_t i = begin; i < end; ++i) {
      // Entries of sequence i: L - 1 of them; its response tokens are the last |response|.
      const lm::Sample& s = responses[i].sample;
      const size_t len = s.tokens.size(), r = static_cast<size_t>(s.response_length());
      for (size_t j = 0; j < r; ++j) sum += s.logprobs[j] - t[len - 1 - r + j];
      t += len - 1;
      n += static_cast<int64_t>(r);
    }
  }
  return n ? sum / static_cast<double>(n) : 0.0;
}

absl::StatusOr<EvalResult> Evaluate(
    lm::CausalLM& model, const lm::Tokenizer& tokenizer,
    const std::vector<lm::PromptExample>& prompts, const EvalSampling& sampling,
    const std::vector<std::pair<std::string, lm::CausalLM*>>& teachers) {
  auto result = SampleAndScore(model, tokenizer, prompts, sampling);
  if (!result.ok()) return result.status();
  for (const auto& [name, teacher] : teachers)
    result->reverse_kl.emplace_back(name, ReverseKl(*teacher, result->responses));
  return result;
}

absl::StatusOr<EvalResult> RunEvaluation(const EvalOptions& options) {
  auto model = lm::LoadModel(options.model);
  if (!model.ok()) return InStage("model", model.status());
  (*model)->eval();
  auto tokenizer =
      lm::Tokenizer::Load(options.tokenizer.empty() ? options.model : options.tokenizer);
  if (!tokenizer.ok()) return InStage("tokenizer", tokenizer.status());
  lm::PromptDatasetOptions po;
  po.sources.push_back({"eval", {options.prompts}, 1.0});
  po.shuffle = false;
  po.drop_final_assistant = true;
  auto data = lm::PromptDataset::Load(**tokenizer, po);
  if (!data.ok()) return InStage("prompts", data.status());
  const std::vector<lm::PromptExample> prompts = (*data)->NextBatch((*data)->source_size(0));

  auto result = SampleAndScore(**model, **tokenizer, prompts, options.sampling);
  if (!result.ok()) return result.status();
  for (const std::string& dir : options.teachers) {
    auto teacher = lm::LoadModel(dir);
    if (!teacher.ok()) return InStage("teacher", teacher.status());
    (*teacher)->eval();
    result->reverse_kl.emplace_back(dir, ReverseKl(**teacher, result->responses));
  }
  return result;
}

nlohmann::json EvalResultJson(const std::string& model, const EvalResult& result) {
  nlohmann::json kl = nlohmann::json::object();
  for (const auto& [name, value] : result.reverse_kl) kl[name] = value;
  return {{"model", model},
          {"prompts", result.prompts},
          {"samples", result.samples},
          {"accuracy", result.accuracy},
          {"mean_response_tokens", result.mean_response_tokens},
          {"reverse_kl", kl}};
}

}  // namespace trainer
