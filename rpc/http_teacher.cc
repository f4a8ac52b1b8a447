#include "rpc/http_teacher.h"

#include <curl/curl.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace opd::rpc {
namespace {

using nlohmann::json;

size_t WriteBody(char* p, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(p, size * n);
  return size * n;
}

int Progress(void* c, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  auto* canceller = static_cast<CallCanceller*>(c);
  return canceller != nullptr && canceller->cancelled() ? 1 : 0;
}

// vLLM writes -inf as -9999.0.
float Logprob(const json& v) {
  if (!v.is_number()) return std::numeric_limits<float>::quiet_NaN();
  const double d = v.get<double>();
  if (d <= -9999.0) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(d);
}

// Python servers write NaN / Infinity / -Infinity as bare words, which JSON does not allow:
// outside strings they become null (read back as NaN, then refused by the pool's validation).
json ParseLenient(const std::string& body) {
  std::string t;
  t.reserve(body.size());
  bool in_str = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (in_str) {
      t += c;
      if (c == '\\' && i + 1 < body.size())
        t += body[++i];
      else if (c == '"')
        in_str = false;
      continue;
    }
    if (c == '"') in_str = true;
    for (const char* w : {"-Infinity", "Infinity", "NaN"}) {
      const size_t n = std::char_traits<char>::length(w);
      if (body.compare(i, n, w) == 0) {
        t += "null";
        i += n;
        break;
      }
    }
    if (i < body.size()) t += body[i];
  }
  return json::parse(t, nullptr, false);
}

}  // namespace

bool ParseHttpTeacherEndpoint(const std::string& endpoint, HttpTeacherKind* kind,
                              std::string* base_url) {
  struct Scheme {
    const char* prefix;
    HttpTeacherKind kind;
    const char* http;
  };
  static const Scheme kSchemes[] = {{"sglang://", HttpTeacherKind::kSglang, "http://"},
                                    {"sglang+https://", HttpTeacherKind::kSglang, "https://"},
                                    {"vllm://", HttpTeacherKind::kVllm, "http://"},
                                    {"vllm+https://", HttpTeacherKind::kVllm, "https://"}};
  for (const auto& s : kSchemes) {
    if (absl::StartsWith(endpoint, s.prefix)) {
      *kind = s.kind;
      std::string rest = endpoint.substr(std::string(s.prefix).size());
      while (!rest.empty() && rest.back() == '/') rest.pop_back();
      *base_url = absl::StrCat(s.http, rest);
      return true;
    }
  }
  return false;
}

absl::StatusOr<std::unique_ptr<HttpTeacher>> HttpTeacher::Create(const ClientOptions& opts,
                                                                 HttpTeacherOptions http) {
  static const CURLcode init = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (init != CURLE_OK) return absl::InternalError("curl_global_init failed");
  HttpTeacherKind kind;
  std::string base;
  if (!ParseHttpTeacherEndpoint(opts.address, &kind, &base))
    return absl::InvalidArgumentError(
        absl::StrCat(opts.address, ": not an sglang:// or vllm:// endpoint"));
  return std::unique_ptr<HttpTeacher>(new HttpTeacher(opts, http, kind, std::move(base)));
}

HttpTeacher::~HttpTeacher() {
  absl::MutexLock lock(&mu_);
  for (void* h : idle_) curl_easy_cleanup(static_cast<CURL*>(h));
}

void* HttpTeacher::TakeHandle() {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_.empty()) {
      void* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  return curl_easy_init();
}

void HttpTeacher::ReturnHandle(void* h) {
  absl::MutexLock lock(&mu_);
  idle_.push_back(h);
}

