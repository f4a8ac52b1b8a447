// SIGINT/SIGTERM as a request to stop: the handler only records the signal; the training loop
// polls StopRequested() between micro-batches, abandons or finishes the step, writes a checkpoint
// and exits non-zero. The handlers are one-shot (SA_RESETHAND): a second Ctrl-C kills at once.
#pragma once

namespace trainer {

void InstallStopHandlers();
bool StopRequested();
int StopSignal();  // the signal received, 0 if none
// For tests: forget a received signal and reinstall the handlers.
void ResetStopForTest();

}  // namespace trainer
