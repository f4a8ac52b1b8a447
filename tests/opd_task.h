// The small OPD task the multi-process learner tests share: scripts/demo/make_task.py's integer
// addition chat (prompts, a byte-level BPE tokenizer, model configs), a random student and a
// random small teacher made with opd-ctl init-model, and a 0600 secret file.
#pragma once

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include <gtest/gtest.h>

namespace testing_util {

// Writes <dir>/task (make_task.py with `task_args`), <dir>/student, <dir>/teacher_small and
// <dir>/secret (holding `secret`).
inline ::testing::AssertionResult MakeOpdTask(const std::filesystem::path& dir,
                                              const std::string& task_args,
                                              const std::string& secret) {
  const std::string d = dir.string(), bin = OPD_BINARY_DIR;
  const std::string task = std::string(OPD_PYTHON) + " " + OPD_SOURCE_DIR +
                           "/scripts/demo/make_task.py --out " + d + "/task " + task_args +
                           " > /dev/null";
  if (std::system(task.c_str()) != 0) return ::testing::AssertionFailure() << task;
  for (auto [name, seed] : {std::pair{"student", 1}, {"teacher_small", 2}}) {
    const std::string init = bin + "/ctl/opd-ctl init-model --config " + d + "/task/models/" +
                             name + ".json --out " + d + "/" + name + " --tokenizer " + d +
                             "/task/tokenizer --seed " + std::to_string(seed) + " 2>/dev/null";
    if (std::system(init.c_str()) != 0) return ::testing::AssertionFailure() << init;
  }
  std::ofstream(dir / "secret") << secret << "\n";
  chmod((dir / "secret").c_str(), 0600);
  return ::testing::AssertionSuccess();
}

}  // namespace testing_util
