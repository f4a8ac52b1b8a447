#include "trainer/opd/rollout_pool.h"

#include <cmath>
#include <future>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rpc/tensor_codec.h"
#include "rpc/weight_wire.h"

namespace trainer {
namespace {

constexpr float kLogprobSlack = 1e-3f;  // a log-prob is <= 0, up to rounding

}  // namespace

WeightPushOptions PushOptionsOf(const OpdRolloutConfig& r) {
  WeightPushOptions o;
  o.mode = r.weight_sync;
  o.store_host = r.weight_sync_host;
  o.group_timeout = absl::Seconds(r.weight_sync_timeout_s);
  o.bucket_bytes = r.weight_sync_bucket_mb << 20;
  return o;
}

SampleStats SummarizeSamples(const std::vector<lm::Sample>& samples, int64_t learner_version) {
  SampleStats st;
  if (samples.empty()) return st;
  double lag_sum = 0, truncated = 0;
  for (const auto& s : samples) {
    const double lag = static_cast<double>(learner_version - s.weight_version);
    lag_sum += lag;
    st.staleness_max = std::max(st.staleness_max, lag);
    truncated += s.finish == lm::FinishReason::kLength;
  }
  const double n = static_cast<double>(samples.size());
  st.staleness_mean = lag_sum / n;
  st.truncated_frac = truncated / n;
  return st;
}

absl::StatusOr<std::unique_ptr<RolloutPool>> RolloutPool::Connect(
    const std::vector<std::string>& endpoints, const opd::rpc::ClientOptions& base,
    const std::string& tokenizer_fingerprint, int64_t vocab_size, const WeightPushOptions& push,
    torch::Device learner_device) {
  if (endpoints.empty()) return absl::InvalidArgumentError("no rollout worker endpoints");
  auto pool = std::make_unique<RolloutPool>();
  pool->vocab_size_ = vocab_size;
  for (const auto& ep : endpoints) {
    auto opts = base;
    opts.address = ep;
    auto client = opd::rpc::RolloutClient::Create(opts);
    if (!client.ok()) return client.status();
    auto info = (*client)->Info();
    if (!info.ok()) return info.status();
    if (info->vocab_size() != vocab_size) {
      return absl::FailedPreconditionError(
          absl::StrCat("rollout worker ", ep, " serves vocabulary size ", info->vocab_size(),
                       ", the student has ", vocab_size));
    }
    if (!tokenizer_fingerprint.empty() && info->tokenizer_fingerprint() != "none" &&
        info->tokenizer_fingerprint() != tokenizer_fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rollout worker ", ep, " has tokenizer fingerprint ", info->tokenizer_fingerprint(),
          ", the student's is ", tokenizer_fingerprint));
    }
    ASSIGN_OR_RETURN(auto pusher, WeightPusher::Connect(opts, *info, push, learner_device));
    pool->clients_.push_back(std::move(*client));
    pool->pushers_.push_back(std::move(pusher));
  }
  return pool;
}

