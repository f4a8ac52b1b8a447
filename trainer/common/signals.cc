#include "trainer/common/signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <map>
#include <mutex>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace trainer {
namespace {

// Only a lock-free atomic object may be written from a signal handler.
volatile std::sig_atomic_t g_signal = 0;
// The self-pipe: the handler writes a byte (write() is async-signal-safe), the helper reads it.
int g_pipe[2] = {-1, -1};

absl::Mutex g_mu;
std::map<int, std::function<void()>>& Callbacks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mu) {
  static auto* callbacks = new std::map<int, std::function<void()>>();  // never destroyed
  return *callbacks;
}
int g_next_id ABSL_GUARDED_BY(g_mu) = 0;

void RunCallbacks() {
  absl::MutexLock lock(&g_mu);
  for (auto& [id, fn] : Callbacks()) fn();
}

void OnSignal(int signo) {
  const int saved = errno;
  g_signal = signo;
  const char byte = 1;
  if (g_pipe[1] >= 0) (void)!write(g_pipe[1], &byte, 1);
  errno = saved;
}

// The helper thread lives as long as the process; it sleeps in read() until a signal arrives.
void WatchPipe() {
  for (;;) {
    char byte;
    const ssize_t n = read(g_pipe[0], &byte, 1);
    if (n == 1) {
      RunCallbacks();
    } else if (n < 0 && errno != EINTR) {
      return;
    }
  }
}

void StartWatcherOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (pipe2(g_pipe, O_CLOEXEC) != 0) return;  // callbacks then run only on registration
    fcntl(g_pipe[1], F_SETFL, O_NONBLOCK);      // the handler must never block
    std::thread(WatchPipe).detach();
  });
}

}  // namespace

void InstallStopHandlers() {
  StartWatcherOnce();
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool StopRequested() {
  return g_signal != 0;
}
int StopSignal() {
  return g_signal;
}

void ResetStopForTest() {
  g_signal = 0;
  InstallStopHandlers();
}

void RaiseStopForTest(int signo) {
  StartWatcherOnce();
  OnSignal(signo);
}

StopCallback::StopCallback(std::function<void()> fn) {
  StartWatcherOnce();
  absl::MutexLock lock(&g_mu);
  id_ = g_next_id++;
  if (StopRequested()) fn();
  Callbacks()[id_] = std::move(fn);
}

StopCallback::~StopCallback() {
  absl::MutexLock lock(&g_mu);
  Callbacks().erase(id_);
}

}  // namespace trainer
