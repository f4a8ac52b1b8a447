#include "rpc/model_server.h"

#include <pthread.h>
#include <signal.h>

#include <cstdlib>
#include <iostream>
#include <thread>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "lm/io/sharded_load.h"
#include "lm/model/expert_parallel.h"
#include "lm/model/placement.h"
#include "lm/util/log.h"
#include "lm/util/memory.h"
#include "lm/util/status.h"
#include "lm/util/threads.h"
#include "rpc/auth.h"
#include "rpc/flag_range.h"
#include "rpc/last_resort.h"
#include "rpc/server.h"
#include "rpc/service_info.h"
#include "rpc/tensor_codec.h"

ABSL_FLAG(std::string, model, "", "Hugging Face model directory (config.json + safetensors)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "host:port to listen on (port 0: any free port)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving");
ABSL_FLAG(std::string, tokenizer, "",
          "tokenizer directory or file for the fingerprint (default: the model directory when it "
          "has tokenizer files, else none)");
ABSL_FLAG(std::string, device, "cpu",
          "device of the model: cpu, cuda or cuda:N (cuda with LOCAL_RANK set: cuda:LOCAL_RANK)");
ABSL_FLAG(std::string, dtype, "",
          "parameter dtype: float32 or bfloat16 (default: bfloat16 on CUDA, float32 on CPU)");
ABSL_FLAG(int, threads, 0, "compute threads (0: LibTorch's default)");
ABSL_FLAG(int, max_message_mb, 64, "largest message accepted, MiB");
ABSL_FLAG(std::string, secret_file, "",
          "file (mode 0600) holding the shared secret; else $OPD_SECRET");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: enables TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA: require client certificates signed by it");
ABSL_FLAG(int, grace_seconds, 10, "how long calls in flight may finish at shutdown");
ABSL_FLAG(int, world_size, 0,
          "expert-parallel ranks (0: the environment's WORLD_SIZE, else 1); each rank is launched "
          "with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT like the learner and holds 1/N of the "
          "experts; rank 0 serves");
ABSL_FLAG(int, ep_timeout_seconds, 300,
          "expert-parallel group: rendezvous and collective timeout (a rank that stops answering "
          "fails the request in flight with UNAVAILABLE after this long)");
ABSL_FLAG(int, debug_kill_rank, -1,
          "tests: this expert-parallel follower rank SIGKILLs itself when the first request "
          "reaches it");
ABSL_FLAG(bool, insecure, false,
          "allow listening on a non-loopback address without a shared secret (unauthenticated "
          "calls from any host that reaches it)");

namespace opd::rpc {
namespace {

// The server options the flags describe.
ServerOptions ServingOptions(bool has_secret) {
  ServerOptions opts;
  opts.listen = absl::GetFlag(FLAGS_listen);
  opts.port_file = absl::GetFlag(FLAGS_port_file);
  opts.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  opts.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
              absl::GetFlag(FLAGS_tls_client_ca)};
  opts.has_secret = has_secret;
  opts.insecure = absl::GetFlag(FLAGS_insecure);
  return opts;
}

// Expert-parallel ranks one model may be split over: far more than any model's experts allow
// (lm::ShardConfig refuses a rank without experts), far fewer than would overflow a rank id.
constexpr int kMaxWorldSize = 1024;

// The ranges of the shared numeric flags. --max-message-mb stops at 2047: its bytes are an int
// (gRPC's limit) and protobuf cannot parse a message of 2 GiB. A grace period or a collective
// timeout past a day is a typo, not a wait anyone means.
absl::Status CheckFlagRanges() {
  return FirstError({
      CheckFlagRange("--threads", absl::GetFlag(FLAGS_threads), 0, kMaxThreads),
      CheckFlagRange("--max-message-mb", absl::GetFlag(FLAGS_max_message_mb), 1, 2047),
      CheckFlagRange("--grace-seconds", absl::GetFlag(FLAGS_grace_seconds), 0, 86400),
      CheckFlagRange("--world-size", absl::GetFlag(FLAGS_world_size), 0, kMaxWorldSize),
      CheckFlagRange("--ep-timeout-seconds", absl::GetFlag(FLAGS_ep_timeout_seconds), 1, 86400),
      CheckFlagRange("--debug-kill-rank", absl::GetFlag(FLAGS_debug_kill_rank), -1,
                     kMaxWorldSize - 1),
      CheckListenPort(absl::GetFlag(FLAGS_listen)),
  });
}

// --world-size against the environment and against the model's experts (a rank without experts
// to hold is a bad flag, found before any load).
absl::Status CheckExpertParallelFlags() {
  ASSIGN_OR_RETURN(const lm::dist::LaunchEnv env,
                   ExpertParallelEnv(absl::GetFlag(FLAGS_world_size)));
  if (!env.distributed() || absl::GetFlag(FLAGS_model).empty()) return absl::OkStatus();
  absl::StatusOr<lm::ModelConfig> config = lm::LoadModelConfig(absl::GetFlag(FLAGS_model));
  if (!config.ok()) return absl::OkStatus();  // the load reports it
  return lm::ShardConfig(*config, env.rank, env.world_size);
}

// Checks what can be checked before the (slow) model load: the flags' ranges (the shared ones,
// then the program's own `check_flags`), the TLS flag set, the secret, whether the listen address
// may be used without one. Returns -1 to go on, else the exit code 2 (a bad flag or value; a
// secret file that is missing, empty or readable by others is a bad value too, as everywhere),
// after printing the reason.
int CheckServingFlags(const char* program, const std::function<absl::Status()>& check_flags) {
  ServerOptions opts = ServingOptions(false);
  absl::Status st = CheckFlagRanges();
  if (st.ok() && check_flags) st = check_flags();
  if (st.ok()) st = CheckServerTls(opts.tls);
  // A device or dtype the process cannot use is a bad flag too, found before the load.
  if (st.ok())
    st = lm::ResolvePlacement(absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_dtype)).status();
  if (st.ok()) st = CheckExpertParallelFlags();
  if (!st.ok()) {
    std::cerr << program << ": " << st.message() << "\n";
    return 2;
  }
  absl::StatusOr<std::string> secret = LoadSecret(absl::GetFlag(FLAGS_secret_file));
  if (!secret.ok()) {
    std::cerr << program << ": " << secret.status().message() << "\n";
    return 2;
  }
  opts.has_secret = !secret->empty();
  if (st = CheckListenAuth(opts); !st.ok()) {
    std::cerr << program << ": " << st.message() << "\n";
    return 2;
  }
  if (opts.has_secret && !opts.tls.enabled() && !IsLoopbackListen(opts.listen)) {
    lm::log::Warn(absl::StrCat(program, ": listening on ", opts.listen,
                               " in plaintext: the shared secret travels in clear (set "
                               "--tls-cert and --tls-key)"));
  }
  return -1;
}

class LoadSignalWatch;
LoadSignalWatch* g_load_watch = nullptr;  // the one alive while ModelServerMain runs `run`

// SIGINT/SIGTERM are blocked in every thread (the serving loop takes them with sigwait), so
// while the model loads nothing would take them: this thread does, and a signal then ends the
// process at once (nothing is served yet, nothing can be lost). End() hands the signals over to
// the serving loop; a signal already pending stays pending for it.
class LoadSignalWatch {
 public:
  explicit LoadSignalWatch(const char* program) {
    g_load_watch = this;
    sigset_t wake;
    sigemptyset(&wake);
    sigaddset(&wake, SIGUSR1);  // End()'s wake-up, blocked before the thread exists
    pthread_sigmask(SIG_BLOCK, &wake, nullptr);
    thread_ = std::thread([program] {
      sigset_t set;
      sigemptyset(&set);
      for (int s : {SIGINT, SIGTERM, SIGUSR1}) sigaddset(&set, s);
      int sig = 0;
      sigwait(&set, &sig);
      if (sig == SIGUSR1) return;
      std::cerr << program << ": signal " << sig << " while loading the model: exiting\n";
      std::_Exit(128 + sig);
    });
  }
  ~LoadSignalWatch() {
    End();
    g_load_watch = nullptr;
  }
  void End() {
    if (!thread_.joinable()) return;
    pthread_kill(thread_.native_handle(), SIGUSR1);
    thread_.join();
  }

 private:
  std::thread thread_;
};
}  // namespace