absl::StatusOr<std::string> HttpTeacher::Request(const std::string& path, const std::string& body,
                                                 long* http_code) {
  const std::string where = absl::StrCat(opts_.address, " ", body.empty() ? "GET " : "POST ", path);
  if (opts_.canceller != nullptr && opts_.canceller->cancelled())
    return absl::CancelledError(absl::StrCat(where, ": cancelled"));
  CURL* h = static_cast<CURL*>(TakeHandle());
  if (h == nullptr) return absl::InternalError(absl::StrCat(where, ": curl_easy_init failed"));
  curl_easy_reset(h);
  const std::string url = base_ + path;
  std::string out;
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  std::string auth;
  if (!opts_.secret.empty()) {
    auth = absl::StrCat("Authorization: Bearer ", opts_.secret);
    headers = curl_slist_append(headers, auth.c_str());
  }
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, WriteBody);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &out);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
  const int64_t ms = absl::ToInt64Milliseconds(opts_.timeout);
  if (opts_.timeout != absl::InfiniteDuration() && ms > 0)
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(ms));
  curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, Progress);
  curl_easy_setopt(h, CURLOPT_XFERINFODATA, opts_.canceller.get());
  if (!opts_.tls.ca_file.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, opts_.tls.ca_file.c_str());
  if (!opts_.tls.cert_file.empty())
    curl_easy_setopt(h, CURLOPT_SSLCERT, opts_.tls.cert_file.c_str());
  if (!opts_.tls.key_file.empty()) curl_easy_setopt(h, CURLOPT_SSLKEY, opts_.tls.key_file.c_str());
  if (!body.empty()) {
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.data());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  }
  const CURLcode rc = curl_easy_perform(h);
  long code = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
  curl_slist_free_all(headers);
  ReturnHandle(h);
  if (http_code != nullptr) *http_code = code;
  if (rc == CURLE_OPERATION_TIMEDOUT)
    return absl::DeadlineExceededError(
        absl::StrCat(where, ": no reply within ", absl::FormatDuration(opts_.timeout)));
  if (rc == CURLE_ABORTED_BY_CALLBACK)
    return absl::CancelledError(absl::StrCat(where, ": cancelled"));
  if (rc == CURLE_PEER_FAILED_VERIFICATION || rc == CURLE_SSL_CACERT_BADFILE)
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": ", curl_easy_strerror(rc), " (CA file '",
                     opts_.tls.ca_file.empty() ? "the system roots" : opts_.tls.ca_file, "')"));
  if (rc != CURLE_OK)
    return absl::UnavailableError(absl::StrCat(where, ": ", curl_easy_strerror(rc)));
  if (code >= 200 && code < 300) return out;
  const std::string msg =
      absl::StrCat(where, ": HTTP ", code, ": ", out.substr(0, std::min<size_t>(out.size(), 300)));
  if (code >= 500) return absl::UnavailableError(msg);
  if (code == 429) return absl::ResourceExhaustedError(msg);
  if (code == 401 || code == 403) return absl::UnauthenticatedError(msg);
  if (code == 404) return absl::NotFoundError(msg);
  return absl::InvalidArgumentError(msg);
}

bool HttpTeacher::Healthy() {
  long code = 0;
  // A short deadline, as the gRPC health check's.
  HttpTeacher probe(opts_, http_, kind_, base_);
  probe.opts_.timeout = absl::Seconds(2);
  return probe.Request("/health", "", &code).ok() && code == 200;
}

absl::StatusOr<std::string> HttpTeacher::ModelName() {
  {
    absl::MutexLock lock(&mu_);
    if (!model_.empty()) return model_;
  }
  auto info = Info();
  if (!info.ok()) return info.status();
  return info->model_name();
}

absl::StatusOr<opd::v1::ServiceInfo> HttpTeacher::Info() {
  const bool sglang = kind_ == HttpTeacherKind::kSglang;
  auto body = Request(sglang ? "/get_model_info" : "/v1/models", "");
  if (!body.ok()) return body.status();
  const json j = json::parse(*body, nullptr, false);
  if (j.is_discarded())
    return absl::InternalError(absl::StrCat(opts_.address, ": the model info is not JSON"));
  opd::v1::ServiceInfo info;
  std::string name;
  if (sglang) {
    if (!j.contains("model_path") || !j["model_path"].is_string())
      return absl::DataLossError(
          absl::StrCat(opts_.address, ": /get_model_info has no model_path"));
    name = j["model_path"].get<std::string>();
    info.set_architecture("sglang");
  } else {
    if (!j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
        !j["data"][0].contains("id") || !j["data"][0]["id"].is_string())
      return absl::DataLossError(absl::StrCat(opts_.address, ": /v1/models has no data[0].id"));
    name = j["data"][0]["id"].get<std::string>();
    info.set_architecture("vllm");
  }
  info.set_model_name(name);
  absl::MutexLock lock(&mu_);
  model_ = name;
  return info;
}

