// The command lines of the built binaries, run as child processes: `--help` on every binary and
// every sub-command prints its flags and exits 0; malformed numbers, unknown flags, inconsistent
// TLS flag sets and a non-loopback --listen without a secret exit 2 with a message naming the
// flag, before anything is loaded or bound. None of these runs listens on a socket: every case
// stops before the server would start.
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "child_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = OPD_BINARY_DIR;
const std::string kTeacher = kBin + "/teacher_service/opd-teacher";
const std::string kRollout = kBin + "/rollout/opd-rollout";
const std::string kTrainer = kBin + "/trainer/opd-trainer";
const std::string kCtl = kBin + "/ctl/opd-ctl";

struct Result {
  int code = -1;
  std::string output;  // stdout and stderr together
};

class Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The refusals below are about a missing secret: none may come from the environment.
    unsetenv("OPD_SECRET");
    std::string tmpl = (fs::temp_directory_path() / "opd_cli_XXXXXX").string();
    dir_ = fs::path(mkdtemp(tmpl.data()));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static Result Run(std::vector<std::string> argv, const std::vector<std::string>& env = {}) {
    const std::string log = (dir_ / ("run" + std::to_string(runs_++) + ".log")).string();
    testing_util::ChildProcess p(std::move(argv), log, env);
    Result r;
    r.code = p.Wait(std::chrono::seconds(120));
    r.output = p.Log();
    return r;
  }

  // The names listed under `header` ("commands:", "jobs:") in a top-level usage text.
  static std::vector<std::string> ListedNames(const std::string& usage, const std::string& header) {
    std::vector<std::string> names;
    std::istringstream in(usage.substr(usage.find(header) + header.size()));
    for (std::string line; std::getline(in, line);) {
      std::istringstream words(line);
      std::string name;
      if (line.rfind("  ", 0) == 0 && words >> name) names.push_back(name);
    }
    return names;
  }

  static inline fs::path dir_;
  static inline int runs_ = 0;
};

// --- --help ---

TEST_F(Cli, ModelServersHelpListsTheirFlags) {
  for (const auto& [binary, own_flag] :
       {std::pair{kTeacher, "--max-batch-tokens"}, {kRollout, "--max-concurrent"}}) {
    const Result r = Run({binary, "--help"});
    EXPECT_EQ(r.code, 0) << binary << "\n" << r.output;
    for (const char* flag : {own_flag, "--model", "--listen", "--secret-file", "--tls-cert",
                             "--tls-key", "--tls-client-ca", "--insecure", "--threads"}) {
      EXPECT_NE(r.output.find(flag), std::string::npos) << binary << " lacks " << flag << "\n"
                                                        << r.output;
    }
    // Abseil's own flags are not ours to advertise.
    EXPECT_EQ(r.output.find("--flagfile"), std::string::npos) << r.output;
    EXPECT_EQ(Run({binary, "-h"}).code, 0);
  }
}

TEST_F(Cli, EveryTrainerJobHasHelp) {
  const Result top = Run({kTrainer, "--help"});
  ASSERT_EQ(top.code, 0) << top.output;
  const auto jobs = ListedNames(top.output, "jobs:");
  ASSERT_GE(jobs.size(), 2u) << top.output;
  for (const std::string& job : jobs) {
    const Result r = Run({kTrainer, job, "--help"});
    EXPECT_EQ(r.code, 0) << job << "\n" << r.output;
    for (const char* flag : {"--config", "--set", "--resume"})
      EXPECT_NE(r.output.find(flag), std::string::npos) << job << " lacks " << flag;
  }
}

