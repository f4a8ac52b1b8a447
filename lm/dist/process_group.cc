// c10d's Gloo backend is compiled into libtorch_cpu; its header needs these switches and Gloo's
// headers (Debian's libgloo-dev: only declarations are used, every member we touch is a pointer).
#define USE_C10D_GLOO 1
#define USE_DISTRIBUTED 1

#include "lm/dist/process_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "lm/dist/backends.h"
#include "lm/util/log.h"

namespace lm::dist {
namespace {

std::string FirstLine(const std::string& s) {
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// The message of whatever c10d threw, without LibTorch's C++ backtrace.
std::string ErrorText(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e))
    return FirstLine(c10->what_without_backtrace());
  return FirstLine(e.what());
}

absl::StatusOr<int> IntFromEnv(const char* name, int fallback, bool* present = nullptr) {
  const char* v = std::getenv(name);
  if (present) *present = v != nullptr && *v != '\0';
  if (v == nullptr || *v == '\0') return fallback;
  int out = 0;
  if (!absl::SimpleAtoi(v, &out))
    return absl::InvalidArgumentError(absl::StrCat(name, "='", v, "' is not an integer"));
  return out;
}

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kSum:
      break;
  }
  return c10d::ReduceOp::SUM;
}

bool IsLoopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// Rank 0's rendezvous socket, bound to MASTER_ADDR itself (not every interface: a test job on
// 127.0.0.1 stays on loopback) and handed to the TCPStore, which takes ownership.
absl::StatusOr<int> ListenOn(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("MASTER_ADDR='", host, "' does not resolve: ", gai_strerror(rc)));
  std::string last_error = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      freeaddrinfo(res);
      return fd;
    }
    last_error = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  return absl::UnavailableError(absl::StrCat("rank 0 cannot listen on MASTER_ADDR:MASTER_PORT ",
                                             host, ":", port, ": ", last_error));
}

}  // namespace

absl::StatusOr<LaunchEnv> LaunchEnv::FromEnvironment() {
  LaunchEnv env;
  bool has_world = false, has_rank = false;
  auto world = IntFromEnv("WORLD_SIZE", 1, &has_world);
  if (!world.ok()) return world.status();
  auto rank = IntFromEnv("RANK", 0, &has_rank);
  if (!rank.ok()) return rank.status();
  auto local = IntFromEnv("LOCAL_RANK", *rank);
  if (!local.ok()) return local.status();
  env.world_size = *world;
  env.rank = *rank;
  env.local_rank = *local;
  if (env.world_size < 1)
    return absl::InvalidArgumentError(absl::StrCat("WORLD_SIZE=", env.world_size, " is below 1"));
  if (env.rank < 0 || env.rank >= env.world_size)
    return absl::InvalidArgumentError(
        absl::StrCat("RANK=", env.rank, " is outside [0, WORLD_SIZE=", env.world_size, ")"));
  if (env.local_rank < 0)
    return absl::InvalidArgumentError(absl::StrCat("LOCAL_RANK=", env.local_rank, " is negative"));
  if (has_rank && !has_world && env.rank != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("RANK=", env.rank, " is set but WORLD_SIZE is not"));
  if (!env.distributed()) return env;
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0')
    return absl::InvalidArgumentError(
        absl::StrCat("WORLD_SIZE=", env.world_size, " needs MASTER_ADDR (rank 0's address)"));
  env.master_addr = addr;
  bool has_port = false;
  auto port = IntFromEnv("MASTER_PORT", 0, &has_port);
  if (!port.ok()) return port.status();
  if (!has_port)
    return absl::InvalidArgumentError(
        absl::StrCat("WORLD_SIZE=", env.world_size, " needs MASTER_PORT (the rendezvous port)"));
  if (*port < 1 || *port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("MASTER_PORT=", *port, " is not a TCP port"));
  env.master_port = *port;
  return env;
}

