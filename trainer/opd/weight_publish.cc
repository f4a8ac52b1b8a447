// WeightPublisher (trainer/opd/weight_push.h): the parallel push of every learner rank's share
// to the rollout workers over one weight group, and its gRPC fallback.
#include <algorithm>
#include <chrono>
#include <future>
#include <tuple>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lm/dist/process_group.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"
#include "rpc/status.h"
#include "rpc/tensor_codec.h"
#include "trainer/opd/rollout_pool.h"
#include "trainer/opd/weight_push.h"

namespace trainer {

namespace {

using Clock = std::chrono::steady_clock;

// The outcome of a phase every learner rank must agree on, with an explicit flag.
nlohmann::json Verdict(const absl::Status& st) {
  return {{"ok", st.ok()}, {"code", static_cast<int>(st.code())}, {"message", st.message()}};
}
absl::Status FromVerdict(const nlohmann::json& j) {
  if (j.at("ok").get<bool>()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(j.at("code").get<int>()),
                      j.at("message").get<std::string>());
}

// Rank 0's JSON to every learner rank (BroadcastBytes); a text that does not parse is DATA_LOSS.
absl::StatusOr<nlohmann::json> ShareJson(lm::dist::ProcessGroup& learners,
                                         const nlohmann::json& mine) {
  std::string bytes = learners.is_root() ? mine.dump() : std::string();
  RETURN_IF_ERROR(learners.BroadcastBytes(&bytes));
  nlohmann::json j = nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return absl::DataLossError("a learner rank's share of the weight push plan does not parse");
  return j;
}

}  // namespace

struct WeightPublisher::Worker {
  std::string address;
  opd::rpc::ClientOptions options;
  std::unique_ptr<opd::v1::Rollout::Stub> stub;
  opd::v1::ServiceInfo info;
  opd::rpc::WireDtype dtype = opd::rpc::WireDtype::kFloat32;  // it serves, and takes updates in
  std::string outside;  // why it takes gRPC pushes only (empty: it may join the group)
  bool down = false;    // did not answer at the last push
  absl::Status probe;   // why
  std::unique_ptr<WeightPusher> grpc;  // its gRPC pusher, made at its first gRPC push
};

// One push, as rank 0 decided it (and told every learner rank).
struct WeightPublisher::Plan {
  bool collective = false;  // a data phase over the weight group
  bool form = false;        // the group is formed anew first
  bool drop = false;        // the group is dropped (its forming anew failed)
  std::string group_id, host, backend;
  std::optional<opd::rpc::WireDtype> wire_dtype;  // the members'
  int port = 0;
  std::vector<int> members;  // worker indices at group ranks L, L + 1, ...
  int64_t bucket_bytes = 0;