TEST_F(Cli, EveryCtlCommandHasHelp) {
  const Result top = Run({kCtl, "--help"});
  ASSERT_EQ(top.code, 0) << top.output;
  const auto commands = ListedNames(top.output, "commands:");
  ASSERT_GE(commands.size(), 11u) << top.output;
  for (const std::string& command : commands) {
    const Result r = Run({kCtl, command, "--help"});
    EXPECT_EQ(r.code, 0) << command << "\n" << r.output;
    EXPECT_NE(r.output.find("usage: opd-ctl " + command), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("  --"), std::string::npos) << command << ": no flags listed\n"
                                                        << r.output;
  }
  // The clients of services list the connection flags.
  for (const char* command : {"info", "health", "score", "generate", "push-weights"}) {
    const Result r = Run({kCtl, command, "-h"});
    EXPECT_EQ(r.code, 0) << r.output;
    for (const char* flag : {"--addr", "--secret-file", "--tls-ca", "--timeout"})
      EXPECT_NE(r.output.find(flag), std::string::npos) << command << " lacks " << flag;
  }
  EXPECT_NE(Run({kCtl, "swap-teacher", "--help"}).output.find("--tls-ca"), std::string::npos);
}

// --- bad flag values: exit 2, the flag named, no abort ---

struct BadFlag {
  std::vector<std::string> argv;
  std::string named;  // the flag the message must name
};

TEST_F(Cli, MalformedNumbersExit2NamingTheFlag) {
  const std::vector<BadFlag> cases = {
      {{kTeacher, "--model", "m", "--threads", "abc"}, "--threads"},
      {{kTeacher, "--model=m", "--max-batch-tokens=12x"}, "--max-batch-tokens"},
      {{kTeacher, "--model=m", "--workers", "1.5"}, "--workers"},
      {{kRollout, "--model=m", "--max-concurrent", "many"}, "--max-concurrent"},
      {{kRollout, "--model=m", "--grace-seconds="}, "--grace-seconds"},
      {{kCtl, "score", "--addr", "127.0.0.1:1", "--input", "-", "--top-k", "abc"}, "--top-k"},
      {{kCtl, "score", "--addr", "127.0.0.1:1", "--input", "-", "--batch", "99999999999"},
       "--batch"},
      {{kCtl, "generate", "--addr", "127.0.0.1:1", "--input", "-", "--seed", "-1"}, "--seed"},
      {{kCtl, "generate", "--addr", "127.0.0.1:1", "--input", "-", "--temperature", "hot"},
       "--temperature"},
      {{kCtl, "info", "--addr", "127.0.0.1:1", "--timeout", "soon"}, "--timeout"},
      {{kCtl, "health", "--addr", "127.0.0.1:1", "--timeout", "nan"}, "--timeout"},
      {{kCtl, "push-weights", "--addr", "127.0.0.1:1", "--from", "d", "--version", "v2"},
       "--version"},
      {{kCtl, "swap-teacher", "--learner", "127.0.0.1:1", "--stage", "s", "--endpoints", "e",
        "--timeout", "x"},
       "--timeout"},
      {{kCtl, "eval", "--model", "m", "--prompts", "p", "--samples", "two"}, "--samples"},
      {{kCtl, "logprobs", "--model", "m", "--input", "-", "--threads", "x"}, "--threads"},
      {{kCtl, "init-model", "--config", "c", "--out", "o", "--std", "wide"}, "--std"},
  };
  for (const auto& c : cases) {
    const Result r = Run(c.argv);
    EXPECT_EQ(r.code, 2) << c.argv[0] << " " << c.argv[1] << ": " << r.output;
    EXPECT_NE(r.output.find(c.named), std::string::npos) << r.output;
  }
}

TEST_F(Cli, UnknownFlagsAndStrayWordsExit2) {
  for (const auto& c :
       std::vector<BadFlag>{{{kTeacher, "--model=m", "--bogus-flag=1"}, "--bogus-flag"},
                            {{kRollout, "stray"}, "stray"},
                            {{kTeacher, "--model"}, "--model"},
                            {{kTeacher, "--flagfile=/etc/passwd"}, "--flagfile"},
                            {{kCtl, "info", "--addr=x", "--nope"}, "--nope"},
                            {{kTrainer, "sft", "--bogus"}, "--bogus"}}) {
    const Result r = Run(c.argv);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(c.named), std::string::npos) << r.output;
  }
}

