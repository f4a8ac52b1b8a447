// opd-ctl eval --model DIR --prompts FILE [--teachers DIR[,DIR...]] [--samples N] ...
//
// Task accuracy of a model on prompts that carry an "answer": samples responses in-process (the
// rollout worker's sampler), decodes them and compares the trimmed text with the answer. With
// --teachers, also the mean per-token reverse KL of the model to each teacher on those samples:
// mean over sampled tokens of log p_model(y_t) - log p_teacher(y_t). Prints one JSON object.
#include <iostream>

#include <torch/torch.h>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "ctl/args.h"
#include "ctl/command.h"
#include "lm/data/prompt_dataset.h"
#include "lm/model/model.h"
#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "rollout/sampler.h"

namespace ctl {
namespace {

constexpr const char* kUsage =
    "usage: opd-ctl eval --model DIR --prompts FILE [--tokenizer DIR] [--teachers DIR,DIR]\n"
    "                    [--samples 1] [--temperature 1.0] [--max-new-tokens 32] [--seed 0] "
    "[--threads N]\n"
    "  --model DIR             the model evaluated (HF directory)\n"
    "  --prompts FILE          JSON lines of prompts with an \"answer\"\n"
    "  --tokenizer DIR         default: the model directory\n"
    "  --teachers DIR,DIR      also the per-token reverse KL to each of these models\n"
    "  --samples N             samples per prompt (1)\n"
    "  --temperature T         (1.0)\n"
    "  --max-new-tokens N      (32)\n"
    "  --seed S                sampling seed (0)\n"
    "  --threads N             compute threads (LibTorch's default)\n";

// Per-token reverse KL of the samples to `teacher`: mean of (model lp - teacher lp). The teacher
// scores the samples in packed batches of up to 256 sequences.
double ReverseKl(lm::CausalLM& teacher, const std::vector<lm::PromptExample>& prompts,
                 const std::vector<rollout::Sample>& samples) {
  torch::NoGradGuard no_grad;
  double sum = 0;
  int64_t n = 0;
  for (size_t begin = 0; begin < samples.size(); begin += 256) {
    const size_t end = std::min(samples.size(), begin + 256);
    std::vector<std::vector<int64_t>> seqs;
    for (size_t i = begin; i < end; ++i) {
      const auto& p = prompts[samples[i].prompt_index].prompt_ids;
      seqs.emplace_back(p.begin(), p.end());
      seqs.back().insert(seqs.back().end(), samples[i].tokens.begin(), samples[i].tokens.end());
    }
    auto lp = lm::SequenceLogprobs(teacher, lm::PackedBatch::FromSequences(seqs));
    const float* t = lp.data_ptr<float>();
    for (size_t i = begin; i < end; ++i) {
      // Entries of sequence i: L - 1 of them; its response tokens are the last |response|.
      const size_t len = seqs[i - begin].size(), r = samples[i].tokens.size();
      for (size_t j = 0; j < r; ++j) sum += samples[i].logprobs[j] - t[len - 1 - r + j];
      t += len - 1;
      n += static_cast<int64_t>(r);
    }
  }
  return n ? sum / static_cast<double>(n) : 0.0;
}

}  // namespace

int RunEval(const std::vector<std::string>& words) {
  Args args;
  const FlagSpec spec = {
      {"model", Kind::kString},         {"prompts", Kind::kString}, {"tokenizer", Kind::kString},
      {"teachers", Kind::kString},      {"samples", Kind::kInt64},  {"temperature", Kind::kNumber},
      {"max-new-tokens", Kind::kInt64}, {"seed", Kind::kUint64},    {"threads", Kind::kInt}};
  if (int rc = ParseCommandArgs("eval", words, spec, {"model", "prompts"}, kUsage, &args); rc >= 0)
    return rc;
  if (args.Int("threads", 0) > 0) torch::set_num_threads(args.Int("threads", 0));
  auto fail = [](const std::string& what, const absl::Status& s) {
    std::cerr << "opd-ctl eval: " << what << ": " << s.message() << "\n";
    return 1;
  };
  auto model = lm::LoadModel(args.Get("model"));
  if (!model.ok()) return fail("model", model.status());
  (*model)->eval();
  auto tokenizer = lm::Tokenizer::Load(args.Get("tokenizer", args.Get("model")));
  if (!tokenizer.ok()) return fail("tokenizer", tokenizer.status());
  lm::PromptDatasetOptions po;
  po.sources.push_back({"eval", {args.Get("prompts")}, 1.0});
  po.shuffle = false;
  po.drop_final_assistant = true;
  auto data = lm::PromptDataset::Load(**tokenizer, po);
  if (!data.ok()) return fail("prompts", data.status());
  const size_t n = (*data)->source_size(0);
  std::vector<lm::PromptExample> prompts = (*data)->NextBatch(n);

  rollout::SamplingParams sp;
  sp.samples_per_prompt = args.Int64("samples", 1);
  sp.temperature = args.Number("temperature", 1.0);
  sp.max_new_tokens = args.Int64("max-new-tokens", 32);
  sp.seed = args.Uint64("seed", 0);
  for (const char* stop : {"<|im_end|>", "<|endoftext|>"}) {
    if (auto id = (*tokenizer)->TokenId(stop); id.ok()) sp.stop_ids.push_back(*id);
  }
  std::vector<std::vector<int64_t>> ids;
  for (const auto& p : prompts) ids.emplace_back(p.prompt_ids.begin(), p.prompt_ids.end());
  std::vector<rollout::Sample> samples;
  torch::NoGradGuard no_grad;
  auto stats = rollout::SampleResponses(
      **model, ids, sp, [&](rollout::Sample s) { samples.push_back(std::move(s)); });
  if (!stats.ok()) return fail("sampling", stats.status());

  int64_t correct = 0, with_answer = 0, tokens = 0;
  for (const auto& s : samples) {
    tokens += static_cast<int64_t>(s.tokens.size());
    const auto& answer = prompts[s.prompt_index].answer;
    if (!answer) continue;
    ++with_answer;
    std::vector<int32_t> resp(s.tokens.begin(), s.tokens.end());
    const std::string text = (*tokenizer)->Decode(resp, /*skip_special=*/true);
    correct += absl::StripAsciiWhitespace(text) == absl::StripAsciiWhitespace(*answer);
  }
  nlohmann::json out = {
      {"model", args.Get("model")},
      {"prompts", prompts.size()},
      {"samples", samples.size()},
      {"accuracy", with_answer ? static_cast<double>(correct) / with_answer : 0.0},
      {"mean_response_tokens",
       samples.empty() ? 0.0 : static_cast<double>(tokens) / samples.size()},
      {"reverse_kl", nlohmann::json::object()}};
  if (args.Has("teachers")) {
    for (const std::string& dir :
         std::vector<std::string>(absl::StrSplit(args.Get("teachers"), ',', absl::SkipEmpty()))) {
      auto teacher = lm::LoadModel(dir);
      if (!teacher.ok()) return fail("teacher", teacher.status());
      (*teacher)->eval();
      out["reverse_kl"][dir] = ReverseKl(**teacher, prompts, samples);
    }
  }
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace ctl
