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

// A rank whose earlier wait gave up has left the group: it meets nobody again.
absl::Status AfterGivingUp(int rank, const std::string& point) {
  return absl::FailedPreconditionError(absl::StrCat(
      "learner rank ", rank, " cannot meet the others at '", point, "': an earlier wait gave up"));
}

// One rank's wait at one point: the outcomes read so far and each peer's last heartbeat. Each
// step is one round's use of the store, made while the caller holds the store's mutex; a step
// that ends the wait returns its error, and the caller gives up (or ends) outside that mutex.
class Meeting {
 public:
  Meeting(StoreClient& store, int rank, int size, const RankSyncOptions& opts,
          const std::string& point, int64_t k, const absl::Status& mine, const std::string& payload)
      : store_(store),
        rank_(rank),
        size_(size),
        opts_(opts),
        point_(point),
        k_(k),
        mine_(mine),
        payload_(payload),
        own_(EncodeOutcome(point, mine, payload)),
        seen_(static_cast<size_t>(size)),
        payloads_(static_cast<size_t>(size)),
        beats_(static_cast<size_t>(size)),
        advanced_(static_cast<size_t>(size), absl::Now()) {}

  // Writes this rank's outcome (again each round until the store takes it).
  void Publish() {
    if (published_) return;
    absl::Status s = store_.Set(AgreeKey(k_, rank_), own_);
    published_ = s.ok();
    if (!s.ok()) {
      store_error_ = std::string(s.message());
      return;
    }
    // Its own outcome is known here, not read back: a store that stops answering after the
    // write would otherwise leave this rank waiting for itself, where no stall is looked for.
    seen_[rank_] = mine_;
    payloads_[rank_] = payload_;
    // Every rank has read the outcomes of point k - 2 once this one is reached.
    if (k_ > 2) (void)store_.Delete(AgreeKey(k_ - 2, rank_));
  }

  // Reads the outcomes not yet seen: true once every rank's is in and this rank's is published,
  // an error when a rank reached another point.
  absl::StatusOr<bool> Collect() {
    int missing = 0;
    for (int r = 0; r < size_; ++r) {
      if (seen_[r]) continue;
      absl::StatusOr<std::optional<std::string>> v = store_.TryGet(AgreeKey(k_, r));
      if (!v.ok()) store_error_ = std::string(v.status().message());
      if (!v.ok() || !v->has_value()) {
        ++missing;
        continue;
      }
      std::optional<Outcome> o = DecodeOutcome(**v);
      if (!o || o->point != point_) return OutOfStep(r, o);
      seen_[r] = o->status;
      payloads_[r] = std::move(o->payload);
    }
    return missing == 0 && published_;
  }

  // A rank that gave up has left the group: nobody passes this point, even with every outcome.
  std::optional<std::string> Abandoned() {
    absl::StatusOr<std::optional<std::string>> a = store_.TryGet(kAbandon);
    if (a.ok() && a->has_value()) return std::move(**a);
    return std::nullopt;
  }

  // The error that ends the wait: a missing peer whose heartbeat has not advanced for the stall
  // timeout, or this rank's own outcome not taken by the store for as long.
  std::optional<absl::Status> Stall() {
    const absl::Time now = absl::Now();
    for (int r = 0; r < size_; ++r) {
      if (seen_[r] || r == rank_) continue;
      ReadBeat(r, now);
      if (now - advanced_[r] >= opts_.stall_timeout) return PeerStalled(r);
    }
    if (!published_ && now - advanced_[rank_] >= opts_.stall_timeout)
      return absl::DeadlineExceededError(absl::StrCat("learner rank ", rank_,
                                                      " could not publish its outcome at '", point_,
                                                      "': ", store_error_));
    return std::nullopt;
  }

  // The lowest failed rank's outcome (named on the other ranks), else every payload in rank order.
  absl::StatusOr<std::vector<std::string>> Verdict() {
    for (int r = 0; r < size_; ++r) {
      const absl::Status& s = *seen_[r];
      if (s.ok()) continue;
      if (r == rank_) return s;
      return absl::Status(s.code(), absl::StrCat("learner rank ", r, ": ", s.message()));
    }
    return std::move(payloads_);
  }

 private:
  absl::Status OutOfStep(int r, const std::optional<Outcome>& o) const {
    return absl::InternalError(absl::StrCat(
        "learner rank ", r, " reached '", o ? o->point : std::string("an unreadable point"),
        "' where rank ", rank_, " reached '", point_, "' (the ranks ran different steps)"));
  }

  // A heartbeat that changed since the last round marks its rank as advancing now.
  void ReadBeat(int r, absl::Time now) {
    absl::StatusOr<std::optional<std::string>> v = store_.TryGet(BeatKey(r));
    if (!v.ok() || !v->has_value()) return;
    BeatSeen b = DecodeBeat(**v);
    if (b.count != beats_[r].count) advanced_[r] = now;
    beats_[r] = std::move(b);
  }

  absl::Status PeerStalled(int r) const {
    std::string said = beats_[r].count < 0 ? "it never reported"
                                           : absl::StrCat("it last reported ", beats_[r].what);
    if (!store_error_.empty()) absl::StrAppend(&said, "; the store: ", store_error_);
    return absl::DeadlineExceededError(
        absl::StrFormat("learner rank %d made no progress for %s while rank %d waited at '%s' (%s)",
                        r, absl::FormatDuration(opts_.stall_timeout), rank_, point_, said));
  }

  StoreClient& store_;
  const int rank_, size_;
  const RankSyncOptions& opts_;
  const std::string& point_;
  const int64_t k_;
  const absl::Status& mine_;
  const std::string& payload_;
  const std::string own_;  // this rank's outcome as published
  bool published_ = false;
  std::vector<std::optional<absl::Status>> seen_;
  std::vector<std::string> payloads_;
  std::vector<BeatSeen> beats_;
  std::vector<absl::Time> advanced_;  // when each rank's heartbeat last changed
  std::string store_error_;           // the store's last error, told when the wait gives up
};

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
  if (broken_.load()) return AfterGivingUp(rank_, point);
  Meeting meeting(*store_, rank_, size_, opts_, point, ++points_, mine, payload);
  absl::Duration poll = opts_.first_poll;
  for (;;) {
    absl::ReleasableMutexLock lock(&store_mu_);
    meeting.Publish();
    absl::StatusOr<bool> all_in = meeting.Collect();
    if (!all_in.ok()) {
      lock.Release();
      return GiveUp(all_in.status());
    }
    if (std::optional<std::string> why = meeting.Abandoned()) {
      broken_.store(true);
      return absl::AbortedError(*why);
    }
    if (*all_in) break;
    if (std::optional<absl::Status> stall = meeting.Stall()) {
      lock.Release();
      return GiveUp(*std::move(stall));
    }
    lock.Release();
    absl::SleepFor(poll);
    poll = std::min(poll * 2, opts_.beat_interval);
  }
  return meeting.Verdict();
}

}  // namespace lm::dist
