#include "trainer/opd/teacher_pool.h"

#include <algorithm>
#include <cmath>
#include <future>
#include <map>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lm/text/tokenizer.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rpc/http_teacher.h"
#include "trainer/opd/opd_config.h"

namespace trainer {
namespace {

// A log-probability is <= 0; this much above 0 is accepted as rounding.
constexpr float kLogprobSlack = 1e-3f;

bool SleepUnlessStopped(absl::Duration d, const std::function<bool()>& stopped) {
  const absl::Time end = absl::Now() + d;
  for (absl::Time now = absl::Now(); now < end; now = absl::Now()) {
    if (stopped()) return false;
    absl::SleepFor(std::min(end - now, absl::Milliseconds(50)));
  }
  return !stopped();
}

absl::Status CheckLogprobs(const std::vector<float>& v, const char* field) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i]) || v[i] > kLogprobSlack)
      return absl::DataLossError(
          absl::StrCat(field, "[", i, "] = ", v[i], " is not a log-probability"));
  }
  return absl::OkStatus();
}

}  // namespace

// [begin, end) of the inputs, and how its tries went.
struct TeacherPool::Share {
  size_t begin = 0, end = 0;
  int replica = 0;   // the replica whose slice of the step's tokens holds it (ScoreSpread)
  int attempts = 0;  // failed tries so far
  absl::Time not_before = absl::InfinitePast();
  bool scored = false;  // its reply was applied: it leaves the pending shares after the round
};

