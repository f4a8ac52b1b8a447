#include "lm/io/sharded_load.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "lm/io/checkpoint.h"
#include "lm/model/arch.h"
#include "lm/model/expert_parallel.h"
#include "lm/util/log.h"
#include "lm/util/status.h"

namespace lm {

absl::StatusOr<std::shared_ptr<CausalLM>> LoadExpertShard(const std::string& dir,
                                                          const LoadOptions& opts, int rank,
                                                          int world_size) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  RETURN_IF_ERROR(ShardConfig(config, rank, world_size));
  // The fused expert parameters are created with local_experts rows only.
  ASSIGN_OR_RETURN(auto model, CreateModel(config, opts));
  ASSIGN_OR_RETURN(auto files, OpenCheckpointFiles(dir));
  std::map<std::string, torch::Tensor> params;
  for (auto& p : model->named_parameters()) params[p.key()] = p.value();
  LoadFilter filter;
  filter.ignore_names = model->TiedAliases();
  filter.ignore_prefixes = FindArchitecture(config.model_type)->ignored_prefixes;
  const int64_t first = config.expert_first, count = config.local_experts;
  filter.expert_row = [first, count](const std::string&, int64_t expert) -> int64_t {
    return expert >= first && expert < first + count ? expert - first : -1;
  };
  ASSIGN_OR_RETURN(LoadReport report, LoadParameters(files, params, filter));
  log::Info(absl::StrCat("loaded rank ", rank, " of ", world_size, " of ", dir, " (",
                         config.model_type, "): experts [", first, ", ", first + count, ") of ",
                         config.num_experts, " per layer, ", report.tensors_loaded,
                         " tensors read, ", report.tensors_ignored,
                         " skipped (other ranks' experts, ignored names)"));
  return model;
}

}  // namespace lm
