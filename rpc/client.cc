#include "rpc/client.h"

#include <algorithm>
#include <thread>
#include <tuple>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include "absl/strings/str_cat.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "rpc/auth.h"
#include "rpc/codec.h"
#include "rpc/status.h"

namespace opd::rpc {

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& opts) {
  if (opts.address.empty()) return absl::InvalidArgumentError("no server address given");
  ASSIGN_OR_RETURN(auto creds, MakeChannelCredentials(opts.tls));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(opts.max_message_bytes);
  args.SetMaxSendMessageSize(opts.max_message_bytes);
  if (!opts.tls.server_name.empty()) args.SetSslTargetNameOverride(opts.tls.server_name);
  return grpc::CreateCustomChannel(opts.address, creds, args);
}

void CallCanceller::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
}

bool CallCanceller::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

CallCanceller::Scope::Scope(CallCanceller* c, grpc::ClientContext* ctx) : c_(c), ctx_(ctx) {
  if (!c_) return;
  absl::MutexLock lock(&c_->mu_);
  // A context cancelled before its call starts makes the call fail CANCELLED without sending.
  if (c_->cancelled_) ctx_->TryCancel();
  c_->calls_.insert(ctx_);
}

CallCanceller::Scope::~Scope() {
  if (!c_) return;
  absl::MutexLock lock(&c_->mu_);
  c_->calls_.erase(ctx_);
}

void PrepareContext(const ClientOptions& opts, grpc::ClientContext* ctx) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + opts.timeout));
  if (!opts.secret.empty()) ctx->AddMetadata(kAuthMetadataKey, BearerValue(opts.secret));
}

// --- teacher ---

