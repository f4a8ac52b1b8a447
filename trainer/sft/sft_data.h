// Host-side batching for SFT: packed sequences (lm/data/sft_dataset.h) grouped into micro-batches
// in the varlen layout the model consumes, with the rows the loss is computed on.
//
// Labels are not shifted in a PackedSequence: label[t] (the token itself where trained, else
// -100) is predicted from hidden row t-1 of the same document. Every document starts with an
// untrained <|im_start|>, so no prediction crosses a document boundary; a trained label at a
// document start would have no row to come from and is ignored.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/data/sft_dataset.h"
#include "nlohmann/json.hpp"

namespace trainer {

struct HostMicroBatch {
  std::vector<int64_t> input_ids;     // [T] the documents of all its sequences, concatenated
  std::vector<int64_t> position_ids;  // [T] restart at 0 per document
  std::vector<int64_t> cu_seqlens;    // [D+1] document boundaries
  std::vector<int64_t> rows;          // [N] hidden rows that predict a trained token
  std::vector<int64_t> targets;       // [N] that token
  int64_t num_sequences = 0;          // packed sequences in the micro-batch

  int64_t tokens() const { return static_cast<int64_t>(input_ids.size()); }
  int64_t trained() const { return static_cast<int64_t>(rows.size()); }
  int64_t max_id() const;  // largest input or target id (vocabulary check)
};

// Micro-batch from sequences [begin, end) of `seqs`.
HostMicroBatch AssembleMicroBatch(const std::vector<lm::PackedSequence>& seqs, size_t begin,
                                  size_t end);

// The documents of sequences [begin, end) as [{"ids": [...], "labels": [...]}, ...] (the debug
// dump the Python reference loop replays).
nlohmann::json DocumentsJson(const std::vector<lm::PackedSequence>& seqs, size_t begin, size_t end);

// How many packed sequences the stream yields while `draws` conversations are drawn from it:
// the packing is simulated on conversation lengths, then the stream is rewound.
absl::StatusOr<int64_t> CountPacks(lm::SftDataset& dataset, uint64_t draws);

}  // namespace trainer
