// The ZeRO-1 optimizer's flat space and its checkpointed state: FlatLayout (the parameters in
// reverse model order), Shard (one rank's contiguous slice of it), and OptimizerStateReader, which
// reads AdamW moments back as ranges of that space whatever world size wrote them:
//
//   optimizer.safetensors                 one rank: exp_avg.<name>, exp_avg_sq.<name>
//   optimizer-RRRRR-of-NNNNN.safetensors  N ranks: exp_avg, exp_avg_sq of [begin, end)
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
inline constexpr char kOptimizerShardFormat[] = "opd-adamw-zero1";
inline constexpr const char* kOptimizerMoments[] = {"exp_avg", "exp_avg_sq"};
// optimizer-RRRRR-of-NNNNN.safetensors
std::string OptimizerShardFileName(int rank, int world);

struct FlatLayout {
  struct Entry {
    std::string name;
    int64_t offset = 0, numel = 0;
    bool decay = false;
  };
  std::vector<Entry> entries;  // in flat order: the model's parameters last to first
  int64_t total = 0;

  static FlatLayout Of(const std::vector<std::pair<std::string, torch::Tensor>>& params);
  nlohmann::json ToJson() const;  // [[name, numel], ...] in flat order
};

// This rank's part [begin, end) of a flat space of `total` elements split over `world` ranks in
// equal chunks of ceil(total / world) (the last ones shorter or empty).
struct Shard {
  int64_t begin = 0, end = 0, chunk = 0;
  static Shard Of(int64_t total, int world, int rank);
};

// AdamW moments stored in a checkpoint, read back as ranges of the flat space whatever world size
// wrote them.
class OptimizerStateReader {
 public:
  // Opens optimizer.safetensors or the complete set of optimizer-*-of-*.safetensors in `dir`, and
  // checks that they were written for `layout`. Errors name the file and what is wrong.
  static absl::StatusOr<std::unique_ptr<OptimizerStateReader>> Open(const std::string& dir,
                                                                    const FlatLayout& layout);
  virtual ~OptimizerStateReader() = default;
  // Copies moment `which` ("exp_avg" | "exp_avg_sq") over [begin, end) into `out` (fp32, CPU).
  virtual absl::Status Read(const std::string& which, int64_t begin, int64_t end,
                            float* out) const = 0;
};

}  // namespace trainer
