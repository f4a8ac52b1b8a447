#include "trainer/teacher_pool.h"

#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lm/util/log.h"

namespace opd {

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

absl::StatusOr<std::unique_ptr<TeacherPool>> TeacherPool::Connect(
    const std::string& stage, const std::vector<std::string>& endpoints,
    const TeacherRequirements& req, const TeacherPoolOptions& opts) {
  if (endpoints.empty())
    return absl::InvalidArgumentError(absl::StrCat("stage '", stage, "': no teacher endpoints"));
  auto pool = std::make_unique<TeacherPool>(stage, opts);
  for (const auto& ep : endpoints) {
    Replica r;
    r.opts = opts.client;
    r.opts.address = ep;
    auto client = rpc::TeacherClient::Create(r.opts);
    if (!client.ok()) return client.status();
    auto info = (*client)->Info();
    if (!info.ok()) {
      return absl::Status(info.status().code(),
                          absl::StrCat("stage '", stage, "': teacher ", ep,
                                       " is not usable: ", info.status().message()));
    }
    if (!req.tokenizer_fingerprint.empty() &&
        info->tokenizer_fingerprint() != req.tokenizer_fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stage '", stage, "': teacher ", ep, " has tokenizer fingerprint ",
          info->tokenizer_fingerprint(), " but the student's is ", req.tokenizer_fingerprint,
          ": teacher and student must share the tokenizer"));
    }
    if (req.vocab_size > 0 && info->vocab_size() != req.vocab_size) {
      return absl::FailedPreconditionError(absl::StrCat("stage '", stage, "': teacher ", ep,
                                                        " has vocabulary size ", info->vocab_size(),
                                                        ", the student ", req.vocab_size));
    }
    lm::log::Info(absl::StrCat("stage '", stage, "': teacher ", ep, " ok (", info->architecture(),
                               ", ", info->model_name(), ", vocab ", info->vocab_size(), ")"));
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
  absl::MutexLock lock(&mu_);
  std::vector<int> out;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    auto& r = replicas_[i];
    if (!r.healthy) {
      auto opts = r.opts;
      opts.timeout = absl::Seconds(2);
      auto h = rpc::CheckHealth(opts);
      if (h.ok() && *h == grpc::health::v1::HealthCheckResponse::SERVING) {
        r.healthy = true;
        lm::log::Info(
            absl::StrCat("stage '", stage_, "': teacher ", r.opts.address, " is healthy again"));
      }
    }
    if (r.healthy) out.push_back(static_cast<int>(i));
  }
  return out;
}

absl::Status TeacherPool::WaitForHealthy(const std::function<bool()>& stop,
                                         const std::string& last_error) {
  absl::Duration wait = opts_.backoff_initial;
  while (HealthyReplicas().empty()) {
    if (stop && stop()) return absl::CancelledError("stopped while waiting for a teacher replica");
    lm::log::Warn(absl::StrCat(
        "stage '", stage_, "': no healthy teacher replica (", absl::StrJoin(endpoints(), ", "),
        "); waiting ", absl::FormatDuration(wait), " before retrying. Last error: ", last_error));
    absl::SleepFor(wait);
    wait = std::min(wait * 2, opts_.backoff_max);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<rpc::ScoreOutput>> TeacherPool::Score(
    const std::vector<rpc::ScoreInput>& inputs, const rpc::ScoreOptions& score_opts,
    const std::function<bool()>& stop) {
  std::vector<rpc::ScoreOutput> out(inputs.size());
  // Pending shares: [begin, end) index ranges of `inputs` still to score.
  std::vector<std::pair<size_t, size_t>> pending;
  const size_t step = static_cast<size_t>(std::max(1, opts_.max_sequences_per_call));
  for (size_t b = 0; b < inputs.size(); b += step)
    pending.emplace_back(b, std::min(inputs.size(), b + step));
  std::string last_error = "none";
  while (!pending.empty()) {
    auto healthy = HealthyReplicas();
    if (healthy.empty()) {
      if (absl::Status s = WaitForHealthy(stop, last_error); !s.ok()) return s;
      continue;
    }
    // One share per replica at a time, round robin; results land in their own slots.
    struct Call {
      std::pair<size_t, size_t> range;
      int replica;
      std::future<absl::StatusOr<std::vector<rpc::ScoreOutput>>> result;
    };
    std::vector<Call> calls;
    for (size_t i = 0; i < pending.size() && i < healthy.size() * 2; ++i) {
      const int rep = healthy[i % healthy.size()];
      rpc::TeacherClient* client;
      {
        absl::MutexLock lock(&mu_);
        client = replicas_[rep].client.get();
      }
      auto range = pending[i];
      calls.push_back(
          {range, rep, std::async(std::launch::async, [client, range, &inputs, &score_opts] {
             std::vector<rpc::ScoreInput> share(inputs.begin() + range.first,
                                                inputs.begin() + range.second);
             return client->Score(share, score_opts);
           })});
    }
    std::vector<std::pair<size_t, size_t>> retry(pending.begin() + calls.size(), pending.end());
    for (auto& c : calls) {
      auto r = c.result.get();
      if (r.ok() && r->size() == c.range.second - c.range.first) {
        for (size_t i = 0; i < r->size(); ++i) out[c.range.first + i] = std::move((*r)[i]);
        continue;
      }
      const absl::Status s =
          r.ok() ? absl::InternalError("teacher returned a wrong number of results") : r.status();
      if (!IsTransient(s)) return s;
      last_error = std::string(s.message());
      retry.push_back(c.range);
      failovers_.fetch_add(1);
      absl::MutexLock lock(&mu_);
      if (replicas_[c.replica].healthy) {
        replicas_[c.replica].healthy = false;
        lm::log::Warn(absl::StrCat("stage '", stage_, "': teacher ",
                                   replicas_[c.replica].opts.address, " failed (", s.message(),
                                   "); taken out of rotation, its share is retried"));
      }
    }
    pending = std::move(retry);
  }
  return out;
}

}  // namespace opd