bool IsTransient(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

absl::Duration RetryBackoff(int attempt, absl::Duration initial, absl::Duration max) {
  absl::Duration d = initial;
  for (int i = 1; i < attempt && d < max; ++i) d *= 2;
  return std::min(d, max);
}

TeacherRequirements StudentRequirements(const lm::Tokenizer& tokenizer, int64_t vocab_size) {
  TeacherRequirements req;
  req.tokenizer_fingerprint = tokenizer.Fingerprint();
  req.vocab_size = vocab_size;
  req.probe_text = kTokenizerProbe;
  req.probe_ids = tokenizer.Encode(kTokenizerProbe);
  return req;
}

TeacherRequirements StageRequirements(const OpdConfig& c, const lm::Tokenizer& tokenizer,
                                      int64_t vocab_size) {
  TeacherRequirements req = StudentRequirements(tokenizer, vocab_size);
  req.temperature = static_cast<float>(c.loss.teacher_temperature);
  req.top_k = c.loss.form == LossForm::kTopK ? static_cast<int32_t>(c.loss.top_k) : 0;
  req.max_prompt_len = c.prompts.max_prompt_len;
  req.max_new_tokens = c.rollout.max_new_tokens;
  return req;
}

ScoreSpread SpreadAmong(const std::vector<int64_t>& tokens, size_t caller) {
  ScoreSpread s;
  for (size_t c = 0; c < tokens.size(); ++c) {
    if (c < caller) s.tokens_before += tokens[c];
    s.total_tokens += tokens[c];
  }
  return s;
}

namespace {

std::string IdList(const std::vector<int32_t>& ids) {
  constexpr size_t kShown = 40;  // enough to see where they part, short enough for a log line
  std::vector<int32_t> head(ids.begin(), ids.begin() + std::min(ids.size(), kShown));
  return absl::StrCat("[", absl::StrJoin(head, ", "), ids.size() > kShown ? ", ...]" : "]");
}

// The flag that bounds a server's top-k, by ServiceInfo::architecture, for the refusal's message.
std::string TopKLimitHint(const std::string& architecture, int32_t k) {
  if (architecture == "vllm")
    return absl::StrCat(
        "vLLM returns at most --max-logprobs log-probs per position (20 by "
        "default): start it with --max-logprobs ",
        k, " or more");
  if (architecture == "sglang")
    return absl::StrCat("the server must return top_logprobs_num ", k, " per position");
  return absl::StrCat(
      "opd-teacher answers a top_k of at most its --max-top-k (1024 by default): "
      "start it with --max-top-k ",
      k, " or more");
}

// The context a server states, for the refusal's message.
std::string ContextSource(const std::string& architecture, int64_t max_seq_len) {
  if (architecture == "vllm" || architecture == "sglang")
    return absl::StrCat(
        "its max_model_len ", max_seq_len + 1,
        " less the one token a request must leave room for; raise it with ",
        architecture == "vllm" ? "vLLM's --max-model-len" : "SGLang's --context-length");
  return "its --max-seq-len, by default the model's max_position_embeddings";
}

// A short sequence the stage's scoring is tried on: the student's ids of the tokenizer probe
// (the teacher shares the tokenizer), or the first ids of any vocabulary when none is given.
lm::Sample ProbeSequence(const TeacherRequirements& req) {
  std::vector<int32_t> ids = req.probe_ids;
  if (ids.size() < 2) ids = {0, 1, 2, 3};
  return lm::Sample::ToScore(std::move(ids), 1);
}

// How much the gap between each position's top-1 log-prob and the sent token's grows from the
// scoring at temperature 1 to the one at T: a server that applies T scales logits by 1 / T, so
// every gap (a difference of logits, the normaliser cancels) scales by 1 / T; one that ignores T
// keeps them. Needs top_k >= 1 in both. Returns -1 when the gaps sum to too little to tell (every
// probe token the teacher's top-1).
double GapRatio(const lm::SequenceScore& at1, const lm::SequenceScore& at_t, size_t k1, size_t kt) {
  double g1 = 0, gt = 0;
  for (size_t p = 0; p < at1.logprobs.size(); ++p) {
    g1 += at1.topk_logprobs[p * k1] - at1.logprobs[p];
    gt += at_t.topk_logprobs[p * kt] - at_t.logprobs[p];
  }
  constexpr double kTooLittle = 1e-3;  // nats over the probe: below it the ratio is noise
  return g1 > kTooLittle ? gt / g1 : -1;
}

}  // namespace

// An endpoint with no fingerprint (SGLang, vLLM) is asked to tokenize the probe: different ids
// mean a different tokenizer, whose log-probs would score other tokens than the student's. A
// transient refusal (5xx, 429) is retried as a share would be; "no /tokenize" (UNIMPLEMENTED)
// lets the endpoint through with a warning; anything else refuses it, unless its endpoint says
// it has no tokenizer ("?tokenizer=none", and then it is not asked).
absl::Status TeacherPool::CheckTokenizerProbe(const std::string& ep,
                                              opd::rpc::TeacherEndpoint& client,
                                              const TeacherRequirements& req) const {
  if (req.probe_text.empty()) return absl::OkStatus();
  if (opd::rpc::IsHttpTeacherEndpoint(ep)) {
    auto address = opd::rpc::ParseHttpTeacherAddress(ep);
    if (address.ok() && !address->has_tokenizer) {
      lm::log::Info(absl::StrCat("stage '", stage_, "': teacher ", ep,
                                 " is declared without a tokenizer (?tokenizer=none): its "
                                 "tokenizer is not checked"));
      return absl::OkStatus();
    }
  }
  const auto cancelled = [this] {
    return opts_.client.canceller != nullptr && opts_.client.canceller->cancelled();
  };
  absl::StatusOr<std::vector<int32_t>> ids = client.Tokenize(req.probe_text);
  for (int attempt = 1;
       !ids.ok() && IsTransient(ids.status()) && attempt < opts_.max_attempts && !cancelled();
       ++attempt) {
    const absl::Duration wait = RetryBackoff(attempt, opts_.backoff_initial, opts_.backoff_max);
    lm::log::Warn(absl::StrCat("stage '", stage_, "': teacher ", ep,
                               " could not tokenize the probe (", ids.status().message(),
                               "); retrying in ", absl::FormatDuration(wait)));
    if (!Wait(wait, cancelled)) break;
    ids = client.Tokenize(req.probe_text);
  }
  if (absl::IsUnimplemented(ids.status())) {
    lm::log::Warn(absl::StrCat("stage '", stage_, "': teacher ", ep,
                               " cannot tokenize, so its tokenizer is not checked (",
                               ids.status().message(), ")"));
    return absl::OkStatus();
  }
  if (!ids.ok()) {
    return absl::Status(
        ids.status().code(),
        absl::StrCat("stage '", stage_, "': teacher ", ep,
                     " did not tokenize the tokenizer probe: ", ids.status().message(),
                     ". A server without a tokenizer is declared so by appending "
                     "?tokenizer=none to its endpoint (its tokenizer is then not checked)"));
  }
  if (*ids == req.probe_ids) return absl::OkStatus();
  size_t at = 0;
  while (at < ids->size() && at < req.probe_ids.size() && (*ids)[at] == req.probe_ids[at]) ++at;
  auto id_at = [at](const std::vector<int32_t>& v) {
    return at < v.size() ? std::to_string(v[at]) : std::string("none (it ends)");
  };
  return absl::FailedPreconditionError(absl::StrCat(
      "stage '", stage_, "': teacher ", ep, " tokenizes the probe \"",
      absl::CHexEscape(req.probe_text), "\" as ", IdList(*ids), " (", ids->size(),
      " ids) but the student's tokenizer gives ", IdList(req.probe_ids), " (", req.probe_ids.size(),
      " ids); first different at id ", at, ": the teacher's ", id_at(*ids), ", the student's ",
      id_at(req.probe_ids), ". Teacher and student must share the tokenizer"));
}

// The stage's scoring tried on a probe sequence where Info cannot tell: a top-k above the
// server's limit, and for SGLang at T != 1 whether it applies the temperature at all.
absl::Status TeacherPool::CheckScoringProbe(const std::string& ep,
                                            opd::rpc::TeacherEndpoint& client,
                                            const opd::v1::ServiceInfo& info,
                                            const TeacherRequirements& req) const {
  const bool check_temperature = req.temperature != 1.0f && info.architecture() == "sglang";
  if (req.top_k <= 0 && !check_temperature) return absl::OkStatus();
  const std::vector<lm::Sample> probe = {ProbeSequence(req)};
  const Share whole{0, 1};
  opd::rpc::ScoreOptions at_t;
  at_t.temperature = req.temperature;
  at_t.top_k = std::max(req.top_k, check_temperature ? 1 : 0);
  const std::string asked = absl::StrCat("top_k ", at_t.top_k, ", temperature ", at_t.temperature);
  absl::StatusOr<std::vector<lm::SequenceScore>> got = client.Score(probe, at_t);
  if (!got.ok()) {
    const bool refused = absl::IsInvalidArgument(got.status());
    return absl::Status(
        refused ? absl::StatusCode::kFailedPrecondition : got.status().code(),
        absl::StrCat("stage '", stage_, "': teacher ", ep,
                     " did not score a probe sequence as the ", "stage asks (", asked,
                     "): ", got.status().message(),
                     refused && req.top_k > 0
                         ? absl::StrCat(". ", TopKLimitHint(info.architecture(), req.top_k))
                         : ""));
  }
  RETURN_IF_ERROR(Validate(*got, whole, probe, at_t.top_k, ep));
  if (!check_temperature) return absl::OkStatus();
  opd::rpc::ScoreOptions at1;
  at1.top_k = 1;
  absl::StatusOr<std::vector<lm::SequenceScore>> ref = client.Score(probe, at1);
  if (!ref.ok()) {
    return absl::Status(
        ref.status().code(),
        absl::StrCat("stage '", stage_, "': teacher ", ep,
                     " did not score a probe sequence at temperature 1: ", ref.status().message()));
  }
  RETURN_IF_ERROR(Validate(*ref, whole, probe, 1, ep));
  const double ratio = GapRatio(ref->front(), got->front(), 1, static_cast<size_t>(at_t.top_k));
  const double scaled = 1.0 / req.temperature;
  if (ratio >= 0 && std::abs(ratio - scaled) < std::abs(ratio - 1.0)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "stage '", stage_, "': teacher ", ep, " is an SGLang server that does not apply ",
      "loss.teacher_temperature ", req.temperature, " to input log-probs: ",
      ratio < 0 ? "the probe cannot tell (its tokens are all the teacher's top-1)"
                : absl::StrCat("on a probe sequence the log-prob gaps to the top-1 token scale by ",
                               ratio, " from temperature 1, not by 1/T = ", scaled),
      ". Stock SGLang scores prompts at temperature 1 whatever the request says: use "
      "loss.teacher_temperature 1, or an opd-teacher endpoint"));
}

