// A child process for multi-process tests: spawned with its output in a log file, and stopped
// (SIGTERM, then SIGKILL) when the object goes away, so a failing test never leaks a process.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

extern char** environ;

namespace testing_util {

class ChildProcess {
 public:
  // Starts argv[0] with `argv` and this process's environment plus `extra_env` ("K=V");
  // stdout and stderr go to `log`.
  ChildProcess(std::vector<std::string> argv, std::string log,
               const std::vector<std::string>& extra_env = {})
      : log_(std::move(log)) {
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    env_strings.insert(env_strings.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    if (posix_spawn(&pid_, argv[0].c_str(), &fa, nullptr, args.data(), envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~ChildProcess() { Stop(); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  bool started() const { return pid_ > 0 || exited_; }
  pid_t pid() const { return pid_; }  // -1 once reaped
  bool Running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      Reap(status);
      return false;
    }
    return true;
  }
  void Kill(int sig) {
    if (pid_ > 0) kill(pid_, sig);
  }
  // Waits up to `timeout` for the exit; returns the exit code (128 + signal), or -1 on timeout.
  int Wait(std::chrono::seconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (Running() && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return Running() ? -1 : exit_code_;
  }
  int Stop() {
    if (pid_ <= 0) return exit_code_;
    Kill(SIGTERM);
    if (Wait(std::chrono::seconds(10)) < 0) {
      Kill(SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
      Reap(status);
    }
    return exit_code_;
  }
  // Resident memory (kB) from /proc; -1 when not running.
  int64_t RssKb() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/status");
    std::string key;
    while (in >> key) {
      if (key == "VmRSS:") {
        int64_t kb = 0;
        in >> kb;
        return kb;
      }
    }
    return -1;
  }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  void Reap(int status) {
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    exited_ = true;
    pid_ = -1;
  }
  std::string log_;
  pid_t pid_ = -1;
  int exit_code_ = -1;
  bool exited_ = false;
};

// A free loopback port: bound, read and released (for a rendezvous that must be told its port
// before it starts, such as MASTER_PORT; it binds the port again at once).
inline int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  return ok ? ntohs(a.sin_port) : 0;
}

// Waits for a server's port file; 0 when it does not appear within `timeout` or the child died.
inline int WaitForPort(ChildProcess& p, const std::string& port_file,
                       std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    int port = 0;
    std::ifstream in(port_file);
    if (in >> port && port > 0) return port;
    if (!p.Running()) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return 0;
}

// A server (opd-teacher, opd-rollout, a learner's admin service) on an ephemeral loopback port.
struct Served {
  std::unique_ptr<ChildProcess> process;  // stopped when it goes away
  std::string address;                    // "127.0.0.1:PORT"; empty when it did not start
};

// The one way tests start a server: argv (the binary and its flags) plus --listen=127.0.0.1:0
// (unless argv has a --listen of its own: a test of that flag) and --port-file=DIR/TAG.port, its
// output in DIR/TAG.log, this environment plus `env`; waits up to `timeout` for the port (a bound
// on failure, not a synchronisation: the port file appears once the server serves). The address
// is empty when the port did not come (the server exited, or hangs): LaunchServed leaves that to
// the caller (a test that expects the server to refuse its flags), StartServed fails the test
// naming the log. StartLearnerAdmin starts an opd-trainer job (argv) with its admin service on
// the same terms, given as config overrides.
namespace served_internal {
inline Served Launch(const std::filesystem::path& dir, const std::string& tag,
                     std::vector<std::string> argv,
                     const std::function<std::vector<std::string>(const std::string&)>& listen,
                     std::chrono::seconds timeout, const std::vector<std::string>& env) {
  const std::string port_file = (dir / (tag + ".port")).string();
  std::filesystem::remove(port_file);  // an earlier server of this name wrote one
  for (std::string& a : listen(port_file)) argv.push_back(std::move(a));
  Served s;
  s.process = std::make_unique<ChildProcess>(std::move(argv), (dir / (tag + ".log")).string(), env);
  const int port = WaitForPort(*s.process, port_file, timeout);
  if (port > 0) s.address = "127.0.0.1:" + std::to_string(port);
  return s;
}
}  // namespace served_internal

inline Served LaunchServed(const std::filesystem::path& dir, const std::string& tag,
                           std::vector<std::string> argv,
                           std::chrono::seconds timeout = std::chrono::seconds(60),
                           const std::vector<std::string>& env = {}) {
  const bool own_listen = std::any_of(
      argv.begin(), argv.end(), [](const std::string& a) { return a.rfind("--listen", 0) == 0; });
  return served_internal::Launch(
      dir, tag, std::move(argv),
      [own_listen](const std::string& port_file) {
        std::vector<std::string> flags = {"--port-file=" + port_file};
        if (!own_listen) flags.push_back("--listen=127.0.0.1:0");
        return flags;
      },
      timeout, env);
}

inline Served StartServed(const std::filesystem::path& dir, const std::string& tag,
                          std::vector<std::string> argv,
                          std::chrono::seconds timeout = std::chrono::seconds(60),
                          const std::vector<std::string>& env = {}) {
  Served s = LaunchServed(dir, tag, std::move(argv), timeout, env);
  EXPECT_FALSE(s.address.empty()) << tag << " did not start: " << s.process->Log();
  return s;
}

inline Served StartLearnerAdmin(const std::filesystem::path& dir, const std::string& tag,
                                std::vector<std::string> argv,
                                std::chrono::seconds timeout = std::chrono::seconds(300)) {
  Served s = served_internal::Launch(dir, tag, std::move(argv),
                                     [](const std::string& port_file) {
                                       return std::vector<std::string>{
                                           "--set", "admin.listen=127.0.0.1:0", "--set",
                                           "admin.port_file=" + port_file};
                                     },
                                     timeout, {});
  EXPECT_FALSE(s.address.empty()) << tag << " did not start: " << s.process->Log();
  return s;
}

}  // namespace testing_util