// A malformed input line is an error naming the field, not an uncaught exception (the check
// comes before any call, so no server is needed).
TEST_F(Cli, ScoreInputWithNonIntegerResponseStartIsAnError) {
  const std::string input = (dir_ / "score_input.jsonl").string();
  std::ofstream(input) << "{\"tokens\": [1, 2, 3], \"response_start\": \"two\"}\n";
  const Result r = Run({kCtl, "score", "--addr=127.0.0.1:1", "--input=" + input});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("score_input.jsonl:1: \"response_start\" must be an integer"),
            std::string::npos)
      << r.output;
}

// --- TLS flag sets: a partial set is an error naming the flags, never plaintext ---

TEST_F(Cli, InconsistentTlsFlagsExit2NamingTheFlags) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{kTeacher, "--model=m", "--tls-client-ca=ca.pem"}, {"--tls-client-ca", "--tls-cert"}},
      {{kTeacher, "--model=m", "--tls-cert=c.pem"}, {"--tls-cert", "--tls-key"}},
      {{kRollout, "--model=m", "--tls-key=k.pem"}, {"--tls-cert", "--tls-key"}},
      {{kRollout, "--model=m", "--tls-key=k.pem", "--tls-client-ca=ca.pem"}, {"--tls-key"}},
      {{kCtl, "info", "--addr=127.0.0.1:1", "--tls-cert=c.pem"}, {"--tls-cert", "--tls-key"}},
      {{kCtl, "score", "--addr=127.0.0.1:1", "--input=-", "--tls-cert=c.pem", "--tls-key=k.pem"},
       {"--tls-ca"}},
      {{kCtl, "health", "--addr=127.0.0.1:1", "--tls-server-name=x"},
       {"--tls-server-name", "--tls-ca"}},
      {{kCtl, "swap-teacher", "--learner=127.0.0.1:1", "--stage=s", "--endpoints=e",
        "--tls-key=k.pem"},
       {"--tls-key"}},
  };
  for (const auto& [argv, named] : cases) {
    const Result r = Run(argv);
    EXPECT_EQ(r.code, 2) << argv[0] << " " << argv[1] << ": " << r.output;
    for (const auto& flag : named) EXPECT_NE(r.output.find(flag), std::string::npos) << r.output;
  }
}

// --- listening beyond loopback needs a secret, or --insecure ---

TEST_F(Cli, NonLoopbackListenWithoutSecretIsRefused) {
  for (const std::string& binary : {kTeacher, kRollout}) {
    for (const std::string listen : {"0.0.0.0:0", "[::]:0", ":0", "teacher.example:7001"}) {
      const Result r = Run({binary, "--model=/nonexistent", "--listen=" + listen});
      EXPECT_EQ(r.code, 2) << binary << " " << listen << ": " << r.output;
      EXPECT_NE(r.output.find("refusing to listen on " + listen), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("--insecure"), std::string::npos) << r.output;
    }
    // An empty $OPD_SECRET is no secret.
    const Result empty =
        Run({binary, "--model=/nonexistent", "--listen=0.0.0.0:0"}, {"OPD_SECRET="});
    EXPECT_EQ(empty.code, 2) << empty.output;
    // Past the check (the missing model is the next error, exit 1): --insecure, a secret, or
    // loopback.
    for (const auto& [args, env] :
         std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>>{
             {{"--listen=0.0.0.0:0", "--insecure"}, {}},
             {{"--listen=0.0.0.0:0"}, {"OPD_SECRET=s3cret"}},
             {{"--listen=127.0.0.1:0"}, {}},
             {{"--listen=[::1]:0"}, {}},
             {{"--listen=localhost:0"}, {}}}) {
      std::vector<std::string> argv = {binary, "--model=/nonexistent"};
      argv.insert(argv.end(), args.begin(), args.end());
      const Result r = Run(argv, env);
      EXPECT_EQ(r.code, 1) << args[0] << ": " << r.output;
      EXPECT_EQ(r.output.find("refusing to listen"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("/nonexistent"), std::string::npos) << r.output;
    }
  }
}

}  // namespace