// Info() of a new endpoint against the student's requirements (what the endpoint leaves unknown
// is not checked), then the probes.
absl::Status TeacherPool::CheckEndpoint(const std::string& ep, opd::rpc::TeacherEndpoint& client,
                                        const TeacherRequirements& req) const {
  auto info = client.Info();
  if (!info.ok()) {
    return absl::Status(info.status().code(),
                        absl::StrCat("stage '", stage_, "': teacher ", ep,
                                     " is not usable: ", info.status().message()));
  }
  if (!req.tokenizer_fingerprint.empty() && !info->tokenizer_fingerprint().empty() &&
      info->tokenizer_fingerprint() != req.tokenizer_fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat("stage '", stage_, "': teacher ", ep, " has tokenizer fingerprint ",
                     info->tokenizer_fingerprint(), " but the student's is ",
                     req.tokenizer_fingerprint, ": teacher and student must share the tokenizer"));
  }
  if (req.vocab_size > 0 && info->vocab_size() > 0 && info->vocab_size() != req.vocab_size) {
    return absl::FailedPreconditionError(absl::StrCat("stage '", stage_, "': teacher ", ep,
                                                      " has vocabulary size ", info->vocab_size(),
                                                      ", the student ", req.vocab_size));
  }
  if (req.temperature != 1.0f && info->architecture() == "vllm") {
    return absl::FailedPreconditionError(
        absl::StrCat("stage '", stage_, "': teacher ", ep, " is a vLLM server, which cannot apply ",
                     "loss.teacher_temperature ", req.temperature,
                     " to prompt log-probs: use temperature 1, or an opd-teacher endpoint"));
  }
  const int64_t needed = req.max_prompt_len + req.max_new_tokens;
  if (needed > 0 && info->max_seq_len() > 0 && info->max_seq_len() < needed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage '", stage_, "': teacher ", ep, " scores sequences of at most ", info->max_seq_len(),
        " tokens (", ContextSource(info->architecture(), info->max_seq_len()),
        "), but the stage's sequences reach prompts.max_prompt_len + rollout.max_new_tokens = ",
        req.max_prompt_len, " + ", req.max_new_tokens, " = ", needed, " tokens"));
  }
  if (info->tokenizer_fingerprint().empty()) RETURN_IF_ERROR(CheckTokenizerProbe(ep, client, req));
  RETURN_IF_ERROR(CheckScoringProbe(ep, client, *info, req));
  lm::log::Info(absl::StrCat("stage '", stage_, "': teacher ", ep, " ok (", info->architecture(),
                             ", ", info->model_name(), ", vocab ", info->vocab_size(),
                             ", max sequence ", info->max_seq_len(), ")"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TeacherPool>> TeacherPool::Connect(
    const std::string& stage, const std::vector<std::string>& endpoints,
    const TeacherRequirements& req, const TeacherPoolOptions& opts) {
  if (endpoints.empty())
    return absl::InvalidArgumentError(absl::StrCat("stage '", stage, "': no teacher endpoints"));
  auto pool = std::make_unique<TeacherPool>(stage, opts, req.vocab_size);
  for (const auto& ep : endpoints) {
    Replica r;
    r.opts = opts.client;
    r.opts.address = ep;
    auto client = opd::rpc::CreateTeacherEndpoint(r.opts);
    if (!client.ok()) return client.status();
    RETURN_IF_ERROR(pool->CheckEndpoint(ep, **client, req));
    r.client = std::move(*client);
    absl::MutexLock lock(&pool->mu_);
    pool->replicas_.push_back(std::move(r));
  }
  return pool;
}

std::vector<std::string> TeacherPool::endpoints() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& r : replicas_) out.push_back(r.opts.address);
  return out;
}

