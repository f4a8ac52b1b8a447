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
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rollout/service.h"
#include "rpc/auth.h"
#include "rpc/model_server.h"

ABSL_FLAG(int, max_concurrent, 4, "generations at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_seq_len, 0, "longest prompt + response (0: the model's max positions)");
ABSL_FLAG(int64_t, max_samples_per_prompt, 64, "largest samples_per_prompt accepted");
ABSL_FLAG(int64_t, max_slots, 1024, "prompts x samples one request may decode");
ABSL_FLAG(double, kv_budget_gb, 32,
          "KV cache one request may need, GiB (sequences x (prompt + max_new_tokens)); more gets "
          "RESOURCE_EXHAUSTED; 0: no budget");

namespace {

constexpr const char* kServiceName = "opd.v1.Rollout";

absl::Status Run() {
  ASSIGN_OR_RETURN(opd::rpc::LoadedModel loaded, opd::rpc::LoadServedModel());
  // Refused at start-up rather than on every Generate.
  if (!loaded.model->SupportsKVCache())
    return absl::FailedPreconditionError(absl::StrCat(
        loaded.model_dir, " is a ", loaded.config.model_type,
        " model, which this rollout worker cannot sample: its decode path (a cache of the "
        "linear-attention layers' recurrent state) is not implemented; serve a qwen3_moe student"));
  if (absl::GetFlag(FLAGS_kv_budget_gb) < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-budget-gb=", absl::GetFlag(FLAGS_kv_budget_gb), " is negative"));
  if (loaded.secret.empty()) {
    lm::log::Warn(
        "no shared secret (--secret-file or OPD_SECRET): calls are not authenticated and "
        "UpdateWeights is disabled");
  }
  const lm::ModelConfig& config = loaded.config;
  rollout::ServiceOptions so;
  so.limits.vocab_size = config.vocab_size;
  so.limits.max_seq_len = absl::GetFlag(FLAGS_max_seq_len) > 0 ? absl::GetFlag(FLAGS_max_seq_len)
                                                               : config.max_position_embeddings;
  so.limits.max_samples_per_prompt = absl::GetFlag(FLAGS_max_samples_per_prompt);
  so.limits.max_slots = absl::GetFlag(FLAGS_max_slots);
  so.limits.kv_bytes_per_token =
      rollout::KvBytesPerToken(config, loaded.dtype == "float32" ? 4 : 2);
  so.limits.max_kv_bytes = absl::GetFlag(FLAGS_kv_budget_gb) * 1024.0 * 1024.0 * 1024.0;
  so.max_concurrent = absl::GetFlag(FLAGS_max_concurrent);

  const opd::v1::ServiceInfo info = loaded.Info(kServiceName, so.limits.max_seq_len);
  // The store owns the model from here on: an update replaces it and frees the old weights.
  rollout::WeightStore store(std::move(loaded.model));
  opd::rpc::Authenticator auth(loaded.secret);
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
      Run);
}