  nlohmann::json ToJson() const {
    return {{"collective", collective},
            {"form", form},
            {"drop", drop},
            {"group_id", group_id},
            {"host", host},
            {"backend", backend},
            {"wire_dtype", wire_dtype ? opd::rpc::WireDtypeName(*wire_dtype) : ""},
            {"port", port},
            {"members", members},
            {"bucket_bytes", bucket_bytes}};
  }
  static Plan FromJson(const nlohmann::json& j) {
    Plan p;
    p.collective = j.at("collective");
    p.form = j.at("form");
    p.drop = j.at("drop");
    p.group_id = j.at("group_id");
    p.host = j.at("host");
    p.backend = j.at("backend");
    const std::string wire = j.at("wire_dtype");
    if (!wire.empty()) p.wire_dtype = opd::rpc::WireDtypeFromName(wire).value();  // rank 0 wrote it
    p.port = j.at("port");
    p.members = j.at("members").get<std::vector<int>>();
    p.bucket_bytes = j.at("bucket_bytes");
    return p;
  }
};

WeightPublisher::WeightPublisher() = default;
WeightPublisher::~WeightPublisher() = default;

absl::StatusOr<std::unique_ptr<WeightPublisher>> WeightPublisher::Create(
    lm::dist::ProcessGroup* learners, const std::vector<std::string>& endpoints,
    const opd::rpc::ClientOptions& base, const WeightPushOptions& push, torch::Device device,
    RolloutPool* pool) {
  if (push.bucket_bytes < 8 || push.bucket_bytes % 8 != 0)
    return absl::InvalidArgumentError(absl::StrCat("weight push bucket of ", push.bucket_bytes,
                                                   " bytes: a multiple of 8 is needed"));
  auto p = std::unique_ptr<WeightPublisher>(new WeightPublisher());
  p->learners_ = learners;
  p->push_ = push;
  p->device_ = device;
  p->pool_ = pool;
  absl::Status connected =
      learners->is_root() ? p->ConnectWorkers(endpoints, base) : absl::OkStatus();
  ASSIGN_OR_RETURN(const nlohmann::json agreed, ShareJson(*learners, Verdict(connected)));
  RETURN_IF_ERROR(FromVerdict(agreed));
  return p;
}

absl::Status WeightPublisher::ConnectWorkers(const std::vector<std::string>& endpoints,
                                             const opd::rpc::ClientOptions& base) {
  if (endpoints.empty()) return absl::InvalidArgumentError("no rollout worker endpoints");
  for (const std::string& address : endpoints) {
    auto w = std::make_unique<Worker>();
    w->address = address;
    w->options = base;
    w->options.address = address;
    ASSIGN_OR_RETURN(auto channel, opd::rpc::MakeChannel(w->options));
    w->stub = opd::v1::Rollout::NewStub(channel);
    grpc::ClientContext ctx;
    opd::rpc::PrepareContext(w->options, &ctx);
    RETURN_IF_ERROR(
        opd::rpc::FromGrpc(w->stub->Info(&ctx, opd::v1::InfoRequest(), &w->info), address));
    auto dtype = opd::rpc::ServedDtype(w->info);
    if (!dtype.ok())
      return absl::FailedPreconditionError(
          absl::StrCat("rollout worker ", address, ": ", dtype.status().message()));
    w->dtype = *dtype;
    workers_.push_back(std::move(w));
  }
  return absl::OkStatus();
}

// Rank 0: whether worker i answers now (marks it down when not).
bool WeightPublisher::Probe(size_t i) {
  Worker& w = *workers_[i];
  if (w.down) {
    // A fresh channel: the old one's connection is in gRPC's reconnect backoff (up to minutes)
    // and would fail the probe without trying. Its pusher goes too (it shares the connection;
    // a worker that restarted needs every tensor anyway).
    w.grpc.reset();
    w.stub.reset();
    auto channel = opd::rpc::MakeChannel(w.options);
    if (!channel.ok()) {
      w.probe = channel.status();
      return false;
    }
    w.stub = opd::v1::Rollout::NewStub(*channel);
  }
  grpc::ClientContext ctx;
  opd::rpc::PrepareContext(w.options, &ctx);
  opd::v1::ServiceInfo info;
  w.probe = opd::rpc::FromGrpc(w.stub->Info(&ctx, opd::v1::InfoRequest(), &info), w.address);
  w.down = !w.probe.ok();
  return !w.down;
}

// Rank 0: who is up, who joins, in what. Workers that do not answer are marked down (reported
// by the push); the group is formed anew when its members would change.
WeightPublisher::Plan WeightPublisher::PlanPush(int64_t version,
                                                std::vector<absl::Status>* failed) {
  Plan plan;
  plan.bucket_bytes = push_.bucket_bytes;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = *workers_[i];
    const bool member =
        std::find(members_.begin(), members_.end(), static_cast<int>(i)) != members_.end();
    if (member && group_) continue;  // in the group: the sync will tell
    const bool was_down = w.down;
    if (Probe(i) && was_down)
      lm::log::Info(absl::StrCat("rollout worker ", w.address,
                                 " answers again: it gets weight version ", version));
    if (w.down)
      (*failed)[i] = absl::UnavailableError(
          absl::StrCat("rollout worker ", w.address, " did not answer (", w.probe.message(),
                       "); it gets the weights once it answers again"));
  }
  if (push_.mode == WeightSyncMode::kGrpc) return plan;
  // The members: every worker up and able to join, in the first such worker's dtype.
  std::vector<int> members;
  for (size_t i = 0; i < workers_.size(); ++i) {
    const Worker& w = *workers_[i];
    if (w.down || !w.outside.empty()) continue;
    if (!plan.wire_dtype.has_value()) plan.wire_dtype = w.dtype;
    if (w.dtype == *plan.wire_dtype) members.push_back(static_cast<int>(i));
  }
  if (members.empty()) return plan;
  plan.collective = true;
  plan.backend = device_.is_cuda() ? "nccl" : "gloo";
  plan.form = !group_ || members != members_;
  plan.members = std::move(members);
  return plan;
}

