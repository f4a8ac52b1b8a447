// The entry point every learner job shares: parse the words after the sub-command, load the YAML
// config with its --set overrides, validate it, run the job, and turn the outcome into an exit
// code: 0 done (and after --help); 2 bad usage or config (nothing was started); 128 + signal when a
// signal stopped the job (it checkpointed first); 1 any other failure.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "lm/util/log.h"
#include "trainer/common/config.h"
#include "trainer/common/signals.h"

namespace trainer {

template <class Config>
struct Job {
  const char* name;  // "sft", "opd": messages read "opd-trainer <name>: ..."
  const char* config_example;
  absl::Status (*validate)(const Config&);
  absl::Status (*run)(const Config&, const JobArgs&);
};

// The usage line and the flags every job takes.
inline void PrintJobUsage(std::FILE* out, const std::string& me, const char* config_example) {
  std::fprintf(out,
               "usage: %s --config %s [--set key.path=value ...] [--resume[=CHECKPOINT_DIR]]\n"
               "  --config FILE           the job's YAML config (unknown keys are errors)\n"
               "  --set key.path=value    override one config value (repeatable; the value is "
               "YAML)\n"
               "  --resume                a checkpoint must exist in the run directory and is "
               "resumed\n"
               "  --resume=DIR            resume from this checkpoint directory\n"
               "  --help                  this text\n",
               me.c_str(), config_example);
}

template <class Config>
int JobMain(const Job<Config>& job, const std::vector<std::string>& words) {
  const std::string me = absl::StrCat("opd-trainer ", job.name);
  for (const auto& w : words) {
    if (w == "--help" || w == "-h") {
      PrintJobUsage(stdout, me, job.config_example);
      return 0;
    }
  }
  absl::StatusOr<JobArgs> args = ParseJobArgs(words);
  if (!args.ok()) {
    std::fprintf(stderr, "%s: %s\n", me.c_str(), std::string(args.status().message()).c_str());
    PrintJobUsage(stderr, me, job.config_example);
    return 2;
  }
  absl::StatusOr<Config> config = LoadConfig<Config>(args->config_path, args->overrides);
  absl::Status s = config.ok() ? job.validate(*config) : config.status();
  if (!s.ok()) {
    lm::log::Error(absl::StrCat(me, ": bad config: ", s.message()));
    return 2;
  }
  s = job.run(*config, *args);
  if (s.ok()) return 0;
  lm::log::Error(absl::StrCat(me, ": ", s.message()));
  if (absl::IsCancelled(s) && StopSignal() != 0) return 128 + StopSignal();
  return 1;
}

}  // namespace trainer