absl::Status RolloutPool::CheckShare(const std::vector<lm::Sample>& samples, size_t prompts,
                                     int32_t samples_per_prompt, int64_t min_version,
                                     int64_t max_version, const std::string& address) const {
  auto bad = [&](size_t i, const std::string& what) {
    return absl::DataLossError(absl::StrCat("rollout worker ", address,
                                            " sent an invalid sample (#", i, " of its ",
                                            samples.size(), "): ", what));
  };
  std::set<std::pair<int64_t, int64_t>> seen;
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    // prompt_index is in range: the client rebuilt the sample's prompt from it.
    if (s.sample_index < 0 || s.sample_index >= samples_per_prompt)
      return bad(i, absl::StrCat("sample_index ", s.sample_index, " is outside [0, ",
                                 samples_per_prompt, ")"));
    if (!seen.emplace(s.prompt_index, s.sample_index).second)
      return bad(i, absl::StrCat("(prompt_index ", s.prompt_index, ", sample_index ",
                                 s.sample_index, ") is duplicated"));
    const absl::Span<const int32_t> response = s.response();  // the prompt is ours
    if (response.empty()) return bad(i, "tokens is empty");
    for (size_t t = 0; t < response.size(); ++t) {
      if (response[t] < 0 || response[t] >= vocab_size_)
        return bad(i, absl::StrCat("tokens[", t, "] = ", response[t],
                                   " is outside the vocabulary [0, ", vocab_size_, ")"));
    }
    if (s.logprobs.size() != response.size())
      return bad(i, absl::StrCat("logprobs has ", s.logprobs.size(), " entries for ",
                                 response.size(), " tokens"));
    for (size_t t = 0; t < s.logprobs.size(); ++t) {
      if (!std::isfinite(s.logprobs[t]) || s.logprobs[t] > kLogprobSlack)
        return bad(
            i, absl::StrCat("logprobs[", t, "] = ", s.logprobs[t], " is not a log-probability"));
    }
    if (min_version >= 0 && (s.weight_version < min_version || s.weight_version > max_version))
      return bad(i, absl::StrCat("weight_version ", s.weight_version, " is not in [", min_version,
                                 ", ", max_version, "] (the versions pushed to it)"));
  }
  const size_t expected = prompts * static_cast<size_t>(samples_per_prompt);
  if (samples.size() != expected) {
    return absl::DataLossError(absl::StrCat("rollout worker ", address, " sent ", samples.size(),
                                            " samples for ", prompts, " prompts x ",
                                            samples_per_prompt, " samples"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<lm::Sample>> RolloutPool::Generate(
    const std::vector<std::vector<int32_t>>& prompts, const opd::rpc::GenerateOptions& opts) {
  const size_t n = prompts.size(), w = clients_.size();
  const int32_t spp = std::max(opts.samples_per_prompt, 1);
  const int64_t min_version = acked_version_.load();
  std::vector<std::future<absl::StatusOr<std::vector<lm::Sample>>>> calls;
  std::vector<std::pair<size_t, size_t>> ranges;
  std::vector<size_t> worker;
  for (size_t i = 0; i < w; ++i) {
    const size_t b = n * i / w, e = n * (i + 1) / w;
    if (b == e) continue;
    ranges.emplace_back(b, e);
    worker.push_back(i);
    opd::rpc::GenerateOptions share_opts = opts;
    share_opts.seed = opts.seed * 1000003ULL + b;
    calls.push_back(std::async(std::launch::async, [this, i, b, e, share_opts, &prompts] {
      std::vector<std::vector<int32_t>> share(prompts.begin() + b, prompts.begin() + e);
      return clients_[i]->Generate(share, share_opts);
    }));
  }
  // Every call is collected before returning, so none outlives this function.
  std::vector<absl::StatusOr<std::vector<lm::Sample>>> results;
  for (auto& c : calls) results.push_back(c.get());
  const int64_t max_version = sent_version_.load();
  std::vector<lm::Sample> out;
  for (size_t c = 0; c < results.size(); ++c) {
    if (!results[c].ok()) return results[c].status();
    const auto [b, e] = ranges[c];
    RETURN_IF_ERROR(CheckShare(*results[c], e - b, spp, min_version, max_version,
                               clients_[worker[c]]->address()));
    for (auto& s : *results[c]) {
      s.prompt_index += static_cast<int64_t>(b);
      out.push_back(std::move(s));
    }
  }
  return out;
}

absl::StatusOr<int64_t> RolloutPool::MaxWeightVersion() {
  int64_t v = 0;
  for (auto& c : clients_) {
    auto info = c->Info();
    if (!info.ok()) return info.status();
    v = std::max<int64_t>(v, info->weight_version());
  }
  return v;
}

void RolloutPool::RecordPush(int64_t version, bool acknowledged) {
  sent_version_.store(std::max(sent_version_.load(), version));
  if (acknowledged) acked_version_.store(version);
}

absl::Status RolloutPool::PushWeights(torch::nn::Module& model, int64_t version) {
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : model.named_parameters()) params.emplace_back(p.key(), p.value());
  // The wire form (and its checksums) once per dtype the workers serve, not once per worker.
  std::map<torch::Dtype, std::vector<opd::rpc::WireTensor>> wire;
  torch::Tensor staging = torch::empty({int64_t{16} << 20}, torch::kUInt8);
  for (const auto& p : pushers_) {
    auto [it, added] = wire.try_emplace(p->wire_dtype());
    if (!added) continue;
    it->second = opd::rpc::WireTensorsOf(params, p->wire_dtype());
    opd::rpc::ComputeChecksums(&it->second, staging);
  }
  sent_version_.store(std::max(sent_version_.load(), version));
  std::vector<std::future<absl::StatusOr<PushReport>>> calls;
  for (auto& p : pushers_) {
    const auto& tensors = wire.at(p->wire_dtype());
    calls.push_back(std::async(std::launch::async,
                               [&p, &tensors, version] { return p->Push(tensors, version); }));
  }
  absl::Status first_error;
  last_push_.assign(calls.size(), PushReport{});
  for (size_t i = 0; i < calls.size(); ++i) {
    auto r = calls[i].get();
    if (r.ok()) {
      last_push_[i] = *r;
      continue;
    }
    if (first_error.ok()) {
      first_error =
          absl::Status(r.status().code(),
                       absl::StrCat("weight push of version ", version, " to rollout worker ",
                                    clients_[i]->address(), " failed: ", r.status().message()));
    }
  }
  if (first_error.ok()) acked_version_.store(version);
  return first_error;
}

}  // namespace trainer