void PrepareNcclErrorHandling() {
  for (const auto& [name, value] :
       {std::pair<const char*, const char*>{"TORCH_NCCL_BLOCKING_WAIT", "1"},
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"}}) {
    const char* was = std::getenv(name);
    if (was != nullptr && std::strcmp(was, value) != 0)
      log::Warn(absl::StrCat(name, "=", was, " replaced by ", value,
                             ": a collective timeout must be an error, not an abort"));
    setenv(name, value, /*overwrite=*/1);
  }
}

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout{0};
  std::string broken;  // the first failure; the group is unusable after it

  // Runs one collective: launches it, waits for it within the timeout, and turns whatever c10d
  // throws into a status naming the operation.
  absl::Status Run(const char* op, int rank, int size,
                   const std::function<c10::intrusive_ptr<c10d::Work>()>& launch) {
    if (!broken.empty())
      return absl::FailedPreconditionError(absl::StrCat(
          "collective ", op, " on rank ", rank, ": the process group failed earlier: ", broken));
    try {
      c10::intrusive_ptr<c10d::Work> work = launch();
      work->wait(timeout);
      return absl::OkStatus();
    } catch (const std::exception& e) {
      broken = ErrorText(e);
    }
    return absl::UnavailableError(absl::StrCat("collective ", op, " failed on rank ", rank, " of ",
                                               size, " (a peer exited or timed out): ", broken));
  }

  // Launches one collective and hands it back in flight (Wait() is Run's wait).
  std::unique_ptr<PendingCollective> Launch(
      const char* op, int rank, int size,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& launch);
};

ProcessGroup::ProcessGroup() : impl_(std::make_unique<Impl>()) {}
ProcessGroup::~ProcessGroup() = default;

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Create(const LaunchEnv& env,
                                                                   torch::Device device,
                                                                   const GroupOptions& options) {
  auto group = std::make_unique<ProcessGroup>();
  group->device_ = device;
  if (!env.distributed()) return group;
  std::string backend = options.backend;
  if (backend == "auto") backend = device.is_cuda() ? "nccl" : "gloo";
  if (backend != "gloo" && backend != "nccl")
    return absl::InvalidArgumentError(
        absl::StrCat("process group backend '", options.backend, "': use auto, gloo or nccl"));
  if (backend == "nccl" && !device.is_cuda())
    return absl::InvalidArgumentError("the nccl backend needs a CUDA device");
  group->rank_ = env.rank;
  group->size_ = env.world_size;
  group->env_ = env;
  group->backend_name_ = backend;
  Impl& impl = *group->impl_;
  impl.timeout = Millis(options.timeout);

  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = env.world_size;
  so.waitWorkers = true;
  so.timeout = impl.timeout;
  if (so.isServer) {
    absl::StatusOr<int> fd = ListenOn(env.master_addr, env.master_port);
    if (!fd.ok()) return fd.status();
    so.masterListenFd = *fd;
  }
  try {
    impl.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    if (backend == "gloo") {
      auto gloo = c10d::ProcessGroupGloo::Options::create(impl.timeout);
      // Peers reach each other on loopback in a single-host test job; elsewhere through the
      // interface GLOO_SOCKET_IFNAME names, or the one this host's name resolves to.
      gloo->devices.push_back(IsLoopback(env.master_addr) && !std::getenv("GLOO_SOCKET_IFNAME")
                                  ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                  : c10d::ProcessGroupGloo::createDefaultDevice());
      impl.backend =
          c10::make_intrusive<c10d::ProcessGroupGloo>(impl.store, env.rank, env.world_size, gloo);
    } else {
      PrepareNcclErrorHandling();
      absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> nccl =
          MakeNcclBackend(impl.store, env.rank, env.world_size, impl.timeout,
                          device.has_index() ? device : c10::Device(c10::kCUDA, 0));
      if (!nccl.ok()) return nccl.status();
      impl.backend = *nccl;
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("rank ", env.rank, " of ", env.world_size, ": rendezvous at ", env.master_addr,
                     ":", env.master_port, " failed (every rank must start within the timeout of ",
                     absl::FormatDuration(options.timeout), "): ", ErrorText(e)));
  }
  return group;
}

