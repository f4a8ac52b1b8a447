// Training progress for a human: on a terminal, one live status line redrawn in place
//   step 120/4000 | loss 1.2345 | lr 9.87e-06 | 12,345 tok/s | ETA 1h02m
// and, when stderr is not a terminal (a log file, a CI job), the same facts as plain log lines
// every `log_every` steps. Other messages during training go through Log(), which clears the
// live line first so that the two never interleave on screen.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>

namespace trainer {

struct StepReport {
  int64_t step = 0;  // steps done (1-based after the first step)
  double loss = 0;
  double lr = 0;
  double tokens_per_s = 0;
  double grad_norm = 0;
  bool skipped = false;
};

// ETA from the mean duration of the recent steps (a window, so a slow first step or a change of
// speed fades out).
class EtaEstimator {
 public:
  explicit EtaEstimator(size_t window = 20) : window_(window) {}
  void AddStep(double seconds);
  // Seconds for `remaining` more steps; < 0 while nothing is known.
  double Eta(int64_t remaining) const;

 private:
  size_t window_;
  std::deque<double> recent_;
  double sum_ = 0;
};

// "1h02m", "3m05s", "12s".
std::string FormatDuration(double seconds);

class Progress {
 public:
  Progress(int64_t total_steps, int64_t log_every);
  Progress(int64_t total_steps, int64_t log_every, bool tty);  // tests force the mode
  ~Progress();

  void Update(const StepReport& r, double step_seconds);
  // A message for the log (and the screen) that must not be garbled by the live line.
  void Log(const std::string& message);
  // Ends the live line (newline) so that later output starts on a fresh line.
  void Finish();
  bool tty() const { return tty_; }
  // The text of the status line for `r` (also the body of the plain log lines).
  std::string Line(const StepReport& r) const;

 private:
  void ClearLine();
  int64_t total_;
  int64_t log_every_;
  bool tty_;
  bool line_shown_ = false;
  EtaEstimator eta_;
};

}  // namespace trainer