// Rank 0: every member is asked to join the new group (each answers at once and joins in the
// background). A worker that cannot (expert-parallel, no CUDA for NCCL) takes gRPC pushes from
// now on, this one included. When any join fails this push has no group (the others wait in a
// rendezvous of the wrong size and give up after the group's timeout): in mode auto its members
// get the version over gRPC, in mode collective the push reports them.
absl::Status WeightPublisher::JoinAll(Plan& plan) {
  const Worker& first = *workers_[static_cast<size_t>(plan.members[0])];
  ASSIGN_OR_RETURN(const auto address, WeightGroupAddress(push_.store_host, first.address));
  std::tie(plan.host, plan.port) = address;
  plan.group_id = NewWeightGroupId();
  const int learners = learners_->size();
  const int world = learners + static_cast<int>(plan.members.size());
  std::vector<std::future<absl::Status>> calls;
  for (size_t j = 0; j < plan.members.size(); ++j) {
    Worker* w = workers_[static_cast<size_t>(plan.members[j])].get();
    opd::v1::JoinWeightGroupRequest req;
    req.set_group_id(plan.group_id);
    req.set_store_host(plan.host);
    req.set_store_port(plan.port);
    req.set_timeout_s(absl::ToDoubleSeconds(push_.group_timeout));
    req.set_learner_cuda(device_.is_cuda());
    req.set_rank(learners + static_cast<int>(j));
    req.set_world_size(world);
    req.set_backend(plan.backend);
    calls.push_back(std::async(std::launch::async, [w, req] {
      grpc::ClientContext ctx;
      opd::rpc::PrepareContext(w->options, &ctx);
      opd::v1::JoinWeightGroupResponse resp;
      return opd::rpc::FromGrpc(w->stub->JoinWeightGroup(&ctx, req, &resp), w->address);
    }));
  }
  absl::Status all;
  std::vector<int> joinable;
  for (size_t j = 0; j < calls.size(); ++j) {
    const absl::Status st = calls[j].get();
    Worker& w = *workers_[static_cast<size_t>(plan.members[j])];
    if (st.code() == absl::StatusCode::kFailedPrecondition) {
      w.outside = std::string(st.message());
      lm::log::Warn(
          absl::StrCat("rollout worker ", w.address,
                       " cannot join the weight group; it gets gRPC pushes: ", st.message()));
    } else {
      joinable.push_back(plan.members[j]);
    }
    if (!st.ok() && all.ok())
      all = absl::Status(st.code(), absl::StrCat("rollout worker ", w.address,
                                                 " cannot join the weight group: ", st.message()));
  }
  plan.members = std::move(joinable);
  return all;
}

