#include "teacher_service/call_registry.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace teacher {

void CallRegistry::Call::WriteStarted(absl::Time now) {
  if (write_started_.exchange(absl::ToUnixNanos(now)) == kNoWrite) ++registry_->writes_waiting_;
}

void CallRegistry::Call::WriteDone() {
  if (write_started_.exchange(kNoWrite) != kNoWrite) --registry_->writes_waiting_;
}

// Inside Cancel on this thread (gRPC may run the call's reactions, down to OnDone, inline in
// TryCancel) the lock is already this thread's; otherwise taking it waits for a Cancel in progress
// on another thread, so that the context is not freed under it.
void CallRegistry::Call::Done() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  WriteDone();
  if (canceller_.load() == std::this_thread::get_id()) {
    ctx_ = nullptr;
  } else {
    absl::MutexLock lock(&mu_);
    ctx_ = nullptr;
  }
  registry_->Remove(this);
}

bool CallRegistry::Call::Cancel() {
  absl::MutexLock lock(&mu_);
  if (ctx_ == nullptr) return false;
  canceller_.store(std::this_thread::get_id());
  ctx_->TryCancel();
  canceller_.store(std::thread::id());
  return true;
}

absl::StatusOr<std::shared_ptr<CallRegistry::Call>> CallRegistry::AddStream(
    grpc::CallbackServerContext* ctx) {
  std::string peer = ctx->peer();
  absl::MutexLock lock(&mu_);
  if (streams_ >= limits_.max_streams) {
    return absl::ResourceExhaustedError(absl::StrCat("the teacher has ", streams_,
                                                     " ScoreStream calls in progress, its limit "
                                                     "(--max-streams=",
                                                     limits_.max_streams, "); retry later"));
  }
  int64_t& mine = streams_per_peer_[peer];
  if (mine >= limits_.max_streams_per_connection) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this connection (", peer, ") has ", mine,
                     " ScoreStream calls in progress, the teacher's limit per connection "
                     "(--max-streams-per-connection=",
                     limits_.max_streams_per_connection, "); finish or cancel one first"));
  }
  ++mine;
  ++streams_;
  auto call = std::make_shared<Call>(this, ctx, std::move(peer), /*stream=*/true);
  calls_.emplace(call.get(), call);
  return call;
}

std::shared_ptr<CallRegistry::Call> CallRegistry::AddUnary(grpc::CallbackServerContext* ctx) {
  auto call = std::make_shared<Call>(this, ctx, ctx->peer(), /*stream=*/false);
  absl::MutexLock lock(&mu_);
  calls_.emplace(call.get(), call);
  return call;
}

void CallRegistry::Remove(const Call* call) {
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(call);
  if (it == calls_.end()) return;
  if (call->stream_) {
    --streams_;
    auto peer = streams_per_peer_.find(call->peer_);
    if (peer != streams_per_peer_.end() && --peer->second == 0) streams_per_peer_.erase(peer);
  }
  calls_.erase(it);  // the reactor may still hold the call; it is no longer the registry's
}

int CallRegistry::CancelStalled(absl::Time now) {
  const int64_t cutoff = absl::ToUnixNanos(now - limits_.write_timeout);
  std::vector<std::shared_ptr<Call>> stalled;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [raw, call] : calls_) {
      const int64_t started = call->write_started_.load();
      if (started != Call::kNoWrite && started <= cutoff) stalled.push_back(call);
    }
  }
  // Outside the registry's lock: a cancelled call's reactions may run inline and unregister it.
  int cancelled = 0;
  for (const auto& call : stalled) cancelled += call->Cancel();
  return cancelled;
}

int64_t CallRegistry::streams() const {
  absl::MutexLock lock(&mu_);
  return streams_;
}

}  // namespace teacher
