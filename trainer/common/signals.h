// SIGINT/SIGTERM as a request to stop: the handler only records the signal (and wakes a helper
// thread through a pipe); the training loop polls StopRequested() between micro-batches, abandons
// or finishes the step, writes a checkpoint and exits non-zero. Calls in flight (a Generate or a
// Score can have an hour's deadline) are ended by a StopCallback, which the helper thread runs
// as soon as the signal arrives. The handlers are one-shot (SA_RESETHAND): a second Ctrl-C kills
// at once.
#pragma once

#include <functional>

namespace trainer {

void InstallStopHandlers();
bool StopRequested();
int StopSignal();  // the signal received, 0 if none
// For tests: forget a received signal and reinstall the handlers.
void ResetStopForTest();
// For tests: behave as if `signo` had been received (the callbacks run on the helper thread).
void RaiseStopForTest(int signo);

// Runs `fn` on the helper thread when a stop signal arrives, or at once (on this thread) when
// one already has; never after the object is destroyed. `fn` must be quick and idempotent (it
// may run twice when the signal races the registration).
class StopCallback {
 public:
  explicit StopCallback(std::function<void()> fn);
  ~StopCallback();
  StopCallback(const StopCallback&) = delete;
  StopCallback& operator=(const StopCallback&) = delete;

 private:
  int id_;
};

}  // namespace trainer