// Rank 0: the version announced to every member (the control plane); OK when all accepted.
absl::Status WeightPublisher::Announce(const Plan& plan,
                                       const std::vector<opd::rpc::OutgoingTensor>& wire,
                                       int64_t version, std::vector<absl::Status>* failed) {
  opd::v1::SyncWeightsRequest req;
  req.set_version(version);
  req.set_bucket_bytes(plan.bucket_bytes);
  int64_t total = 0;
  for (const auto& t : wire) {
    opd::rpc::ToProto(t, req.mutable_manifest()->add_tensors());  // without a checksum
    total += t.bytes;
  }
  for (int64_t b : opd::rpc::SenderShares(total, learners_->size())) req.add_sender_bytes(b);
  std::vector<std::future<absl::Status>> calls;
  for (int i : members_) {
    Worker* w = workers_[static_cast<size_t>(i)].get();
    opd::v1::SyncWeightsRequest mine = req;
    mine.set_group_id(group_id_);
    calls.push_back(std::async(std::launch::async, [w, mine] {
      grpc::ClientContext ctx;
      opd::rpc::PrepareContext(w->options, &ctx);
      opd::v1::SyncWeightsResponse resp;
      return opd::rpc::FromGrpc(w->stub->SyncWeights(&ctx, mine, &resp), w->address);
    }));
  }
  absl::Status all;
  for (size_t j = 0; j < calls.size(); ++j) {
    const absl::Status st = calls[j].get();
    if (st.ok()) continue;
    const size_t i = static_cast<size_t>(members_[j]);
    (*failed)[i] = absl::Status(
        st.code(), absl::StrCat("rollout worker ", workers_[i]->address, ": weight version ",
                                version, " not announced: ", st.message()));
    if (all.ok()) all = (*failed)[i];
  }
  return all;
}

// Every learner rank: its share, then the others', then the workers' verdicts.
absl::Status WeightPublisher::SendShares(const Plan& plan,
                                         const std::vector<opd::rpc::OutgoingTensor>& wire,
                                         std::vector<opd::rpc::SyncVerdict>* verdicts) {
  const int me = learners_->rank(), senders = learners_->size();
  int64_t total = 0;
  for (const auto& t : wire) total += t.bytes;
  const std::vector<int64_t> shares = opd::rpc::SenderShares(total, senders);
  const torch::Device on = backend_ == "nccl" ? device_ : torch::Device(torch::kCPU);
  const int64_t largest = *std::max_element(shares.begin(), shares.end());
  const int64_t size = std::min(plan.bucket_bytes, std::max<int64_t>(largest, 8));
  if (!bucket_.defined() || bucket_.numel() != size || bucket_.device() != on)
    bucket_ = torch::empty({size}, torch::TensorOptions(torch::kUInt8).device(on));
  int64_t begin = 0, buckets = 0;
  for (int r = 0; r < senders; ++r) {
    if (r == me) {
      RETURN_IF_ERROR(opd::rpc::PackRange(wire, begin, begin + shares[r], bucket_, [&](int64_t n) {
        std::vector<torch::Tensor> data{bucket_.narrow(0, 0, n)};
        RETURN_IF_ERROR(group_->Broadcast(data, r));
        if (push_.on_bucket) push_.on_bucket(buckets);
        ++buckets;
        return absl::OkStatus();
      }));
    } else {
      for (int64_t left = shares[r]; left > 0;) {
        const int64_t n = std::min(left, size);
        std::vector<torch::Tensor> data{bucket_.narrow(0, 0, n)};
        RETURN_IF_ERROR(group_->Broadcast(data, r));
        left -= n;
      }
    }
    begin += shares[r];
  }
  const int world = group_->size();
  torch::Tensor mine = torch::zeros({opd::rpc::kVerdictBytes}, torch::kUInt8);
  opd::rpc::EncodeVerdict(opd::rpc::SyncVerdict{}, mine.data_ptr<uint8_t>());
  torch::Tensor all = torch::empty({opd::rpc::kVerdictBytes * world},
                                   torch::TensorOptions(torch::kUInt8).device(on));
  RETURN_IF_ERROR(group_->AllGather(all, mine.to(on)));
  const torch::Tensor host = all.to(torch::kCPU).contiguous();
  verdicts->clear();
  for (int k = senders; k < world; ++k)
    verdicts->push_back(
        opd::rpc::DecodeVerdict(host.data_ptr<uint8_t>() + k * opd::rpc::kVerdictBytes));
  return absl::OkStatus();
}