TeacherClient::TeacherClient(ClientOptions opts, std::shared_ptr<grpc::Channel> channel)
    : opts_(std::move(opts)),
      channel_(std::move(channel)),
      stub_(opd::v1::Teacher::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<TeacherClient>> TeacherClient::Create(const ClientOptions& opts) {
  ASSIGN_OR_RETURN(auto channel, MakeChannel(opts));
  return std::unique_ptr<TeacherClient>(new TeacherClient(opts, std::move(channel)));
}

absl::StatusOr<opd::v1::ServiceInfo> TeacherClient::Info() {
  grpc::ClientContext ctx;
  PrepareContext(opts_, &ctx);
  CallCanceller::Scope cancel_scope(opts_.canceller.get(), &ctx);
  opd::v1::ServiceInfo info;
  RETURN_IF_ERROR(FromGrpc(stub_->Info(&ctx, opd::v1::InfoRequest(), &info), opts_.address));
  return info;
}

namespace {

opd::v1::ScoreRequest MakeScoreRequest(const std::vector<lm::Sample>& seqs,
                                       const ScoreOptions& opts) {
  opd::v1::ScoreRequest req;
  req.set_temperature(opts.temperature);
  req.set_top_k(opts.top_k);
  for (const auto& s : seqs) {
    auto* m = req.add_sequences();
    m->mutable_tokens()->Add(s.tokens.begin(), s.tokens.end());
    m->set_response_start(static_cast<int32_t>(s.response_start));
  }
  return req;
}

// PrepareContext with an absolute deadline, shared by the tries of one Score (stream, then unary).
void PrepareContextUntil(const ClientOptions& opts, absl::Time deadline, grpc::ClientContext* ctx) {
  PrepareContext(opts, ctx);
  ctx->set_deadline(absl::ToChronoTime(deadline));
}

// `s` with `what: ` in front of its message, same code.
absl::Status Prefixed(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// One sequence's scores; `in` says how many positions it has.
absl::StatusOr<lm::SequenceScore> UnpackScores(const opd::v1::SequenceScores& r,
                                               const lm::Sample& in, int32_t top_k) {
  const int64_t n = static_cast<int64_t>(in.tokens.size()) - in.response_start;
  lm::SequenceScore out;
  ASSIGN_OR_RETURN(out.logprobs, UnpackArray<float>(r.logprobs(), n, "logprobs"));
  if (top_k > 0) {
    ASSIGN_OR_RETURN(out.topk_ids, UnpackArray<int32_t>(r.topk_ids(), n * top_k, "topk_ids"));
    ASSIGN_OR_RETURN(out.topk_logprobs,
                     UnpackArray<float>(r.topk_logprobs(), n * top_k, "topk_logprobs"));
  }
  return out;
}

// Appends `chunk`'s sequences to `out`: they must be the next ones of `seqs`, with the top_k of
// the first chunk (`*top_k`, -1 before it).
absl::Status AppendChunk(const opd::v1::ScoreChunk& chunk, const std::vector<lm::Sample>& seqs,
                         int32_t* top_k, std::vector<lm::SequenceScore>* out) {
  if (chunk.first_sequence() != static_cast<int64_t>(out->size())) {
    return absl::InternalError(absl::StrCat("a chunk starts at sequence ", chunk.first_sequence(),
                                            ", expected ", out->size()));
  }
  if (chunk.top_k() < 0 || (*top_k >= 0 && chunk.top_k() != *top_k)) {
    return absl::InternalError(absl::StrCat("chunk at sequence ", chunk.first_sequence(),
                                            " has top_k ", chunk.top_k(), ", the first had ",
                                            *top_k));
  }
  *top_k = chunk.top_k();
  if (out->size() + chunk.sequences_size() > seqs.size()) {
    return absl::InternalError(
        absl::StrCat("chunks carry more than the ", seqs.size(), " sequences asked for"));
  }
  for (const auto& r : chunk.sequences()) {
    const size_t i = out->size();
    absl::StatusOr<lm::SequenceScore> o = UnpackScores(r, seqs[i], *top_k);
    if (!o.ok()) return Prefixed(o.status(), absl::StrCat("sequence ", i));
    out->push_back(*std::move(o));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<lm::SequenceScore>> TeacherClient::Score(
    const std::vector<lm::Sample>& seqs, const ScoreOptions& opts) {
  const opd::v1::ScoreRequest req = MakeScoreRequest(seqs, opts);
  const absl::Time deadline = absl::Now() + opts_.timeout;
  if (!unary_only_.load()) {
    bool unimplemented = false;
    absl::StatusOr<std::vector<lm::SequenceScore>> out =
        ScoreStreamed(req, seqs, deadline, &unimplemented);
    if (!unimplemented) return out;
    if (!unary_only_.exchange(true)) {
      lm::log::Info(absl::StrCat(opts_.address,
                                 ": the teacher has no ScoreStream (an older opd-teacher); "
                                 "scoring with unary Score calls from now on"));
    }
  }
  return ScoreUnary(req, seqs, deadline);
}

absl::StatusOr<std::vector<lm::SequenceScore>> TeacherClient::ScoreStreamed(
    const opd::v1::ScoreRequest& req, const std::vector<lm::Sample>& seqs, absl::Time deadline,
    bool* unimplemented) {
  grpc::ClientContext ctx;
  PrepareContextUntil(opts_, deadline, &ctx);
  CallCanceller::Scope cancel_scope(opts_.canceller.get(), &ctx);
  auto reader = stub_->ScoreStream(&ctx, req);
  std::vector<lm::SequenceScore> out;
  out.reserve(seqs.size());
  int32_t top_k = -1;
  absl::Status bad;
  opd::v1::ScoreChunk chunk;
  while (reader->Read(&chunk)) {
    if (!bad.ok()) continue;  // drains what was in flight when the call was cancelled
    bad = AppendChunk(chunk, seqs, &top_k, &out);
    if (!bad.ok()) ctx.TryCancel();
  }
  const grpc::Status st = reader->Finish();
  if (!bad.ok()) return Prefixed(bad, opts_.address);
  // An older server answers before any chunk; an UNIMPLEMENTED after chunks is a failure.
  *unimplemented = st.error_code() == grpc::StatusCode::UNIMPLEMENTED && out.empty();
  RETURN_IF_ERROR(FromGrpc(st, opts_.address));
  if (out.size() != seqs.size()) {
    return absl::InternalError(
        absl::StrCat(opts_.address, ": ", out.size(), " results for ", seqs.size(), " sequences"));
  }
  return out;
}

absl::StatusOr<std::vector<lm::SequenceScore>> TeacherClient::ScoreUnary(
    const opd::v1::ScoreRequest& req, const std::vector<lm::Sample>& seqs, absl::Time deadline) {
  grpc::ClientContext ctx;
  PrepareContextUntil(opts_, deadline, &ctx);
  CallCanceller::Scope cancel_scope(opts_.canceller.get(), &ctx);
  opd::v1::ScoreResponse resp;
  RETURN_IF_ERROR(FromGrpc(stub_->Score(&ctx, req, &resp), opts_.address));
  if (resp.sequences_size() != static_cast<int>(seqs.size())) {
    return absl::InternalError(absl::StrCat(opts_.address, ": ", resp.sequences_size(),
                                            " results for ", seqs.size(), " sequences"));
  }
  std::vector<lm::SequenceScore> out(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    absl::StatusOr<lm::SequenceScore> o =
        UnpackScores(resp.sequences(static_cast<int>(i)), seqs[i], resp.top_k());
    if (!o.ok()) return Prefixed(o.status(), absl::StrCat(opts_.address, ": sequence ", i));
    out[i] = *std::move(o);
  }
  return out;
}

// --- rollout ---

RolloutClient::RolloutClient(ClientOptions opts, std::shared_ptr<grpc::Channel> channel)
    : opts_(std::move(opts)),
      channel_(std::move(channel)),
      stub_(opd::v1::Rollout::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<RolloutClient>> RolloutClient::Create(const ClientOptions& opts) {
  ASSIGN_OR_RETURN(auto channel, MakeChannel(opts));
  return std::unique_ptr<RolloutClient>(new RolloutClient(opts, std::move(channel)));
}

absl::StatusOr<opd::v1::ServiceInfo> RolloutClient::Info() {
  grpc::ClientContext ctx;
  PrepareContext(opts_, &ctx);
  CallCanceller::Scope cancel_scope(opts_.canceller.get(), &ctx);
  opd::v1::ServiceInfo info;
  RETURN_IF_ERROR(FromGrpc(stub_->Info(&ctx, opd::v1::InfoRequest(), &info), opts_.address));
  return info;
}

namespace {

// The request's one conversion to the wire (rollout/generate_request.cc's JobFromRequest is the
// one back): every member of `params`, each prompt's seed index where the params give them.
opd::v1::GenerateRequest MakeGenerateRequest(absl::Span<const absl::Span<const int32_t>> prompts,
                                             const lm::SamplingParams& params) {
  opd::v1::GenerateRequest req;
  for (size_t i = 0; i < prompts.size(); ++i) {
    opd::v1::Prompt* p = req.add_prompts();
    p->mutable_tokens()->Add(prompts[i].begin(), prompts[i].end());
    if (i < params.seed_indices.size()) p->set_seed_index(params.seed_indices[i]);
  }
  // Checked by the server (and by the job configs before): the narrowing never hides a value a
  // server would take.
  req.set_samples_per_prompt(static_cast<int32_t>(params.samples_per_prompt));
  auto* m = req.mutable_params();
  m->set_temperature(static_cast<float>(params.temperature));
  m->set_top_p(static_cast<float>(params.top_p));
  m->set_top_k(static_cast<int32_t>(params.top_k));
  m->set_max_new_tokens(static_cast<int32_t>(params.max_new_tokens));
  m->mutable_stop_token_ids()->Add(params.stop_ids.begin(), params.stop_ids.end());
  m->set_seed(static_cast<uint64_t>(params.seed));
  req.set_return_routing(params.return_routing);
  return req;
}

// A sample's routing: [positions, routing_layers, routing_top_k] ids for positions =
// tokens.size() - 1. The sizes come from the wire, so the expected count is never formed by
// multiplying them (2^31 x 2^31 x positions overflows int64, and a wrapped product could pass):
// the count received is divided instead.
absl::StatusOr<std::vector<int32_t>> UnpackRouting(const opd::v1::Sample& m, const lm::Sample& s,
                                                   const std::string& address) {
  const auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("rollout worker ", address,
                                            " sent an invalid sample: sample ", m.sample_index(),
                                            " of prompt ", m.prompt_index(), ": ", what));
  };
  if (m.routing_layers() <= 0 || m.routing_top_k() <= 0)
    return bad(absl::StrCat("routed_experts with routing_layers ", m.routing_layers(),
                            " and routing_top_k ", m.routing_top_k(), " (both must be > 0)"));
  const int64_t positions = static_cast<int64_t>(s.tokens.size()) - 1;
  // Both factors are positive int32: their product fits int64.
  const int64_t per_position = int64_t{m.routing_layers()} * m.routing_top_k();
  const size_t bytes = m.routed_experts().size();
  const int64_t values = static_cast<int64_t>(bytes / sizeof(int32_t));
  if (positions < 1 || bytes % sizeof(int32_t) != 0 || values % per_position != 0 ||
      values / per_position != positions)
    return bad(absl::StrCat("routed_experts has ", bytes, " bytes, expected ", positions,
                            " positions x ", m.routing_layers(), " layers x ", m.routing_top_k(),
                            " experts x 4"));
  return UnpackArray<int32_t>(m.routed_experts(), values, "routed_experts");
}

// The sample `m` answers, with its prompt (which the wire does not repeat) in front.
absl::StatusOr<lm::Sample> FromProto(const opd::v1::Sample& m,
                                     absl::Span<const absl::Span<const int32_t>> prompts,
                                     const std::string& address) {
  if (m.prompt_index() < 0 || m.prompt_index() >= static_cast<int64_t>(prompts.size()))
    return absl::DataLossError(absl::StrCat(
        "rollout worker ", address, " sent an invalid sample: prompt_index ", m.prompt_index(),
        " is outside [0, ", prompts.size(), ") (the prompts sent to it)"));
  lm::Sample s;
  s.prompt_index = m.prompt_index();
  s.sample_index = m.sample_index();
  s.SetPrompt(prompts[m.prompt_index()]);
  s.tokens.insert(s.tokens.end(), m.tokens().begin(), m.tokens().end());
  ASSIGN_OR_RETURN(s.logprobs, UnpackArray<float>(m.logprobs(), m.tokens_size(), "logprobs"));
  switch (m.finish_reason()) {
    case opd::v1::FINISH_REASON_STOP:
      s.finish = lm::FinishReason::kStop;
      break;
    case opd::v1::FINISH_REASON_LENGTH:
      s.finish = lm::FinishReason::kLength;
      break;
    default:
      return absl::DataLossError(
          absl::StrCat("rollout worker ", address, " sent an invalid sample: sample ",
                       m.sample_index(), " of prompt ", m.prompt_index(), " has finish reason ",
                       static_cast<int>(m.finish_reason())));
  }
  s.weight_version = m.weight_version();
  if (!m.routed_experts().empty()) {
    ASSIGN_OR_RETURN(s.routed_experts, UnpackRouting(m, s, address));
    s.routing_layers = m.routing_layers();
    s.routing_top_k = m.routing_top_k();
  }
  return s;
}

}  // namespace

absl::Status RolloutClient::StreamGenerate(
    absl::Span<const absl::Span<const int32_t>> prompts, const lm::SamplingParams& params,
    const std::function<absl::Status(lm::Sample)>& on_sample) {
  if (!params.seed_indices.empty() && params.seed_indices.size() != prompts.size())
    return absl::InvalidArgumentError(
        absl::StrCat(params.seed_indices.size(), " seed indices for ", prompts.size(), " prompts"));
  grpc::ClientContext ctx;
  PrepareContext(opts_, &ctx);
  CallCanceller::Scope cancel_scope(opts_.canceller.get(), &ctx);
  auto reader = stub_->Generate(&ctx, MakeGenerateRequest(prompts, params));
  opd::v1::Sample msg;
  absl::Status refused;  // the first sample refused, by decoding or by on_sample
  while (reader->Read(&msg)) {
    if (!refused.ok()) continue;  // drain until Read fails
    absl::StatusOr<lm::Sample> s = FromProto(msg, prompts, opts_.address);
    refused = s.ok() ? on_sample(std::move(*s)) : s.status();
    if (!refused.ok()) ctx.TryCancel();
  }
  const grpc::Status st = reader->Finish();
  RETURN_IF_ERROR(refused);
  return FromGrpc(st, opts_.address);
}

absl::StatusOr<std::vector<lm::Sample>> RolloutClient::Generate(
    absl::Span<const std::vector<int32_t>> prompts, const lm::SamplingParams& params,
    const std::function<void(const lm::Sample&)>& on_sample) {
  const std::vector<absl::Span<const int32_t>> views(prompts.begin(), prompts.end());
  std::vector<lm::Sample> samples;
  RETURN_IF_ERROR(StreamGenerate(views, params, [&](lm::Sample s) {
    if (on_sample) on_sample(s);
    samples.push_back(std::move(s));
    return absl::OkStatus();
  }));
  std::sort(samples.begin(), samples.end(), [](const auto& a, const auto& b) {
    return std::tie(a.prompt_index, a.sample_index) < std::tie(b.prompt_index, b.sample_index);
  });
  return samples;
}

// --- health ---

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
    const ClientOptions& opts, const std::string& service) {
  ASSIGN_OR_RETURN(auto channel, MakeChannel(opts));
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  PrepareContext(opts, &ctx);
  CallCanceller::Scope cancel_scope(opts.canceller.get(), &ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  RETURN_IF_ERROR(FromGrpc(stub->Check(&ctx, req, &resp), opts.address));
  return resp.status();
}

absl::Status WaitUntilServing(const ClientOptions& opts, absl::Duration timeout,
                              const std::string& service) {
  const absl::Time end = absl::Now() + timeout;
  ClientOptions probe = opts;
  probe.timeout = absl::Seconds(1);
  absl::Status last = absl::DeadlineExceededError("not probed");
  while (absl::Now() < end) {
    auto st = CheckHealth(probe, service);
    if (st.ok() && *st == grpc::health::v1::HealthCheckResponse::SERVING) return absl::OkStatus();
    last = st.ok() ? absl::UnavailableError(absl::StrCat(opts.address, ": not serving yet"))
                   : st.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat("server did not become healthy within ",
                                                  absl::FormatDuration(timeout), ": ",
                                                  last.message()));
}

}  // namespace opd::rpc
