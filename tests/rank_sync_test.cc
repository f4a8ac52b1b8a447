// lm::dist::RankSync: ranks meet after phases of any length, agree on the first failure, and give
// up only on a rank whose heartbeat stops. Ranks are threads, each with its own Gloo group (and
// its own connection to the store) on loopback; AllGatherBytes rides along.
//
// Time: the stall cases need a heartbeat that never advances, so they end after the stall timeout
// however slow the machine; the one case with a long wait makes the wait 10x the stall timeout,
// with a heartbeat every 20 ms against a stall timeout of 1 s (a thread starved for a whole second
// would be needed to fail it).
#include "lm/dist/rank_sync.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "lm/dist/process_group.h"
#include "lm/util/status.h"
#include "tests/child_process.h"
#include "tests/testing.h"

namespace {

using lm::dist::LaunchEnv;
using lm::dist::ProcessGroup;
using lm::dist::RankSync;
using lm::dist::RankSyncOptions;

// Every group lives until every rank's fn has returned (rank 0's hosts the store).
void RunRanks(int world, const std::function<void(int, ProcessGroup&)>& fn) {
  const int port = testing_util::FreeLoopbackPort();
  absl::Mutex mu;
  int finished = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      LaunchEnv env{r, world, r, "127.0.0.1", port};
      lm::dist::GroupOptions o;
      o.timeout = absl::Seconds(60);
      auto group = ProcessGroup::Create(env, torch::kCPU, o);
      if (group.ok()) {
        fn(r, **group);
      } else {
        ADD_FAILURE() << group.status();
      }
      absl::MutexLock lock(&mu);
      ++finished;
      const auto all_returned = [&] { return finished == world; };
      mu.Await(absl::Condition(&all_returned));
    });
  }
  for (auto& t : threads) t.join();
}

RankSyncOptions Fast(absl::Duration stall = absl::Seconds(1)) {
  RankSyncOptions o;
  o.stall_timeout = stall;
  o.beat_interval = absl::Milliseconds(20);
  return o;
}

TEST(RankSync, AllOkAgreesOk) {
  RunRanks(3, [](int r, ProcessGroup& g) {
    auto sync = RankSync::Create(g, Fast());
    ASSERT_TRUE(sync.ok()) << sync.status();
    for (int i = 0; i < 5; ++i) EXPECT_TRUE((*sync)->Agree("point", absl::OkStatus()).ok());
  });
}

TEST(RankSync, TheLowestFailingRankIsEveryRanksOutcome) {
  RunRanks(3, [](int r, ProcessGroup& g) {
    auto sync = RankSync::Create(g, Fast());
    ASSERT_TRUE(sync.ok());
    absl::Status mine =
        r == 0 ? absl::OkStatus() : absl::ResourceExhaustedError(absl::StrCat("out of memory ", r));
    absl::Status agreed = (*sync)->Agree("step 1: learned", mine);
    EXPECT_EQ(agreed.code(), absl::StatusCode::kResourceExhausted);
    if (r == 1) {
      EXPECT_EQ(agreed.message(), "out of memory 1");
    } else {
      EXPECT_EQ(agreed.message(), "learner rank 1: out of memory 1");
    }
    // The group is still usable: the failure was agreed, nobody gave up.
    EXPECT_FALSE((*sync)->broken());
    EXPECT_TRUE((*sync)->Agree("checkpoint", absl::OkStatus()).ok());
  });
}

TEST(RankSync, AWaitLongerThanTheStallTimeoutSucceedsWhileTheLateRankBeats) {
  RunRanks(2, [](int r, ProcessGroup& g) {
    auto sync = RankSync::Create(g, Fast(absl::Seconds(1)));
    ASSERT_TRUE(sync.ok());
    if (r == 1) {
      (*sync)->SetPhase("sampling");
      absl::SleepFor(absl::Seconds(10));  // a long phase, beating all along
    }
    EXPECT_TRUE((*sync)->Agree("samples scored", absl::OkStatus()).ok());
  });
}

