// Sub-commands of opd-ctl. Each lives in its own cmd_*.cc and is listed in main.cc.
#pragma once

#include <string>
#include <vector>

namespace ctl {

// args: the words after the sub-command name. Returns the process exit code. A command prints
// its own usage on bad arguments and returns 2.
using CommandFn = int (*)(const std::vector<std::string>& args);

struct Command {
  const char* name;
  const char* summary;
  CommandFn run;
};

int RunLogprobs(const std::vector<std::string>& args);
int RunTokenize(const std::vector<std::string>& args);
int RunDetokenize(const std::vector<std::string>& args);
int RunInitModel(const std::vector<std::string>& args);
// The memory and time plan of a job config (lm/plan/plan.h); no model weights needed.
int RunPlan(const std::vector<std::string>& args);

// Clients of running services (opd-teacher, opd-rollout).
int RunInfo(const std::vector<std::string>& args);
int RunHealth(const std::vector<std::string>& args);
int RunScore(const std::vector<std::string>& args);
int RunGenerate(const std::vector<std::string>& args);
int RunPushWeights(const std::vector<std::string>& args);

// Evaluation and the learner's admin service.
int RunEval(const std::vector<std::string>& args);
int RunSwapTeacher(const std::vector<std::string>& args);

}  // namespace ctl
