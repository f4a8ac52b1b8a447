// The entry point every learner job shares: parse the words after the sub-command, load the YAML
// config with its --set overrides, validate it, check its secret file, run the job, and turn the
// outcome into an exit code: 0 done (and after --help); 2 bad usage or config, a secret file that
// cannot be used included (nothing was started); 128 + signal when a signal stopped the job (it
// checkpointed first); 1 any other failure, an exception escaping the job included (reported
// naming the model, rpc/last_resort.h; never an abort).
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "lm/util/config.h"
#include "lm/util/log.h"
#include "rpc/auth.h"
#include "rpc/last_resort.h"
#include "trainer/common/job_args.h"
#include "trainer/common/signals.h"

namespace trainer {

// Whether a job's config has an `auth` section with a secret file (OPD's learner; SFT has none).
template <class Config, class = void>
struct HasSecretFile : std::false_type {};
template <class Config>
struct HasSecretFile<Config, std::void_t<decltype(std::declval<const Config&>().auth.secret_file)>>
    : std::true_type {};

// The secret file (else $OPD_SECRET) read once before the job starts: a missing, empty or
// world-readable file is a bad config value (exit 2), found before any rank joins a group or
// loads a model. The job reads it again when it starts its links.
template <class Config>
absl::Status CheckSecretFile(const Config& config) {
  if constexpr (HasSecretFile<Config>::value) {
    const absl::Status s = opd::rpc::LoadSecret(config.auth.secret_file).status();
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("auth.secret_file: ", s.message()));
  }
  return absl::OkStatus();
}

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

// JobMain without the last resort; `*context` names the model once the config is loaded.
template <class Config>
int RunJobMain(const Job<Config>& job, const std::vector<std::string>& words, const std::string& me,
               std::string* context) {
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
  absl::StatusOr<Config> config = lm::LoadConfig<Config>(args->config_path, args->overrides);
  absl::Status s = config.ok() ? job.validate(*config) : config.status();
  if (s.ok()) s = CheckSecretFile(*config);
  if (!s.ok()) {
    lm::log::Error(absl::StrCat(me, ": bad config: ", s.message()));
    return 2;
  }
  *context = absl::StrCat("model ", config->model.path);
  opd::rpc::DebugThrowForTests();
  s = job.run(*config, *args);
  if (s.ok()) return 0;
  lm::log::Error(absl::StrCat(me, ": ", s.message()));
  if (absl::IsCancelled(s) && StopSignal() != 0) return 128 + StopSignal();
  return 1;
}

template <class Config>
int JobMain(const Job<Config>& job, const std::vector<std::string>& words) {
  const std::string me = absl::StrCat("opd-trainer ", job.name);
  std::string context;
  return opd::rpc::ExitCodeCatchingExceptions(me, context,
                                              [&] { return RunJobMain(job, words, me, &context); });
}

}  // namespace trainer