int TeacherPool::healthy_count() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& r : replicas_) n += r.healthy;
  return n;
}

std::vector<int> TeacherPool::HealthyReplicas() {
  // Health checks run without the lock (each can take its 2 s deadline).
  // (Replicas are never removed, so the endpoint pointers stay valid.)
  std::vector<std::pair<int, opd::rpc::TeacherEndpoint*>> due;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = Now();
    for (size_t i = 0; i < replicas_.size(); ++i) {
      if (!replicas_[i].healthy && now >= replicas_[i].readmit_at)
        due.emplace_back(static_cast<int>(i), replicas_[i].client.get());
    }
  }
  std::vector<bool> passed(due.size());
  for (size_t d = 0; d < due.size(); ++d) passed[d] = due[d].second->Healthy();
  absl::MutexLock lock(&mu_);
  for (size_t d = 0; d < due.size(); ++d) {
    Replica& r = replicas_[due[d].first];
    if (passed[d]) {
      r.healthy = true;
      lm::log::Info(absl::StrCat("stage '", stage_, "': teacher ", r.opts.address,
                                 " passed its health check after its cool-down: back in rotation"));
    } else {
      r.readmit_at =
          Now() + RetryBackoff(r.consecutive_failures, opts_.readmit_after, opts_.readmit_max);
    }
  }
  std::vector<int> out;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    if (replicas_[i].healthy) out.push_back(static_cast<int>(i));
  }
  return out;
}

