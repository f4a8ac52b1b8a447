#include "rpc/http_teacher.h"

#include <curl/curl.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "lm/util/status.h"

namespace opd::rpc {
namespace {

using nlohmann::json;

constexpr int64_t kMaxTokenId = std::numeric_limits<int32_t>::max();

// Where a reply body goes: appended until it would pass `max` bytes, then refused (libcurl ends
// the transfer when the callback takes fewer bytes than it was given).
struct BodySink {
  std::string* out;
  int64_t max;
  bool over = false;
};

size_t WriteBody(char* p, size_t size, size_t n, void* sink_ptr) {
  auto* sink = static_cast<BodySink*>(sink_ptr);
  const size_t bytes = size * n;
  if (static_cast<int64_t>(sink->out->size() + bytes) > sink->max) {
    sink->over = true;
    return 0;
  }
  sink->out->append(p, bytes);
  return bytes;
}

int Progress(void* c, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  auto* canceller = static_cast<CallCanceller*>(c);
  return canceller != nullptr && canceller->cancelled() ? 1 : 0;
}

// The request's headers: JSON, and the bearer secret when there is one (libcurl copies each
// string, so `auth` need not outlive the list).
curl_slist* RequestHeaders(const std::string& secret) {
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  std::string auth;
  if (!secret.empty()) {
    auth = absl::StrCat("Authorization: Bearer ", secret);
    headers = curl_slist_append(headers, auth.c_str());
  }
  return headers;
}

// Where the reply goes and what bounds the transfer: its size (sink->max), time and canceller.
void SetTransferOptions(CURL* h, const std::string& url, curl_slist* headers, BodySink* sink,
                        const ClientOptions& opts) {
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, WriteBody);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, sink);
  // A Content-Length past the bound is refused before any of the body is read.
  curl_easy_setopt(h, CURLOPT_MAXFILESIZE_LARGE, static_cast<curl_off_t>(sink->max));
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
  const int64_t ms = absl::ToInt64Milliseconds(opts.timeout);
  if (opts.timeout != absl::InfiniteDuration() && ms > 0)
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(ms));
  curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, Progress);
  curl_easy_setopt(h, CURLOPT_XFERINFODATA, opts.canceller.get());
}

// The CA that vouches for the server and this client's own certificate, each when configured.
void SetTlsOptions(CURL* h, const TlsClientOptions& tls) {
  if (!tls.ca_file.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, tls.ca_file.c_str());
  if (!tls.cert_file.empty()) curl_easy_setopt(h, CURLOPT_SSLCERT, tls.cert_file.c_str());
  if (!tls.key_file.empty()) curl_easy_setopt(h, CURLOPT_SSLKEY, tls.key_file.c_str());
}

// A non-empty body makes the request a POST.
void SetRequestBody(CURL* h, const std::string& body) {
  if (body.empty()) return;
  curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
}

// A failed transfer as the status the header file's table gives it; OK when the transfer ended.
absl::Status TransferStatus(CURLcode rc, const BodySink& sink, const std::string& where,
                            const std::string& why_max, const ClientOptions& opts) {
  if (rc == CURLE_FILESIZE_EXCEEDED || (rc == CURLE_WRITE_ERROR && sink.over))
    return absl::DataLossError(absl::StrCat(where, ": the reply body is larger than ", sink.max,
                                            " bytes, the most this request can return (", why_max,
                                            ")"));
  if (rc == CURLE_OPERATION_TIMEDOUT)
    return absl::DeadlineExceededError(
        absl::StrCat(where, ": no reply within ", absl::FormatDuration(opts.timeout)));
  if (rc == CURLE_ABORTED_BY_CALLBACK)
    return absl::CancelledError(absl::StrCat(where, ": cancelled"));
  if (rc == CURLE_PEER_FAILED_VERIFICATION || rc == CURLE_SSL_CACERT_BADFILE)
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": ", curl_easy_strerror(rc), " (CA file '",
                     opts.tls.ca_file.empty() ? "the system roots" : opts.tls.ca_file, "')"));
  if (rc != CURLE_OK)
    return absl::UnavailableError(absl::StrCat(where, ": ", curl_easy_strerror(rc)));
  return absl::OkStatus();
}