TEST(RankSync, ARankWhoseHeartbeatStopsEndsTheWaitNamingItsPhaseAndProgress) {
  absl::Notification described, ended;
  RunRanks(2, [&](int r, ProcessGroup& g) {
    if (r == 1) {
      {
        auto sync = RankSync::Create(g, Fast(absl::Milliseconds(300)));
        ASSERT_TRUE(sync.ok());
        (*sync)->SetPhase("sampling");
        (*sync)->Progress("3 of 4 samples");
        absl::SleepFor(absl::Milliseconds(200));  // a few beats carry the description
        described.Notify();
      }  // the heartbeat ends here: a process that stopped
      ended.WaitForNotification();
      return;
    }
    described.WaitForNotification();
    auto sync = RankSync::Create(g, Fast(absl::Milliseconds(300)));
    ASSERT_TRUE(sync.ok());
    absl::Status s = (*sync)->Agree("samples scored", absl::OkStatus());
    ended.Notify();
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("learner rank 1 made no progress"), std::string::npos) << s;
    EXPECT_NE(s.message().find("'samples scored'"), std::string::npos) << s;
    EXPECT_NE(s.message().find("sampling"), std::string::npos) << s;
    EXPECT_NE(s.message().find("3 of 4 samples"), std::string::npos) << s;
    EXPECT_TRUE((*sync)->broken());
  });
}

