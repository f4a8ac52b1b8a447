#include "trainer/opd/weight_push.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <random>

#include <torch/torch.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/dist/process_group.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rpc/status.h"
#include "rpc/tensor_codec.h"
#include "rpc/weight_stream.h"

namespace trainer {
namespace {

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

// A port free on `host` now (the TCPStore binds it a moment later; a clash is an error the push
// reports, not a hang).
absl::StatusOr<int> FreePort(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), "0", &hints, &res); rc != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("weight sync host '", host, "' does not resolve: ", gai_strerror(rc)));
  int port = 0;
  for (addrinfo* a = res; a != nullptr && port == 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    }
    ::close(fd);
  }
  freeaddrinfo(res);
  if (port == 0)
    return absl::UnavailableError(absl::StrCat("no free port on weight sync host '", host, "'"));
  return port;
}

}  // namespace

absl::StatusOr<std::pair<std::string, int>> WeightGroupAddress(const std::string& store_host,
                                                               const std::string& worker) {
  std::string host = store_host;
  if (host.empty() && IsLoopbackHost(HostOf(worker))) host = "127.0.0.1";
  if (host.empty()) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  ASSIGN_OR_RETURN(const int port, FreePort(host));
  return std::make_pair(host, port);
}

std::string NewWeightGroupId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

WeightPusher::~WeightPusher() = default;

absl::StatusOr<std::unique_ptr<WeightPusher>> WeightPusher::Connect(
    const opd::rpc::ClientOptions& options, const opd::v1::ServiceInfo& info,
    const WeightPushOptions& push, torch::Device learner_device) {
  if (push.bucket_bytes < 8 || push.bucket_bytes % 8 != 0)
    return absl::InvalidArgumentError(absl::StrCat("weight push bucket of ", push.bucket_bytes,
                                                   " bytes: a multiple of 8 is needed"));
  auto p = std::unique_ptr<WeightPusher>(new WeightPusher());
  p->options_ = options;
  p->push_ = push;
  p->device_ = learner_device;
  auto dtype = opd::rpc::ServedDtype(info);
  if (!dtype.ok())
    return absl::FailedPreconditionError(
        absl::StrCat("rollout worker ", options.address, ": ", dtype.status().message()));
  p->wire_dtype_ = *dtype;
  ASSIGN_OR_RETURN(auto channel, opd::rpc::MakeChannel(options));
  p->stub_ = opd::v1::Rollout::NewStub(channel);
  if (push.mode != WeightSyncMode::kGrpc) {
    absl::Status joined = p->JoinGroup();
    if (!joined.ok()) {
      if (push.mode == WeightSyncMode::kCollective) return joined;
      lm::log::Warn(absl::StrCat("weight sync with ", options.address,
                                 " falls back to gRPC streaming: ", joined.message()));
      p->collective_off_ = true;
    }
  }
  return p;
}

absl::Status WeightPusher::Fail(const std::string& what, const absl::Status& st) const {
  return absl::Status(
      st.code(), absl::StrCat("rollout worker ", options_.address, ": ", what, ": ", st.message()));
}

absl::Status WeightPusher::JoinGroup() {
  group_.reset();
  ASSIGN_OR_RETURN(const auto address, WeightGroupAddress(push_.store_host, options_.address));
  const auto& [host, port] = address;
  opd::v1::JoinWeightGroupRequest req;
  group_id_ = NewWeightGroupId();
  req.set_group_id(group_id_);
  req.set_store_host(host);
  req.set_store_port(port);
  req.set_timeout_s(absl::ToDoubleSeconds(push_.group_timeout));
  req.set_learner_cuda(device_.is_cuda());
  opd::v1::JoinWeightGroupResponse resp;
  {
    grpc::ClientContext ctx;
    opd::rpc::PrepareContext(options_, &ctx);
    opd::rpc::CallCanceller::Scope cancel(options_.canceller.get(), &ctx);
    if (absl::Status st =
            opd::rpc::FromGrpc(stub_->JoinWeightGroup(&ctx, req, &resp), options_.address);
        !st.ok())
      return Fail("cannot form a weight group", st);
  }
  // The worker is joining now; the rendezvous returns once it has.
  lm::dist::GroupOptions go;
  go.timeout = push_.group_timeout;
  go.backend = resp.backend();
  backend_ = resp.backend();
  const torch::Device on = backend_ == "nccl" ? device_ : torch::Device(torch::kCPU);
  auto group = lm::dist::ProcessGroup::Create(lm::dist::LaunchEnv{0, 2, 0, host, port}, on, go);
  if (!group.ok()) return Fail("the weight group did not form", group.status());
  group_ = std::move(*group);
  bucket_ = torch::empty({push_.bucket_bytes}, torch::TensorOptions(torch::kUInt8).device(on));
  lm::log::Info(absl::StrCat("weight group with ", options_.address, ": ", backend_, " via ", host,
                             ":", port, " (worker on ", resp.device(), ")"));
  return absl::OkStatus();
}