// Rank 0: one worker's push over gRPC (its own pusher: only the changed tensors, checksummed).
WorkerPush WeightPublisher::PushGrpc(
    size_t i, const std::vector<std::pair<std::string, torch::Tensor>>& params, int64_t version) {
  Worker& w = *workers_[i];
  WorkerPush out;
  out.address = w.address;
  if (!w.grpc) {
    WeightPushOptions o = push_;
    o.mode = WeightSyncMode::kGrpc;
    o.on_bucket = nullptr;
    auto pusher = WeightPusher::Connect(w.options, w.info, o, device_);
    if (!pusher.ok()) {
      out.status = pusher.status();
      return out;
    }
    w.grpc = std::move(*pusher);
  }
  auto wire = opd::rpc::OutgoingTensorsOf(params, w.grpc->wire_dtype());
  torch::Tensor staging = torch::empty({int64_t{16} << 20}, torch::kUInt8);
  opd::rpc::ComputeChecksums(&wire, staging);
  auto r = w.grpc->Push(wire, version);
  if (!r.ok()) {
    out.status = absl::Status(
        r.status().code(), absl::StrCat("rollout worker ", w.address, ": weight push of version ",
                                        version, " over gRPC failed: ", r.status().message()));
    return out;
  }
  out.tensors = r->tensors;
  out.bytes = r->bytes;
  return out;
}

// One Publish's state, as its steps leave it.
struct WeightPublisher::Round {
  int64_t version = 0;
  Plan plan;
  std::vector<absl::Status> failed;  // rank 0: per worker, before the data phase
  absl::Status joined, formed, announced, sent;
  bool formed_now = false, data_phase = false, broken = false;
  std::vector<size_t> by_grpc;  // rank 0: the workers pushed over gRPC this round
  std::vector<opd::rpc::SyncVerdict> verdicts;

  bool InGroup(size_t worker) const {
    return std::find(plan.members.begin(), plan.members.end(), static_cast<int>(worker)) !=
           plan.members.end();
  }
};

