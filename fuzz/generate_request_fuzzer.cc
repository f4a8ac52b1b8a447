// Rollout Generate requests: any byte string is a serialized opd.v1.GenerateRequest as the
// rollout worker receives it. JobFromRequest must carry it over with the proto's defaults (seed
// indices included), and Validate must refuse it with INVALID_ARGUMENT or accept only what the
// sampler and the engine may run on: prompts of in-vocabulary ids that leave room for
// max_new_tokens, a temperature it can divide by, filters inside their ranges, non-negative seed
// indices. There is no summed KV budget (the generators queue the sequences through their
// cache), so the size of the request's KV cache never decides.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_util.h"
#include "lm/util/limits.h"
#include "opd/v1/rollout.pb.h"
#include "rollout/generate_request.h"

namespace {

using lm::SamplingParams;
using rollout::GenerateJob;
using rollout::GenerateLimits;

// Small limits, so that short inputs reach every bound.
GenerateLimits Limits() {
  GenerateLimits l;
  l.vocab_size = 1000;
  l.max_seq_len = 64;
  l.max_samples_per_prompt = 8;
  l.max_slots = 32;
  return l;
}

bool SameFloat(double a, double b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

void CheckCarriedOver(const opd::v1::GenerateRequest& req, const GenerateJob& job) {
  FUZZ_CHECK(job.prompts.size() == static_cast<size_t>(req.prompts_size()), "prompts");
  for (int i = 0; i < req.prompts_size(); ++i) {
    const auto& t = req.prompts(i).tokens();
    FUZZ_CHECK(job.prompts[i] == std::vector<int32_t>(t.begin(), t.end()),
               absl::StrCat("prompt ", i));
  }
  const auto& m = req.params();
  const SamplingParams& p = job.params;
  FUZZ_CHECK(p.samples_per_prompt == (req.samples_per_prompt() == 0 ? 1 : req.samples_per_prompt()),
             "samples_per_prompt");
  FUZZ_CHECK(SameFloat(p.temperature, m.has_temperature() ? m.temperature() : 1.0), "temperature");
  FUZZ_CHECK(SameFloat(p.top_p, m.top_p() == 0 ? 1.0 : m.top_p()), "top_p");
  FUZZ_CHECK(p.top_k == m.top_k() && p.max_new_tokens == m.max_new_tokens(), "top_k, max_new");
  FUZZ_CHECK(
      p.stop_ids == std::vector<int32_t>(m.stop_token_ids().begin(), m.stop_token_ids().end()),
      "stop ids");
  FUZZ_CHECK(static_cast<uint64_t>(p.seed) == m.seed() && p.return_routing == req.return_routing(),
             "seed, routing");
  bool seeded = false;
  for (const auto& pr : req.prompts()) seeded |= pr.has_seed_index();
  FUZZ_CHECK(p.seed_indices.size() == (seeded ? job.prompts.size() : 0), "seed indices");
  for (int i = 0; seeded && i < req.prompts_size(); ++i) {
    const auto& pr = req.prompts(i);
    FUZZ_CHECK(p.seed_indices[i] == (pr.has_seed_index() ? pr.seed_index() : i),
               absl::StrCat("seed index of prompt ", i));
  }
}

// What the sampler and the engine rely on for every accepted request.
void CheckRunnable(const GenerateJob& job, const GenerateLimits& l) {
  const SamplingParams& p = job.params;
  const int64_t prompts = static_cast<int64_t>(job.prompts.size());
  FUZZ_CHECK(prompts >= 1, "no prompts");
  FUZZ_CHECK(p.samples_per_prompt >= 1 && p.samples_per_prompt <= l.max_samples_per_prompt,
             absl::StrCat("samples_per_prompt ", p.samples_per_prompt));
  FUZZ_CHECK(prompts * p.samples_per_prompt <= l.max_slots, "slots");
  FUZZ_CHECK(p.temperature == 0 ||
                 (std::isfinite(p.temperature) &&
                  static_cast<float>(p.temperature) >= static_cast<float>(lm::kMinTemperature)),
             absl::StrCat("temperature ", p.temperature));
  FUZZ_CHECK(p.top_k >= 0 && p.top_k <= l.vocab_size, absl::StrCat("top_k ", p.top_k));
  FUZZ_CHECK(p.top_p >= 0 && p.top_p <= 1, absl::StrCat("top_p ", p.top_p));
  FUZZ_CHECK(p.max_new_tokens >= 1, absl::StrCat("max_new_tokens ", p.max_new_tokens));
  for (int64_t id : p.stop_ids)
    FUZZ_CHECK(id >= 0 && id < l.vocab_size, absl::StrCat("stop id ", id));
  FUZZ_CHECK(p.seed_indices.empty() || p.seed_indices.size() == job.prompts.size(),
             "seed index count");
  for (size_t i = 0; i < job.prompts.size(); ++i) {
    const auto& s = job.prompts[i];
    const int64_t len = static_cast<int64_t>(s.size());
    FUZZ_CHECK(len >= 1 && len + p.max_new_tokens <= l.max_seq_len,
               absl::StrCat("prompt ", i, ": ", len, " tokens"));
    for (int64_t id : s) FUZZ_CHECK(id >= 0 && id < l.vocab_size, absl::StrCat("prompt ", i));
    FUZZ_CHECK(p.SeedIndex(static_cast<int64_t>(i)) >= 0, absl::StrCat("seed index ", i));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  opd::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  const GenerateJob job = rollout::JobFromRequest(req);
  CheckCarriedOver(req, job);
  const GenerateLimits limits = Limits();
  const absl::Status st = rollout::Validate(job.prompts, job.params, limits);
  if (st.ok()) {
    CheckRunnable(job, limits);
    return 0;
  }
  FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument, st.ToString());
  FUZZ_CHECK(!st.message().empty(), "an error without a message");
  return 0;
}
