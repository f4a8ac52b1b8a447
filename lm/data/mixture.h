// Deterministic weighted mixture of data sources with a resumable cursor.
//
// Draw number `step` picks a source with probability weight / sum(weights) from a counter-based
// random number (a pure function of seed and step), and takes that source's next item in a
// per-epoch shuffled order (a pure function of seed, source and epoch). So the whole stream is a
// function of the seed, and a cursor of plain counters resumes it exactly where it stopped.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace lm {

// Where a data stream stands; small and serialisable (checkpoint it with the trainer state).
struct DataCursor {
  uint64_t step = 0;               // items drawn from the mixture so far
  std::vector<uint64_t> consumed;  // per source: items drawn from it (epoch = consumed / size)

  std::string ToJson() const;
  static absl::StatusOr<DataCursor> FromJson(std::string_view text);
  bool operator==(const DataCursor& o) const { return step == o.step && consumed == o.consumed; }
};

// Not thread-safe: a data stream has one reader.
class MixtureSampler {
 public:
  struct Draw {
    size_t source;
    size_t index;  // into the source's items
  };

  // `sizes[i]` > 0 items in source i, sampled with `weights[i]` > 0. Without `shuffle` each
  // source is read in file order (the mixture itself is still random across sources).
  static absl::StatusOr<MixtureSampler> Create(std::vector<size_t> sizes,
                                               std::vector<double> weights, uint64_t seed,
                                               bool shuffle);

  Draw Peek() const;  // the next item, not taken
  Draw Next();        // takes the next item

  const DataCursor& cursor() const { return cursor_; }
  // Continues from a cursor of this stream (same number of sources).
  absl::Status Seek(const DataCursor& cursor);
  uint64_t epoch(size_t source) const { return cursor_.consumed[source] / sizes_[source]; }

 private:
  MixtureSampler() = default;
  size_t PickSource(uint64_t step) const;
  size_t IndexIn(size_t source, uint64_t k) const;  // the k-th item drawn from `source`

  std::vector<size_t> sizes_;
  std::vector<double> cumulative_;  // normalised cumulative weights, last == 1
  uint64_t seed_ = 0;
  bool shuffle_ = true;
  DataCursor cursor_;
  // Shuffled order of each source for the epoch in perm_epoch_ (rebuilt when the epoch moves).
  mutable std::vector<std::vector<uint32_t>> perm_;
  mutable std::vector<uint64_t> perm_epoch_;
};

}  // namespace lm