absl::StatusOr<PublishReport> WeightPublisher::Publish(torch::nn::Module& model, int64_t version) {
  torch::NoGradGuard no_grad;
  const auto t0 = Clock::now();
  const bool root = learners_->is_root();
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : model.named_parameters()) params.emplace_back(p.key(), p.value().detach());
  // A worker may serve the version before this returns: the pool's sample checks allow it now.
  if (root && pool_) pool_->RecordPush(version, /*acknowledged=*/false);
  Round round;
  round.version = version;
  round.failed.resize(root ? workers_.size() : 0);

  // 1. Rank 0's plan, to every rank.
  if (root) {
    round.plan = PlanPush(version, &round.failed);
    if (round.plan.form) round.joined = JoinAll(round.plan);
    if (!round.joined.ok()) {
      round.plan.collective = round.plan.form = false;
      round.plan.drop = true;  // the workers that joined left the old group
    }
  }
  ASSIGN_OR_RETURN(const nlohmann::json shared, ShareJson(*learners_, round.plan.ToJson()));
  round.plan = Plan::FromJson(shared);

  // 2. The group, formed anew by every rank when its members change.
  RETURN_IF_ERROR(FormGroup(round));

  // 3. The announcement (rank 0), and whether the data phase goes ahead (every rank).
  std::vector<opd::rpc::OutgoingTensor> wire;
  if (round.plan.collective) wire = opd::rpc::OutgoingTensorsOf(params, *round.plan.wire_dtype);
  if (root && round.plan.collective)
    round.announced = Announce(round.plan, wire, version, &round.failed);
  ASSIGN_OR_RETURN(const nlohmann::json go, ShareJson(*learners_, Verdict(round.announced)));
  round.data_phase = round.plan.collective && FromVerdict(go).ok();
  if (round.plan.collective && !round.data_phase) {
    // The members that accepted wait for data that will not come: dropping the group ends that.
    DropGroup();
  }

  // 4. The shares, every rank; rank 0 meanwhile pushes over gRPC the workers outside the group
  // (and, in mode auto, the members when the group did not form or was not announced).
  std::vector<WorkerPush> results(root ? workers_.size() : 0);
  if (root) round.by_grpc = GrpcWorkers(round);
  std::future<void> grpc_pushes;
  if (!round.by_grpc.empty())
    grpc_pushes = std::async(std::launch::async, [&] {
      for (size_t i : round.by_grpc) results[i] = PushGrpc(i, params, version);
    });
  if (round.data_phase) round.sent = SendShares(round.plan, wire, &round.verdicts);
  // Unusable after a failed collective; dropping it now closes our connections, so the members
  // waiting on us fail at once instead of at the group's timeout.
  if (!round.sent.ok()) DropGroup();
  ASSIGN_OR_RETURN(round.broken, learners_->AnyRank(!round.sent.ok()));
  if (round.broken) DropGroup();
  if (grpc_pushes.valid()) grpc_pushes.get();

  // 5. Rank 0's report, to every rank.
  nlohmann::json mine;
  if (root) {
    for (size_t i = 0; i < workers_.size(); ++i) Settle(i, round, params, results[i]);
    mine = RootReport(round, results, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  ASSIGN_OR_RETURN(const nlohmann::json agreed, ShareJson(*learners_, mine));
  return ReportFromJson(agreed);
}

void WeightPublisher::DropGroup() {
  group_.reset();
  members_.clear();
}

absl::Status WeightPublisher::FormGroup(Round& round) {
  Plan& plan = round.plan;
  round.formed = round.joined;
  if (plan.drop) DropGroup();
  if (!plan.form) return absl::OkStatus();
  DropGroup();
  lm::dist::GroupOptions go;
  go.timeout = push_.group_timeout;
  go.backend = plan.backend;
  const int world = learners_->size() + static_cast<int>(plan.members.size());
  const torch::Device on = plan.backend == "nccl" ? device_ : torch::Device(torch::kCPU);
  auto group = lm::dist::ProcessGroup::Create(
      lm::dist::LaunchEnv{learners_->rank(), world, 0, plan.host, plan.port}, on, go);
  round.formed = group.status();
  ASSIGN_OR_RETURN(const bool any_failed, learners_->AnyRank(!round.formed.ok()));
  if (any_failed) {
    plan.collective = false;
    if (round.formed.ok())
      round.formed = absl::UnavailableError("another learner rank could not join");
    return absl::OkStatus();
  }
  group_ = std::move(*group);
  members_ = plan.members;
  backend_ = plan.backend;
  group_id_ = plan.group_id;
  round.formed_now = true;
  if (learners_->is_root())
    lm::log::Info(absl::StrCat("weight group of ", learners_->size(), " learner rank(s) and ",
                               members_.size(), " rollout worker(s): ", plan.backend, " via ",
                               plan.host, ":", plan.port));
  return absl::OkStatus();
}

std::vector<size_t> WeightPublisher::GrpcWorkers(const Round& round) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < workers_.size(); ++i) {
    const bool in_group = round.InGroup(i);
    if (!round.failed[i].ok() || (round.data_phase && in_group)) continue;
    // Mode collective: a member without a group this push is a failure, not a gRPC push.
    if (in_group && push_.mode == WeightSyncMode::kCollective) continue;
    out.push_back(i);
  }
  return out;
}

