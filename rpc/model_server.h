// What opd-teacher and opd-rollout share: the flags both take (model, listen address, port file,
// tokenizer, device, dtype, threads, shared secret, TLS, grace period), loading the served model,
// and serving until SIGINT/SIGTERM. Each program's main adds its own flags and builds its service.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <grpcpp/impl/service_type.h>

#include "absl/status/statusor.h"
#include "lm/model/model.h"
#include "lm/model/placement.h"
#include "opd/v1/common.pb.h"
#include "rpc/ep_group.h"
#include "rpc/server.h"

namespace opd::rpc {

struct LoadedModel {
  std::string model_dir;
  std::shared_ptr<lm::CausalLM> model;  // in eval mode (a service may take it over)
  lm::ModelConfig config;
  std::string secret;  // empty: calls are not authenticated
  std::string tokenizer_fingerprint;
  std::string dtype;        // "float32" | "bfloat16": placement.dtype's name
  lm::Placement placement;  // --device (LOCAL_RANK) and --dtype, resolved
  int threads = 0;
  // Expert parallelism (--world-size N > 1): this rank's place and its group; null with one
  // process. Rank 0 serves; the others follow (rpc/ep_group.h).
  lm::dist::LaunchEnv env;
  std::unique_ptr<EpGroup> ep;
  bool follower() const { return ep && !ep->leader(); }
  // The ServiceInfo of `service` ("opd.v1.Teacher" | "opd.v1.Rollout") serving this model.
  opd::v1::ServiceInfo Info(const std::string& service, int64_t max_seq_len) const;
};

// Sets the thread count, reads the secret, loads --model (onto --device, in --dtype) and
// fingerprints the tokenizer, from the shared flags.
absl::StatusOr<LoadedModel> LoadServedModel();

// Starts `service` (named `service_name`) with health and reflection on --listen, logs a line
// naming `program` and the model, blocks until SIGINT/SIGTERM, then stops taking calls, lets
// calls in flight finish for up to --grace-seconds, and calls `after_shutdown`.
// `max_send_bytes` is the server's ServerOptions::max_send_bytes (the largest reply it sends).
absl::Status ServeUntilSignal(const char* program, const std::string& service_name,
                              grpc::Service* service, const LoadedModel& loaded,
                              const std::function<void()>& after_shutdown = {},
                              int max_send_bytes = kMaxSendBytes);

// An expert-parallel follower's loop, instead of ServeUntilSignal: runs each of rank 0's commands
// with `work` until rank 0 stops the group (OK) or the group fails (its error).
absl::Status FollowUntilStopped(const char* program, const LoadedModel& loaded,
                                const EpGroup::Work& work);

// A program's main: blocks the shutdown signals, parses the flags (--listen defaults to
// `default_listen`; --help prints every flag and exits 0, a bad flag exits 2), checks the
// serving flags and then the program's own (`check_flags`: its flags' ranges) before any model
// is loaded (a value out of its range, inconsistent TLS flags, a secret file that cannot be used,
// or a non-loopback --listen without a secret and without --insecure: exit 2), runs `run` and
// prints its error (exit 1). An exception escaping `run` is reported naming --model (exit 1,
// rpc/last_resort.h), never an abort.
int ModelServerMain(int argc, char** argv, const char* program, const char* default_listen,
                    const char* usage, const std::function<absl::Status()>& check_flags,
                    const std::function<absl::Status()>& run);

}  // namespace opd::rpc
