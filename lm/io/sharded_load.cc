#include "lm/io/sharded_load.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/io/hf_model_dir.h"
#include "lm/model/expert_parallel.h"
#include "lm/util/log.h"
#include "lm/util/status.h"

namespace lm {

absl::StatusOr<std::shared_ptr<CausalLM>> LoadExpertShard(const std::string& dir,
                                                          const LoadOptions& opts, int rank,
                                                          int world_size) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  RETURN_IF_ERROR(ShardConfig(config, rank, world_size));
  // The fused expert parameters are created with local_experts rows only; the checkpoint and the
  // memory budget are checked against this rank's part before it is allocated.
  LoadFilter filter = ModelLoadFilter(config);
  const int64_t first = config.expert_first, count = config.local_experts;
  filter.expert_row = [first, count](const std::string&, int64_t expert) -> int64_t {
    return expert >= first && expert < first + count ? expert - first : -1;
  };
  LoadReport report;
  ASSIGN_OR_RETURN(auto model, LoadCheckpoint(dir, config, opts, filter, &report));
  log::Info(absl::StrCat("loaded rank ", rank, " of ", world_size, " of ", dir, " (",
                         config.model_type, "): experts [", first, ", ", first + count, ") of ",
                         config.num_experts, " per layer, ", report.tensors_loaded,
                         " tensors read, ", report.tensors_ignored,
                         " skipped (other ranks' experts, ignored names)"));
  return model;
}

}  // namespace lm