void WeightPublisher::Settle(size_t i, const Round& round,
                             const std::vector<std::pair<std::string, torch::Tensor>>& params,
                             WorkerPush& r) {
  const int64_t version = round.version;
  r.address = workers_[i]->address;
  const bool in_group = round.InGroup(i);
  if (!round.failed[i].ok()) {
    r.status = round.failed[i];
  } else if (round.data_phase && in_group && !round.broken) {
    const size_t k = static_cast<size_t>(
        std::find(round.plan.members.begin(), round.plan.members.end(), static_cast<int>(i)) -
        round.plan.members.begin());
    const opd::rpc::SyncVerdict& v = round.verdicts[k];
    r.collective = true;
    r.tensors = v.tensors;
    r.bytes = v.bytes;
    if (!v.present)
      r.status = absl::DataLossError(
          absl::StrCat("rollout worker ", r.address, " sent no verdict for version ", version));
    else if (v.code != 0)
      r.status = absl::Status(static_cast<absl::StatusCode>(v.code),
                              absl::StrCat("rollout worker ", r.address, ": weight version ",
                                           version, ": ", v.message));
    else if (v.version != version)
      r.status = absl::DataLossError(
          absl::StrCat("rollout worker ", r.address, " applied version ", v.version));
  } else if (round.data_phase && in_group) {
    // Broken: a member that does not answer died; the others learn nothing of this version.
    if (!Probe(i)) {
      r.status = absl::UnavailableError(absl::StrCat(
          "rollout worker ", r.address, " died during the push of version ", version, " (",
          workers_[i]->probe.message(), "); it gets the weights once it answers again"));
    } else if (push_.mode == WeightSyncMode::kAuto) {
      r = PushGrpc(i, params, version);
    } else {
      r.status = absl::UnavailableError(absl::StrCat(
          "rollout worker ", r.address, ": the weight group broke during the push", " of version ",
          version, " (", round.sent.ok() ? "on another rank" : round.sent.message(),
          "); it gets the weights at the next push"));
    }
  } else if (std::find(round.by_grpc.begin(), round.by_grpc.end(), i) == round.by_grpc.end()) {
    // Mode collective, a member without a group this push.
    r.status = absl::UnavailableError(
        absl::StrCat("rollout worker ", r.address, ": no weight group for version ", version, ": ",
                     round.formed.ok() ? round.announced.message() : round.formed.message()));
  }
}

nlohmann::json WeightPublisher::RootReport(const Round& round,
                                           const std::vector<WorkerPush>& results, double seconds) {
  std::vector<std::string> bad;
  absl::StatusCode code = absl::StatusCode::kOk;
  nlohmann::json workers = nlohmann::json::array();
  for (const WorkerPush& r : results) {
    if (!r.status.ok()) {
      if (code == absl::StatusCode::kOk) code = r.status.code();
      bad.push_back(std::string(r.status.message()));
    }
    workers.push_back({{"address", r.address},
                       {"status", Verdict(r.status)},
                       {"collective", r.collective},
                       {"tensors", r.tensors},
                       {"bytes", r.bytes}});
  }
  const absl::Status status =
      bad.empty()
          ? absl::OkStatus()
          : absl::Status(code, absl::StrCat("weight version ", round.version, ": ", bad.size(),
                                            " of ", results.size(), " rollout worker(s) failed: ",
                                            absl::StrJoin(bad, "; ")));
  if (pool_) pool_->RecordPush(round.version, status.ok());
  return {{"version", round.version},
          {"status", Verdict(status)},
          {"workers", workers},
          {"group_formed", round.formed_now},
          {"senders", round.data_phase && !round.broken ? learners_->size() : 0},
          {"seconds", seconds}};
}

PublishReport WeightPublisher::ReportFromJson(const nlohmann::json& agreed) {
  PublishReport report;
  report.version = agreed.at("version");
  report.status = FromVerdict(agreed.at("status"));
  report.group_formed = agreed.at("group_formed");
  report.senders = agreed.at("senders");
  report.seconds = agreed.at("seconds");
  for (const auto& w : agreed.at("workers")) {
    WorkerPush r;
    r.address = w.at("address");
    r.status = FromVerdict(w.at("status"));
    r.collective = w.at("collective");
    r.tensors = w.at("tensors");
    r.bytes = w.at("bytes");
    report.workers.push_back(std::move(r));
  }
  return report;
}

}  // namespace trainer