absl::StatusOr<PushReport> WeightPusher::Push(const std::vector<opd::rpc::OutgoingTensor>& tensors,
                                              int64_t version) {
  const bool partial = acked_version_ >= 0;
  auto r = PushOnce(tensors, version);
  if (r.ok() || r.status().code() != absl::StatusCode::kFailedPrecondition) return r;
  // A worker that takes full updates only (an expert-parallel one) says so: it gets every
  // tensor, without a manifest, from now on.
  if (!manifest_off_ && absl::StrContains(r.status().message(), "(no manifest)")) {
    lm::log::Warn(absl::StrCat("rollout worker ", options_.address,
                               " takes full weight updates only: every push sends every tensor"));
    manifest_off_ = true;
    return PushOnce(tensors, version);
  }
  // A worker that restarted (or was updated by someone else) refuses an update relative to the
  // version we think it serves: it gets every tensor instead (PushOnce forgot the checksums).
  if (partial && absl::StrContains(r.status().message(), "send every tensor"))
    return PushOnce(tensors, version);
  return r;
}

absl::StatusOr<PushReport> WeightPusher::PushOnce(
    const std::vector<opd::rpc::OutgoingTensor>& tensors, int64_t version) {
  std::vector<size_t> which;
  opd::v1::WeightManifest manifest;
  const bool partial = acked_version_ >= 0 && !manifest_off_;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = acked_.find(tensors[i].name);
    if (partial && it != acked_.end() && it->second.has_value() &&
        it->second == tensors[i].checksum)
      continue;
    which.push_back(i);
    opd::rpc::ToProto(tensors[i], manifest.add_tensors());
  }
  if (partial) manifest.set_base_version(acked_version_);
  // Whatever happens next, only a success says what the worker holds.
  std::map<std::string, std::optional<uint64_t>> acked = std::move(acked_);
  acked_.clear();
  acked_version_ = -1;

  absl::StatusOr<PushReport> r;
  if (manifest_off_) return PushGrpc(tensors, which, nullptr, version);
  if (push_.mode != WeightSyncMode::kGrpc && !collective_off_ && !group_) {
    // The group broke on an earlier push: form it again once.
    if (absl::Status st = JoinGroup(); !st.ok()) {
      if (push_.mode == WeightSyncMode::kCollective) return st;
      lm::log::Warn(absl::StrCat("weight sync with ", options_.address,
                                 " falls back to gRPC streaming: ", st.message()));
      collective_off_ = true;
    }
  }
  if (group_) {
    r = PushCollective(tensors, which, manifest, version);
    if (!r.ok() && push_.mode == WeightSyncMode::kAuto &&
        r.status().code() == absl::StatusCode::kUnavailable) {
      lm::log::Warn(absl::StrCat("collective push of version ", version, " to ", options_.address,
                                 " failed, sending it over gRPC: ", r.status().message()));
      // The worker's state is unknown now: everything goes.
      manifest.clear_base_version();
      manifest.clear_tensors();
      which.clear();
      for (size_t i = 0; i < tensors.size(); ++i) {
        which.push_back(i);
        opd::rpc::ToProto(tensors[i], manifest.add_tensors());
      }
      r = PushGrpc(tensors, which, &manifest, version);
    }
  } else {
    r = PushGrpc(tensors, which, &manifest, version);
  }
  if (!r.ok()) return r;
  if (r->collective && r->tensors != static_cast<int64_t>(which.size()))
    return Fail(absl::StrCat("push of version ", version),
                absl::DataLossError(absl::StrCat("applied ", r->tensors, " tensors of the ",
                                                 which.size(), " sent")));
  if (!manifest.has_base_version()) acked.clear();
  for (size_t i : which) acked[tensors[i].name] = tensors[i].checksum;
  acked_ = std::move(acked);
  acked_version_ = version;
  return r;
}