// A non-2xx reply: 5xx is UNAVAILABLE so the pool fails over; the message keeps the body's start.
absl::Status HttpErrorStatus(long code, const std::string& out, const std::string& where) {
  const std::string msg =
      absl::StrCat(where, ": HTTP ", code, ": ", out.substr(0, std::min<size_t>(out.size(), 300)));
  if (code >= 500) return absl::UnavailableError(msg);
  if (code == 429) return absl::ResourceExhaustedError(msg);
  if (code == 401 || code == 403) return absl::UnauthenticatedError(msg);
  if (code == 404) return absl::NotFoundError(msg);
  return absl::InvalidArgumentError(msg);
}

// A log-prob field: a number (vLLM writes -inf as -9999.0), or null (a bare NaN / Infinity that
// ParseLenient turned into null: read as NaN and refused by the pool's validation). Anything else
// is not a log-prob.
bool ReadLogprob(const json& v, float* out) {
  if (v.is_null()) {
    *out = std::numeric_limits<float>::quiet_NaN();
    return true;
  }
  if (!v.is_number()) return false;
  const double d = v.get<double>();
  *out = d <= -9999.0 ? -std::numeric_limits<float>::infinity() : static_cast<float>(d);
  return true;
}

// A token id field: a JSON integer in [0, 2^31) (the pool then checks it against the vocabulary).
// A larger one is refused here rather than narrowed (2^32 + 5 would become 5).
bool ReadTokenId(const json& v, int32_t* out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(kMaxTokenId)) return false;
    *out = static_cast<int32_t>(u);
    return true;
  }
  if (!v.is_number_integer()) return false;
  const int64_t i = v.get<int64_t>();
  if (i < 0 || i > kMaxTokenId) return false;
  *out = static_cast<int32_t>(i);
  return true;
}