// Rank 2 never beats. Ranks 0 and 1 wait for it: each either gives up on it (DEADLINE_EXCEEDED,
// "it never reported") or learns that the other gave up first (ABORTED); at least one gives up.
// Rank 2, back after rank 0's wait ended, learns that the wait was abandoned.
TEST(RankSync, ARankThatNeverBeatsIsAStallAndTheOthersLearnThatTheWaitWasAbandoned) {
  absl::Notification rank0_done;
  std::atomic<int> gave_up{0};
  RunRanks(3, [&](int r, ProcessGroup& g) {
    RankSyncOptions o = Fast(absl::Milliseconds(300));
    if (r == 2) o.heartbeat = false;  // stopped before its first beat
    auto sync = RankSync::Create(g, o);
    ASSERT_TRUE(sync.ok());
    if (r == 2) rank0_done.WaitForNotification();  // it comes back after rank 0's wait ended
    absl::Status s = (*sync)->Agree("held-out evaluated", absl::OkStatus());
    EXPECT_TRUE((*sync)->broken());
    if (r == 0) rank0_done.Notify();
    if (r != 2 && s.code() == absl::StatusCode::kDeadlineExceeded) {
      EXPECT_NE(s.message().find("it never reported"), std::string::npos) << s;
      ++gave_up;
      return;
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << "rank " << r << ": " << s;
    EXPECT_NE(s.message().find("gave up"), std::string::npos) << s;
  });
  EXPECT_GE(gave_up.load(), 1);
}

TEST(RankSync, RanksAtDifferentPointsAreAnError) {
  RunRanks(2, [](int r, ProcessGroup& g) {
    auto sync = RankSync::Create(g, Fast());
    ASSERT_TRUE(sync.ok());
    absl::Status s = (*sync)->Agree(r == 0 ? "step 3" : "step 4", absl::OkStatus());
    // Whichever rank reads the other's point first reports it; the other learns it gave up.
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(s.code() == absl::StatusCode::kInternal || s.code() == absl::StatusCode::kAborted)
        << s;
  });
}

TEST(RankSync, ExchangeGivesEveryRanksPayloadAndKeepsMessagesWhole) {
  RunRanks(3, [](int r, ProcessGroup& g) {
    auto sync = RankSync::Create(g, Fast());
    ASSERT_TRUE(sync.ok());
    const std::string mine =
        r == 1 ? std::string() : std::string("line\nbreak\0end", 14) + char('0' + r);
    auto all = (*sync)->Exchange("announce", absl::OkStatus(), mine);
    ASSERT_TRUE(all.ok()) << all.status();
    ASSERT_EQ(all->size(), 3u);
    EXPECT_EQ((*all)[0], std::string("line\nbreak\0end", 14) + "0");
    EXPECT_EQ((*all)[1], "");
    EXPECT_EQ((*all)[2], std::string("line\nbreak\0end", 14) + "2");
    // A failure's message with line breaks arrives whole, and the payloads do not.
    auto failed = (*sync)->Exchange(
        "second", r == 2 ? absl::DataLossError("two\nlines") : absl::OkStatus(), "x");
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(failed.status().message(), r == 2 ? "two\nlines" : "learner rank 2: two\nlines");
  });
}

// A store whose host stops answering right after this rank wrote its outcome (the first call
// succeeds, every later one fails): the rank knows its own outcome without reading it back, so it
// waits for rank 0 alone and gives up on it after the stall timeout. Before, it waited for its own
// unreadable outcome, where no stall is looked for, for ever.
class StoreThatStopsAfterOneWrite final : public lm::dist::StoreClient {
 public:
  absl::Status Set(const std::string&, const std::string&) override { return Next(); }
  absl::StatusOr<std::optional<std::string>> TryGet(const std::string&) override {
    RETURN_IF_ERROR(Next());
    return std::optional<std::string>();
  }
  absl::Status Delete(const std::string&) override { return Next(); }

 private:
  absl::Status Next() {
    return calls_++ == 0 ? absl::OkStatus() : absl::UnavailableError("the store stopped");
  }
  int calls_ = 0;
};

TEST(RankSync, AStoreThatStopsAfterTheOwnWriteIsAStallOfTheOthers) {
  RankSyncOptions o = Fast(absl::Milliseconds(200));
  o.heartbeat = false;  // the one write the store takes is the outcome's
  std::unique_ptr<RankSync> sync =
      RankSync::WithStore(1, 2, std::make_unique<StoreThatStopsAfterOneWrite>(), o);
  absl::Status agreed;
  absl::Notification done;
  std::thread waiter([&] {
    agreed = sync->Agree("step 2: learned", absl::OkStatus());
    done.Notify();
  });
  // A bound on failure only (the wait ends 200 ms after it starts when it works).
  const bool ended = done.WaitForNotificationWithTimeout(absl::Seconds(60));
  EXPECT_TRUE(ended) << "the wait never ended";
  if (!ended) {
    waiter.detach();
    return;
  }
  waiter.join();
  EXPECT_EQ(agreed.code(), absl::StatusCode::kDeadlineExceeded) << agreed;
  EXPECT_NE(agreed.message().find("learner rank 0 made no progress"), std::string::npos) << agreed;
  EXPECT_NE(agreed.message().find("the store stopped"), std::string::npos) << agreed;
  EXPECT_TRUE(sync->broken());
}

TEST(RankSync, OneProcessReturnsItsOwnStatus) {
  ProcessGroup trivial;
  auto sync = RankSync::Create(trivial);
  ASSERT_TRUE(sync.ok());
  EXPECT_TRUE((*sync)->Agree("x", absl::OkStatus()).ok());
  EXPECT_EQ((*sync)->Agree("x", absl::UnavailableError("down")).code(),
            absl::StatusCode::kUnavailable);
}

TEST(AllGatherBytes, EveryRanksBytesOfAnyLengthInRankOrder) {
  RunRanks(3, [](int r, ProcessGroup& g) {
    const std::string mine =
        r == 1 ? std::string() : std::string(static_cast<size_t>(5 + r), 'a' + r);
    auto all = g.AllGatherBytes(mine);
    ASSERT_TRUE(all.ok()) << all.status();
    ASSERT_EQ(all->size(), 3u);
    EXPECT_EQ((*all)[0], "aaaaa");
    EXPECT_EQ((*all)[1], "");
    EXPECT_EQ((*all)[2], "ccccccc");
    auto none = g.AllGatherBytes("");
    ASSERT_TRUE(none.ok());
    EXPECT_EQ(*none, std::vector<std::string>(3));
  });
}

}  // namespace
