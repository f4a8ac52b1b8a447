// The one sample type (lm/generate/sampling.h) and the one byte codec (lm/util/bytes.h): samples
// survive encoding exactly (the learner's rank broadcast and a checkpoint's prefetched samples),
// and every truncated or malformed byte string is a DATA_LOSS error naming what is wrong, never a
// crash or a partial result.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "lm/generate/sampling.h"
#include "lm/util/bytes.h"

namespace lm {
namespace {

std::vector<Sample> SomeSamples() {
  Sample a;
  a.prompt_index = 3;
  a.sample_index = 1;
  a.SetPrompt(std::vector<int64_t>{11, 12, 13});
  a.tokens.insert(a.tokens.end(), {21, 22});
  a.logprobs = {-0.5f, -1.25f};
  a.weight_version = 7;
  a.finish = FinishReason::kStop;
  a.domain = "math";
  a.routing_layers = 2;
  a.routing_top_k = 1;
  a.routed_experts = {0, 1, 2, 3, 0, 1, 2, 3};  // (5 - 1) positions x 2 layers x top-1
  Sample b;  // a bare sequence to score: no response yet, no domain, no routing
  b.SetPrompt(std::vector<int32_t>{5});
  return {a, b};
}

void ExpectSame(const Sample& got, const Sample& want) {
  EXPECT_EQ(got.prompt_index, want.prompt_index);
  EXPECT_EQ(got.sample_index, want.sample_index);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.response_start, want.response_start);
  EXPECT_EQ(got.logprobs, want.logprobs);
  EXPECT_EQ(got.weight_version, want.weight_version);
  EXPECT_EQ(got.finish, want.finish);
  EXPECT_EQ(got.domain, want.domain);
  EXPECT_EQ(got.routed_experts, want.routed_experts);
  EXPECT_EQ(got.routing_layers, want.routing_layers);
  EXPECT_EQ(got.routing_top_k, want.routing_top_k);
}

TEST(Sample, PromptAndResponseAreViewsOfOneSequence) {
  const Sample s = SomeSamples()[0];
  EXPECT_EQ(std::vector<int32_t>(s.prompt().begin(), s.prompt().end()),
            (std::vector<int32_t>{11, 12, 13}));
  EXPECT_EQ(std::vector<int32_t>(s.response().begin(), s.response().end()),
            (std::vector<int32_t>{21, 22}));
  EXPECT_EQ(s.response_length(), 2);
  const Sample scored = Sample::ToScore({1, 2, 3, 4}, 1);
  EXPECT_EQ(scored.response_length(), 3);
  EXPECT_TRUE(scored.logprobs.empty());
}

TEST(SampleCodec, RoundTripsEveryField) {
  const std::vector<Sample> want = SomeSamples();
  auto got = DecodeSamples(EncodeSamples(want));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) ExpectSame((*got)[i], want[i]);
  auto none = DecodeSamples(EncodeSamples({}));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
}

// Every proper prefix of the bytes (and the bytes with one more) is refused: the counts are
// checked against what is left before anything is allocated. Bytes without the format tag are
// another build's (or not samples): FAILED_PRECONDITION, which a resume treats as "sample anew".
TEST(SampleCodec, EveryTruncationIsDataLoss) {
  const std::string bytes = EncodeSamples(SomeSamples());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto got = DecodeSamples(std::string_view(bytes).substr(0, n));
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << n << " bytes";
  }
  EXPECT_EQ(DecodeSamples(bytes + "x").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeSamples("not samples at all").status().code(),
            absl::StatusCode::kFailedPrecondition);
  const std::string untagged(16, '\0');  // the untagged format: a u64 count of 0, and more
  EXPECT_EQ(DecodeSamples(untagged).status().code(), absl::StatusCode::kFailedPrecondition);
}

// Well-formed bytes of a sample whose shape is wrong: named, not trusted.
TEST(SampleCodec, MisshapenSamplesAreNamed) {
  struct Case {
    void (*corrupt)(Sample*);
    std::string named;
  };
  const std::vector<Case> cases = {
      {[](Sample* s) { s->logprobs.pop_back(); }, "1 log-probs for 2 response tokens"},
      {[](Sample* s) { s->response_start = 9; }, "response_start 9 is outside [0, 5]"},
      {[](Sample* s) { s->routed_experts.pop_back(); }, "7 routed experts for 4 positions"},
      {[](Sample* s) { s->finish = static_cast<FinishReason>(7); }, "finish reason 7"},
  };
  for (const Case& c : cases) {
    std::vector<Sample> samples = SomeSamples();
    c.corrupt(&samples[0]);
    auto got = DecodeSamples(EncodeSamples(samples));
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << c.named;
    EXPECT_NE(got.status().message().find("encoded sample 0: " + c.named), std::string::npos)
        << got.status();
  }
}

TEST(ByteCodec, ReaderStopsAtTheEndAndStaysFailed) {
  ByteWriter w;
  w.Put<int32_t>(-4);
  w.PutVector(std::vector<int64_t>{1, 2, 3});
  w.PutString("abc");
  const std::string bytes = w.Take();
  ByteReader r(bytes);
  int32_t i = 0;
  std::vector<int64_t> v;
  std::string_view s;
  ASSERT_TRUE(r.Get(&i) && r.GetVector(&v) && r.GetString(&s));
  EXPECT_EQ(i, -4);
  EXPECT_EQ(v, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(s, "abc");
  EXPECT_TRUE(r.done());
  EXPECT_FALSE(r.Get(&i));
  EXPECT_FALSE(r.ok());
  // A count larger than the bytes left fails without allocating it.
  ByteWriter huge;
  huge.Put<uint64_t>(uint64_t{1} << 60);
  ByteReader h(huge.bytes());
  EXPECT_FALSE(h.GetVector(&v));
  EXPECT_FALSE(h.ok());
}

}  // namespace
}  // namespace lm
