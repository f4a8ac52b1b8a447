#include "lm/dist/rank_sync.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace lm::dist {
namespace {

constexpr char kAbandon[] = "opd/sync/abandon";

std::string AgreeKey(int64_t point, int rank) {
  return absl::StrCat("opd/sync/agree/", point, "/", rank);
}
std::string BeatKey(int rank) {
  return absl::StrCat("opd/sync/beat/", rank);
}

// An outcome as a rank publishes it: the point's name (so that ranks calling Agree out of order
// are caught), an explicit ok flag, the code, the message's length and the message, then the
// rank's payload.
std::string EncodeOutcome(const std::string& point, const absl::Status& s,
                          const std::string& payload) {
  return absl::StrCat(point, "\n", s.ok() ? "ok" : "failed", "\n", static_cast<int>(s.code()), "\n",
                      s.message().size(), "\n", s.message(), payload);
}

struct Outcome {
  std::string point;
  absl::Status status;
  std::string payload;
};

std::optional<Outcome> DecodeOutcome(const std::string& bytes) {
  std::vector<std::string> parts = absl::StrSplit(bytes, absl::MaxSplits('\n', 4));
  int code = 0;
  size_t length = 0;
  if (parts.size() != 5 || !absl::SimpleAtoi(parts[2], &code) ||
      !absl::SimpleAtoi(parts[3], &length) || length > parts[4].size())
    return std::nullopt;
  Outcome o{parts[0], absl::OkStatus(), parts[4].substr(length)};
  if (parts[1] == "ok") return o;
  if (parts[1] != "failed" || code <= 0 || code > 16) return std::nullopt;
  o.status = absl::Status(static_cast<absl::StatusCode>(code), parts[4].substr(0, length));
  return o;
}

struct BeatSeen {
  int64_t count = -1;  // -1: never seen
  std::string what;    // the rank's phase and progress, as it described them
};

BeatSeen DecodeBeat(const std::string& bytes) {
  BeatSeen b;
  std::pair<std::string, std::string> parts = absl::StrSplit(bytes, absl::MaxSplits('\n', 1));
  if (!absl::SimpleAtoi(parts.first, &b.count)) b.count = -1;
  b.what = parts.second;
  return b;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RankSync>> RankSync::Create(const ProcessGroup& group,
                                                           RankSyncOptions options) {
  std::unique_ptr<StoreClient> store;
  if (group.size() > 1) {
    // Each call on this connection ends within a beat interval or so, so that a stopped store
    // host shows as a stall of that length, not as a call that waits for the group's timeout.
    absl::StatusOr<std::unique_ptr<StoreClient>> s =
        group.ConnectStore(std::max(options.beat_interval * 5, absl::Seconds(5)));
    if (!s.ok()) return s.status();
    store = std::move(*s);
  }
  return std::unique_ptr<RankSync>(
      new RankSync(group.rank(), group.size(), std::move(store), options));
}

std::unique_ptr<RankSync> RankSync::WithStore(int rank, int size,
                                              std::unique_ptr<StoreClient> store,
                                              RankSyncOptions options) {
  return std::unique_ptr<RankSync>(new RankSync(rank, size, std::move(store), options));
}

RankSync::RankSync(int rank, int size, std::unique_ptr<StoreClient> store, RankSyncOptions options)
    : rank_(rank), size_(size), opts_(options), store_(std::move(store)) {
  detail_at_ = absl::Now();
  if (store_ && opts_.heartbeat) beater_ = std::thread([this] { Beat(); });
}

RankSync::~RankSync() {
  stop_.Notify();
  if (beater_.joinable()) beater_.join();
}

void RankSync::SetPhase(std::string phase) {
  absl::MutexLock lock(&mu_);
  phase_ = std::move(phase);
  detail_.clear();
  detail_at_ = absl::Now();
}

void RankSync::Progress(std::string detail) {
  absl::MutexLock lock(&mu_);
  detail_ = std::move(detail);
  detail_at_ = absl::Now();
}

std::string RankSync::Describe() const {
  absl::MutexLock lock(&mu_);
  std::string out = absl::StrCat("phase '", phase_.empty() ? "starting" : phase_, "'");
  if (!detail_.empty())
    absl::StrAppend(&out, absl::StrFormat(", last progress '%s' %.0fs before", detail_,
                                          absl::ToDoubleSeconds(absl::Now() - detail_at_)));
  return out;
}

void RankSync::Beat() {
  int64_t count = 0;
  do {
    const std::string value = absl::StrCat(count++, "\n", Describe());
    absl::MutexLock lock(&store_mu_);
    (void)store_->Set(BeatKey(rank_), value);  // a missed beat is what a stall looks like
  } while (!stop_.WaitForNotificationWithTimeout(opts_.beat_interval));
}

absl::Status RankSync::GiveUp(absl::Status why) {
  broken_.store(true);
  {
    absl::MutexLock lock(&store_mu_);
    (void)store_->Set(kAbandon, absl::StrCat("learner rank ", rank_, " gave up: ", why.message()));
  }
  return why;
}

absl::Status RankSync::Agree(const std::string& point, const absl::Status& mine) {
  absl::StatusOr<std::vector<std::string>> all = Exchange(point, mine, "");
  return all.status();
}

absl::StatusOr<std::vector<std::string>> RankSync::Exchange(const std::string& point,
                                                            const absl::Status& mine,
                                                            const std::string& payload) {
  if (!store_) {
    if (!mine.ok()) return mine;
    return std::vector<std::string>{payload};
  }
  if (broken_.load())
    return absl::FailedPreconditionError(absl::StrCat("learner rank ", rank_,
                                                      " cannot meet the others at '", point,
                                                      "': an earlier wait gave up"));
  const int64_t k = ++points_;
  const std::string own = EncodeOutcome(point, mine, payload);
  bool published = false;
  std::vector<std::optional<absl::Status>> seen(static_cast<size_t>(size_));
  std::vector<std::string> payloads(static_cast<size_t>(size_));
  std::vector<BeatSeen> beats(static_cast<size_t>(size_));
  std::vector<absl::Time> advanced(static_cast<size_t>(size_), absl::Now());
  std::string store_error;
  absl::Duration poll = opts_.first_poll;
  for (;;) {
    absl::ReleasableMutexLock lock(&store_mu_);
    if (!published) {
      absl::Status s = store_->Set(AgreeKey(k, rank_), own);
      published = s.ok();
      if (!s.ok()) store_error = std::string(s.message());
      // Its own outcome is known here, not read back: a store that stops answering after the
      // write would otherwise leave this rank waiting for itself, where no stall is looked for.
      if (published) {
        seen[rank_] = mine;
        payloads[rank_] = payload;
      }
      // Every rank has read the outcomes of point k - 2 once this one is reached.
      if (published && k > 2) (void)store_->Delete(AgreeKey(k - 2, rank_));
    }
    int missing = 0;
    for (int r = 0; r < size_; ++r) {
      if (seen[r]) continue;
      absl::StatusOr<std::optional<std::string>> v = store_->TryGet(AgreeKey(k, r));
      if (!v.ok()) store_error = std::string(v.status().message());
      if (!v.ok() || !v->has_value()) {
        ++missing;
        continue;
      }
      std::optional<Outcome> o = DecodeOutcome(**v);
      if (!o || o->point != point) {
        lock.Release();
        return GiveUp(absl::InternalError(absl::StrCat(
            "learner rank ", r, " reached '", o ? o->point : std::string("an unreadable point"),
            "' where rank ", rank_, " reached '", point, "' (the ranks ran different steps)")));
      }
      seen[r] = o->status;
      payloads[r] = std::move(o->payload);
    }
    // A rank that gave up has left the group: nobody passes this point, even with every outcome.
    if (absl::StatusOr<std::optional<std::string>> a = store_->TryGet(kAbandon);
        a.ok() && a->has_value()) {
      broken_.store(true);
      return absl::AbortedError(**a);
    }
    if (missing == 0 && published) break;
    const absl::Time now = absl::Now();
    for (int r = 0; r < size_; ++r) {
      if (seen[r] || r == rank_) continue;
      absl::StatusOr<std::optional<std::string>> v = store_->TryGet(BeatKey(r));
      if (v.ok() && v->has_value()) {
        BeatSeen b = DecodeBeat(**v);
        if (b.count != beats[r].count) advanced[r] = now;
        beats[r] = std::move(b);
      }
      if (now - advanced[r] < opts_.stall_timeout) continue;
      std::string said = beats[r].count < 0 ? "it never reported"
                                            : absl::StrCat("it last reported ", beats[r].what);
      if (!store_error.empty()) absl::StrAppend(&said, "; the store: ", store_error);
      lock.Release();
      return GiveUp(absl::DeadlineExceededError(absl::StrFormat(
          "learner rank %d made no progress for %s while rank %d waited at '%s' (%s)", r,
          absl::FormatDuration(opts_.stall_timeout), rank_, point, said)));
    }
    if (!published && now - advanced[rank_] >= opts_.stall_timeout) {
      lock.Release();
      return GiveUp(absl::DeadlineExceededError(absl::StrCat("learner rank ", rank_,
                                                             " could not publish its outcome at '",
                                                             point, "': ", store_error)));
    }
    lock.Release();
    absl::SleepFor(poll);
    poll = std::min(poll * 2, opts_.beat_interval);
  }
  for (int r = 0; r < size_; ++r) {
    const absl::Status& s = *seen[r];
    if (s.ok()) continue;
    if (r == rank_) return s;
    return absl::Status(s.code(), absl::StrCat("learner rank ", r, ": ", s.message()));
  }
  return payloads;
}

}  // namespace lm::dist