absl::StatusOr<PushReport> WeightPusher::PushGrpc(
    const std::vector<opd::rpc::OutgoingTensor>& tensors, const std::vector<size_t>& which,
    const opd::v1::WeightManifest* manifest, int64_t version) {
  if (!bucket_.defined() || !bucket_.device().is_cpu())
    bucket_ = torch::empty({push_.bucket_bytes}, torch::kUInt8);
  opd::rpc::StreamOptions stream;
  stream.chunk_bytes = push_.grpc_chunk_bytes;
  stream.on_bucket = push_.on_bucket;
  absl::StatusOr<opd::rpc::StreamReport> r =
      opd::rpc::StreamWeights(*stub_, options_, version, tensors, which, manifest, bucket_, stream);
  if (!r.ok())
    return absl::Status(r.status().code(), absl::StrCat("weight push of version ", version, ": ",
                                                        r.status().message()));
  if (r->applied.version() != version)
    return Fail(
        absl::StrCat("push of version ", version),
        absl::DataLossError(absl::StrCat("serves version ", r->applied.version(), " after it")));
  return PushReport{false, r->applied.tensors(), r->bytes};
}

absl::StatusOr<PushReport> WeightPusher::PushCollective(
    const std::vector<opd::rpc::OutgoingTensor>& tensors, const std::vector<size_t>& which,
    const opd::v1::WeightManifest& manifest, int64_t version) {
  const std::string what = absl::StrCat("collective push of version ", version);
  opd::v1::SyncWeightsRequest req;
  req.set_group_id(group_id_);
  req.set_version(version);
  *req.mutable_manifest() = manifest;
  req.set_bucket_bytes(push_.bucket_bytes);
  opd::v1::SyncWeightsResponse resp;
  {
    grpc::ClientContext ctx;
    opd::rpc::PrepareContext(options_, &ctx);
    opd::rpc::CallCanceller::Scope cancel(options_.canceller.get(), &ctx);
    absl::Status st = opd::rpc::FromGrpc(stub_->SyncWeights(&ctx, req, &resp), options_.address);
    if (!st.ok()) {
      // No broadcast started: the group is fine, unless the worker lost it (it restarted).
      if (st.code() == absl::StatusCode::kFailedPrecondition &&
          absl::StrContains(st.message(), "no weight group")) {
        group_.reset();
        return absl::UnavailableError(absl::StrCat(what, ": ", st.message()));
      }
      return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
    }
  }
  // The data phase (rollout.proto, SyncWeightsRequest): frames, the end, the worker's verdict.
  auto broke = [&](const absl::Status& st) {
    group_.reset();  // unusable after a failed collective
    return absl::UnavailableError(
        absl::StrCat("rollout worker ", options_.address, ": ", what, ": ", st.message()));
  };
  const auto on = bucket_.options().dtype(torch::kInt64);
  std::vector<torch::Tensor> header{torch::empty({1}, on)};
  int64_t buckets = 0, bytes = 0;
  absl::Status sent = opd::rpc::PackBuckets(
      tensors, which, bucket_, [&](int64_t n, const std::vector<opd::rpc::BucketSegment>&) {
        if (n == 0) return absl::OkStatus();  // only zero-byte tensors: nothing to send
        header[0].fill_(n);
        RETURN_IF_ERROR(group_->Broadcast(header, 0));
        std::vector<torch::Tensor> data{bucket_.narrow(0, 0, n)};
        RETURN_IF_ERROR(group_->Broadcast(data, 0));
        bytes += n;
        if (push_.on_bucket) push_.on_bucket(buckets);
        ++buckets;
        return absl::OkStatus();
      });
  if (!sent.ok()) return broke(sent);
  header[0].fill_(0);
  if (absl::Status st = group_->Broadcast(header, 0); !st.ok()) return broke(st);
  std::string verdict;
  if (absl::Status st = group_->BroadcastBytes(&verdict, 1); !st.ok()) return broke(st);
  opd::v1::SyncWeightsResult result;
  if (!result.ParseFromString(verdict))
    return broke(absl::DataLossError("the worker's verdict does not parse"));
  if (result.code() != 0)
    return absl::Status(
        static_cast<absl::StatusCode>(result.code()),
        absl::StrCat("rollout worker ", options_.address, ": ", what, ": ", result.message()));
  if (result.applied().version() != version)
    return Fail(what, absl::DataLossError(
                          absl::StrCat("the worker applied version ", result.applied().version())));
  return PushReport{true, result.applied().tensors(), bytes};
}

}  // namespace trainer
