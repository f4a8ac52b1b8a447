// The small OPD task the multi-process learner tests share: scripts/demo/make_task.py's integer
// addition chat (prompts, a byte-level BPE tokenizer, model configs), a random student and a
// random small teacher made with opd-ctl init-model, and a 0600 secret file.
#pragma once

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "nlohmann/json.hpp"
#include "tests/child_process.h"

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

// A test CA and one certificate it signs for 127.0.0.1/localhost in `dir` (ca.pem, node.pem,
// node.key): the services', the admin service's and the learner's client certificate. With
// `other_ca`, a second CA (other_ca.pem) that signs nothing. Made with the openssl command line.
inline ::testing::AssertionResult MakeTestCertificates(const std::filesystem::path& dir,
                                                       bool other_ca = false) {
  std::string gen =
      "cd " + dir.string() +
      " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=opd-test-ca"
      " -keyout ca.key -out ca.pem"
      " && openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout node.key -out node.csr"
      " && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > ext.cnf"
      " && openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1"
      " -extfile ext.cnf -out node.pem";
  if (other_ca)
    gen +=
        " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=other-ca"
        " -keyout other_ca.key -out other_ca.pem";
  const std::string log = (dir / "openssl.log").string();
  if (std::system(("(" + gen + ") > " + log + " 2>&1").c_str()) != 0) {
    std::ifstream in(log);
    return ::testing::AssertionFailure()
           << "openssl failed: " << std::string(std::istreambuf_iterator<char>(in), {});
  }
  return ::testing::AssertionSuccess();
}

// An opd-teacher or opd-rollout (the `binary`'s path) serving `model` for the task MakeOpdTask
// wrote in `dir`: its tokenizer (or `tokenizer`), its secret, one thread; StartServed's port and
// log as DIR/TAG.*.
inline Served StartTaskService(const std::filesystem::path& dir, const std::string& tag,
                               const std::string& binary, const std::string& model,
                               const std::string& tokenizer = "") {
  return StartServed(
      dir, tag,
      {binary, "--model=" + model,
       "--tokenizer=" + (tokenizer.empty() ? (dir / "task/tokenizer").string() : tokenizer),
       "--secret-file=" + (dir / "secret").string(), "--threads=1"});
}

// `opd-trainer opd` on configs/demo/opd.yaml over the task MakeOpdTask wrote in `dir`: the run
// directory, the student, the task's prompts, the rollout endpoint and the secret, then `sets`
// (key=value overrides: stages, step counts, ...).
inline std::vector<std::string> OpdTrainerArgs(const std::filesystem::path& dir,
                                               const std::string& run, const std::string& rollout,
                                               const std::vector<std::string>& sets) {
  const std::string d = dir.string();
  std::vector<std::string> argv = {std::string(OPD_BINARY_DIR) + "/trainer/opd-trainer", "opd",
                                   "--config",
                                   std::string(OPD_SOURCE_DIR) + "/configs/demo/opd.yaml"};
  std::vector<std::string> all = {"run.dir=" + run, "model.path=" + d + "/student",
                                  "prompts.sources=[{files: [" + d + "/task/opd_prompts.jsonl]}]",
                                  "rollout.endpoints=[" + rollout + "]",
                                  "auth.secret_file=" + d + "/secret"};
  all.insert(all.end(), sets.begin(), sets.end());
  for (const auto& s : all) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  return argv;
}

// Two prompt sources for teachers-by-domain tests: the task's prompts alternately into `a` and
// `b`, each line's "domain" set to `domain_a` / `domain_b` (removed where that is empty, so that
// the source's name is the domain).
inline void SplitPromptsByDomain(const std::filesystem::path& dir, const std::filesystem::path& a,
                                 const std::string& domain_a, const std::filesystem::path& b,
                                 const std::string& domain_b) {
  std::ifstream in(dir / "task/opd_prompts.jsonl");
  std::ofstream out_a(a), out_b(b);
  int n = 0;
  for (std::string line; std::getline(in, line); ++n) {
    auto j = nlohmann::json::parse(line);
    const std::string& domain = n % 2 == 0 ? domain_a : domain_b;
    if (domain.empty())
      j.erase("domain");
    else
      j["domain"] = domain;
    (n % 2 == 0 ? out_a : out_b) << j.dump() << "\n";
  }
}

}  // namespace testing_util