absl::Status ProcessGroup::AllReduce(std::vector<torch::Tensor>& tensors, ReduceOp op) {
  if (size_ == 1 || tensors.empty()) return absl::OkStatus();
  c10d::AllreduceOptions o;
  o.reduceOp = ToC10d(op);
  return impl_->Run("all_reduce", rank_, size_,
                    [&] { return impl_->backend->allreduce(tensors, o); });
}

namespace {
class ReadyCollective : public PendingCollective {
 public:
  explicit ReadyCollective(absl::Status s) : status_(std::move(s)) {}
  absl::Status Wait() override { return status_; }

 private:
  absl::Status status_;
};

// A collective launched by c10d; Wait() waits for it within the group's timeout.
class InFlightCollective : public PendingCollective {
 public:
  using Waiter = std::function<absl::Status(const char*, c10::intrusive_ptr<c10d::Work>)>;
  InFlightCollective(const char* op, c10::intrusive_ptr<c10d::Work> work, Waiter wait)
      : op_(op), work_(std::move(work)), wait_(std::move(wait)) {}
  absl::Status Wait() override { return wait_(op_, work_); }

 private:
  const char* op_;
  c10::intrusive_ptr<c10d::Work> work_;
  Waiter wait_;
};
}  // namespace

std::unique_ptr<PendingCollective> ProcessGroup::Impl::Launch(
    const char* op, int rank, int size,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& launch) {
  if (!broken.empty())
    return std::make_unique<ReadyCollective>(absl::FailedPreconditionError(absl::StrCat(
        "collective ", op, " on rank ", rank, ": the process group failed earlier: ", broken)));
  try {
    return std::make_unique<InFlightCollective>(
        op, launch(), [this, rank, size](const char* name, c10::intrusive_ptr<c10d::Work> work) {
          return Run(name, rank, size, [&] { return work; });
        });
  } catch (const std::exception& e) {
    broken = ErrorText(e);
    return std::make_unique<ReadyCollective>(absl::UnavailableError(
        absl::StrCat("collective ", op, " failed on rank ", rank, ": ", broken)));
  }
}

std::unique_ptr<PendingCollective> ProcessGroup::AllReduceAsync(
    std::vector<torch::Tensor>& tensors) {
  if (size_ == 1 || tensors.empty()) return std::make_unique<ReadyCollective>(absl::OkStatus());
  return impl_->Launch("all_reduce (bucket)", rank_, size_,
                       [&] { return impl_->backend->allreduce(tensors, {}); });
}

std::unique_ptr<PendingCollective> ProcessGroup::ReduceScatterSumAsync(torch::Tensor output,
                                                                       torch::Tensor input) {
  if (input.numel() != output.numel() * size_ || !input.is_contiguous() || !output.is_contiguous())
    return std::make_unique<ReadyCollective>(absl::InvalidArgumentError(
        absl::StrCat("reduce_scatter: input has ", input.numel(), " elements, expected ", size_,
                     " x ", output.numel(), ", both contiguous")));
  if (size_ == 1) {
    output.copy_(input.view_as(output));
    return std::make_unique<ReadyCollective>(absl::OkStatus());
  }
  return impl_->Launch("reduce_scatter (bucket)", rank_, size_,
                       [&] { return impl_->backend->_reduce_scatter_base(output, input, {}); });
}

absl::Status ProcessGroup::Broadcast(std::vector<torch::Tensor>& tensors, int root) {
  if (size_ == 1 || tensors.empty()) return absl::OkStatus();
  c10d::BroadcastOptions o;
  o.rootRank = root;
  return impl_->Run("broadcast", rank_, size_,
                    [&] { return impl_->backend->broadcast(tensors, o); });
}

