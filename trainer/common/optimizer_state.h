// The sharded optimizer's flat space and its checkpointed state: FlatLayout (the parameters in
// reverse model order), BucketSharding (how N ranks split it: buckets, and one piece of each bucket
// per rank), and OptimizerStateReader, which reads AdamW moments back as ranges of that space
// whatever world size and bucket size wrote them, and refuses moments no AdamW could have made:
//
//   optimizer.safetensors                 one rank: exp_avg.<name>, exp_avg_sq.<name>
//   optimizer-RRRRR-of-NNNNN.safetensors  N ranks: exp_avg, exp_avg_sq of the flat ranges listed in
//                                         the file's "ranges" metadata, concatenated (an older
//                                         format held one contiguous [begin, end); it still loads)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace trainer {

// The files and names of the stored moments (DistributedOptimizer::SaveState writes them).
inline constexpr char kOptimizerNamedFile[] = "optimizer.safetensors";
inline constexpr char kOptimizerShardFormat[] = "opd-adamw-ranges";
inline constexpr char kOptimizerContiguousShardFormat[] = "opd-adamw-zero1";  // read only
inline constexpr const char* kOptimizerMoments[] = {"exp_avg", "exp_avg_sq"};
// optimizer-RRRRR-of-NNNNN.safetensors
std::string OptimizerShardFileName(int rank, int world);

struct FlatLayout {
  struct Entry {
    std::string name;
    int64_t offset = 0, numel = 0;
    bool decay = false;
  };
  std::vector<Entry> entries;  // in flat order
  int64_t total = 0;

  // The parameters in `order` (their names: the order in which a backward produces their
  // gradients, GradientArrivalOrder in trainer/common/gradient_order.h), any it leaves out after
  // them; without `order`, the model's parameters last to first (nearly the backward's order).
  static FlatLayout Of(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                       const std::vector<std::string>& order = {});
  nlohmann::json ToJson() const;  // [[name, numel], ...] in flat order
  // The names and sizes ToJson wrote (no decay flags); DATA_LOSS when it is not such a list.
  static absl::StatusOr<FlatLayout> FromJson(const std::string& text);
};

// The older checkpoints' split: [begin, end) of `total` elements over `world` ranks in equal
// chunks of ceil(total / world) (the last ones shorter or empty).
struct Shard {
  int64_t begin = 0, end = 0, chunk = 0;
  static Shard Of(int64_t total, int world, int rank);
};

// How `world` ranks split the flat space: consecutive buckets of L elements (L the bucket size
// rounded up to a multiple of `world`; the last bucket shorter, padded up to a multiple of
// `world`), each cut into `world` equal pieces, rank r owning piece r of every bucket. A bucket is
// the unit of the gradients' reduce-scatter and of the weights' all-gather, so every collective's
// pieces are equal; a bucket may cut a parameter (the padding is only at the very end, so every
// parameter stays contiguous in the padded space [0, padded_total)). A rank's pieces, concatenated
// in bucket order, are its slice: its reduced gradients, masters and AdamW moments.
struct BucketSharding {
  struct Bucket {
    int64_t begin = 0, end = 0;          // flat range (end <= total); padded length piece * world
    int64_t piece = 0;                   // elements of each rank's piece
    int64_t slice_begin = 0;             // where this rank's piece sits in its slice
    int64_t own_begin = 0, own_end = 0;  // this rank's flat range (empty in the padding)
    int64_t padded_length(int world) const { return piece * world; }
  };
  std::vector<Bucket> buckets;
  int world = 1, rank = 0;
  int64_t total = 0, padded_total = 0, slice = 0;

  static BucketSharding Of(int64_t total, int64_t bucket_elements, int world, int rank);
  // The buckets that [begin, end) overlaps: [first, last].
  std::pair<size_t, size_t> BucketsOf(int64_t begin, int64_t end) const;
  // This rank's non-empty flat ranges, in order.
  std::vector<std::pair<int64_t, int64_t>> OwnedRanges() const;
  // Where flat element `x` (owned by this rank) sits in the slice.
  int64_t SliceOffset(size_t bucket, int64_t x) const {
    return buckets[bucket].slice_begin + (x - buckets[bucket].begin - rank * buckets[bucket].piece);
  }
};

// AdamW moments stored in a checkpoint, read back as ranges of the flat space whatever world size
// wrote them.
class OptimizerStateReader {
 public:
  // Opens optimizer.safetensors or the complete set of optimizer-*-of-*.safetensors in `dir`, and
  // checks that they were written for the parameters of `layout` (the same names and sizes, in
  // any flat order: ranges are translated by parameter) and cover them exactly once. Errors name
  // the file and what is wrong.
  static absl::StatusOr<std::unique_ptr<OptimizerStateReader>> Open(const std::string& dir,
                                                                    const FlatLayout& layout);
  virtual ~OptimizerStateReader() = default;
  // Copies moment `which` ("exp_avg" | "exp_avg_sq") over [begin, end) into `out` (fp32, CPU).
  // Values AdamW cannot have produced (NaN or infinite moments, a negative second moment: the
  // update would make the weights NaN) are DATA_LOSS naming the file, the stored tensor, the
  // parameter and the element; only the range read is checked (each rank checks its own).
  virtual absl::Status Read(const std::string& which, int64_t begin, int64_t end,
                            float* out) const = 0;
};

}  // namespace trainer
