// The plan as text (lm/plan/plan.h): one table per process kind.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/plan/plan.h"

namespace lm::plan {
namespace {

constexpr int kNameWidth = 72;

std::string Row(const std::string& name, const std::string& value, const std::string& tail = "") {
  return absl::StrFormat("  %-*s %12s%s\n", kNameWidth, name, value, tail);
}

}  // namespace

std::string FormatGiB(int64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / kGiB);
}

std::string FormatSeconds(double s) {
  if (!std::isfinite(s)) return "never";
  if (s >= 1) return absl::StrFormat("%.1f s", s);
  return absl::StrFormat("%.2f ms", s * 1e3);
}

std::string FormatPlan(const ProcessPlan& p, const DeviceSpec& d) {
  std::string out = absl::StrFormat("%s (x%d devices): memory per device\n", p.process, p.replicas);
  for (const Term& t : p.memory.terms) out += Row(t.name, FormatGiB(t.bytes));
  const int64_t peak = p.memory.peak();
  out += Row(absl::StrCat("peak, of a ", FormatGiB(d.memory_bytes), " device"), FormatGiB(peak),
             absl::StrFormat("  %.0f%%%s", 100.0 * peak / d.memory_bytes,
                             peak > d.memory_bytes ? "  DOES NOT FIT" : ""));
  for (const Term& t : p.memory.alternatives)
    out += Row(absl::StrCat("(instead: ", t.name, ")"), FormatGiB(t.bytes));
  if (!p.memory.host.empty())
    out += absl::StrFormat("%s: host memory beside the device\n", p.process);
  for (const Term& t : p.memory.host) out += Row(t.name, FormatGiB(t.bytes));
  out +=
      absl::StrFormat("%s: time per step (roofline at 100%% of peak: a lower bound)\n", p.process);
  for (const TimeTerm& t : p.time.terms)
    out += Row(t.name, FormatSeconds(t.seconds), absl::StrCat("  ", t.bound));
  out += Row("total", FormatSeconds(p.time.total()));
  for (const std::string& f : p.facts) out += absl::StrCat("  ", f, "\n");
  return out;
}

}  // namespace lm::plan
