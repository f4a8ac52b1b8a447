// opd-rollout: samples responses from the student over gRPC (opd.v1.Rollout) and takes new
// weights from the learner.
//
//   opd-rollout --model DIR --listen 127.0.0.1:7002 [--secret-file F] [--threads N] ...
//
// The shared secret comes from --secret-file or $OPD_SECRET; without one, UpdateWeights is
// refused, and it listens only on loopback unless --insecure. SIGINT/SIGTERM stop it gracefully.
// The flags every model server takes are in rpc/model_server.cc.
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "lm/plan/device_memory.h"
#include "lm/plan/plan.h"
#include "lm/util/limits.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rollout/engine.h"
#include "rollout/ep_rollout.h"
#include "rollout/kv_pool.h"
#include "rollout/service.h"
#include "rpc/auth.h"
#include "rpc/flag_range.h"
#include "rpc/model_server.h"

ABSL_FLAG(int, max_concurrent, 4, "generations at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_seq_len, 0, "longest prompt + response (0: the model's max positions)");
ABSL_FLAG(int64_t, max_samples_per_prompt, 64, "largest samples_per_prompt accepted");
ABSL_FLAG(int64_t, max_slots, 1024, "prompts x samples one request may decode");
ABSL_FLAG(std::string, engine, "paged",
          "paged: continuous batching over a paged KV cache (rollout/engine.h); static: one "
          "batch per request with a contiguous cache (the reference sampler)");
ABSL_FLAG(std::string, kv_cache_gb, "auto",
          "paged engine: the KV cache pool, GiB, preallocated in the model's dtype and shared by "
          "all requests; a request with a sequence that cannot fit it gets RESOURCE_EXHAUSTED. "
          "auto: what the device has left after the weights, a weight update's receive bucket, "
          "the prefill workspace and a 2 GiB reserve (opd-ctl plan's terms; rollout/kv_pool.h); "
          "a CPU worker without --device-memory-gb takes 4 GiB. Static sampler (and expert "
          "parallelism): the largest cache of one batch of a request, sized the same way");
ABSL_FLAG(double, device_memory_gb, 0,
          "the device's memory, GiB, that --kv-cache-gb auto sizes the pool from (0: the CUDA "
          "driver's figure; on the CPU, none)");
ABSL_FLAG(int64_t, kv_block_size, 16, "paged engine: tokens per KV cache block");
ABSL_FLAG(int64_t, max_running_seqs, 256, "paged engine: sequences decoding at once");
ABSL_FLAG(int64_t, max_queued_requests, 64,
          "paged engine: requests waiting or running; more get RESOURCE_EXHAUSTED");

namespace {

constexpr const char* kServiceName = "opd.v1.Rollout";

// Sizes past these are typos: 16M tokens in one sequence, a million sequences in one request or
// samples of one prompt, 64 TiB of KV cache, blocks of more than 1024 tokens (the paged engine's
// blocks are a few dozen tokens; a huge block wastes its unused tail in every sequence).
using lm::limits::kMaxTokens;
constexpr int64_t kMillion = lm::limits::kMaxBatch;
using lm::limits::kMaxGiB;
// Generations at once: each holds a gRPC reactor and, with the static engine, a sampling thread
// of its own (opd::rpc::kMaxThreads bounds thread counts everywhere).
constexpr int kMaxConcurrent = opd::rpc::kMaxThreads;

// --engine, decoded once.
enum class EngineKind { kPaged, kStatic };
absl::StatusOr<EngineKind> EngineFlag() {
  const std::string engine = absl::GetFlag(FLAGS_engine);
  if (engine == "paged") return EngineKind::kPaged;
  if (engine == "static") return EngineKind::kStatic;
  return absl::InvalidArgumentError(
      absl::StrCat("--engine=", engine, " is neither paged nor static"));
}

// The ranges of opd-rollout's own flags and --engine, checked before the model is loaded.
absl::Status CheckFlags() {
  using opd::rpc::CheckFlagRange;
  RETURN_IF_ERROR(EngineFlag().status());
  return opd::rpc::FirstError({
      CheckFlagRange("--max-concurrent", absl::GetFlag(FLAGS_max_concurrent), 1, kMaxConcurrent),
      CheckFlagRange("--max-seq-len", absl::GetFlag(FLAGS_max_seq_len), 0, kMaxTokens),
      CheckFlagRange("--max-samples-per-prompt", absl::GetFlag(FLAGS_max_samples_per_prompt), 1,
                     kMillion),
      CheckFlagRange("--max-slots", absl::GetFlag(FLAGS_max_slots), 1, kMillion),
      rollout::ParseKvCacheGb(absl::GetFlag(FLAGS_kv_cache_gb), kMaxGiB).status(),
      CheckFlagRange("--device-memory-gb", absl::GetFlag(FLAGS_device_memory_gb), 0.0, kMaxGiB),
      CheckFlagRange("--kv-block-size", absl::GetFlag(FLAGS_kv_block_size), 1, 1024),
      CheckFlagRange("--max-running-seqs", absl::GetFlag(FLAGS_max_running_seqs), 1, kMillion),
      CheckFlagRange("--max-queued-requests", absl::GetFlag(FLAGS_max_queued_requests), 1,
                     kMillion),
  });
}

// The engine --engine asks for, or the static sampler under expert parallelism; refused at
// start-up rather than on every Generate when the model cannot run it.
absl::StatusOr<EngineKind> ChooseEngine(const opd::rpc::LoadedModel& loaded) {
  ASSIGN_OR_RETURN(EngineKind engine_kind, EngineFlag());
  // Expert parallelism runs the static sampler on every rank (rollout/ep_rollout.h).
  if (loaded.ep && engine_kind == EngineKind::kPaged) {
    lm::log::Info("expert parallelism: the static sampler (the paged engine is single-process)");
    engine_kind = EngineKind::kStatic;
  }
  if (engine_kind == EngineKind::kPaged && !loaded.model->SupportsPagedKV())
    return absl::FailedPreconditionError(absl::StrCat(
        loaded.model_dir, " is a ", loaded.config.model_type,
        " model, which the paged rollout engine cannot sample: it has no paged KV cache "
        "(lm/model/paged_kv.h); serve a qwen3_moe or qwen3_next student"));
  if (engine_kind == EngineKind::kStatic && !loaded.model->SupportsKVCache())
    return absl::FailedPreconditionError(absl::StrCat(
        loaded.model_dir, " is a ", loaded.config.model_type,
        " model, which this rollout worker cannot sample: it has no incremental decode (KV "
        "cache); serve a qwen3_moe or qwen3_next student"));
  return engine_kind;
}

void WarnIfNoSecret(const opd::rpc::LoadedModel& loaded) {
  if (loaded.secret.empty()) {
    lm::log::Warn(
        "no shared secret (--secret-file or OPD_SECRET): calls are not authenticated and "
        "UpdateWeights is disabled");
  }
}

// The device's memory that --kv-cache-gb auto sizes the pool from: --device-memory-gb, else the
// CUDA driver's figure; 0 (unknown) on the CPU or when the driver cannot say.
int64_t DeviceMemoryBytes(const torch::Device& d) {
  int64_t device_bytes =
      static_cast<int64_t>(absl::GetFlag(FLAGS_device_memory_gb) * lm::plan::kGiB);
  if (device_bytes == 0 && d.is_cuda()) {
    if (absl::StatusOr<int64_t> cuda =
            lm::plan::CudaDeviceMemoryBytes(d.has_index() ? d.index() : 0);
        cuda.ok())
      device_bytes = *cuda;
  }
  return device_bytes;
}

// The engine's flags and the paged engine's pool (or the static sampler's largest batch cache),
// from the plan's terms (rollout/kv_pool.h); refused here, naming the term, rather than by an
// allocation failure in the KV pool (the largest term).
absl::StatusOr<rollout::EngineOptions> EngineOptionsFromFlags(const opd::rpc::LoadedModel& loaded) {
  const int64_t dtype_bytes = static_cast<int64_t>(c10::elementSize(loaded.placement.dtype));
  rollout::EngineOptions eo;
  eo.block_size = absl::GetFlag(FLAGS_kv_block_size);
  eo.max_running = absl::GetFlag(FLAGS_max_running_seqs);
  eo.max_requests = absl::GetFlag(FLAGS_max_queued_requests);
  lm::plan::RolloutSettings plan;
  plan.weight_bytes = dtype_bytes;
  plan.block_size = eo.block_size;
  plan.max_running = eo.max_running;
  plan.max_prefill_tokens = eo.max_prefill_tokens;
  const int64_t device_bytes = DeviceMemoryBytes(loaded.placement.device);
  ASSIGN_OR_RETURN(const std::optional<double> gib,
                   rollout::ParseKvCacheGb(absl::GetFlag(FLAGS_kv_cache_gb), kMaxGiB));
  ASSIGN_OR_RETURN(const rollout::KvPoolChoice pool,
                   rollout::ChooseKvPool(loaded.config, plan, gib, device_bytes));
  eo.kv_cache_bytes = static_cast<double>(pool.bytes);
  lm::log::Info(pool.why);
  return eo;
}

// The service's limits from the flags; the static sampler's batches take the engine's pool size.
rollout::ServiceOptions ServiceOptionsFromFlags(const lm::ModelConfig& config,
                                                const rollout::EngineOptions& eo) {
  rollout::ServiceOptions so;
  so.limits.vocab_size = config.vocab_size;
  so.limits.max_seq_len = absl::GetFlag(FLAGS_max_seq_len) > 0 ? absl::GetFlag(FLAGS_max_seq_len)
                                                               : config.max_position_embeddings;
  so.limits.max_samples_per_prompt = absl::GetFlag(FLAGS_max_samples_per_prompt);
  so.limits.max_slots = absl::GetFlag(FLAGS_max_slots);
  so.max_concurrent = absl::GetFlag(FLAGS_max_concurrent);
  so.static_batch_kv_bytes = static_cast<int64_t>(eo.kv_cache_bytes);
  return so;
}

// The paged engine: its pool (sized above) is allocated once here and shared by all requests,
// which it queues through the pool however many sequences they hold (only a sequence that could
// never fit the pool is refused).
absl::StatusOr<std::unique_ptr<rollout::Engine>> NewPagedEngine(rollout::WeightStore& store,
                                                                const rollout::EngineOptions& eo) {
  ASSIGN_OR_RETURN(std::unique_ptr<rollout::Engine> engine,
                   rollout::Engine::Create(*store.Current().model, eo));
  const rollout::EngineStats es = engine->stats();
  lm::log::Info(absl::StrCat("paged engine: ", es.usable_blocks, " KV blocks of ", eo.block_size,
                             " tokens (", es.pool_bytes >> 20, " MiB), up to ", eo.max_running,
                             " sequences at once"));
  return engine;
}

// Loads the model, checks it can run the chosen engine, builds the weight store, the expert
// parallel group's sampler or the paged engine, and the service, and serves until a signal (an
// expert parallel follower rank follows its leader instead).
absl::Status Run() {
  ASSIGN_OR_RETURN(opd::rpc::LoadedModel loaded, opd::rpc::LoadServedModel());
  ASSIGN_OR_RETURN(const EngineKind engine_kind, ChooseEngine(loaded));
  WarnIfNoSecret(loaded);
  ASSIGN_OR_RETURN(const rollout::EngineOptions eo, EngineOptionsFromFlags(loaded));
  rollout::ServiceOptions so = ServiceOptionsFromFlags(loaded.config, eo);
  const opd::v1::ServiceInfo info = loaded.Info(kServiceName, so.limits.max_seq_len);
  // The store owns the model from here on: updates are written into it (rollout/weights.h).
  // Under expert parallelism a commit is one of the group's commands, which run one at a time.
  rollout::WeightStoreOptions wo;
  if (loaded.ep) wo.commit = rollout::WeightStoreOptions::Commit::kAtOnce;
  rollout::WeightStore store(std::move(loaded.model), 0, wo);
  std::unique_ptr<rollout::EpRollout> ep;
  if (loaded.ep) {
    ep = std::make_unique<rollout::EpRollout>(loaded.ep.get(), &store, so.static_batch_kv_bytes);
    if (loaded.follower())
      return opd::rpc::FollowUntilStopped("opd-rollout", loaded, ep->FollowerWork());
    so.generator = ep.get();
    so.expert_parallel = ep.get();
  }
  opd::rpc::Authenticator auth(loaded.secret);
  std::unique_ptr<rollout::Engine> engine;
  if (engine_kind == EngineKind::kPaged) {
    ASSIGN_OR_RETURN(engine, NewPagedEngine(store, eo));
    so.generator = engine.get();
  }
  rollout::RolloutService service(&store, &auth, so, info);
  return opd::rpc::ServeUntilSignal("opd-rollout", kServiceName, &service, loaded);
}

}  // namespace

int main(int argc, char** argv) {
  return opd::rpc::ModelServerMain(
      argc, argv, "opd-rollout", "127.0.0.1:7002",
      "samples from a student model over gRPC:\n"
      "  opd-rollout --model DIR [--listen 127.0.0.1:7002] [--secret-file F] [--tls-cert F "
      "--tls-key F]",
      CheckFlags, Run);
}