absl::Time TeacherPool::NextReadmission() const {
  absl::MutexLock lock(&mu_);
  absl::Time next = absl::InfiniteFuture();
  for (const auto& r : replicas_) {
    if (!r.healthy) next = std::min(next, r.readmit_at);
  }
  return next;
}

void TeacherPool::TakeOutOfRotation(int replica, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  Replica& r = replicas_[replica];
  if (!r.healthy) return;  // another call of the same round: the same outage
  ++r.consecutive_failures;
  const absl::Duration cool =
      RetryBackoff(r.consecutive_failures, opts_.readmit_after, opts_.readmit_max);
  r.readmit_at = Now() + cool;
  r.healthy = false;
  lm::log::Warn(absl::StrCat("stage '", stage_, "': teacher ", r.opts.address, " failed (",
                             why.message(), "); out of rotation for ", absl::FormatDuration(cool),
                             ", its share is retried"));
}

bool TeacherPool::Wait(absl::Duration d, const std::function<bool()>& stopped) const {
  return opts_.wait ? opts_.wait(d, stopped) : SleepUnlessStopped(d, stopped);
}

absl::Status TeacherPool::Validate(const std::vector<lm::SequenceScore>& out, const Share& share,
                                   const std::vector<lm::Sample>& inputs, int32_t top_k,
                                   const std::string& address) const {
  auto bad = [&](size_t seq, const absl::Status& s) {
    return absl::DataLossError(absl::StrCat("stage '", stage_, "': teacher ", address,
                                            " sent an invalid reply for sequence ", seq, ": ",
                                            s.message()));
  };
  if (out.size() != share.end - share.begin) {
    return absl::DataLossError(absl::StrCat("stage '", stage_, "': teacher ", address, " sent ",
                                            out.size(), " results for ", share.end - share.begin,
                                            " sequences"));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    const size_t seq = share.begin + i;
    const size_t n = inputs[seq].tokens.size() - static_cast<size_t>(inputs[seq].response_start);
    const size_t k = static_cast<size_t>(std::max(top_k, 0));
    const lm::SequenceScore& o = out[i];
    if (o.logprobs.size() != n) {
      return bad(seq, absl::DataLossError(absl::StrCat("logprobs has ", o.logprobs.size(),
                                                       " entries, the response ", n, " tokens")));
    }
    if (absl::Status s = CheckLogprobs(o.logprobs, "logprobs"); !s.ok()) return bad(seq, s);
    if (o.topk_ids.size() != n * k || o.topk_logprobs.size() != n * k) {
      return bad(
          seq, absl::DataLossError(absl::StrCat("topk_ids/topk_logprobs have ", o.topk_ids.size(),
                                                "/", o.topk_logprobs.size(), " entries, expected ",
                                                n * k, " (top_k ", k, ")")));
    }
    for (size_t j = 0; j < o.topk_ids.size(); ++j) {
      const int32_t id = o.topk_ids[j];
      if (id < 0 || (vocab_size_ > 0 && id >= vocab_size_)) {
        return bad(seq, absl::DataLossError(absl::StrCat("topk_ids[", j, "] = ", id,
                                                         " is outside the vocabulary [0, ",
                                                         vocab_size_, ")")));
      }
    }
    if (absl::Status s = CheckLogprobs(o.topk_logprobs, "topk_logprobs"); !s.ok())
      return bad(seq, s);
  }
  return absl::OkStatus();
}

