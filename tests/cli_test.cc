// The command lines of the built binaries, run as child processes: `--help` on every binary and
// every sub-command prints its flags and exits 0; malformed numbers, numbers out of their range,
// unknown flags, inconsistent TLS flag sets, unusable secret files and a non-loopback --listen
// without a secret exit 2 with a message naming the flag, before anything is loaded or bound; an
// exception escaping a program is an error naming it and the model (exit 1), never an abort. No
// case is meant to listen on a socket: every one stops before the server would start, and one
// that serves instead (its port file appears) fails at once.
#include <stdlib.h>
#include <sys/stat.h>

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
    // A valid tiny model: a server given it would load it and serve, so a refusal with it proves
    // that the check comes before the load.
    model_ = (dir_ / "tiny_model").string();
    const Result init =
        Run({kCtl, "init-model", "--config",
             std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny_model.json", "--out", model_});
    ASSERT_EQ(init.code, 0) << init.output;
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

  // A model server given the tiny model, `flags` and a port file: its exit code, or -1 as soon as
  // the port file appears (it loaded the model and serves: the check it should have failed came
  // too late or not at all). The event, not a timing, tells the two apart.
  static Result RunServer(const std::string& binary, const std::vector<std::string>& flags,
                          const std::vector<std::string>& env = {}) {
    std::vector<std::string> argv = {binary, "--model=" + model_};
    argv.insert(argv.end(), flags.begin(), flags.end());
    testing_util::Served s = testing_util::LaunchServed(
        dir_, "server" + std::to_string(runs_++), std::move(argv), std::chrono::seconds(120), env);
    Result r;
    r.code = s.address.empty() ? s.process->Wait(std::chrono::seconds(10)) : -1;
    r.output = s.process->Log();
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
  static inline std::string model_;
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

// --- numbers out of their range: exit 2 naming the flag, its value and its range, before the load

struct OutOfRange {
  std::vector<std::string> flags;
  std::string named;  // "--flag=value"
  std::string range;  // "[lo, hi]"
};

TEST_F(Cli, ModelServerFlagsOutOfRangeExit2BeforeTheModelLoads) {
  const std::vector<std::pair<std::string, std::vector<OutOfRange>>> servers = {
      {kTeacher,
       {{{"--workers=0"}, "--workers=0", "[1, 256]"},
        {{"--workers=100000"}, "--workers=100000", "[1, 256]"},
        {{"--max-batch-tokens=0"}, "--max-batch-tokens=0", "[1, 16777216]"},
        {{"--logprob-chunk=0"}, "--logprob-chunk=0", "[1, 1048576]"},
        {{"--max-queue=0"}, "--max-queue=0", "[1, 1048576]"},
        {{"--max-seq-len=-1"}, "--max-seq-len=-1", "[0, 16777216]"},
        {{"--max-top-k=-5"}, "--max-top-k=-5", "[0, 1048576]"},
        {{"--max-reply-mb=4096"}, "--max-reply-mb=4096", "[1, 2047]"},
        {{"--max-chunk-mb=0"}, "--max-chunk-mb=0", "[1, 2047]"}}},
      {kRollout,
       {{{"--max-concurrent=0"}, "--max-concurrent=0", "[1, 1024]"},
        {{"--max-concurrent=100000"}, "--max-concurrent=100000", "[1, 1024]"},
        {{"--max-seq-len=-1"}, "--max-seq-len=-1", "[0, 16777216]"},
        {{"--max-samples-per-prompt=0"}, "--max-samples-per-prompt=0", "[1, 1048576]"},
        {{"--max-slots=0"}, "--max-slots=0", "[1, 1048576]"},
        {{"--kv-cache-gb=0"}, "--kv-cache-gb=0", "(0, 65536]"},
        {{"--kv-cache-gb=nan"}, "--kv-cache-gb=nan", "(0, 65536]"},
        {{"--kv-block-size=0"}, "--kv-block-size=0", "[1, 1024]"},
        {{"--max-running-seqs=0"}, "--max-running-seqs=0", "[1, 1048576]"},
        {{"--max-queued-requests=0"}, "--max-queued-requests=0", "[1, 1048576]"},
        {{"--engine=turbo"}, "--engine=turbo", "neither paged nor static"}}},
  };
  // The flags both servers share (rpc/model_server.cc).
  const std::vector<OutOfRange> shared = {
      {{"--threads=100000"}, "--threads=100000", "[0, 1024]"},
      {{"--threads=-1"}, "--threads=-1", "[0, 1024]"},
      {{"--max-message-mb=4096"}, "--max-message-mb=4096", "[1, 2047]"},
      {{"--grace-seconds=-1"}, "--grace-seconds=-1", "[0, 86400]"},
      {{"--world-size=5000"}, "--world-size=5000", "[0, 1024]"},
      {{"--ep-timeout-seconds=0"}, "--ep-timeout-seconds=0", "[1, 86400]"},
      {{"--debug-kill-rank=-2"}, "--debug-kill-rank=-2", "[-1, 1023]"},
      {{"--listen=127.0.0.1:99999"}, "--listen=127.0.0.1:99999", "[0, 65535]"},
      {{"--listen=[::1]:http"}, "--listen=[::1]:http", "[0, 65535]"},
  };
  for (auto [binary, cases] : servers) {
    cases.insert(cases.end(), shared.begin(), shared.end());
    for (const auto& c : cases) {
      const Result r = RunServer(binary, c.flags);
      EXPECT_EQ(r.code, 2) << binary << " " << c.named << " (-1: it loaded the model and served)\n"
                           << r.output;
      EXPECT_NE(r.output.find(c.named), std::string::npos) << r.output;
      EXPECT_NE(r.output.find(c.range), std::string::npos) << r.output;
    }
  }
  // In range, the same servers load the tiny model and serve (the event the cases above wait for).
  for (const auto& [binary, flag] :
       {std::pair{kTeacher, "--workers=2"}, {kRollout, "--max-concurrent=1"}}) {
    const Result r = RunServer(binary, {flag, "--threads=1"});
    EXPECT_EQ(r.code, -1) << binary << "\n" << r.output;
  }
}

TEST_F(Cli, CtlFlagsOutOfRangeExit2NamingTheRange) {
  const std::string addr = "--addr=127.0.0.1:1", input = "--input=/nonexistent.jsonl";
  const std::vector<std::pair<std::vector<std::string>, OutOfRange>> cases = {
      {{"score", addr, input, "--batch=0"}, {{}, "--batch=0", "[1, 4096]"}},
      {{"score", addr, input, "--top-k=-1"}, {{}, "--top-k=-1", "[0, 1048576]"}},
      {{"score", addr, input, "--temperature=0"}, {{}, "--temperature=0", "(0, 1000]"}},
      {{"generate", addr, input, "--samples=0"}, {{}, "--samples=0", "[1, 1048576]"}},
      {{"generate", addr, input, "--top-p=2"}, {{}, "--top-p=2", "[0, 1]"}},
      {{"generate", addr, input, "--top-k=-1"}, {{}, "--top-k=-1", "[0, 16777216]"}},
      {{"generate", addr, input, "--max-new-tokens=0"}, {{}, "--max-new-tokens=0", "[1, "}},
      {{"generate", addr, input, "--temperature=-1"}, {{}, "--temperature=-1", "[0, 1000]"}},
      {{"info", addr, "--timeout=0"}, {{}, "--timeout=0", "(0, 604800]"}},
      {{"health", addr, "--timeout=1e9"}, {{}, "--timeout=1e+09", "(0, 604800]"}},
      {{"swap-teacher", "--learner=127.0.0.1:1", "--stage=s", "--endpoints=e", "--timeout=-3"},
       {{}, "--timeout=-3", "(0, 604800]"}},
      // These name a valid model: the check comes before it is loaded.
      {{"push-weights", addr, "--from=" + model_, "--version=-1"}, {{}, "--version=-1", "[1, "}},
      {{"push-weights", addr, "--from=" + model_, "--version=1", "--chunk-mb=4096"},
       {{}, "--chunk-mb=4096", "(0, 2047]"}},
      {{"eval", "--model=" + model_, "--prompts=/nonexistent", "--samples=0"},
       {{}, "--samples=0", "[1, 1048576]"}},
      {{"eval", "--model=" + model_, "--prompts=/nonexistent", "--threads=5000"},
       {{}, "--threads=5000", "[0, 1024]"}},
      {{"eval", "--model=" + model_, "--prompts=/nonexistent", "--max-new-tokens=0"},
       {{}, "--max-new-tokens=0", "[1, 16777216]"}},
      // Before, --temperature 1e-45 printed NaN log-probs with exit 0 and --threads 100000 hung.
      {{"logprobs", "--model=" + model_, "--input=/nonexistent", "--temperature=1e-45"},
       {{}, "--temperature=1e-45", "[0.0001, 1000]"}},
      {{"logprobs", "--model=" + model_, "--input=/nonexistent", "--threads=100000"},
       {{}, "--threads=100000", "[0, 1024]"}},
  };
  for (const auto& [words, c] : cases) {
    std::vector<std::string> argv = {kCtl};
    argv.insert(argv.end(), words.begin(), words.end());
    const Result r = Run(argv);
    EXPECT_EQ(r.code, 2) << words[0] << " " << c.named << "\n" << r.output;
    EXPECT_NE(r.output.find(c.named), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.range), std::string::npos) << r.output;
  }
}

// --- secret files: missing, empty or readable by others is a bad value, exit 2 everywhere ---

TEST_F(Cli, UnusableSecretFilesExit2InEveryProcess) {
  const fs::path secrets = dir_ / "secrets";
  fs::create_directories(secrets);
  std::ofstream(secrets / "loose") << "s3cret\n";
  chmod((secrets / "loose").c_str(), 0644);
  std::ofstream(secrets / "empty") << " \n";
  chmod((secrets / "empty").c_str(), 0600);
  const std::vector<std::pair<std::string, std::string>> files = {
      {(secrets / "loose").string(), "chmod 600"},
      {(secrets / "empty").string(), "is empty"},
      {(secrets / "missing").string(), "does not exist"}};
  const std::string run_dir = (dir_ / "opd_run").string();
  for (const auto& [file, why] : files) {
    std::vector<Result> results = {
        RunServer(kTeacher, {"--secret-file=" + file}),
        RunServer(kRollout, {"--secret-file=" + file}),
        Run({kCtl, "info", "--addr=127.0.0.1:1", "--secret-file=" + file}),
        Run({kCtl, "score", "--addr=127.0.0.1:1", "--input=-", "--secret-file=" + file}),
        Run({kCtl, "swap-teacher", "--learner=127.0.0.1:1", "--stage=s", "--endpoints=e",
             "--secret-file=" + file}),
        Run({kTrainer, "opd", "--config", std::string(OPD_SOURCE_DIR) + "/configs/demo/opd.yaml",
             "--set", "auth.secret_file=" + file, "--set", "model.path=" + model_, "--set",
             "run.dir=" + run_dir})};
    for (const Result& r : results) {
      EXPECT_EQ(r.code, 2) << file << "\n" << r.output;
      EXPECT_NE(r.output.find(file), std::string::npos) << r.output;
      EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
    }
    EXPECT_NE(results.back().output.find("auth.secret_file"), std::string::npos)
        << results.back().output;
  }
  EXPECT_FALSE(fs::exists(run_dir)) << "the learner started before refusing its secret file";
}

// --- the last resort: an exception escaping a program exits 1 naming it, never aborts ---

TEST_F(Cli, ExceptionsEscapingAProgramExit1NamingTheModel) {
  const std::vector<std::pair<std::string, std::string>> kinds = {
      {"c10", "LibTorch error (c10::Error): debug exception"},
      {"bad_alloc", "out of memory (std::bad_alloc)"},
      {"std", "uncaught exception: debug exception"}};
  for (const auto& [kind, message] : kinds) {
    const std::vector<std::string> env = {"OPD_DEBUG_THROW=" + kind};
    const std::vector<std::pair<std::string, Result>> results = {
        {"opd-teacher", RunServer(kTeacher, {"--threads=1"}, env)},
        {"opd-rollout", RunServer(kRollout, {"--threads=1"}, env)},
        {"opd-ctl eval", Run({kCtl, "eval", "--model", model_, "--prompts=/nonexistent"}, env)},
        {"opd-ctl push-weights",
         Run({kCtl, "push-weights", "--addr=127.0.0.1:1", "--from=" + model_, "--version=1"}, env)},
        {"opd-trainer sft",
         Run({kTrainer, "sft", "--config", std::string(OPD_SOURCE_DIR) + "/configs/sft/tiny.yaml",
              "--set", "model.path=" + model_, "--set", "run.dir=" + (dir_ / "sft_run").string()},
             env)}};
    for (const auto& [program, r] : results) {
      EXPECT_EQ(r.code, 1) << program << " " << kind << "\n" << r.output;
      EXPECT_NE(r.output.find(program + ": " + message), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("(model " + model_ + ")"), std::string::npos) << r.output;
    }
  }
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
