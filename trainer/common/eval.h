// Evaluation of a model on prompts that carry an "answer" (what `opd-ctl eval` prints):
//   - task accuracy: responses sampled in-process with the rollout worker's sampler, decoded
//     (special tokens skipped) and compared with the answer, both trimmed of ASCII whitespace;
//   - with teachers, the mean per-token reverse KL of the model to each teacher on those samples:
//     mean over sampled tokens of log p_model(y_t) - log p_teacher(y_t).
// Two layers: Evaluate on loaded models (for a job that holds them), RunEvaluation from files.
// Sampling is deterministic given the seed (see lm/generate/sampler.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/data/prompt_dataset.h"
#include "lm/generate/sampler.h"
#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace lm {
class CausalLM;
}  // namespace lm

namespace trainer {

struct EvalSampling {
  int64_t samples_per_prompt = 1;
  double temperature = 1.0;
  int64_t max_new_tokens = 32;
  uint64_t seed = 0;
};

// One sampled response, decoded.
struct EvalResponse {
  lm::Sample sample;     // the prompt and response, the model's log-probs, the prompt's domain
  std::string text;      // special tokens skipped
  bool correct = false;  // false too when the prompt has no answer
};

struct EvalResult {
  size_t prompts = 0;
  size_t samples = 0;
  double accuracy = 0;  // over the samples of prompts with an answer; 0 when there are none
  double mean_response_tokens = 0;
  std::vector<std::pair<std::string, double>> reverse_kl;  // teacher name -> KL, in given order
  std::vector<EvalResponse> responses;                     // in the order they finished
};

// Samples `prompts` from `model` (stopping at ChatFormat::StopIds) and scores the responses; no
// reverse KL yet. Errors are prefixed with the stage that failed ("sampling: ...").
absl::StatusOr<EvalResult> SampleAndScore(lm::CausalLM& model, const lm::Tokenizer& tokenizer,
                                          const std::vector<lm::PromptExample>& prompts,
                                          const EvalSampling& sampling);

// Mean per-token reverse KL of the responses to `teacher` (0 when there are no tokens). The
// teacher scores them in packed batches of up to 256 sequences.
double ReverseKl(lm::CausalLM& teacher, const std::vector<EvalResponse>& responses);

// SampleAndScore, then the reverse KL to each (name, model) of `teachers`.
absl::StatusOr<EvalResult> Evaluate(
    lm::CausalLM& model, const lm::Tokenizer& tokenizer,
    const std::vector<lm::PromptExample>& prompts, const EvalSampling& sampling,
    const std::vector<std::pair<std::string, lm::CausalLM*>>& teachers = {});

struct EvalOptions {
  std::string model;                  // HF model directory
  std::string prompts;                // JSON lines with an "answer"
  std::string tokenizer;              // "": the model directory
  std::vector<std::string> teachers;  // model directories; the KL is reported under each path
  EvalSampling sampling;
};

// Loads the model, tokenizer and prompts, samples, then loads one teacher at a time for its KL
// (never two in memory). Errors name the stage ("model: ...", "tokenizer: ...", "prompts: ...",
// "sampling: ...", "teacher: ...").
absl::StatusOr<EvalResult> RunEvaluation(const EvalOptions& options);

// The JSON object `opd-ctl eval` prints: model, prompts, samples, accuracy, mean_response_tokens,
// reverse_kl {teacher: KL}.
nlohmann::json EvalResultJson(const std::string& model, const EvalResult& result);

}  // namespace trainer
