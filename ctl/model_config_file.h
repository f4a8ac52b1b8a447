// A config.json given by its path (opd-ctl init-model --config, plan --model-config): read and
// parsed, errors naming the file. lm::LoadModelConfig reads a model directory's.
#pragma once

#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "lm/model/config.h"
#include "nlohmann/json.hpp"

namespace ctl {

inline absl::StatusOr<lm::ModelConfig> ReadModelConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not JSON"));
  auto config = lm::ParseModelConfig(j);
  if (!config.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", config.status().message()));
  return config;
}

}  // namespace ctl