absl::StatusOr<std::vector<int32_t>> HttpTeacher::Tokenize(const std::string& text) {
  json req = {{"prompt", text}, {"add_special_tokens", false}};
  if (kind_ == HttpTeacherKind::kVllm) {  // SGLang serves one model and needs no name
    auto model = ModelName();
    if (!model.ok()) return model.status();
    req["model"] = *model;
  }
  long code = 0;
  auto body = Request("/tokenize", req.dump(), &code);
  // A server that answers, but not with ids, cannot tell (no endpoint, or no tokenizer loaded);
  // refused credentials and unreachable servers stay errors.
  if (!body.ok() && code >= 400 && code != 401 && code != 403 && code != 429)
    return absl::UnimplementedError(body.status().message());
  if (!body.ok()) return body.status();
  const json j = json::parse(*body, nullptr, false);
  if (j.is_discarded() || !j.contains("tokens") || !j["tokens"].is_array())
    return absl::DataLossError(absl::StrCat(opts_.address, ": /tokenize reply has no tokens"));
  std::vector<int32_t> ids;
  for (const auto& t : j["tokens"]) {
    if (!t.is_number_integer())
      return absl::DataLossError(
          absl::StrCat(opts_.address, ": /tokenize reply holds a token that is not an id"));
    ids.push_back(t.get<int32_t>());
  }
  return ids;
}

absl::StatusOr<std::vector<ScoreOutput>> HttpTeacher::Score(const std::vector<lm::Sample>& seqs,
                                                            const ScoreOptions& opts) {
  if (kind_ == HttpTeacherKind::kVllm && opts.temperature != 1.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(opts_.address,
                     ": vLLM cannot apply a temperature to prompt log-probs (teacher temperature ",
                     opts.temperature, "); use temperature 1 or an sglang:// endpoint"));
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    const auto& s = seqs[i];
    if (s.response_start < 1 || static_cast<size_t>(s.response_start) > s.tokens.size())
      return absl::InvalidArgumentError(absl::StrCat(opts_.address, ": sequence ", i,
                                                     " has response_start ", s.response_start,
                                                     " outside [1, ", s.tokens.size(), "]"));
  }
  std::vector<ScoreOutput> out;
  out.reserve(seqs.size());
  size_t begin = 0;
  while (begin < seqs.size()) {
    size_t end = begin + 1;
    int64_t tokens = static_cast<int64_t>(seqs[begin].tokens.size());
    while (end < seqs.size() &&
           tokens + static_cast<int64_t>(seqs[end].tokens.size()) <= http_.max_tokens_per_request)
      tokens += static_cast<int64_t>(seqs[end++].tokens.size());
    auto part = ScoreBatch(seqs, begin, end, opts);
    if (!part.ok()) return part.status();
    for (auto& o : *part) out.push_back(std::move(o));
    begin = end;
  }
  return out;
}

