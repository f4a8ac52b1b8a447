// opd-teacher: serves a teacher model's log-probs over gRPC (opd.v1.Teacher).
//
//   opd-teacher --model DIR --listen 127.0.0.1:7001 [--secret-file F] [--threads N] ...
//
// The shared secret comes from --secret-file or $OPD_SECRET (never a flag value: `ps` shows
// flags); without one it listens only on loopback unless --insecure. SIGINT/SIGTERM stop it
// gracefully: no new calls, calls in flight finish (up to
// --grace-seconds), then the process exits. The flags every model server takes are in
// rpc/model_server.cc.
#include <algorithm>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "lm/plan/device_memory.h"
#include "lm/plan/plan.h"
#include "lm/util/limits.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rpc/auth.h"
#include "rpc/flag_range.h"
#include "rpc/model_server.h"
#include "teacher_service/ep_teacher.h"
#include "teacher_service/service.h"

ABSL_FLAG(int, workers, 1, "scoring threads, each running whole forwards");
ABSL_FLAG(int64_t, max_batch_tokens, 16384, "tokens per forward pass");
ABSL_FLAG(int64_t, max_queue, 64, "requests waiting at most; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_seq_len, 0, "longest sequence accepted (0: the model's max positions)");
ABSL_FLAG(int64_t, max_top_k, 1024, "largest top_k a request may ask for");
ABSL_FLAG(int64_t, logprob_chunk, 512, "rows of [rows, vocab] logits alive at once");
ABSL_FLAG(int64_t, max_reply_mb, 1024,
          "largest reply a request may cost, in MiB (1..2047: protobuf cannot send 2 GiB); "
          "larger requests get RESOURCE_EXHAUSTED; with ScoreStream, the largest reply one "
          "sequence may cost");
ABSL_FLAG(int64_t, max_streams, teacher::StreamLimits().max_streams,
          "ScoreStream calls in progress at once; more get RESOURCE_EXHAUSTED (each holds its "
          "request until it ends)");
ABSL_FLAG(int64_t, max_streams_per_connection, teacher::StreamLimits().max_streams_per_connection,
          "ScoreStream calls in progress at once on one client connection; more get "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, stream_write_timeout_s,
          absl::ToInt64Seconds(teacher::StreamLimits().write_timeout),
          "seconds a reply (a ScoreStream chunk or a Score reply) may wait for its client to "
          "read it; then the call is cancelled and its memory freed. While a reply waits it "
          "holds one of --max-queue's slots");
ABSL_FLAG(bool, batch_invariant, true,
          "score every sequence with arithmetic independent of what shares its batch (CPU): "
          "the same bits whatever concurrent requests are packed with it, so that OPD runs "
          "reproduce and resume exactly; costs some speed (docs/performance.md)");
ABSL_FLAG(int64_t, max_chunk_mb, 32,
          "ScoreStream: reply bytes per chunk, in MiB (1..2047; above --max-reply-mb it is "
          "--max-reply-mb); the server scores and holds one chunk per stream at a time");

namespace {

constexpr const char* kServiceName = "opd.v1.Teacher";

// Scoring workers each run whole forwards with an OpenMP pool of --threads threads of their own,
// so the process holds about workers x threads; past a few hundred forwards at once only split
// the same cores and multiply the activations held.
constexpr int kMaxWorkers = 256;
// Sizes past these are typos: 16M tokens in one forward or in one sequence, a million requests
// waiting, a top-k or a chunk of a million rows exceed any device and any vocabulary.
using lm::limits::kMaxTokens;
constexpr int64_t kMillion = lm::limits::kMaxBatch;

// The chunk budget of ScoreStream. A chunk is one reply message, so it obeys --max-reply-mb: a
// larger --max-chunk-mb is lowered to it, with a warning, rather than refused, so that a command
// line lowering only --max-reply-mb (below the 32 MiB default chunk) still starts.
int64_t ChunkBytes() {
  const int64_t chunk = absl::GetFlag(FLAGS_max_chunk_mb),
                reply = absl::GetFlag(FLAGS_max_reply_mb);
  if (chunk > reply) {
    lm::log::Warn(absl::StrCat("--max-chunk-mb=", chunk, " is above --max-reply-mb=", reply,
                               ": ScoreStream chunks take at most ", reply, " MiB"));
  }
  return std::min(chunk, reply) << 20;
}

// The ranges of opd-teacher's own flags, checked before the model is loaded. --max-reply-mb
// stops at 2047: protobuf cannot send a message of 2 GiB.
absl::Status CheckFlags() {
  using opd::rpc::CheckFlagRange;
  return opd::rpc::FirstError({
      CheckFlagRange("--workers", absl::GetFlag(FLAGS_workers), 1, kMaxWorkers),
      CheckFlagRange("--max-batch-tokens", absl::GetFlag(FLAGS_max_batch_tokens), 1, kMaxTokens),
      CheckFlagRange("--max-queue", absl::GetFlag(FLAGS_max_queue), 1, kMillion),
      CheckFlagRange("--max-seq-len", absl::GetFlag(FLAGS_max_seq_len), 0, kMaxTokens),
      CheckFlagRange("--max-top-k", absl::GetFlag(FLAGS_max_top_k), 0, kMillion),
      CheckFlagRange("--logprob-chunk", absl::GetFlag(FLAGS_logprob_chunk), 1, kMillion),
      CheckFlagRange("--max-reply-mb", absl::GetFlag(FLAGS_max_reply_mb), 1, 2047),
      CheckFlagRange("--max-chunk-mb", absl::GetFlag(FLAGS_max_chunk_mb), 1, 2047),
      CheckFlagRange("--max-streams", absl::GetFlag(FLAGS_max_streams), 1, kMillion),
      CheckFlagRange("--max-streams-per-connection",
                     absl::GetFlag(FLAGS_max_streams_per_connection), 1, kMillion),
      // A day: past it a stalled reply is held as good as forever.
      CheckFlagRange("--stream-write-timeout-s", absl::GetFlag(FLAGS_stream_write_timeout_s), 1,
                     86400),
  });
}

absl::Status Run() {
  ASSIGN_OR_RETURN(opd::rpc::LoadedModel loaded, opd::rpc::LoadServedModel());
  // Expert parallelism: a follower runs rank 0's forwards and serves nothing.
  if (loaded.follower())
    return opd::rpc::FollowUntilStopped("opd-teacher", loaded,
                                        teacher::FollowerForwards(loaded.model));
  if (loaded.secret.empty())
    lm::log::Warn("no shared secret (--secret-file or OPD_SECRET): calls are not authenticated");
  const lm::ModelConfig& config = loaded.config;
  teacher::ScoreLimits limits;
  limits.vocab_size = config.vocab_size;
  limits.max_seq_len = absl::GetFlag(FLAGS_max_seq_len) > 0 ? absl::GetFlag(FLAGS_max_seq_len)
                                                            : config.max_position_embeddings;
  limits.max_top_k = absl::GetFlag(FLAGS_max_top_k);
  limits.max_reply_bytes = absl::GetFlag(FLAGS_max_reply_mb) << 20;
  limits.max_chunk_bytes = ChunkBytes();

  teacher::ScorerOptions so;
  so.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  so.max_queue = absl::GetFlag(FLAGS_max_queue);
  so.workers = absl::GetFlag(FLAGS_workers);
  so.logprob_chunk_rows = absl::GetFlag(FLAGS_logprob_chunk);
  so.batch_invariant = absl::GetFlag(FLAGS_batch_invariant);
  if (so.batch_invariant && !loaded.placement.device.is_cpu()) {
    // What is invariant on CUDA is so without the mode; the rest would only cost time.
    lm::log::Warn(
        "--batch-invariant covers CPU scoring only and is off on this device: on CUDA, cuBLAS "
        "chooses GEMM kernels and torch's reductions split rows by batch shape, so a sequence's "
        "log-probs may change in the last bits with what it is batched with (docs/gpu.md)");
    so.batch_invariant = false;
  }
  // The scoring buckets and LM-head chunks on top of the loaded weights, as opd-ctl plan counts
  // them (lm/plan/plan.h): refused naming the term rather than failing mid-request. Under
  // --world-size the loaded config's local_experts is already this rank's share.
  if (loaded.placement.device.is_cuda()) {
    lm::plan::TeacherSettings plan;
    plan.weight_bytes = static_cast<int64_t>(c10::elementSize(loaded.placement.dtype));
    plan.workers = so.workers;
    plan.max_batch_tokens = so.max_batch_tokens;
    plan.logprob_chunk_rows = so.logprob_chunk_rows;
    const torch::Device& d = loaded.placement.device;
    if (absl::StatusOr<int64_t> device =
            lm::plan::CudaDeviceMemoryBytes(d.has_index() ? d.index() : 0);
        device.ok())
      RETURN_IF_ERROR(lm::plan::CheckTeacherFits(config, plan, *device));
  }
  std::shared_ptr<lm::CausalLM> model = loaded.model;
  if (loaded.ep) model = std::make_shared<teacher::EpLeaderModel>(loaded.model, loaded.ep.get());
  teacher::Scorer scorer(model, so);

  opd::rpc::Authenticator auth(loaded.secret);
  teacher::StreamLimits streams;
  streams.max_streams = absl::GetFlag(FLAGS_max_streams);
  streams.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  streams.write_timeout = absl::Seconds(absl::GetFlag(FLAGS_stream_write_timeout_s));
  teacher::TeacherService service(&scorer, &auth, limits,
                                  loaded.Info(kServiceName, limits.max_seq_len), streams);
  // No reply or chunk exceeds max_reply_bytes (Validate, and the service's last check), so gRPC's
  // send limit can be that: it stays below the 2 GiB protobuf cannot serialise.
  return opd::rpc::ServeUntilSignal(
      "opd-teacher", kServiceName, &service, loaded, [&scorer] { scorer.Stop(); },
      static_cast<int>(limits.max_reply_bytes));
}

}  // namespace

int main(int argc, char** argv) {
  return opd::rpc::ModelServerMain(
      argc, argv, "opd-teacher", "127.0.0.1:7001",
      "serves a teacher model's log-probs over gRPC:\n"
      "  opd-teacher --model DIR [--listen 127.0.0.1:7001] [--secret-file F] [--tls-cert F "
      "--tls-key F]",
      CheckFlags, Run);
}