std::vector<TeacherPool::Share> TeacherPool::MakeShares(const std::vector<lm::Sample>& inputs,
                                                        const ScoreSpread& spread) const {
  int64_t own = 0;
  for (const auto& s : inputs) own += static_cast<int64_t>(s.tokens.size());
  const __int128 total = std::max(spread.total_tokens, spread.tokens_before + own);
  __int128 replicas;
  {
    absl::MutexLock lock(&mu_);
    replicas = static_cast<__int128>(std::max<size_t>(1, replicas_.size()));
  }
  const size_t per_call = static_cast<size_t>(std::max(1, opts_.max_sequences_per_call));
  std::vector<Share> shares;
  __int128 at = std::max<int64_t>(0, spread.tokens_before);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t len = static_cast<int64_t>(inputs[i].tokens.size());
    // The slice holding the sequence's middle, (at + len / 2) * replicas / total, in integers.
    const int replica =
        spread.replica_hint >= 0
            ? static_cast<int>(spread.replica_hint % static_cast<int64_t>(replicas))
            : static_cast<int>(
                  std::min(replicas - 1, total > 0 ? (2 * at + len) * replicas / (2 * total) : 0));
    at += len;
    if (shares.empty() || shares.back().replica != replica ||
        shares.back().end - shares.back().begin >= per_call) {
      Share share;
      share.begin = i;
      share.replica = replica;
      shares.push_back(share);
    }
    shares.back().end = i + 1;
  }
  return shares;
}

namespace {

// A share's first try goes to its own replica while that is healthy; a retry (or a share whose
// replica is out of rotation) moves along the healthy ones, so tries land on different replicas.
int ReplicaFor(int own, int attempts, const std::vector<int>& healthy) {
  const bool own_healthy = std::find(healthy.begin(), healthy.end(), own) != healthy.end();
  return attempts == 0 && own_healthy
             ? own
             : healthy[static_cast<size_t>(own + attempts) % healthy.size()];
}

}  // namespace

// One Score() call, round after round until every share is scored: the shares left, the scores
// so far and the last transient error are shared by every step of every round.
class TeacherPool::ScoreRun {
 public:
  ScoreRun(TeacherPool& pool, const std::vector<lm::Sample>& inputs,
           const opd::rpc::ScoreOptions& score_opts, const std::function<bool()>& stop,
           const ScoreSpread& spread)
      : pool_(pool),
        inputs_(inputs),
        score_opts_(score_opts),
        stop_(stop),
        out_(inputs.size()),
        pending_(pool.MakeShares(inputs, spread)),
        deadline_(pool.Now() + pool.opts_.score_deadline) {}

  absl::StatusOr<std::vector<lm::SequenceScore>> Run();

 private:
  // Shares (by index into pending_) and the replica each is sent to this round.
  struct Round {
    std::vector<std::pair<size_t, int>> ready;     // (share, replica)
    absl::Time earliest = absl::InfiniteFuture();  // the first backoff end of those not ready
  };
  struct Call {
    size_t share;
    int replica;
    std::string address;
    std::future<absl::StatusOr<std::vector<lm::SequenceScore>>> result;
  };