opd::v1::ServiceInfo LoadedModel::Info(const std::string& service, int64_t max_seq_len) const {
  return MakeServiceInfo({service, model_dir, tokenizer_fingerprint, max_seq_len, dtype, threads},
                         config);
}

absl::StatusOr<LoadedModel> LoadServedModel() {
  LoadedModel m;
  m.model_dir = absl::GetFlag(FLAGS_model);
  if (m.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  if (absl::GetFlag(FLAGS_threads) > 0) torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  m.threads = torch::get_num_threads();  // what the service's compute threads will use
  // This thread only loads and then waits for a signal: one thread, no OpenMP pool of its own.
  lm::SetThreadsForThisThread(1);
  ASSIGN_OR_RETURN(m.secret, LoadSecret(absl::GetFlag(FLAGS_secret_file)));
  ASSIGN_OR_RETURN(m.placement,
                   lm::ResolvePlacement(absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_dtype)));
  lm::BindThreadToDevice(m.placement.device);  // before the load and any group: not device 0
  m.dtype = DtypeName(m.placement.dtype);      // the names the flags and ServiceInfo use
  lm::LoadOptions load;
  load.dtype = m.placement.dtype;
  load.device = m.placement.device;
  ASSIGN_OR_RETURN(m.env, ExpertParallelEnv(absl::GetFlag(FLAGS_world_size)));
  if (m.env.distributed()) {
    ASSIGN_OR_RETURN(m.model, lm::LoadExpertShard(m.model_dir, load, m.env.rank, m.env.world_size));
  } else {
    ASSIGN_OR_RETURN(m.model, lm::LoadModel(m.model_dir, load));
  }
  m.model->eval();
  m.config = m.model->config();
  if (m.env.distributed()) {
    const lm::ParameterBytes bytes = lm::CountParameterBytes(*m.model);
    lm::log::Info(absl::StrCat(
        "expert-parallel rank ", m.env.rank, " of ", m.env.world_size, ": experts [",
        m.config.expert_first, ", ", m.config.expert_first + m.config.local_experts, ") of ",
        m.config.num_experts, "; parameter_bytes=", bytes.total, " expert_bytes=", bytes.experts));
    ASSIGN_OR_RETURN(
        m.ep,
        EpGroup::Join(
            m.env, load.device, absl::Seconds(absl::GetFlag(FLAGS_ep_timeout_seconds)), *m.model,
            absl::StrCat(m.config.model_type, " layers=", m.config.num_hidden_layers,
                         " hidden=", m.config.hidden_size, " experts=", m.config.num_experts,
                         " vocab=", m.config.vocab_size, " dtype=", m.dtype)));
  }
  ASSIGN_OR_RETURN(m.tokenizer_fingerprint,
                   TokenizerFingerprint(absl::GetFlag(FLAGS_tokenizer), m.model_dir));
  return m;
}

