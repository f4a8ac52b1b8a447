#include "trainer/common/job_args.h"

#include "absl/strings/str_cat.h"

namespace trainer {

absl::StatusOr<JobArgs> ParseJobArgs(const std::vector<std::string>& words) {
  JobArgs a;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    auto value = [&](const std::string& flag) -> absl::StatusOr<std::string> {
      if (w.size() > flag.size() && w[flag.size()] == '=') return w.substr(flag.size() + 1);
      if (i + 1 >= words.size()) return absl::InvalidArgumentError(flag + " needs a value");
      return words[++i];
    };
    if (w == "--config" || w.rfind("--config=", 0) == 0) {
      absl::StatusOr<std::string> v = value("--config");
      if (!v.ok()) return v.status();
      a.config_path = *v;
    } else if (w == "--set" || w.rfind("--set=", 0) == 0) {
      absl::StatusOr<std::string> v = value("--set");
      if (!v.ok()) return v.status();
      a.overrides.push_back(*v);
    } else if (w == "--resume") {
      a.resume = true;
    } else if (w.rfind("--resume=", 0) == 0) {
      a.resume = true;
      a.resume_from = w.substr(9);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", w, "'"));
    }
  }
  if (a.config_path.empty()) return absl::InvalidArgumentError("--config FILE is required");
  return a;
}

}  // namespace trainer