// vLLM keys a position's entries by the token id in decimal: digits only, in [0, 2^31) ("5abc",
// "+5", " 5" and "4294967301" are not ids).
bool ParseTokenIdKey(const std::string& s, int32_t* out) {
  if (s.empty() || s.size() > 10) return false;
  int64_t v = 0;
  for (const char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v > kMaxTokenId) return false;
  *out = static_cast<int32_t>(v);
  return true;
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

// The field-by-field reading of one score reply: every field is checked before it is used, and a
// wrong one is DATA_LOSS naming the endpoint, the request, the sequence and the field.
class ReplyReader {
 public:
  ReplyReader(std::string where, const std::vector<lm::Sample>& seqs, size_t begin, size_t end,
              int32_t k)
      : where_(std::move(where)), seqs_(seqs), begin_(begin), end_(end), k_(k) {}

  absl::StatusOr<std::vector<lm::SequenceScore>> Sglang(const json& j) const;
  absl::StatusOr<std::vector<lm::SequenceScore>> Vllm(const json& j) const;

 private:
  absl::Status Bad(size_t seq, const std::string& field, const std::string& what) const {
    return absl::DataLossError(absl::StrCat(where_, ": sequence ", seq, ": ", field, " ", what));
  }
  absl::Status BadReply(const std::string& what) const {
    return absl::DataLossError(absl::StrCat(where_, ": ", what));
  }
  absl::StatusOr<lm::SequenceScore> SglangItem(size_t seq, const json& it) const;
  absl::Status SglangTopK(size_t seq, const json& meta, lm::SequenceScore* o) const;
  absl::StatusOr<lm::SequenceScore> VllmItem(size_t seq, const json& it) const;
  absl::Status VllmPosition(size_t seq, size_t p, const json& d, lm::SequenceScore* o) const;

  std::string where_;
  const std::vector<lm::Sample>& seqs_;
  size_t begin_, end_;
  int32_t k_;
};

absl::StatusOr<std::vector<lm::SequenceScore>> ReplyReader::Sglang(const json& j) const {
  const size_t n_seq = end_ - begin_;
  json single;
  const json* list = &j;
  if (j.is_object()) {  // a batch of one may come back unwrapped
    single = json::array({j});
    list = &single;
  }
  if (!list->is_array() || list->size() != n_seq)
    return BadReply(absl::StrCat("reply has ", list->is_array() ? list->size() : 0, " items for ",
                                 n_seq, " sequences"));
  std::vector<lm::SequenceScore> out;
  out.reserve(n_seq);
  for (size_t i = 0; i < n_seq; ++i) {
    ASSIGN_OR_RETURN(lm::SequenceScore o, SglangItem(begin_ + i, (*list)[i]));
    out.push_back(std::move(o));
  }
  return out;
}

// Entries for tokens [r - 1, L): the first (null: the token before the response has no score
// here) is dropped; each is [logprob, id, text-or-null] and must carry the id sent.
absl::StatusOr<lm::SequenceScore> ReplyReader::SglangItem(size_t seq, const json& it) const {
  const lm::Sample& in = seqs_[seq];
  const size_t r = static_cast<size_t>(in.response_start), L = in.tokens.size();
  if (!it.is_object() || !it.contains("meta_info") || !it["meta_info"].is_object())
    return Bad(seq, "meta_info", "is missing or not an object");
  const json& meta = it["meta_info"];
  if (!meta.contains("input_token_logprobs"))
    return Bad(seq, "meta_info.input_token_logprobs", "is missing");
  const json& lp = meta["input_token_logprobs"];
  if (!lp.is_array() || lp.size() != L - r + 1)
    return Bad(
        seq, "meta_info.input_token_logprobs",
        absl::StrCat("has ", lp.is_array() ? lp.size() : 0, " entries, expected ", L - r + 1));
  lm::SequenceScore o;
  o.logprobs.reserve(L - r);
  for (size_t p = 1; p < lp.size(); ++p) {
    const json& e = lp[p];
    const std::string field = absl::StrCat("meta_info.input_token_logprobs[", p, "]");
    int32_t id = 0;
    float v = 0;
    if (!e.is_array() || e.size() < 2 || !ReadTokenId(e[1], &id) || !ReadLogprob(e[0], &v))
      return Bad(seq, field, "is not [logprob, token id in [0, 2^31), ...]");
    if (id != in.tokens[r - 1 + p])
      return Bad(seq, field, absl::StrCat("has token ", id, ", sent ", in.tokens[r - 1 + p]));
    o.logprobs.push_back(v);
  }
  if (k_ > 0) RETURN_IF_ERROR(SglangTopK(seq, meta, &o));
  return o;
}

// input_top_logprobs: per position at least k [logprob, id, ...] entries, the k most likely
// kept (most likely first).
absl::Status ReplyReader::SglangTopK(size_t seq, const json& meta, lm::SequenceScore* o) const {
  const lm::Sample& in = seqs_[seq];
  const size_t n = in.tokens.size() - static_cast<size_t>(in.response_start);
  if (!meta.contains("input_top_logprobs"))
    return Bad(seq, "meta_info.input_top_logprobs", "is missing");
  const json& tl = meta["input_top_logprobs"];
  if (!tl.is_array() || tl.size() != n + 1)
    return Bad(seq, "meta_info.input_top_logprobs",
               absl::StrCat("has ", tl.is_array() ? tl.size() : 0, " entries, expected ", n + 1));
  const size_t k = static_cast<size_t>(k_);
  o->topk_ids.reserve(n * k);
  o->topk_logprobs.reserve(n * k);
  std::vector<std::pair<float, int32_t>> v;
  for (size_t p = 1; p < tl.size(); ++p) {
    const json& row = tl[p];
    const std::string field = absl::StrCat("meta_info.input_top_logprobs[", p, "]");
    if (!row.is_array() || row.size() < k)
      return Bad(seq, field, absl::StrCat("has fewer than ", k, " entries"));
    v.clear();
    for (size_t e = 0; e < row.size(); ++e) {
      const json& x = row[e];
      float lp = 0;
      int32_t id = 0;
      if (!x.is_array() || x.size() < 2 || !ReadLogprob(x[0], &lp) || !ReadTokenId(x[1], &id))
        return Bad(seq, absl::StrCat(field, "[", e, "]"),
                   "is not [logprob, token id in [0, 2^31), ...]");
      v.emplace_back(lp, id);
    }
    std::stable_sort(v.begin(), v.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    for (size_t t = 0; t < k; ++t) {
      o->topk_ids.push_back(v[t].second);
      o->topk_logprobs.push_back(v[t].first);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<lm::SequenceScore>> ReplyReader::Vllm(const json& j) const {
  const size_t n_seq = end_ - begin_;
  if (!j.is_object() || !j.contains("choices") || !j["choices"].is_array())
    return BadReply("reply has no choices");
  const json& choices = j["choices"];
  std::vector<const json*> items(n_seq, nullptr);
  for (size_t c = 0; c < choices.size(); ++c) {
    const json& ch = choices[c];
    if (!ch.is_object() || !ch.contains("index") || !ch["index"].is_number_integer())
      return BadReply(absl::StrCat("choices[", c, "].index is missing or not an integer"));
    const int64_t idx = ch["index"].get<int64_t>();
    if (idx < 0 || static_cast<uint64_t>(idx) >= n_seq || items[idx] != nullptr)
      return BadReply(absl::StrCat("choices[", c, "].index ", idx, " is out of range or repeated"));
    items[idx] = &ch;
  }
  std::vector<lm::SequenceScore> out;
  out.reserve(n_seq);
  for (size_t i = 0; i < n_seq; ++i) {
    if (items[i] == nullptr)
      return BadReply(absl::StrCat("choices has ", choices.size(), " entries for ", n_seq,
                                   " sequences (index ", i, " missing)"));
    ASSIGN_OR_RETURN(lm::SequenceScore o, VllmItem(begin_ + i, *items[i]));
    out.push_back(std::move(o));
  }
  return out;
}

// prompt_logprobs: one entry per prompt token (the first null), each an object keyed by token id.
absl::StatusOr<lm::SequenceScore> ReplyReader::VllmItem(size_t seq, const json& it) const {
  const lm::Sample& in = seqs_[seq];
  const size_t r = static_cast<size_t>(in.response_start), L = in.tokens.size();
  if (!it.contains("prompt_logprobs") || !it["prompt_logprobs"].is_array())
    return Bad(seq, "prompt_logprobs", "is missing");
  const json& pl = it["prompt_logprobs"];
  if (pl.size() != L)
    return Bad(seq, "prompt_logprobs",
               absl::StrCat("has ", pl.size(), " entries for ", L, " prompt tokens"));
  lm::SequenceScore o;
  o.logprobs.reserve(L - r);
  for (size_t p = r; p < L; ++p) RETURN_IF_ERROR(VllmPosition(seq, p, pl[p], &o));
  return o;
}

// One position: {"<id>": {"logprob": x, "rank": n, ...}, ...} with the sent token's entry and
// (k > 0) the entries of rank 1..k, each checked whether it is used or not.
absl::Status ReplyReader::VllmPosition(size_t seq, size_t p, const json& d,
                                       lm::SequenceScore* o) const {
  const std::string field = absl::StrCat("prompt_logprobs[", p, "]");
  if (!d.is_object()) return Bad(seq, field, "is not an object");
  const std::string sent = std::to_string(seqs_[seq].tokens[p]);
  bool have_sent = false;
  std::vector<std::pair<int64_t, std::pair<float, int32_t>>> top;
  for (auto e = d.begin(); e != d.end(); ++e) {
    const std::string entry = absl::StrCat(field, "[\"", e.key(), "\"]");
    int32_t id = 0;
    if (!ParseTokenIdKey(e.key(), &id))
      return Bad(seq, entry, "is keyed by something that is not a token id in [0, 2^31)");
    const json& v = e.value();
    float lp = 0;
    if (!v.is_object() || !v.contains("logprob") || !ReadLogprob(v["logprob"], &lp))
      return Bad(seq, entry + ".logprob", "is missing or not a number");
    if (!v.contains("rank") || !v["rank"].is_number_integer())
      return Bad(seq, entry + ".rank", "is missing or not an integer");
    const int64_t rank = v["rank"].get<int64_t>();
    if (e.key() == sent) {
      o->logprobs.push_back(lp);
      have_sent = true;
    }
    if (k_ > 0 && rank >= 1 && rank <= k_) top.push_back({rank, {lp, id}});
  }
  if (!have_sent) return Bad(seq, field, absl::StrCat("has no entry for the sent token ", sent));
  if (k_ == 0) return absl::OkStatus();
  if (top.size() != static_cast<size_t>(k_))
    return Bad(seq, field, absl::StrCat("has ", top.size(), " entries of rank <= ", k_));
  std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t t = 0; t < top.size(); ++t) {
    if (top[t].first != static_cast<int64_t>(t) + 1)
      return Bad(seq, field, absl::StrCat("has no entry of rank ", t + 1, " (ranks repeat)"));
  }
  for (const auto& e : top) {
    o->topk_ids.push_back(e.second.second);
    o->topk_logprobs.push_back(e.second.first);
  }
  return absl::OkStatus();
}

}  // namespace

bool IsHttpTeacherEndpoint(const std::string& endpoint) {
  for (const char* s : {"sglang://", "sglang+https://", "vllm://", "vllm+https://"})
    if (absl::StartsWith(endpoint, s)) return true;
  return false;
}

absl::StatusOr<HttpTeacherAddress> ParseHttpTeacherAddress(const std::string& endpoint) {
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
    if (!absl::StartsWith(endpoint, s.prefix)) continue;
    HttpTeacherAddress a;
    a.kind = s.kind;
    std::string rest = endpoint.substr(std::string(s.prefix).size());
    if (const size_t q = rest.find('?'); q != std::string::npos) {
      const std::string option = rest.substr(q + 1);
      if (option != "tokenizer=none")
        return absl::InvalidArgumentError(
            absl::StrCat(endpoint, ": unknown option '", option,
                         "' (the one option is '?tokenizer=none': a server without a tokenizer)"));
      a.has_tokenizer = false;
      rest.resize(q);
    }
    while (!rest.empty() && rest.back() == '/') rest.pop_back();
    if (rest.empty())
      return absl::InvalidArgumentError(absl::StrCat(endpoint, ": no host:port after the scheme"));
    a.base_url = absl::StrCat(s.http, rest);
    return a;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(endpoint, ": not an sglang:// or vllm:// endpoint"));
}

int64_t ReplyBytesBound(const std::vector<lm::Sample>& seqs, size_t begin, size_t end,
                        int32_t top_k) {
  const int64_t entries = 1 + std::max<int64_t>(top_k, 0);
  int64_t bound = kReplyFixedBytes;
  for (size_t i = begin; i < end; ++i)
    bound += kReplySequenceBytes +
             static_cast<int64_t>(seqs[i].tokens.size()) * entries * kMaxReplyEntryBytes;
  return bound;
}

absl::StatusOr<std::unique_ptr<HttpTeacher>> HttpTeacher::Create(const ClientOptions& opts,
                                                                 HttpTeacherOptions http) {
  static const CURLcode init = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (init != CURLE_OK) return absl::InternalError("curl_global_init failed");
  ASSIGN_OR_RETURN(HttpTeacherAddress where, ParseHttpTeacherAddress(opts.address));
  return std::unique_ptr<HttpTeacher>(new HttpTeacher(opts, http, std::move(where)));
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
                                                 int64_t max_body, const std::string& why_max,
                                                 long* http_code) {
  const std::string where = absl::StrCat(opts_.address, " ", body.empty() ? "GET " : "POST ", path);
  if (opts_.canceller != nullptr && opts_.canceller->cancelled())
    return absl::CancelledError(absl::StrCat(where, ": cancelled"));
  CURL* h = static_cast<CURL*>(TakeHandle());
  if (h == nullptr) return absl::InternalError(absl::StrCat(where, ": curl_easy_init failed"));
  curl_easy_reset(h);  // a kept handle must not carry the last request's options
  const std::string url = where_.base_url + path;
  std::string out;
  BodySink sink{&out, max_body};
  curl_slist* headers = RequestHeaders(opts_.secret);
  SetTransferOptions(h, url, headers, &sink, opts_);
  SetTlsOptions(h, opts_.tls);
  SetRequestBody(h, body);
  const CURLcode rc = curl_easy_perform(h);
  long code = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
  curl_slist_free_all(headers);
  ReturnHandle(h);
  if (http_code != nullptr) *http_code = code;
  RETURN_IF_ERROR(TransferStatus(rc, sink, where, why_max, opts_));
  if (code >= 200 && code < 300) return out;
  return HttpErrorStatus(code, out, where);
}

bool HttpTeacher::Healthy() {
  long code = 0;
  // A short deadline, as the gRPC health check's.
  HttpTeacher probe(opts_, http_, where_);
  probe.opts_.timeout = absl::Seconds(2);
  return probe.Request("/health", "", kMaxSmallReplyBytes, "a health check", &code).ok() &&
         code == 200;
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

namespace {

// data[0].max_model_len of a /v1/models reply: 0 when absent, DATA_LOSS when not a positive
// integer.
absl::StatusOr<int64_t> MaxModelLen(const json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].is_object() || !j["data"][0].contains("max_model_len"))
    return 0;
  const json& m = j["data"][0]["max_model_len"];
  if (m.is_null()) return 0;
  if (!m.is_number_integer() || m.get<int64_t>() < 2)
    return absl::DataLossError(
        absl::StrCat(where, ": data[0].max_model_len is not an integer of at least 2"));
  return m.get<int64_t>();
}

}  // namespace

absl::StatusOr<opd::v1::ServiceInfo> HttpTeacher::Info() {
  const bool sglang = where_.kind == HttpTeacherKind::kSglang;
  const std::string path = sglang ? "/get_model_info" : "/v1/models";
  const std::string where = absl::StrCat(opts_.address, " GET ", path);
  ASSIGN_OR_RETURN(const std::string body, Request(path, "", kMaxSmallReplyBytes, "model info"));
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return absl::DataLossError(absl::StrCat(where, ": reply is not JSON"));
  opd::v1::ServiceInfo info;
  std::string name;
  int64_t max_model_len = 0;
  if (sglang) {
    if (!j.is_object() || !j.contains("model_path") || !j["model_path"].is_string())
      return absl::DataLossError(absl::StrCat(where, ": reply has no model_path"));
    name = j["model_path"].get<std::string>();
    info.set_architecture("sglang");
    // SGLang also serves the OpenAI /v1/models, with the context length; a server without it
    // leaves the length unknown.
    auto models = Request("/v1/models", "", kMaxSmallReplyBytes, "model list");
    if (models.ok()) {
      const json m = json::parse(*models, nullptr, false);
      if (!m.is_discarded()) {
        ASSIGN_OR_RETURN(max_model_len,
                         MaxModelLen(m, absl::StrCat(opts_.address, " GET /v1/models")));
      }
    }
  } else {
    if (!j.is_object() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
        !j["data"][0].is_object() || !j["data"][0].contains("id") ||
        !j["data"][0]["id"].is_string())
      return absl::DataLossError(absl::StrCat(where, ": reply has no data[0].id"));
    name = j["data"][0]["id"].get<std::string>();
    info.set_architecture("vllm");
    ASSIGN_OR_RETURN(max_model_len, MaxModelLen(j, where));
  }
  info.set_model_name(name);
  // A request must leave room for the one token it allows (vLLM's max_tokens 1; SGLang counts
  // the same way), so the longest sequence it scores is one shorter than the context.
  if (max_model_len > 0) info.set_max_seq_len(max_model_len - 1);
  absl::MutexLock lock(&mu_);
  model_ = name;
  return info;
}

absl::StatusOr<std::vector<int32_t>> HttpTeacher::Tokenize(const std::string& text) {
  if (!where_.has_tokenizer)
    return absl::UnimplementedError(
        absl::StrCat(opts_.address, ": declared without a tokenizer (?tokenizer=none)"));
  json req = {{"prompt", text}, {"add_special_tokens", false}};
  if (where_.kind == HttpTeacherKind::kVllm) {  // SGLang serves one model and needs no name
    ASSIGN_OR_RETURN(req["model"], ModelName());
  }
  // At most one id of <= 11 bytes per byte of text, plus the reply's other fields.
  const int64_t max_body = kMaxSmallReplyBytes + 16 * static_cast<int64_t>(text.size());
  auto body = Request("/tokenize", req.dump(), max_body, "the ids of the text");
  // No /tokenize at all: the server cannot tell. Every other refusal keeps its code: the pool
  // retries the transient ones and refuses the rest.
  if (absl::IsNotFound(body.status())) return absl::UnimplementedError(body.status().message());
  if (!body.ok()) return body.status();
  const std::string where = absl::StrCat(opts_.address, " POST /tokenize");
  const json j = json::parse(*body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
    return absl::DataLossError(absl::StrCat(where, ": reply has no tokens"));
  std::vector<int32_t> ids;
  ids.reserve(j["tokens"].size());
  for (size_t i = 0; i < j["tokens"].size(); ++i) {
    int32_t id = 0;
    if (!ReadTokenId(j["tokens"][i], &id))
      return absl::DataLossError(
          absl::StrCat(where, ": tokens[", i, "] is not a token id in [0, 2^31)"));
    ids.push_back(id);
  }
  return ids;
}

absl::StatusOr<std::vector<lm::SequenceScore>> HttpTeacher::Score(
    const std::vector<lm::Sample>& seqs, const ScoreOptions& opts) {
  if (where_.kind == HttpTeacherKind::kVllm && opts.temperature != 1.0f) {
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
  std::vector<lm::SequenceScore> out;
  out.reserve(seqs.size());
  size_t begin = 0;
  while (begin < seqs.size()) {
    size_t end = begin + 1;
    int64_t tokens = static_cast<int64_t>(seqs[begin].tokens.size());
    while (end < seqs.size() &&
           tokens + static_cast<int64_t>(seqs[end].tokens.size()) <= http_.max_tokens_per_request)
      tokens += static_cast<int64_t>(seqs[end++].tokens.size());
    ASSIGN_OR_RETURN(auto part, ScoreBatch(seqs, begin, end, opts));
    for (auto& o : part) out.push_back(std::move(o));
    begin = end;
  }
  return out;
}

absl::StatusOr<std::vector<lm::SequenceScore>> HttpTeacher::ScoreBatch(
    const std::vector<lm::Sample>& seqs, size_t begin, size_t end, const ScoreOptions& opts) {
  const bool sglang = where_.kind == HttpTeacherKind::kSglang;
  const int32_t k = std::max(opts.top_k, 0);
  json ids = json::array();
  json starts = json::array();
  int64_t tokens = 0;
  for (size_t i = begin; i < end; ++i) {
    ids.push_back(seqs[i].tokens);
    starts.push_back(seqs[i].response_start - 1);
    tokens += static_cast<int64_t>(seqs[i].tokens.size());
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
    ASSIGN_OR_RETURN(const std::string model, ModelName());
    path = "/v1/completions";
    req = {{"model", model}, {"prompt", ids}, {"max_tokens", 1}, {"prompt_logprobs", k}};
  }
  const std::string why =
      absl::StrCat(end - begin, " sequences of ", tokens, " tokens x ", k + 1,
                   " entries of <= ", kMaxReplyEntryBytes, " bytes, plus framing");
  ASSIGN_OR_RETURN(const std::string body,
                   Request(path, req.dump(), ReplyBytesBound(seqs, begin, end, k), why));
  const std::string where = absl::StrCat(opts_.address, " POST ", path);
  const json j = ParseLenient(body);
  // A server that sent a broken body will send it again: not worth a retry.
  if (j.is_discarded()) return absl::DataLossError(absl::StrCat(where, ": reply is not JSON"));
  const ReplyReader reader(where, seqs, begin, end, k);
  return sglang ? reader.Sglang(j) : reader.Vllm(j);
}

// TeacherClient's health check (declared in rpc/client.h).
bool TeacherClient::Healthy() {
  ClientOptions o = opts_;
  o.timeout = absl::Seconds(2);
  auto h = CheckHealth(o);
  return h.ok() && *h == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::StatusOr<std::unique_ptr<TeacherEndpoint>> CreateTeacherEndpoint(const ClientOptions& opts) {
  if (IsHttpTeacherEndpoint(opts.address)) {
    ASSIGN_OR_RETURN(auto c, HttpTeacher::Create(opts));
    return std::unique_ptr<TeacherEndpoint>(std::move(c));
  }
  ASSIGN_OR_RETURN(auto c, TeacherClient::Create(opts));
  return std::unique_ptr<TeacherEndpoint>(std::move(c));
}

}  // namespace opd::rpc