absl::Status ServeUntilSignal(const char* program, const std::string& service_name,
                              grpc::Service* service, const LoadedModel& loaded,
                              const std::function<void()>& after_shutdown, int max_send_bytes) {
  if (g_load_watch) g_load_watch->End();  // the signals are WaitForShutdownSignal's from here
  ServerOptions opts = ServingOptions(!loaded.secret.empty());
  opts.max_send_bytes = max_send_bytes;
  ASSIGN_OR_RETURN(auto server, StartServer(opts, {service}, {service_name}));
  const lm::ModelConfig& config = loaded.config;
  lm::log::Info(absl::StrCat(program, ": serving ", loaded.model_dir, " (", config.model_type,
                             ", vocab ", config.vocab_size, ") on port ", server.port, " (",
                             opts.listen, ", ", opts.tls.enabled() ? "TLS" : "plaintext", ", ",
                             loaded.dtype, " on ", loaded.placement.device.str(), ", ",
                             loaded.threads, " threads)"));
  const int sig = WaitForShutdownSignal();
  lm::log::Info(absl::StrCat(program, ": signal ", sig, ", shutting down"));
  server.SetServing({service_name}, false);
  server.server->Shutdown(
      absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_grace_seconds))));
  if (after_shutdown) after_shutdown();
  // The followers end with rank 0; after a group failure the exit is non-zero.
  if (loaded.ep) return loaded.ep->Stop();
  return absl::OkStatus();
}

absl::Status FollowUntilStopped(const char* program, const LoadedModel& loaded,
                                const EpGroup::Work& work) {
  // SIGINT/SIGTERM stay blocked and unanswered here: a follower ends when rank 0 (the one to
  // signal) stops the group, or when the group fails.
  if (g_load_watch) g_load_watch->End();
  lm::log::Info(absl::StrCat(program, ": expert-parallel rank ", loaded.ep->rank(), " of ",
                             loaded.ep->size(), " following rank 0 (", loaded.model_dir, ")"));
  const bool kill = absl::GetFlag(FLAGS_debug_kill_rank) == loaded.ep->rank();
  // Computed on a thread of its own: this one keeps the single thread it loaded with.
  absl::Status st;
  std::thread follower([&] {
    lm::BindThreadToDevice(loaded.placement.device);
    st = loaded.ep->Follow(work, kill);
  });
  follower.join();
  if (st.ok()) lm::log::Info(absl::StrCat(program, ": rank 0 stopped the group"));
  return st;
}

int ModelServerMain(int argc, char** argv, const char* program, const char* default_listen,
                    const char* usage, const std::function<absl::Status()>& check_flags,
                    const std::function<absl::Status()>& run) {
  lm::RetainFreedMemory();
  BlockShutdownSignals();
  absl::SetFlag(&FLAGS_listen, default_listen);
  if (const int code = ParseFlagsOrExitCode(argc, argv, usage); code >= 0) return code;
  const std::string model = absl::GetFlag(FLAGS_model);
  return ExitCodeCatchingExceptions(program, model.empty() ? "" : "model " + model, [&] {
    if (const int code = CheckServingFlags(program, check_flags); code >= 0) return code;
    absl::Status st;
    {
      LoadSignalWatch watch(program);
      DebugThrowForTests();
      st = run();
    }
    if (st.ok()) return 0;
    std::cerr << program << ": " << st << "\n";
    return 1;
  });
}

}  // namespace opd::rpc
