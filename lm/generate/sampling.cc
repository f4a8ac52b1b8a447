#include "lm/generate/sampling.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "lm/util/bytes.h"

namespace lm {
namespace {

// The first bytes of encoded samples and their format's version: bytes of another kind (or of a
// format this build does not read) fail by name instead of decoding into nonsense.
constexpr uint32_t kMagic = 0x5344504f;  // "OPDS"
constexpr uint32_t kFormat = 1;

// Where a decoded sample's shape is wrong, or "" when it is whole.
std::string ShapeError(const Sample& s) {
  const int64_t n = static_cast<int64_t>(s.tokens.size());
  if (s.response_start < 0 || s.response_start > n)
    return absl::StrCat("response_start ", s.response_start, " is outside [0, ", n, "]");
  if (static_cast<int64_t>(s.logprobs.size()) != s.response_length())
    return absl::StrCat(s.logprobs.size(), " log-probs for ", s.response_length(),
                        " response tokens");
  if (s.finish != FinishReason::kStop && s.finish != FinishReason::kLength)
    return absl::StrCat("finish reason ", static_cast<int32_t>(s.finish));
  const int64_t routing = std::max<int64_t>(n - 1, 0) * s.routing_layers * s.routing_top_k;
  if (!s.routed_experts.empty() && static_cast<int64_t>(s.routed_experts.size()) != routing)
    return absl::StrCat(s.routed_experts.size(), " routed experts for ", n - 1, " positions x ",
                        s.routing_layers, " layers x top_k ", s.routing_top_k);
  return "";
}

}  // namespace

std::string EncodeSamples(const std::vector<Sample>& samples) {
  ByteWriter out;
  out.Put(kMagic);
  out.Put(kFormat);
  out.Put<uint64_t>(samples.size());
  for (const Sample& s : samples) {
    out.Put(s.prompt_index);
    out.Put(s.sample_index);
    out.Put(s.response_start);
    out.Put(s.weight_version);
    out.Put(static_cast<int32_t>(s.finish));
    out.PutVector(s.tokens);
    out.PutVector(s.logprobs);
    out.PutString(s.domain);
    out.Put(s.routing_layers);
    out.Put(s.routing_top_k);
    out.PutVector(s.routed_experts);
  }
  return out.Take();
}

absl::StatusOr<std::vector<Sample>> DecodeSamples(std::string_view bytes) {
  ByteReader in(bytes);
  uint32_t magic = 0, format = 0;
  uint64_t n = 0;
  if (!in.Get(&magic) || !in.Get(&format))
    return absl::DataLossError(
        absl::StrCat("encoded samples are truncated (", bytes.size(), " bytes, no header)"));
  if (magic != kMagic || format != kFormat)
    return absl::FailedPreconditionError(
        absl::StrCat("not samples of format ", kFormat, " (", bytes.size(),
                     " bytes): written by another build, or not samples at all"));
  in.Get(&n);
  std::vector<Sample> out;
  for (uint64_t i = 0; in.ok() && i < n; ++i) {
    Sample s;
    int32_t finish = 0;
    std::string_view domain;
    if (in.Get(&s.prompt_index) && in.Get(&s.sample_index) && in.Get(&s.response_start) &&
        in.Get(&s.weight_version) && in.Get(&finish) && in.GetVector(&s.tokens) &&
        in.GetVector(&s.logprobs) && in.GetString(&domain) && in.Get(&s.routing_layers) &&
        in.Get(&s.routing_top_k) && in.GetVector(&s.routed_experts)) {
      s.finish = static_cast<FinishReason>(finish);
      s.domain = std::string(domain);
      if (std::string e = ShapeError(s); !e.empty())
        return absl::DataLossError(absl::StrCat("encoded sample ", i, ": ", e));
      out.push_back(std::move(s));
    }
  }
  if (!in.done())
    return absl::DataLossError(absl::StrCat("encoded samples are truncated or malformed (",
                                            bytes.size(), " bytes, ", out.size(), " of ", n,
                                            " samples read)"));
  return out;
}

}  // namespace lm
