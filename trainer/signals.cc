#include "trainer/signals.h"

#include <csignal>

namespace trainer {
namespace {

// Only a lock-free atomic object may be written from a signal handler.
volatile std::sig_atomic_t g_signal = 0;

void OnSignal(int signo) {
  g_signal = signo;
}

}  // namespace

void InstallStopHandlers() {
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

}  // namespace trainer
