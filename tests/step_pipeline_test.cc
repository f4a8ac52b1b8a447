// An OPD step's pipeline on one rank (trainer/opd/step_pipeline.h, score_stream.h and the rollout
// pool's streaming): teachers score while the student samples, micro-batches come in (prompt,
// sample) order whatever order the samples arrive in, a worker that dies mid-stream has its
// unfinished prompts sampled elsewhere with nothing counted twice, and a new teacher set scores
// everything anew. In-process fake services (tests/opd_fakes.h); every wait is on an event, and
// the bounds below only keep a broken build from hanging.
#include "trainer/opd/step_pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "tests/opd_fakes.h"
#include "trainer/opd/rollout_pool.h"
#include "trainer/opd/score_stream.h"
#include "trainer/opd/teacher_pool.h"

namespace {

using testing_util::FakeRollout;
using testing_util::FakeTeacher;
using testing_util::InProcessServer;
using trainer::RolloutPool;
using trainer::StepPipeline;
using trainer::StepPipelineOptions;
using trainer::StepPrompts;
using trainer::TeacherPool;
using trainer::TeacherPools;

const std::string kFingerprint = "step-pipeline-test";

std::unique_ptr<RolloutPool> Rollout(const std::vector<std::string>& addresses) {
  opd::rpc::ClientOptions base;
  base.timeout = absl::Seconds(60);
  auto pool = RolloutPool::Connect(addresses, base, kFingerprint, 320);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

TeacherPools Teachers(const std::string& address) {
  trainer::TeacherPoolOptions o;
  o.client.timeout = absl::Seconds(60);
  auto pool =
      TeacherPool::Connect("stage", {address}, trainer::TeacherRequirements(kFingerprint, 320), o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  TeacherPools pools;
  if (pool.ok()) pools.fallback = std::move(*pool);
  return pools;
}

StepPrompts Prompts(int n) {
  StepPrompts p;
  p.step = 1;
  for (int i = 0; i < n; ++i) {
    lm::PromptExample e;
    e.prompt_ids = {1, 2 + i};
    p.prompts.push_back(e);
  }
  p.SetShare(0, 1);
  return p;
}

StepPipelineOptions Options(bool overlap, int64_t micro_batch_tokens = 1 << 20) {
  StepPipelineOptions o;
  o.samples_per_prompt = 2;
  o.micro_batch_tokens = micro_batch_tokens;
  o.overlap = overlap;
  return o;
}

// Drains the pipeline's micro-batches: their slots, in the order handed out.
std::vector<StepPipeline::MicroBatchSlots> Drain(StepPipeline& p) {
  std::vector<StepPipeline::MicroBatchSlots> out;
  for (;;) {
    auto mb = p.NextMicroBatch();
    EXPECT_TRUE(mb.ok()) << mb.status();
    if (!mb.ok() || !*mb) return out;
    out.push_back(std::move(**mb));
  }
}

// The fake rollout holds its last sample until the teacher has received its first Score call:
// the step can only end with the last sample released by that event if scoring began while the
// student was still sampling. Phase by phase, the teacher hears nothing until the last sample
// is in: the rollout then gives up waiting (a bound, the outcome the test expects there).
TEST(StepPipeline, TeachersScoreWhileTheStudentSamples) {
  for (const bool overlap : {true, false}) {
    absl::Notification teacher_called;
    std::atomic<bool> released_by_teacher{false};
    InProcessServer<FakeTeacher> teacher("opd.v1.Teacher", kFingerprint, [&](int call) {
      if (call == 0 && !teacher_called.HasBeenNotified()) teacher_called.Notify();
      return FakeTeacher::Action{};
    });
    InProcessServer<FakeRollout> worker("opd.v1.Rollout", kFingerprint);
    worker.service.before_write = [&](int n, int total) {
      if (n + 1 < total) return;
      released_by_teacher = teacher_called.WaitForNotificationWithTimeout(
          overlap ? absl::Seconds(120) : absl::Seconds(2));
    };
    auto rollout = Rollout({worker.address});
    auto pipe = StepPipeline::Sample(Prompts(4), Options(overlap), *rollout, {});
    pipe->StartScoring(Teachers(teacher.address), {}, 1);
    ASSERT_TRUE(pipe->WaitScored().ok()) << "overlap " << overlap;
    EXPECT_EQ(released_by_teacher.load(), overlap);
    const auto mbs = Drain(*pipe);
    ASSERT_EQ(mbs.size(), 1u);
    EXPECT_EQ(mbs[0].slots.size(), 8u);
    EXPECT_TRUE(mbs[0].last);
    for (size_t slot = 0; slot < 8; ++slot)
      EXPECT_EQ(pipe->scores(slot).logprobs, std::vector<float>(3, -1.0f));
  }
}

// Samples written last first: the micro-batches still come in (prompt, sample) order, the same
// as when they arrive in order, and only the final one is marked last. Each sample is 2 prompt
// + 3 response tokens; a budget of 12 packs two per micro-batch.
TEST(StepPipeline, MicroBatchesComeInPromptOrderWhateverTheArrivalOrder) {
  std::map<bool, std::vector<std::vector<size_t>>> by_order;
  for (const bool reverse : {false, true}) {
    InProcessServer<FakeTeacher> teacher("opd.v1.Teacher", kFingerprint,
                                         [](int) { return FakeTeacher::Action{}; });
    InProcessServer<FakeRollout> worker("opd.v1.Rollout", kFingerprint);
    worker.service.reverse = reverse;
    auto rollout = Rollout({worker.address});
    auto pipe = StepPipeline::Sample(Prompts(5), Options(true, 12), *rollout, {});
    pipe->StartScoring(Teachers(teacher.address), {}, 1);
    const auto mbs = Drain(*pipe);
    ASSERT_EQ(mbs.size(), 5u);
    for (size_t i = 0; i < mbs.size(); ++i) {
      EXPECT_EQ(mbs[i].slots, (std::vector<size_t>{2 * i, 2 * i + 1}));
      EXPECT_EQ(mbs[i].last, i + 1 == mbs.size());
      by_order[reverse].push_back(mbs[i].slots);
    }
  }
  EXPECT_EQ(by_order[false], by_order[true]);
}

// One sample a call, one call at a time, samples written last first: the first call takes a
// sample that has arrived and is held until every sample has; every later call then takes the
// lowest slot queued, the order the learner consumes them in, so the first micro-batch is scored
// first whatever order the samples arrived in.
TEST(StepPipeline, TeachersScoreInTheLearnersOrderWhateverTheArrivalOrder) {
  absl::Notification sampled;
  absl::Mutex mu;
  std::vector<int32_t> prompt_of_call;  // each call's one sequence: its prompt (token 1 is 2 + p)
  InProcessServer<FakeTeacher> teacher("opd.v1.Teacher", kFingerprint, [&](int call) {
    if (call == 0) sampled.WaitForNotificationWithTimeout(absl::Seconds(120));
    return FakeTeacher::Action{};
  });
  teacher.service.on_request = [&](const opd::v1::ScoreRequest& req) {
    absl::MutexLock lock(&mu);
    for (const auto& seq : req.sequences()) prompt_of_call.push_back(seq.tokens(1) - 2);
  };
  InProcessServer<FakeRollout> worker("opd.v1.Rollout", kFingerprint);
  worker.service.reverse = true;
  auto rollout = Rollout({worker.address});
  auto pipe = StepPipeline::Sample(Prompts(5), Options(true, 12), *rollout, {});
  trainer::ScoreStreamOptions so;
  so.max_calls_per_pool = 1;
  so.max_call_tokens = 5;  // one sample: 2 prompt + 3 response tokens
  pipe->StartScoring(Teachers(teacher.address), so, 1);
  ASSERT_TRUE(pipe->WaitSampled().ok());
  sampled.Notify();
  ASSERT_TRUE(pipe->WaitScored().ok());
  EXPECT_EQ(Drain(*pipe).size(), 5u);
  absl::MutexLock lock(&mu);
  ASSERT_EQ(prompt_of_call.size(), 10u);
  // After the first call (whichever sample it found), the calls come in slot order.
  EXPECT_TRUE(std::is_sorted(prompt_of_call.begin() + 1, prompt_of_call.end()));
  std::sort(prompt_of_call.begin(), prompt_of_call.end());
  EXPECT_EQ(prompt_of_call, (std::vector<int32_t>{0, 0, 1, 1, 2, 2, 3, 3, 4, 4}));
}

// Phase by phase (overlap off) is the baseline the pipeline is measured against: nothing is
// learned until every sample is scored. The teacher's last call waits for the learner's first
// micro-batch: pipelined, it comes (its samples were scored by earlier calls); phase by phase it
// never does, and the call goes on after a bound (the outcome the test expects there).
TEST(StepPipeline, PhaseByPhaseLearnsOnlyOnceEverySampleIsScored) {
  for (const bool overlap : {true, false}) {
    absl::Notification first_learned;
    std::atomic<bool> learned_before_last_call{false};
    InProcessServer<FakeTeacher> teacher("opd.v1.Teacher", kFingerprint, [&](int call) {
      if (call == 9)
        learned_before_last_call = first_learned.WaitForNotificationWithTimeout(
            overlap ? absl::Seconds(120) : absl::Seconds(2));
      return FakeTeacher::Action{};
    });
    InProcessServer<FakeRollout> worker("opd.v1.Rollout", kFingerprint);
    auto rollout = Rollout({worker.address});
    auto pipe = StepPipeline::Sample(Prompts(5), Options(overlap, 12), *rollout, {});
    trainer::ScoreStreamOptions so;
    so.max_calls_per_pool = 1;
    so.max_call_tokens = 5;
    pipe->StartScoring(Teachers(teacher.address), so, 1);
    auto first = pipe->NextMicroBatch();
    ASSERT_TRUE(first.ok() && first->has_value()) << "overlap " << overlap;
    first_learned.Notify();
    EXPECT_EQ((*first)->slots, (std::vector<size_t>{0, 1}));
    EXPECT_EQ(Drain(*pipe).size(), 4u);
    EXPECT_EQ(learned_before_last_call.load(), overlap);
  }
}

// Worker A dies after its first sample; its prompts (0 and 2 of 4: prompt i goes to worker
// i % 2) are sampled again on worker B with the same seed indices. Every (prompt, sample) comes
// out once, the one A sent is not counted twice, and the samples are those A would have sent.
TEST(StepPipeline, AWorkerThatDiesMidStreamHasItsPromptsSampledElsewhere) {
  InProcessServer<FakeRollout> a("opd.v1.Rollout", kFingerprint), b("opd.v1.Rollout", kFingerprint);
  a.service.fail_after = 1;
  auto rollout = Rollout({a.address, b.address});
  std::vector<std::vector<int32_t>> tokens = {{1, 2}, {1, 3}, {1, 4}, {1, 5}};
  std::vector<trainer::IndexedPrompt> prompts;
  for (int64_t i = 0; i < 4; ++i) prompts.push_back({i, tokens[static_cast<size_t>(i)]});
  lm::SamplingParams g;
  g.samples_per_prompt = 2;
  g.max_new_tokens = 256;
  absl::Mutex mu;
  std::multiset<std::pair<int64_t, int64_t>> seen;
  std::map<int64_t, std::vector<int32_t>> responses;
  ASSERT_TRUE(rollout
                  ->Stream(prompts, g,
                           [&](lm::Sample s) {
                             absl::MutexLock lock(&mu);
                             seen.emplace(s.prompt_index, s.sample_index);
                             auto r = s.response();
                             responses[s.prompt_index].assign(r.begin(), r.end());
                           })
                  .ok());
  EXPECT_EQ(seen.size(), 8u);
  for (int64_t p = 0; p < 4; ++p)
    for (int64_t s = 0; s < 2; ++s) EXPECT_EQ(seen.count({p, s}), 1u) << p << "," << s;
  for (int64_t p = 0; p < 4; ++p)
    EXPECT_EQ(responses[p], (std::vector<int32_t>{5, 6, static_cast<int32_t>(7 + p)})) << p;
  EXPECT_EQ(a.service.calls(), 1);
  EXPECT_EQ(b.service.calls(), 2);  // its own prompts, then A's
  EXPECT_EQ(rollout->failovers(), 1);
}

// A reply that fails validation is not a failure to retry elsewhere: the stream ends with it.
TEST(StepPipeline, AnInvalidSampleEndsTheStreamWithoutRetrying) {
  InProcessServer<FakeRollout> a("opd.v1.Rollout", kFingerprint), b("opd.v1.Rollout", kFingerprint);
  a.service.corrupt = [](std::vector<opd::v1::Sample>* v) { (*v)[1] = (*v)[0]; };
  auto rollout = Rollout({a.address, b.address});
  auto pipe = StepPipeline::Sample(Prompts(4), Options(true), *rollout, {});
  const absl::Status st = pipe->WaitSampled();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("twice"), std::string::npos) << st;
  EXPECT_EQ(b.service.calls(), 1);  // its own prompts only
  EXPECT_FALSE(pipe->NextMicroBatch().ok());
}

// A swap (a new teacher generation) scores every sample anew on the new pool: the old scores are
// dropped, whether they had arrived or not.
TEST(StepPipeline, ANewTeacherSetScoresEverythingAnew) {
  InProcessServer<FakeTeacher> old_teacher("opd.v1.Teacher", kFingerprint,
                                           [](int) { return FakeTeacher::Action{}; });
  InProcessServer<FakeTeacher> new_teacher("opd.v1.Teacher", kFingerprint, [](int) {
    FakeTeacher::Action a;
    a.corrupt = [](opd::v1::ScoreResponse* r) {
      for (auto& s : *r->mutable_sequences()) {
        const size_t n = s.logprobs().size() / sizeof(float);
        s.set_logprobs(opd::rpc::PackArray(std::vector<float>(n, -2.0f)));
      }
    };
    return a;
  });
  InProcessServer<FakeRollout> worker("opd.v1.Rollout", kFingerprint);
  auto rollout = Rollout({worker.address});
  auto pipe = StepPipeline::Sample(Prompts(3), Options(true), *rollout, {});
  pipe->StartScoring(Teachers(old_teacher.address), {}, 1);
  ASSERT_TRUE(pipe->WaitScored().ok());
  pipe->StartScoring(Teachers(new_teacher.address), {}, 2);
  ASSERT_TRUE(pipe->WaitScored().ok());
  EXPECT_EQ(pipe->scoring_generation(), 2);
  for (size_t slot = 0; slot < 6; ++slot)
    EXPECT_EQ(pipe->scores(slot).logprobs, std::vector<float>(3, -2.0f)) << slot;
}

// A teacher that refuses (not a transient error) fails the step: NextMicroBatch names it.
TEST(StepPipeline, ATeacherFailureEndsTheStep) {
  InProcessServer<FakeTeacher> teacher("opd.v1.Teacher", kFingerprint, [](int) {
    FakeTeacher::Action a;
    a.status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no such thing");
    return a;
  });
  InProcessServer<FakeRollout> worker("opd.v1.Rollout", kFingerprint);
  auto rollout = Rollout({worker.address});
  auto pipe = StepPipeline::Sample(Prompts(2), Options(true), *rollout, {});
  pipe->StartScoring(Teachers(teacher.address), {}, 1);
  absl::Status st;
  for (;;) {
    auto mb = pipe->NextMicroBatch();
    if (!mb.ok()) {
      st = mb.status();
      break;
    }
    ASSERT_TRUE(mb->has_value()) << "the step ended without the teacher's error";
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("no such thing"), std::string::npos) << st;
}

// A domain whose pool is down: with on_domain_down: default_pool its samples are scored by the
// stage's default pool and counted; with fail the step ends naming the domain's pool.
TEST(StepPipeline, ADownDomainPoolFallsBackToTheDefaultPoolOnlyWhenAskedTo) {
  for (const bool fall_back : {true, false}) {
    InProcessServer<FakeTeacher> fallback("opd.v1.Teacher", kFingerprint,
                                          [](int) { return FakeTeacher::Action{}; });
    auto domain_server = std::make_unique<InProcessServer<FakeTeacher>>(
        "opd.v1.Teacher", kFingerprint, [](int) { return FakeTeacher::Action{}; });
    trainer::TeacherPoolOptions o;
    o.client.timeout = absl::Seconds(60);
    o.backoff_initial = absl::Milliseconds(1);
    o.give_up_when_all_down = true;  // what on_domain_down: default_pool sets for domain pools
    auto math = TeacherPool::Connect("stage/math", {domain_server->address},
                                     trainer::TeacherRequirements(kFingerprint, 320), o);
    ASSERT_TRUE(math.ok()) << math.status();
    domain_server.reset();  // the domain's only replica goes away
    TeacherPools pools = Teachers(fallback.address);
    pools.by_domain["math"] = std::move(*math);
    pools.domain_down_to_fallback = fall_back;
    InProcessServer<FakeRollout> worker("opd.v1.Rollout", kFingerprint);
    auto rollout = Rollout({worker.address});
    StepPipelineOptions po = Options(true);
    po.domain_of = [](const lm::PromptExample&) { return std::string("math"); };
    auto pipe = StepPipeline::Sample(Prompts(2), po, *rollout, {});
    pipe->StartScoring(pools, {}, 1);
    const absl::Status st = pipe->WaitScored();
    if (fall_back) {
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(pipe->score_fallbacks(), 4);
      EXPECT_EQ(pipe->scores(0).logprobs, std::vector<float>(3, -1.0f));
    } else {
      EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
      EXPECT_NE(st.message().find("stage/math"), std::string::npos) << st;
    }
  }
}

}  // namespace
