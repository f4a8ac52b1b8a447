#include "lm/model/model.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/model/arch.h"
#include "lm/model/logprobs.h"

namespace lm {

PackedBatch PackedBatch::FromSequences(const std::vector<std::vector<int64_t>>& seqs) {
  PackedBatch b;
  std::vector<int64_t> ids, pos;
  b.cu_seqlens.push_back(0);
  for (const auto& s : seqs) {
    ids.insert(ids.end(), s.begin(), s.end());
    for (size_t i = 0; i < s.size(); ++i) pos.push_back(static_cast<int64_t>(i));
    b.cu_seqlens.push_back(static_cast<int64_t>(ids.size()));
  }
  b.input_ids = torch::tensor(ids, torch::kInt64);
  b.position_ids = torch::tensor(pos, torch::kInt64);
  return b;
}

PackedBatch PackedBatch::FromSpans(absl::Span<const absl::Span<const int32_t>> seqs) {
  PackedBatch b;
  b.cu_seqlens.reserve(seqs.size() + 1);
  b.cu_seqlens.push_back(0);
  for (const auto& s : seqs)
    b.cu_seqlens.push_back(b.cu_seqlens.back() + static_cast<int64_t>(s.size()));
  b.input_ids = torch::empty({b.num_tokens()}, torch::kInt64);
  b.position_ids = torch::empty({b.num_tokens()}, torch::kInt64);
  int64_t* ids = b.input_ids.data_ptr<int64_t>();
  int64_t* pos = b.position_ids.data_ptr<int64_t>();
  for (const auto& s : seqs) {
    for (size_t i = 0; i < s.size(); ++i) {
      *ids++ = s[i];
      *pos++ = static_cast<int64_t>(i);
    }
  }
  return b;
}

KVCache KVCache::RepeatInterleave(int64_t n) const {
  KVCache out;
  auto repeat = [n](const std::vector<torch::Tensor>& from, std::vector<torch::Tensor>& to) {
    for (const auto& t : from) to.push_back(t.repeat_interleave(n, 0));
  };
  repeat(k, out.k);
  repeat(v, out.v);
  repeat(conv, out.conv);
  repeat(recurrent, out.recurrent);
  for (int64_t len : lengths) out.lengths.insert(out.lengths.end(), n, len);
  return out;
}

KVCache KVCache::Select(const std::vector<int64_t>& slots) const {
  KVCache out;
  for (int64_t s : slots) out.lengths.push_back(lengths[s]);
  const torch::Tensor* any = !k.empty() ? &k[0] : !conv.empty() ? &conv[0] : nullptr;
  if (!any) return out;
  auto idx = torch::tensor(slots, torch::kInt64).to(any->device());
  auto select = [&idx](const std::vector<torch::Tensor>& from, std::vector<torch::Tensor>& to) {
    for (const auto& t : from) to.push_back(t.index_select(0, idx));
  };
  select(k, out.k);
  select(v, out.v);
  select(conv, out.conv);
  select(recurrent, out.recurrent);
  return out;
}

void CausalLM::AddLmHead(const Embedding& embed) {
  embed_tokens_ = embed;
  if (!config_.tie_word_embeddings)
    lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size));
}

std::vector<std::string> CausalLM::TiedAliases() const {
  if (config_.tie_word_embeddings) return {"lm_head.weight"};
  return {};
}

void CausalLM::InitWeights(double std, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& p : named_parameters()) {
    const auto& name = p.key();
    auto& t = p.value();
    const bool is_norm = name.find("norm") != std::string::npos && t.dim() == 1;
    if (is_norm) {
      // Zero-centred norms (Qwen3-Next) store w with scale 1 + w; its gated DeltaNet's output
      // norm is a plain one.
      const Architecture* arch = FindArchitecture(config_.model_type);
      const bool zero_centred = arch != nullptr && arch->hybrid_attention &&
                                name.find("linear_attn.norm") == std::string::npos;
      t.fill_(zero_centred ? 0.0 : 1.0);
    } else if (name.find("A_log") != std::string::npos) {
      // As transformers: A in [0.01, 16], so that log A stays finite.
      t.copy_(torch::empty(t.sizes()).uniform_(0.01, 16, gen).log());
    } else if (name.find("dt_bias") != std::string::npos) {
      t.fill_(1.0);
    } else {
      t.copy_(torch::empty(t.sizes()).normal_(0.0, std, gen));
    }
  }
}

absl::StatusOr<std::shared_ptr<CausalLM>> CreateModel(const ModelConfig& config) {
  const Architecture* arch = FindArchitecture(config.model_type);
  if (arch == nullptr)
    return absl::UnimplementedError(absl::StrCat("model_type '", config.model_type,
                                                 "' has no implementation (expected ",
                                                 KnownModelTypes(), ")"));
  return arch->create(config);
}

std::pair<torch::Tensor, torch::Tensor> NextTokenRows(const PackedBatch& batch) {
  std::vector<int64_t> rows;
  rows.reserve(batch.num_tokens());
  for (int64_t b = 0; b < batch.num_sequences(); ++b) {
    for (int64_t i = batch.cu_seqlens[b]; i + 1 < batch.cu_seqlens[b + 1]; ++i) rows.push_back(i);
  }
  auto r = torch::tensor(rows, torch::kInt64).to(batch.input_ids.device());
  return {r, batch.input_ids.index_select(0, r + 1)};
}

torch::Tensor SequenceLogprobs(CausalLM& model, const PackedBatch& batch, double temperature) {
  auto hidden = model.Forward(batch);
  auto [rows, targets] = NextTokenRows(batch);
  LogprobOptions opts;
  opts.temperature = temperature;
  return TokenLogprobs(hidden.index_select(0, rows), model.LmHeadWeight(), targets, opts);
}

}  // namespace lm
