#include "rollout/generate_request.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "lm/util/limits.h"
#include "opd/v1/rollout.pb.h"

namespace rollout {

absl::Status Validate(const std::vector<std::vector<int32_t>>& prompts, const lm::SamplingParams& p,
                      const GenerateLimits& limits) {
  if (prompts.empty()) return absl::InvalidArgumentError("no prompts");
  if (p.samples_per_prompt < 1 || p.samples_per_prompt > limits.max_samples_per_prompt) {
    return absl::InvalidArgumentError(absl::StrCat("samples_per_prompt ", p.samples_per_prompt,
                                                   " is outside [1, ",
                                                   limits.max_samples_per_prompt, "]"));
  }
  if (static_cast<int64_t>(prompts.size()) * p.samples_per_prompt > limits.max_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        prompts.size(), " prompts x ", p.samples_per_prompt, " samples is more than the ",
        limits.max_slots, " sequences one request may decode"));
  }
  // Compared as the float it travels as, so that a client's float(1e-4) passes.
  if (!(p.temperature == 0 ||
        static_cast<float>(p.temperature) >= static_cast<float>(lm::kMinTemperature)) ||
      !std::isfinite(p.temperature)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature must be 0 (greedy) or finite and at least ", lm::kMinTemperature,
        " (below it logits / temperature overflow fp32 into NaN log-probs), got ", p.temperature));
  }
  if (p.top_k < 0 || p.top_k > limits.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k ", p.top_k, " is outside [0, ", limits.vocab_size, "]"));
  }
  if (!(p.top_p >= 0 && p.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p ", p.top_p, " is outside [0, 1]"));
  }
  if (p.max_new_tokens < 1 || p.max_new_tokens > limits.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens ", p.max_new_tokens,
                                                   " is outside [1, ", limits.max_seq_len, "]"));
  }
  for (int64_t id : p.stop_ids) {
    if (id < 0 || id >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop token id ", id, " is outside the vocabulary [0, ", limits.vocab_size, ")"));
    }
  }
  if (!p.seed_indices.empty() && p.seed_indices.size() != prompts.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(p.seed_indices.size(), " seed indices for ", prompts.size(), " prompts"));
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& s = prompts[i];
    if (s.empty()) return absl::InvalidArgumentError(absl::StrCat("prompt ", i, ": empty"));
    if (p.SeedIndex(static_cast<int64_t>(i)) < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt ", i, ": seed_index ", p.SeedIndex(static_cast<int64_t>(i)), " is negative"));
    }
    const int64_t len = static_cast<int64_t>(s.size());
    if (len + p.max_new_tokens > limits.max_seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt ", i, ": ", len, " tokens + max_new_tokens ", p.max_new_tokens,
                       " exceed the maximum sequence length ", limits.max_seq_len));
    }
    for (int64_t j = 0; j < len; ++j) {
      if (s[j] < 0 || s[j] >= limits.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompt ", i, ": token id ", s[j], " at position ", j,
                         " is outside the vocabulary [0, ", limits.vocab_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

GenerateJob JobFromRequest(const opd::v1::GenerateRequest& req) {
  GenerateJob job;
  job.prompts.reserve(req.prompts_size());
  bool seeded = false;
  for (const auto& p : req.prompts()) {
    job.prompts.emplace_back(p.tokens().begin(), p.tokens().end());
    seeded |= p.has_seed_index();
  }
  if (seeded) {
    for (int i = 0; i < req.prompts_size(); ++i) {
      const auto& p = req.prompts(i);
      job.params.seed_indices.push_back(p.has_seed_index() ? p.seed_index() : i);
    }
  }
  const auto& m = req.params();
  lm::SamplingParams& p = job.params;
  p.samples_per_prompt = req.samples_per_prompt() == 0 ? 1 : req.samples_per_prompt();
  p.temperature = m.has_temperature() ? m.temperature() : 1.0;
  p.top_k = m.top_k();
  p.top_p = m.top_p() == 0 ? 1.0 : m.top_p();
  p.max_new_tokens = m.max_new_tokens();
  p.stop_ids.assign(m.stop_token_ids().begin(), m.stop_token_ids().end());
  p.seed = static_cast<int64_t>(m.seed());  // the same bits
  p.return_routing = req.return_routing();
  return job;
}

}  // namespace rollout