  bool Stopped() const {
    return (stop_ && stop_()) ||
           (pool_.opts_.client.canceller != nullptr && pool_.opts_.client.canceller->cancelled());
  }
  // A stop or the score deadline ends the call before the next round.
  absl::Status CheckStillWanted() const;
  // With every replica out of rotation: gives up when told to, else waits for a re-admission.
  absl::Status WaitForAReplica();
  Round PickReady(const std::vector<int>& healthy, absl::Time now) const;
  // Sends every ready share, collects every reply, and drops the shares that were scored.
  absl::Status RunRound(const Round& round);
  std::vector<Call> Launch(const Round& round);
  // A reply: validated, then written to its inputs' slots.
  absl::Status Accept(const Call& c, std::vector<lm::SequenceScore>& scores);
  // A failed call: a retry after the backoff, or the step's error.
  absl::Status Fail(const Call& c, const absl::Status& s);

  TeacherPool& pool_;
  const std::vector<lm::Sample>& inputs_;
  const opd::rpc::ScoreOptions& score_opts_;
  const std::function<bool()>& stop_;
  std::vector<lm::SequenceScore> out_;
  std::vector<Share> pending_;
  std::string last_error_ = "none";
  const absl::Time deadline_;
};

absl::StatusOr<std::vector<lm::SequenceScore>> TeacherPool::ScoreRun::Run() {
  while (!pending_.empty()) {
    RETURN_IF_ERROR(CheckStillWanted());
    const std::vector<int> healthy = pool_.HealthyReplicas();
    if (healthy.empty()) {
      RETURN_IF_ERROR(WaitForAReplica());
      continue;
    }
    const absl::Time now = pool_.Now();
    const Round round = PickReady(healthy, now);
    if (round.ready.empty()) {
      pool_.Wait(std::max(absl::ZeroDuration(), std::min(round.earliest, deadline_) - now),
                 [this] { return Stopped(); });
      continue;
    }
    RETURN_IF_ERROR(RunRound(round));
  }
  return std::move(out_);
}

absl::Status TeacherPool::ScoreRun::CheckStillWanted() const {
  const std::string& stage = pool_.stage_;
  if (Stopped()) {
    return absl::CancelledError(absl::StrCat("stage '", stage, "': stopped while scoring (",
                                             pending_.size(),
                                             " share(s) of sequences not scored)"));
  }
  if (pool_.Now() >= deadline_) {
    return absl::DeadlineExceededError(absl::StrCat(
        "stage '", stage, "': scoring passed its deadline of ",
        absl::FormatDuration(pool_.opts_.score_deadline), " (train.score_deadline_s) with ",
        pending_.size(), " share(s) of sequences not scored; replicas: ",
        absl::StrJoin(pool_.endpoints(), ", "), ". Last error: ", last_error_));
  }
  return absl::OkStatus();
}

absl::Status TeacherPool::ScoreRun::WaitForAReplica() {
  const std::string& stage = pool_.stage_;
  if (pool_.opts_.give_up_when_all_down)
    return absl::UnavailableError(
        absl::StrCat("stage '", stage, "': every teacher replica is down (",
                     absl::StrJoin(pool_.endpoints(), ", "), "). Last error: ", last_error_));
  // Until the next cool-down ends (at most backoff_max, never past the deadline), and at least
  // 10 ms so that the loop does not spin.
  const absl::Duration wait = std::max(
      absl::Milliseconds(10), std::min({pool_.NextReadmission() - pool_.Now(),
                                        pool_.opts_.backoff_max, deadline_ - pool_.Now()}));
  lm::log::Warn(absl::StrCat("stage '", stage, "': no healthy teacher replica (",
                             absl::StrJoin(pool_.endpoints(), ", "), "); next health check in ",
                             absl::FormatDuration(wait), ". Last error: ", last_error_));
  pool_.Wait(wait, [this] { return Stopped(); });
  return absl::OkStatus();
}

// The shares whose backoff has passed, each on its own replica while that is healthy, else (and
// after a failure) on another healthy one; at most two calls per replica.
TeacherPool::ScoreRun::Round TeacherPool::ScoreRun::PickReady(const std::vector<int>& healthy,
                                                              absl::Time now) const {
  Round round;
  std::map<int, int> calls_on;
  for (size_t i = 0; i < pending_.size(); ++i) {
    const Share& sh = pending_[i];
    if (sh.not_before > now) {
      round.earliest = std::min(round.earliest, sh.not_before);
      continue;
    }
    const int rep = ReplicaFor(sh.replica, sh.attempts, healthy);
    if (calls_on[rep] < 2) {
      ++calls_on[rep];
      round.ready.emplace_back(i, rep);
    }
  }
  return round;
}

