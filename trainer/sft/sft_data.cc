#include "trainer/sft/sft_data.h"

#include <algorithm>

namespace trainer {

int64_t HostMicroBatch::max_id() const {
  int64_t m = -1;
  for (int64_t id : input_ids) m = std::max(m, id);
  for (int64_t id : targets) m = std::max(m, id);
  return m;
}

HostMicroBatch AssembleMicroBatch(const std::vector<lm::PackedSequence>& seqs, size_t begin,
                                  size_t end) {
  HostMicroBatch mb;
  mb.cu_seqlens.push_back(0);
  for (size_t s = begin; s < end; ++s) {
    const lm::PackedSequence& p = seqs[s];
    const int64_t offset = mb.tokens();
    for (int32_t d = 0; d < p.num_documents(); ++d) {
      const int32_t a = p.cu_seqlens[d], b = p.cu_seqlens[d + 1];
      for (int32_t t = a; t < b; ++t) {
        if (t > a && p.labels[t] != lm::kIgnoreIndex) {
          mb.rows.push_back(offset + t - 1);
          mb.targets.push_back(p.labels[t]);
        }
      }
      mb.cu_seqlens.push_back(offset + b);
    }
    mb.input_ids.insert(mb.input_ids.end(), p.input_ids.begin(), p.input_ids.end());
    mb.position_ids.insert(mb.position_ids.end(), p.position_ids.begin(), p.position_ids.end());
    ++mb.num_sequences;
  }
  return mb;
}

nlohmann::json DocumentsJson(const std::vector<lm::PackedSequence>& seqs, size_t begin,
                             size_t end) {
  nlohmann::json docs = nlohmann::json::array();
  for (size_t s = begin; s < end; ++s) {
    const lm::PackedSequence& p = seqs[s];
    for (int32_t d = 0; d < p.num_documents(); ++d) {
      const auto a = p.cu_seqlens[d], b = p.cu_seqlens[d + 1];
      docs.push_back(
          {{"ids", std::vector<int32_t>(p.input_ids.begin() + a, p.input_ids.begin() + b)},
           {"labels", std::vector<int32_t>(p.labels.begin() + a, p.labels.begin() + b)}});
    }
  }
  return docs;
}

absl::StatusOr<int64_t> CountPacks(lm::SftDataset& dataset, uint64_t draws) {
  const lm::DataCursor start = dataset.cursor();
  const size_t max_len = static_cast<size_t>(dataset.options().max_seq_len);
  int64_t packs = 0;
  size_t used = 0;  // tokens in the pack being filled
  // NextPacked's rule: a conversation that does not fit starts the next pack.
  for (uint64_t i = 0; i < draws; ++i) {
    const size_t len = dataset.NextConversation().ids.size();
    if (packs == 0 || used + len > max_len) {
      ++packs;
      used = 0;
    }
    used += len;
  }
  if (absl::Status s = dataset.Seek(start); !s.ok()) return s;
  return packs;
}

}  // namespace trainer
