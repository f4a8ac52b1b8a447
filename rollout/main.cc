// opd-rollout: samples responses from the student over gRPC (opd.v1.Rollout) and takes new
// weights from the learner.
//
//   opd-rollout --model DIR --listen 127.0.0.1:7002 [--secret-file F] [--threads N] ...
//
// The shared secret comes from --secret-file or $OPD_SECRET; without one, UpdateWeights is
// refused. SIGINT/SIGTERM stop it gracefully.
#include <iostream>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "lm/model/model.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rollout/service.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "rpc/service_info.h"
#include "rpc/tensor_codec.h"

ABSL_FLAG(std::string, model, "", "Hugging Face model directory (config.json + safetensors)");
ABSL_FLAG(std::string, listen, "127.0.0.1:7002", "host:port to listen on (port 0: any free port)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving");
ABSL_FLAG(std::string, tokenizer, "",
          "tokenizer directory or file for the fingerprint (default: the model directory when it "
          "has tokenizer files, else none)");
ABSL_FLAG(std::string, dtype, "float32", "parameter dtype: float32 or bfloat16");
ABSL_FLAG(int, threads, 0, "compute threads (0: LibTorch's default)");
ABSL_FLAG(int, max_concurrent, 4, "generations at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_seq_len, 0, "longest prompt + response (0: the model's max positions)");
ABSL_FLAG(int64_t, max_samples_per_prompt, 64, "largest samples_per_prompt accepted");
ABSL_FLAG(int64_t, max_slots, 1024, "prompts x samples one request may decode");
ABSL_FLAG(int, max_message_mb, 64, "largest message accepted (one weight chunk), MiB");
ABSL_FLAG(std::string, secret_file, "",
          "file (mode 0600) holding the shared secret; else $OPD_SECRET");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: enables TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA: require client certificates signed by it");
ABSL_FLAG(int, grace_seconds, 10, "how long calls in flight may finish at shutdown");

namespace {

constexpr const char* kServiceName = "opd.v1.Rollout";

absl::Status Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  if (absl::GetFlag(FLAGS_threads) > 0) torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  ASSIGN_OR_RETURN(std::string secret, opd::rpc::LoadSecret(absl::GetFlag(FLAGS_secret_file)));
  if (secret.empty()) {
    lm::log::Warn(
        "no shared secret (--secret-file or OPD_SECRET): calls are not authenticated and "
        "UpdateWeights is disabled");
  }

  lm::LoadOptions load;
  ASSIGN_OR_RETURN(load.dtype, opd::rpc::DtypeFromName(absl::GetFlag(FLAGS_dtype)));
  ASSIGN_OR_RETURN(auto model, lm::LoadModel(model_dir, load));
  model->eval();
  ASSIGN_OR_RETURN(std::string fingerprint,
                   opd::rpc::TokenizerFingerprint(absl::GetFlag(FLAGS_tokenizer), model_dir));
  const lm::ModelConfig config = model->config();

  rollout::ServiceOptions so;
  so.limits.vocab_size = config.vocab_size;
  so.limits.max_seq_len = absl::GetFlag(FLAGS_max_seq_len) > 0 ? absl::GetFlag(FLAGS_max_seq_len)
                                                               : config.max_position_embeddings;
  so.limits.max_samples_per_prompt = absl::GetFlag(FLAGS_max_samples_per_prompt);
  so.limits.max_slots = absl::GetFlag(FLAGS_max_slots);
  so.max_concurrent = absl::GetFlag(FLAGS_max_concurrent);

  rollout::WeightStore store(std::move(model));
  const opd::rpc::ServedModel served{kServiceName,
                                     model_dir,
                                     fingerprint,
                                     so.limits.max_seq_len,
                                     absl::GetFlag(FLAGS_dtype),
                                     torch::get_num_threads()};
  opd::rpc::Authenticator auth(secret);
  rollout::RolloutService service(&store, &auth, so, opd::rpc::MakeServiceInfo(served, config));

  opd::rpc::ServerOptions server_opts;
  server_opts.listen = absl::GetFlag(FLAGS_listen);
  server_opts.port_file = absl::GetFlag(FLAGS_port_file);
  server_opts.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  server_opts.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                     absl::GetFlag(FLAGS_tls_client_ca)};
  ASSIGN_OR_RETURN(auto server, opd::rpc::StartServer(server_opts, {&service}, {kServiceName}));
  lm::log::Info(absl::StrCat("opd-rollout: serving ", model_dir, " (", config.model_type,
                             ", vocab ", config.vocab_size, ") on port ", server.port, " (",
                             server_opts.listen, ", ",
                             server_opts.tls.enabled() ? "TLS" : "plaintext", ", ",
                             torch::get_num_threads(), " threads)"));

  const int sig = opd::rpc::WaitForShutdownSignal();
  lm::log::Info(absl::StrCat("opd-rollout: signal ", sig, ", shutting down"));
  server.SetServing({kServiceName}, false);
  server.server->Shutdown(
      absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_grace_seconds))));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  opd::rpc::BlockShutdownSignals();
  opd::rpc::ParseFlags(
      argc, argv, "samples from a student model over gRPC: opd-rollout --model DIR --listen ADDR");
  absl::Status st = Run();
  if (!st.ok()) {
    std::cerr << "opd-rollout: " << st << "\n";
    return 1;
  }
  return 0;
}