absl::Status ProcessGroup::ReduceScatterSum(torch::Tensor& output, const torch::Tensor& input) {
  if (input.numel() != output.numel() * size_)
    return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: input has ", input.numel(),
                                                   " elements, expected ", size_, " x ",
                                                   output.numel()));
  if (size_ == 1) {
    output.copy_(input.view_as(output));
    return absl::OkStatus();
  }
  torch::Tensor in = input.contiguous();
  return impl_->Run("reduce_scatter", rank_, size_,
                    [&] { return impl_->backend->_reduce_scatter_base(output, in, {}); });
}

absl::Status ProcessGroup::AllGather(torch::Tensor& output, const torch::Tensor& input) {
  if (output.numel() != input.numel() * size_)
    return absl::InvalidArgumentError(absl::StrCat("all_gather: output has ", output.numel(),
                                                   " elements, expected ", size_, " x ",
                                                   input.numel()));
  if (size_ == 1) {
    output.copy_(input.view_as(output));
    return absl::OkStatus();
  }
  torch::Tensor in = input.contiguous();
  return impl_->Run("all_gather", rank_, size_,
                    [&] { return impl_->backend->_allgather_base(output, in, {}); });
}

absl::Status ProcessGroup::BroadcastBytes(std::string* bytes, int root) {
  if (size_ == 1) return absl::OkStatus();
  std::vector<torch::Tensor> len{
      torch::tensor({static_cast<int64_t>(bytes->size())}, torch::kInt64).to(device_)};
  if (absl::Status s = Broadcast(len, root); !s.ok()) return s;
  const int64_t n = len[0].to(torch::kCPU).item<int64_t>();
  torch::Tensor data = torch::empty({n}, torch::kUInt8);
  if (rank_ == root) std::memcpy(data.data_ptr(), bytes->data(), static_cast<size_t>(n));
  std::vector<torch::Tensor> payload{data.to(device_)};
  if (n > 0) {
    if (absl::Status s = Broadcast(payload, root); !s.ok()) return s;
  }
  if (rank_ != root) {
    torch::Tensor host = payload[0].to(torch::kCPU).contiguous();
    bytes->assign(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ProcessGroup::AllGatherBytes(const std::string& mine) {
  if (size_ == 1) return std::vector<std::string>{mine};
  torch::Tensor lengths = torch::empty({size_}, torch::kInt64).to(device_);
  const torch::Tensor my_length =
      torch::tensor({static_cast<int64_t>(mine.size())}, torch::kInt64).to(device_);
  if (absl::Status s = AllGather(lengths, my_length); !s.ok()) return s;
  const torch::Tensor n = lengths.to(torch::kCPU).contiguous();
  const int64_t* len = n.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(len, len + size_);
  std::vector<std::string> out(static_cast<size_t>(size_));
  if (longest == 0) return out;
  // Padded to the longest, so that one all_gather of equal parts carries every rank's bytes.
  torch::Tensor part = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(part.data_ptr(), mine.data(), mine.size());
  torch::Tensor all = torch::empty({longest * size_}, torch::kUInt8).to(device_);
  if (absl::Status s = AllGather(all, part.to(device_)); !s.ok()) return s;
  const torch::Tensor host = all.to(torch::kCPU).contiguous();
  const char* data = static_cast<const char*>(host.data_ptr());
  for (int r = 0; r < size_; ++r)
    out[static_cast<size_t>(r)].assign(data + r * longest, static_cast<size_t>(len[r]));
  return out;
}

namespace {

// A c10d::TCPStore client whose every call ends within `timeout`. c10d bounds only the waits for a
// key; a call to a store host that stopped answering (its process stopped, its host unreachable
// with the connection open) blocks in recv() for good. So each call runs on a thread of its own
// and the caller waits for it at most `timeout`: past that the client is dead (this call and every
// later one fail at once, naming the first), and the stuck thread is left to the process's end.
class TcpStoreClient final : public StoreClient {
 public:
  TcpStoreClient(c10::intrusive_ptr<c10d::TCPStore> store, absl::Duration timeout)
      : store_(std::move(store)), timeout_(timeout) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    return Call("set", key,
                [key, value](c10d::TCPStore& s) {
                  s.set(key, std::vector<uint8_t>(value.begin(), value.end()));
                  return std::optional<std::string>();
                })
        .status();
  }
  absl::StatusOr<std::optional<std::string>> TryGet(const std::string& key) override {
    return Call("get", key, [key](c10d::TCPStore& s) {
      std::optional<std::string> out;
      if (!s.check({key})) return out;
      const std::vector<uint8_t> v = s.get(key);
      out.emplace(v.begin(), v.end());
      return out;
    });
  }
  absl::Status Delete(const std::string& key) override {
    return Call("delete", key,
                [key](c10d::TCPStore& s) {
                  s.deleteKey(key);
                  return std::optional<std::string>();
                })
        .status();
  }

 private:
  using Op = std::function<std::optional<std::string>(c10d::TCPStore&)>;
  // What a call's thread hands back; shared, so that a thread outliving its caller stays valid.
  struct Result {
    absl::Notification done;
    absl::StatusOr<std::optional<std::string>> value;
  };

  absl::StatusOr<std::optional<std::string>> Call(const char* op, const std::string& key, Op fn) {
    if (!dead_.ok()) return dead_;
    auto result = std::make_shared<Result>();
    std::thread worker(
        [store = store_, result, fn = std::move(fn), what = absl::StrCat(op, " ", key)] {
          try {
            result->value = fn(*store);
          } catch (const std::exception& e) {
            result->value = absl::UnavailableError(
                absl::StrCat("the group's store did not answer (", what, "): ", ErrorText(e)));
          }
          result->done.Notify();
        });
    if (result->done.WaitForNotificationWithTimeout(timeout_)) {
      worker.join();
      return std::move(result->value);
    }
    worker.detach();
    dead_ = absl::UnavailableError(absl::StrCat("the group's store did not answer within ",
                                                absl::FormatDuration(timeout_), " (", op, " ", key,
                                                ")"));
    return dead_;
  }

  c10::intrusive_ptr<c10d::TCPStore> store_;
  const absl::Duration timeout_;
  absl::Status dead_;  // set once a call timed out
};

}  // namespace

absl::StatusOr<std::unique_ptr<StoreClient>> ProcessGroup::ConnectStore(
    absl::Duration timeout) const {
  if (size_ == 1) return absl::FailedPreconditionError("a one-process group has no store");
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env_.master_port);
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = Millis(timeout);
  try {
    return std::make_unique<TcpStoreClient>(
        c10::make_intrusive<c10d::TCPStore>(env_.master_addr, so), timeout);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("connecting to the group's store at ",
                                               env_.master_addr, ":", env_.master_port, ": ",
                                               ErrorText(e)));
  }
}

absl::Status ProcessGroup::Barrier() {
  if (size_ == 1) return absl::OkStatus();
  // An all-reduce of one element: a barrier that also reports a missing peer as an error.
  std::vector<torch::Tensor> one{torch::ones({1}, torch::TensorOptions(device_))};
  return AllReduce(one);
}

absl::StatusOr<std::vector<double>> ProcessGroup::AllReduceDoubles(std::vector<double> values,
                                                                   ReduceOp op) {
  if (size_ == 1 || values.empty()) return values;
  std::vector<torch::Tensor> t{torch::tensor(values, torch::kFloat64).to(device_)};
  if (absl::Status s = AllReduce(t, op); !s.ok()) return s;
  torch::Tensor host = t[0].to(torch::kCPU).contiguous();
  std::memcpy(values.data(), host.data_ptr(), values.size() * sizeof(double));
  return values;
}

absl::StatusOr<bool> ProcessGroup::AnyRank(bool value) {
  absl::StatusOr<std::vector<double>> v = AllReduceDoubles({value ? 1.0 : 0.0}, ReduceOp::kMax);
  if (!v.ok()) return v.status();
  return (*v)[0] > 0;
}

}  // namespace lm::dist