absl::StatusOr<std::vector<ScoreOutput>> HttpTeacher::ScoreBatch(
    const std::vector<lm::Sample>& seqs, size_t begin, size_t end, const ScoreOptions& opts) {
  const bool sglang = kind_ == HttpTeacherKind::kSglang;
  const int32_t k = std::max(opts.top_k, 0);
  json ids = json::array();
  json starts = json::array();
  for (size_t i = begin; i < end; ++i) {
    ids.push_back(seqs[i].tokens);
    starts.push_back(seqs[i].response_start - 1);
  }
  json req;
  std::string path;
  if (sglang) {
    path = "/generate";
    req = {{"input_ids", ids},
           {"sampling_params", {{"max_new_tokens", 0}, {"temperature", opts.temperature}}},
           {"return_logprob", true},
           {"logprob_start_len", starts}};
    if (k > 0) req["top_logprobs_num"] = k;
  } else {
    auto model = ModelName();
    if (!model.ok()) return model.status();
    path = "/v1/completions";
    req = {{"model", *model}, {"prompt", ids}, {"max_tokens", 1}, {"prompt_logprobs", k}};
  }
  auto body = Request(path, req.dump());
  if (!body.ok()) return body.status();
  const json j = ParseLenient(*body);
  if (j.is_discarded())
    return absl::InternalError(absl::StrCat(opts_.address, " POST ", path, ": reply is not JSON"));
  auto bad = [&](size_t seq, const std::string& field, const std::string& what) {
    return absl::DataLossError(
        absl::StrCat(opts_.address, " POST ", path, ": sequence ", seq, ": ", field, " ", what));
  };
  const size_t n_seq = end - begin;
  std::vector<const json*> items(n_seq, nullptr);
  std::vector<json> keep;  // SGLang's items, when the reply had to be re-wrapped
  if (sglang) {
    const json* list = &j;
    json single;
    if (j.is_object()) {  // a batch of one may come back unwrapped
      single = json::array({j});
      list = &single;
    }
    if (!list->is_array() || list->size() != n_seq)
      return absl::DataLossError(absl::StrCat(opts_.address, " POST ", path, ": reply has ",
                                              list->is_array() ? list->size() : 0, " items for ",
                                              n_seq, " sequences"));
    keep.assign(list->begin(), list->end());
    for (size_t i = 0; i < n_seq; ++i) items[i] = &keep[i];
  } else {
    if (!j.contains("choices") || !j["choices"].is_array())
      return absl::DataLossError(
          absl::StrCat(opts_.address, " POST ", path, ": reply has no choices"));
    for (const auto& c : j["choices"]) {
      if (!c.contains("index") || !c["index"].is_number_integer())
        return absl::DataLossError(
            absl::StrCat(opts_.address, " POST ", path, ": choices[].index missing"));
      const int64_t idx = c["index"].get<int64_t>();
      if (idx < 0 || static_cast<size_t>(idx) >= n_seq || items[idx] != nullptr)
        return absl::DataLossError(absl::StrCat(opts_.address, " POST ", path, ": choices[].index ",
                                                idx, " is out of range or repeated"));
      items[idx] = &c;
    }
    for (size_t i = 0; i < n_seq; ++i)
      if (items[i] == nullptr)
        return absl::DataLossError(absl::StrCat(opts_.address, " POST ", path, ": choices has ",
                                                j["choices"].size(), " entries for ", n_seq,
                                                " sequences (index ", i, " missing)"));
  }
  std::vector<ScoreOutput> out(n_seq);
  for (size_t i = 0; i < n_seq; ++i) {
    const size_t seq = begin + i;
    const lm::Sample& in = seqs[seq];
    const size_t r = static_cast<size_t>(in.response_start), L = in.tokens.size();
    const json& it = *items[i];
    ScoreOutput& o = out[i];
    if (sglang) {
      if (!it.contains("meta_info") || !it["meta_info"].contains("input_token_logprobs"))
        return bad(seq, "meta_info.input_token_logprobs", "is missing");
      const json& lp = it["meta_info"]["input_token_logprobs"];
      // Entries for tokens [r - 1, L): the first (null) is dropped.
      if (!lp.is_array() || lp.size() != L - r + 1)
        return bad(
            seq, "meta_info.input_token_logprobs",
            absl::StrCat("has ", lp.is_array() ? lp.size() : 0, " entries, expected ", L - r + 1));
      for (size_t p = 1; p < lp.size(); ++p) {
        const json& e = lp[p];
        if (!e.is_array() || e.size() < 2 || !e[1].is_number_integer())
          return bad(seq, absl::StrCat("meta_info.input_token_logprobs[", p, "]"),
                     "is not [logprob, id, ...]");
        if (e[1].get<int64_t>() != in.tokens[r - 1 + p])
          return bad(
              seq, absl::StrCat("meta_info.input_token_logprobs[", p, "]"),
              absl::StrCat("has token ", e[1].get<int64_t>(), ", sent ", in.tokens[r - 1 + p]));
        o.logprobs.push_back(Logprob(e[0]));
      }
      if (k > 0) {
        if (!it["meta_info"].contains("input_top_logprobs"))
          return bad(seq, "meta_info.input_top_logprobs", "is missing");
        const json& tl = it["meta_info"]["input_top_logprobs"];
        if (!tl.is_array() || tl.size() != L - r + 1)
          return bad(seq, "meta_info.input_top_logprobs", "has the wrong number of entries");
        for (size_t p = 1; p < tl.size(); ++p) {
          const json& row = tl[p];
          if (!row.is_array() || row.size() < static_cast<size_t>(k))
            return bad(seq, absl::StrCat("meta_info.input_top_logprobs[", p, "]"),
                       absl::StrCat("has fewer than ", k, " entries"));
          std::vector<std::pair<float, int32_t>> v;
          for (const auto& e : row) {
            if (!e.is_array() || e.size() < 2 || !e[1].is_number_integer())
              return bad(seq, absl::StrCat("meta_info.input_top_logprobs[", p, "]"),
                         "holds an entry that is not [logprob, id, ...]");
            v.emplace_back(Logprob(e[0]), e[1].get<int32_t>());
          }
          std::stable_sort(v.begin(), v.end(),
                           [](const auto& a, const auto& b) { return a.first > b.first; });
          for (int32_t t = 0; t < k; ++t) {
            o.topk_ids.push_back(v[t].second);
            o.topk_logprobs.push_back(v[t].first);
          }
        }
      }
    } else {
      if (!it.contains("prompt_logprobs") || !it["prompt_logprobs"].is_array())
        return bad(seq, "prompt_logprobs", "is missing");
      const json& pl = it["prompt_logprobs"];
      if (pl.size() != L)
        return bad(seq, "prompt_logprobs",
                   absl::StrCat("has ", pl.size(), " entries for ", L, " prompt tokens"));
      for (size_t p = r; p < L; ++p) {
        const json& d = pl[p];
        const std::string field = absl::StrCat("prompt_logprobs[", p, "]");
        if (!d.is_object()) return bad(seq, field, "is not an object");
        const std::string key = std::to_string(in.tokens[p]);
        if (!d.contains(key) || !d[key].is_object() || !d[key].contains("logprob"))
          return bad(seq, field, absl::StrCat("has no entry for the sent token ", key));
        o.logprobs.push_back(Logprob(d[key]["logprob"]));
        if (k > 0) {
          std::vector<std::pair<int64_t, std::pair<float, int32_t>>> v;
          for (auto e = d.begin(); e != d.end(); ++e) {
            if (!e.value().is_object() || !e.value().contains("rank") ||
                !e.value()["rank"].is_number_integer())
              return bad(seq, field, absl::StrCat("entry ", e.key(), " has no rank"));
            const int64_t rank = e.value()["rank"].get<int64_t>();
            if (rank < 1 || rank > k) continue;  // the sampled token outside the top k
            int32_t id = 0;
            try {
              id = std::stoi(e.key());
            } catch (...) {
              return bad(seq, field, absl::StrCat("key '", e.key(), "' is not a token id"));
            }
            v.push_back({rank, {Logprob(e.value()["logprob"]), id}});
          }
          std::sort(v.begin(), v.end(),
                    [](const auto& a, const auto& b) { return a.first < b.first; });
          if (v.size() != static_cast<size_t>(k))
            return bad(seq, field, absl::StrCat("has ", v.size(), " entries of rank <= ", k));
          for (const auto& e : v) {
            o.topk_ids.push_back(e.second.second);
            o.topk_logprobs.push_back(e.second.first);
          }
        }
      }
    }
  }
  return out;
}

// TeacherClient's health check (declared in rpc/client.h).
bool TeacherClient::Healthy() {
  ClientOptions o = opts_;
  o.timeout = absl::Seconds(2);
  auto h = CheckHealth(o);
  return h.ok() && *h == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::StatusOr<std::unique_ptr<TeacherEndpoint>> CreateTeacherEndpoint(const ClientOptions& opts) {
  HttpTeacherKind kind;
  std::string base;
  if (ParseHttpTeacherEndpoint(opts.address, &kind, &base)) {
    auto c = HttpTeacher::Create(opts);
    if (!c.ok()) return c.status();
    return std::unique_ptr<TeacherEndpoint>(std::move(*c));
  }
  auto c = TeacherClient::Create(opts);
  if (!c.ok()) return c.status();
  return std::unique_ptr<TeacherEndpoint>(std::move(*c));
}

}  // namespace opd::rpc