absl::Status TeacherPool::ScoreRun::RunRound(const Round& round) {
  std::vector<Call> calls = Launch(round);
  // Every call of the round is collected before deciding, so no call outlives Score(); the
  // first error is the step's.
  absl::Status fatal;
  for (auto& c : calls) {
    absl::StatusOr<std::vector<lm::SequenceScore>> r = c.result.get();
    absl::Status s = r.ok() ? Accept(c, *r) : Fail(c, r.status());
    if (fatal.ok()) fatal = std::move(s);
  }
  RETURN_IF_ERROR(fatal);
  pending_.erase(
      std::remove_if(pending_.begin(), pending_.end(), [](const Share& sh) { return sh.scored; }),
      pending_.end());
  return absl::OkStatus();
}

std::vector<TeacherPool::ScoreRun::Call> TeacherPool::ScoreRun::Launch(const Round& round) {
  std::vector<Call> calls;
  const std::vector<lm::Sample>& inputs = inputs_;
  const opd::rpc::ScoreOptions& score_opts = score_opts_;
  for (const auto& [share_index, rep] : round.ready) {
    opd::rpc::TeacherEndpoint* client;
    {
      absl::MutexLock lock(&pool_.mu_);
      client = pool_.replicas_[rep].client.get();
    }
    const Share range = pending_[share_index];
    calls.push_back({share_index, rep, client->address(),
                     std::async(std::launch::async, [client, range, &inputs, &score_opts] {
                       std::vector<lm::Sample> share(inputs.begin() + range.begin,
                                                     inputs.begin() + range.end);
                       return client->Score(share, score_opts);
                     })});
  }
  return calls;
}

absl::Status TeacherPool::ScoreRun::Accept(const Call& c, std::vector<lm::SequenceScore>& scores) {
  Share& share = pending_[c.share];
  RETURN_IF_ERROR(pool_.Validate(scores, share, inputs_, score_opts_.top_k, c.address));
  for (size_t i = 0; i < scores.size(); ++i) out_[share.begin + i] = std::move(scores[i]);
  pool_.scored_.fetch_add(static_cast<int64_t>(scores.size()));
  share.scored = true;
  absl::MutexLock lock(&pool_.mu_);
  pool_.replicas_[c.replica].consecutive_failures = 0;
  return absl::OkStatus();
}

absl::Status TeacherPool::ScoreRun::Fail(const Call& c, const absl::Status& s) {
  const std::string& stage = pool_.stage_;
  Share& share = pending_[c.share];
  if (Stopped()) return absl::OkStatus();  // a cancelled call is not the replica's fault
  if (!IsTransient(s)) {
    return absl::Status(
        s.code(), absl::StrCat("stage '", stage, "': teacher ", c.address, " failed sequences [",
                               share.begin, ", ", share.end, ") (not retried): ", s.message()));
  }
  last_error_ = std::string(s.message());
  pool_.failovers_.fetch_add(1);
  if (++share.attempts >= pool_.opts_.max_attempts) {
    return absl::Status(
        s.code(), absl::StrCat("stage '", stage, "': sequences [", share.begin, ", ", share.end,
                               ") failed ", share.attempts, " times; last error: ", s.message()));
  }
  share.not_before = pool_.Now() + RetryBackoff(share.attempts, pool_.opts_.backoff_initial,
                                                pool_.opts_.backoff_max);
  // A full queue is load, not a fault: the replica stays, the share waits its backoff.
  if (s.code() != absl::StatusCode::kResourceExhausted) pool_.TakeOutOfRotation(c.replica, s);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<lm::SequenceScore>> TeacherPool::Score(
    const std::vector<lm::Sample>& inputs, const opd::rpc::ScoreOptions& score_opts,
    const std::function<bool()>& stop, const ScoreSpread& spread) {
  return ScoreRun(*this, inputs, score_opts, stop, spread).Run();
}

}  // namespace trainer
