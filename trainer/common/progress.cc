#include "trainer/common/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "absl/strings/str_format.h"
#include "lm/util/log.h"

namespace trainer {

void EtaEstimator::AddStep(double seconds) {
  recent_.push_back(seconds);
  sum_ += seconds;
  if (recent_.size() > window_) {
    sum_ -= recent_.front();
    recent_.pop_front();
  }
}

double EtaEstimator::Eta(int64_t remaining) const {
  if (recent_.empty()) return -1;
  return sum_ / static_cast<double>(recent_.size()) * static_cast<double>(remaining);
}

std::string FormatDuration(double seconds) {
  if (seconds < 0 || !std::isfinite(seconds)) return "?";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

Progress::Progress(int64_t total_steps, int64_t log_every)
    : Progress(total_steps, log_every, ::isatty(STDERR_FILENO) == 1) {}

Progress::Progress(int64_t total_steps, int64_t log_every, bool tty)
    : total_(total_steps), log_every_(log_every < 1 ? 1 : log_every), tty_(tty) {}

Progress::~Progress() {
  Finish();
}

std::string Progress::Line(const StepReport& r) const {
  return absl::StrFormat("step %d/%d | loss %.4f | lr %.3g | grad %.3g | %.0f tok/s | ETA %s%s",
                         r.step, total_, r.loss, r.lr, r.grad_norm, r.tokens_per_s,
                         FormatDuration(eta_.Eta(total_ - r.step)),
                         r.skipped ? " | SKIPPED (non-finite)" : "");
}

void Progress::Update(const StepReport& r, double step_seconds) {
  eta_.AddStep(step_seconds);
  if (tty_) {
    // \r + clear-to-end-of-line redraws in place.
    std::fprintf(stderr, "\r\033[K%s", Line(r).c_str());
    std::fflush(stderr);
    line_shown_ = true;
  } else if (r.step % log_every_ == 0 || r.step == total_ || r.skipped) {
    lm::log::Info(Line(r));
  }
}

void Progress::ClearLine() {
  if (!line_shown_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  line_shown_ = false;
}

void Progress::Log(const std::string& message) {
  ClearLine();
  lm::log::Info(message);
}

void Progress::Finish() {
  if (!line_shown_) return;
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  line_shown_ = false;
}

}  // namespace trainer
