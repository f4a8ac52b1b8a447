#include "trainer/rollout_pool.h"

#include <future>

#include "absl/strings/str_cat.h"
#include "lm/util/log.h"
#include "rpc/tensor_codec.h"

namespace opd {

absl::StatusOr<std::unique_ptr<RolloutPool>> RolloutPool::Connect(
    const std::vector<std::string>& endpoints, const rpc::ClientOptions& base,
    const std::string& tokenizer_fingerprint, int64_t vocab_size) {
  if (endpoints.empty()) return absl::InvalidArgumentError("no rollout worker endpoints");
  auto pool = std::make_unique<RolloutPool>();
  for (const auto& ep : endpoints) {
    auto opts = base;
    opts.address = ep;
    auto client = rpc::RolloutClient::Create(opts);
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
    pool->clients_.push_back(std::move(*client));
  }
  return pool;
}

absl::StatusOr<std::vector<rpc::GeneratedSample>> RolloutPool::Generate(
    const std::vector<std::vector<int32_t>>& prompts, const rpc::GenerateOptions& opts) {
  const size_t n = prompts.size(), w = clients_.size();
  std::vector<std::future<absl::StatusOr<std::vector<rpc::GeneratedSample>>>> calls;
  std::vector<size_t> starts;
  for (size_t i = 0; i < w; ++i) {
    const size_t b = n * i / w, e = n * (i + 1) / w;
    if (b == e) continue;
    starts.push_back(b);
    rpc::GenerateOptions share_opts = opts;
    share_opts.seed = opts.seed * 1000003ULL + b;
    calls.push_back(std::async(std::launch::async, [this, i, b, e, share_opts, &prompts] {
      std::vector<std::vector<int32_t>> share(prompts.begin() + b, prompts.begin() + e);
      return clients_[i]->Generate(share, share_opts);
    }));
  }
  std::vector<rpc::GeneratedSample> out;
  for (size_t c = 0; c < calls.size(); ++c) {
    auto r = calls[c].get();
    if (!r.ok()) return r.status();
    for (auto& s : *r) {
      s.prompt_index += static_cast<int32_t>(starts[c]);
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

absl::Status RolloutPool::PushWeights(torch::nn::Module& model, int64_t version) {
  auto weights = rpc::WeightsOf(model);
  std::vector<std::future<absl::StatusOr<opd::v1::UpdateWeightsResponse>>> calls;
  for (auto& c : clients_) {
    calls.push_back(std::async(std::launch::async, [&c, &weights, version] {
      return c->UpdateWeights(version, weights.views);
    }));
  }
  absl::Status first_error;
  for (auto& f : calls) {
    auto r = f.get();
    if (!r.ok() && first_error.ok()) first_error = r.status();
  }
  return first_error;
}

}  // namespace opd
