// opd-teacher: serves a teacher model's log-probs over gRPC (opd.v1.Teacher).
//
//   opd-teacher --model DIR --listen 127.0.0.1:7001 [--secret-file F] [--threads N] ...
//
// The shared secret comes from --secret-file or $OPD_SECRET (never a flag value: `ps` shows
// flags). SIGINT/SIGTERM stop it gracefully: no new calls, calls in flight finish (up to
// --grace-seconds), then the process exits.
#include <iostream>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "lm/model/model.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "rpc/service_info.h"
#include "rpc/tensor_codec.h"
#include "teacher_service/service.h"

ABSL_FLAG(std::string, model, "", "Hugging Face model directory (config.json + safetensors)");
ABSL_FLAG(std::string, listen, "127.0.0.1:7001", "host:port to listen on (port 0: any free port)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving");
ABSL_FLAG(std::string, tokenizer, "",
          "tokenizer directory or file for the fingerprint (default: the model directory when it "
          "has tokenizer files, else none)");
ABSL_FLAG(std::string, dtype, "float32", "parameter dtype: float32 or bfloat16");
ABSL_FLAG(int, threads, 0, "compute threads (0: LibTorch's default)");
ABSL_FLAG(int, workers, 1, "scoring threads, each running whole forwards");
ABSL_FLAG(int64_t, max_batch_tokens, 16384, "tokens per forward pass");
ABSL_FLAG(int64_t, max_queue, 64, "requests waiting at most; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_seq_len, 0, "longest sequence accepted (0: the model's max positions)");
ABSL_FLAG(int64_t, max_top_k, 1024, "largest top_k a request may ask for");
ABSL_FLAG(int64_t, logprob_chunk, 512, "rows of [rows, vocab] logits alive at once");
ABSL_FLAG(int, max_message_mb, 64, "largest request accepted, MiB");
ABSL_FLAG(std::string, secret_file, "",
          "file (mode 0600) holding the shared secret; else $OPD_SECRET");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: enables TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA: require client certificates signed by it");
ABSL_FLAG(int, grace_seconds, 10, "how long calls in flight may finish at shutdown");

namespace {

constexpr const char* kServiceName = "opd.v1.Teacher";

absl::Status Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  if (absl::GetFlag(FLAGS_threads) > 0) torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  ASSIGN_OR_RETURN(std::string secret, opd::rpc::LoadSecret(absl::GetFlag(FLAGS_secret_file)));
  if (secret.empty())
    lm::log::Warn("no shared secret (--secret-file or OPD_SECRET): calls are not authenticated");

  lm::LoadOptions load;
  ASSIGN_OR_RETURN(load.dtype, opd::rpc::DtypeFromName(absl::GetFlag(FLAGS_dtype)));
  ASSIGN_OR_RETURN(auto model, lm::LoadModel(model_dir, load));
  model->eval();
  ASSIGN_OR_RETURN(std::string fingerprint,
                   opd::rpc::TokenizerFingerprint(absl::GetFlag(FLAGS_tokenizer), model_dir));

  const auto& config = model->config();
  teacher::ScoreLimits limits;
  limits.vocab_size = config.vocab_size;
  limits.max_seq_len = absl::GetFlag(FLAGS_max_seq_len) > 0 ? absl::GetFlag(FLAGS_max_seq_len)
                                                            : config.max_position_embeddings;
  limits.max_top_k = absl::GetFlag(FLAGS_max_top_k);

  teacher::ScorerOptions so;
  so.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  so.max_queue = absl::GetFlag(FLAGS_max_queue);
  so.workers = absl::GetFlag(FLAGS_workers);
  so.logprob_chunk_rows = absl::GetFlag(FLAGS_logprob_chunk);
  teacher::Scorer scorer(model, so);

  opd::rpc::ServedModel served{kServiceName,
                               model_dir,
                               fingerprint,
                               limits.max_seq_len,
                               absl::GetFlag(FLAGS_dtype),
                               torch::get_num_threads()};
  const opd::v1::ServiceInfo info = opd::rpc::MakeServiceInfo(served, config);

  opd::rpc::Authenticator auth(secret);
  teacher::TeacherService service(&scorer, &auth, limits, info);
  opd::rpc::ServerOptions server_opts;
  server_opts.listen = absl::GetFlag(FLAGS_listen);
  server_opts.port_file = absl::GetFlag(FLAGS_port_file);
  server_opts.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  server_opts.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                     absl::GetFlag(FLAGS_tls_client_ca)};
  ASSIGN_OR_RETURN(auto server, opd::rpc::StartServer(server_opts, {&service}, {kServiceName}));
  lm::log::Info(absl::StrCat("opd-teacher: serving ", model_dir, " (", config.model_type,
                             ", vocab ", config.vocab_size, ") on port ", server.port, " (",
                             server_opts.listen, ", ",
                             server_opts.tls.enabled() ? "TLS" : "plaintext", ", ",
                             torch::get_num_threads(), " threads)"));

  const int sig = opd::rpc::WaitForShutdownSignal();
  lm::log::Info(absl::StrCat("opd-teacher: signal ", sig, ", shutting down"));
  server.SetServing({kServiceName}, false);
  server.server->Shutdown(
      absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_grace_seconds))));
  scorer.Stop();
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  opd::rpc::BlockShutdownSignals();
  opd::rpc::ParseFlags(
      argc, argv,
      "serves a teacher model's log-probs over gRPC: opd-teacher --model DIR --listen ADDR");
  absl::Status st = Run();
  if (!st.ok()) {
    std::cerr << "opd-teacher: " << st << "\n";
    return 1;
  }
  return 0;
}
