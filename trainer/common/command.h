// Sub-commands of opd-trainer (the learner). Each job lives in its own file and is listed in
// main.cc's table.
#pragma once

#include <string>
#include <vector>

namespace trainer {

// args: the words after the sub-command name. Returns the process exit code.
using CommandFn = int (*)(const std::vector<std::string>& args);

struct Command {
  const char* name;
  const char* summary;
  CommandFn run;
};

int SftMain(const std::vector<std::string>& args);  // trainer/sft/sft.cc
int OpdMain(const std::vector<std::string>& args);  // trainer/opd/opd.cc

}  // namespace trainer
