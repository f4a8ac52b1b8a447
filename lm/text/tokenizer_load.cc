// Loading: tokenizer.json, or vocab.json + merges.txt (+ tokenizer_config.json), parsed into a
// Builder that checks every id and token, then builds the tables, the regex and the fingerprint.
// Every error names the file; malformed input is an error, never a crash.
#include <algorithm>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/text/byte_level.h"
#include "lm/text/sha256.h"
#include "lm/text/tokenizer.h"
#include "lm/text/tokenizer_internal.h"
#include "lm/text/utf8.h"
#include "lm/util/file.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"

namespace lm {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The Qwen2/Qwen3 pre-tokenizer, as written in their tokenizer.json (Oniguruma syntax).
constexpr char kQwen2Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// GPT-2's, used by a ByteLevel pre-tokenizer with use_regex=true.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Largest token id accepted from a file. The id tables are dense (one entry per id up to the
// largest), so an id is also an allocation size: 2^24 is ~64x the largest published vocabulary
// (Gemma's 262,144) and keeps a hostile file from asking for gigabytes or overflowing int32.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// A token's text for an error message: quoted, shortened, and safe to print.
std::string QuoteToken(std::string_view token) {
  constexpr size_t kShown = 64;
  std::string out = "'";
  out.append(token.substr(0, kShown));
  if (token.size() > kShown) out += "...";
  return out + "'";
}

// `id` as a token id, or an error naming the token and the id.
absl::StatusOr<int32_t> CheckedTokenId(int64_t id, std::string_view token, std::string_view what,
                                       std::string_view where) {
  if (id < 0 || id > kMaxTokenId)
    return absl::InvalidArgumentError(absl::StrCat(Av(where), where.empty() ? "" : ": ", Av(what),
                                                   " ", QuoteToken(token), " has id ", id,
                                                   "; ids must be in [0, ", kMaxTokenId, "]"));
  return static_cast<int32_t>(id);
}

// A JSON id of `token`: an integer in [0, kMaxTokenId]. Unsigned values beyond int64 and floats
// are refused too (nlohmann's get<int32_t>() would silently truncate them).
absl::StatusOr<int32_t> TokenIdFromJson(const nlohmann::json& v, std::string_view token,
                                        std::string_view what, std::string_view where) {
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kMaxTokenId))
    return absl::InvalidArgumentError(absl::StrCat(Av(where), ": ", Av(what), " ",
                                                   QuoteToken(token), " has id ", v.get<uint64_t>(),
                                                   "; ids must be in [0, ", kMaxTokenId, "]"));
  if (!v.is_number_integer())
    return absl::InvalidArgumentError(absl::StrCat(Av(where), ": ", Av(what), " ",
                                                   QuoteToken(token), " has a non-integer id (",
                                                   v.type_name(), ")"));
  return CheckedTokenId(v.get<int64_t>(), token, what, where);
}

absl::StatusOr<json> ReadJson(const fs::path& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path.string()));
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": bad JSON: ", e.what()));
  }
}

// Reads a flat {"token": id, ...} object (vocab.json) without building a DOM of 150k entries.
class VocabSax : public json::json_sax_t {
 public:
  explicit VocabSax(std::vector<std::pair<std::string, int32_t>>* out) : out_(out) {}
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool number_unsigned(number_unsigned_t v) override {
    return Id(v > static_cast<uint64_t>(kMaxTokenId) ? kMaxTokenId + 1 : static_cast<int64_t>(v));
  }
  bool number_integer(number_integer_t v) override { return Id(v); }
  bool start_object(std::size_t) override { return Fail(depth_++ != 0, "nested object"); }
  bool end_object() override { return --depth_, true; }
  bool null() override { return Fail(true, "null"); }
  bool boolean(bool) override { return Fail(true, "boolean"); }
  bool number_float(number_float_t, const string_t&) override { return Fail(true, "float"); }
  bool string(string_t&) override { return Fail(true, "string value"); }
  bool binary(binary_t&) override { return Fail(true, "binary"); }
  bool start_array(std::size_t) override { return Fail(true, "array"); }
  bool end_array() override { return false; }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& e) override {
    error_ = absl::StrCat("bad JSON at byte ", position, ": ", e.what());
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  bool Id(int64_t v) {
    auto id = CheckedTokenId(v, key_, "token", "");
    if (!id.ok()) {
      if (error_.empty()) error_ = std::string(id.status().message());
      return false;
    }
    out_->emplace_back(std::move(key_), *id);
    return true;
  }
  bool Fail(bool failed, const char* what) {
    if (failed && error_.empty())
      error_ = absl::StrCat("not a flat {token: id} object (", what, ")");
    return !failed;
  }

  std::vector<std::pair<std::string, int32_t>>* out_;
  std::string key_;
  std::string error_;
  int depth_ = 0;
};

}  // namespace

struct Tokenizer::Builder {
  std::vector<std::pair<std::string, int32_t>> vocab;       // byte-level spelling, id
  std::vector<std::pair<std::string, std::string>> merges;  // byte-level spellings, by rank
  std::vector<AddedToken> added;
  std::string pattern = kQwen2Pattern;
  bool nfc = true;
  bool ignore_merges = false;

  absl::Status ParseVocab(const json& j, const std::string& where) {
    if (!j.is_object()) return absl::InvalidArgumentError(where + ": vocab is not an object");
    vocab.reserve(j.size());
    for (const auto& [token, id_json] : j.items()) {
      ASSIGN_OR_RETURN(const int32_t id, TokenIdFromJson(id_json, token, "vocab token", where));
      vocab.emplace_back(token, id);
    }
    return absl::OkStatus();
  }

  absl::Status AddMerge(std::string_view line, const std::string& where) {
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 >= line.size() ||
        line.find(' ', space + 1) != std::string_view::npos)
      return absl::InvalidArgumentError(absl::StrCat(where, ": bad merge '", Av(line), "'"));
    merges.emplace_back(std::string(line.substr(0, space)), std::string(line.substr(space + 1)));
    return absl::OkStatus();
  }

  absl::Status ParseAddedToken(const json& t, int32_t id, const std::string& where) {
    if (!t.is_object() || !t.contains("content") || !t["content"].is_string())
      return absl::InvalidArgumentError(where + ": added token without content");
    for (const char* unsupported : {"lstrip", "rstrip", "single_word"}) {
      if (t.value(unsupported, false))
        return absl::UnimplementedError(absl::StrCat(where, ": added token ", t["content"].dump(),
                                                     " uses ", unsupported, ", not supported"));
    }
    added.push_back({id, t["content"].get<std::string>(), t.value("special", false)});
    return absl::OkStatus();
  }

  absl::Status ParseTokenizerJson(const json& j, const std::string& where);
  absl::Status ParseNormalizer(const json& n, const std::string& where);
  absl::Status ParsePreTokenizer(const json& p, const std::string& where);
  absl::Status LoadVocabMerges(const fs::path& dir);
  absl::Status AddQwen3Tokens();
  absl::StatusOr<std::unique_ptr<Tokenizer>> Build();
  // Build's steps, each filling its part of `tok`.
  absl::Status BuildVocab(Tokenizer& tok) const;
  absl::Status BuildMerges(Tokenizer& tok,
                           std::vector<std::pair<int32_t, int32_t>>* merge_ids) const;
  absl::Status BuildAddedTokens(Tokenizer& tok);
  std::string Fingerprint(const Tokenizer& tok,
                          const std::vector<std::pair<int32_t, int32_t>>& merge_ids) const;

  // The options' extra tokens, then Build; every error names `label` (the files read).
  absl::StatusOr<std::unique_ptr<Tokenizer>> Finish(const TokenizerOptions& options,
                                                    const std::string& label) {
    const absl::Status added = options.qwen3_added_tokens ? AddQwen3Tokens() : absl::OkStatus();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
        added.ok() ? Build() : absl::StatusOr<std::unique_ptr<Tokenizer>>(added);
    if (tok.ok() || absl::StartsWith(tok.status().message(), label + ": ")) return tok;
    return absl::Status(tok.status().code(), absl::StrCat(label, ": ", tok.status().message()));
  }
};

absl::Status Tokenizer::Builder::ParseNormalizer(const json& n, const std::string& where) {
  if (n.is_null()) {
    nfc = false;
    return absl::OkStatus();
  }
  const std::string type = n.value("type", "");
  if (type == "NFC") {
    nfc = true;
    return absl::OkStatus();
  }
  if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].size() <= 1) {
    if (n["normalizers"].empty()) {
      nfc = false;
      return absl::OkStatus();
    }
    return ParseNormalizer(n["normalizers"][0], where);
  }
  return absl::UnimplementedError(absl::StrCat(where, ": normalizer ", n.dump(), " not supported"));
}

absl::Status Tokenizer::Builder::ParsePreTokenizer(const json& p, const std::string& where) {
  const auto unsupported = [&] {
    return absl::UnimplementedError(
        absl::StrCat(where, ": pre_tokenizer ", p.dump().substr(0, 300), " not supported"));
  };
  const auto is_plain_byte_level = [](const json& b) {
    return b.value("type", "") == "ByteLevel" && !b.value("add_prefix_space", false);
  };
  if (is_plain_byte_level(p)) {
    if (!p.value("use_regex", true)) return unsupported();
    pattern = kGpt2Pattern;
    return absl::OkStatus();
  }
  // Split(regex, Isolated) followed by ByteLevel(use_regex=false): Qwen2/Qwen3, Llama 3, ...
  if (p.value("type", "") != "Sequence" || !p.contains("pretokenizers") ||
      p["pretokenizers"].size() != 2)
    return unsupported();
  const json& split = p["pretokenizers"][0];
  const json& byte_level = p["pretokenizers"][1];
  if (split.value("type", "") != "Split" || split.value("behavior", "") != "Isolated" ||
      split.value("invert", false) || !is_plain_byte_level(byte_level) ||
      byte_level.value("use_regex", true) || !split.contains("pattern"))
    return unsupported();
  const json& pat = split["pattern"];
  if (pat.contains("Regex") && pat["Regex"].is_string()) {
    pattern = pat["Regex"].get<std::string>();
  } else {
    return unsupported();
  }
  return absl::OkStatus();
}

// True when `key` is absent, null or "" (tokenizers writes null for unset string options).
static bool NullOrEmptyString(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty());
}

absl::Status Tokenizer::Builder::ParseTokenizerJson(const json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("model"))
    return absl::InvalidArgumentError(where + ": not a tokenizer.json (no model)");
  const json& model = j["model"];
  if (model.value("type", "BPE") != "BPE")
    return absl::UnimplementedError(where + ": only BPE models are supported");
  if (!model.value("dropout", json()).is_null() || model.value("byte_fallback", false) ||
      !NullOrEmptyString(model, "continuing_subword_prefix") ||
      !NullOrEmptyString(model, "end_of_word_suffix"))
    return absl::UnimplementedError(where +
                                    ": BPE options (dropout, byte_fallback, prefixes) "
                                    "are not supported");
  ignore_merges = model.value("ignore_merges", false);
  RETURN_IF_ERROR(ParseVocab(model.value("vocab", json()), where));
  const json merges_json = model.value("merges", json::array());
  merges.reserve(merges_json.size());
  for (const json& m : merges_json) {
    if (m.is_string()) {
      RETURN_IF_ERROR(AddMerge(m.get<std::string>(), where));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      return absl::InvalidArgumentError(where + ": bad merge " + m.dump());
    }
  }
  for (const json& t : j.value("added_tokens", json::array())) {
    if (!t.is_object() || !t.contains("id"))
      return absl::InvalidArgumentError(where + ": added token without id");
    const json& content = t.value("content", json());
    const std::string name = content.is_string() ? content.get<std::string>() : "";
    ASSIGN_OR_RETURN(const int32_t id, TokenIdFromJson(t["id"], name, "added token", where));
    RETURN_IF_ERROR(ParseAddedToken(t, id, where));
  }
  RETURN_IF_ERROR(ParseNormalizer(j.value("normalizer", json()), where));
  const json pre = j.value("pre_tokenizer", json());
  if (pre.is_null()) return absl::UnimplementedError(where + ": no pre_tokenizer");
  return ParsePreTokenizer(pre, where);
}

absl::Status Tokenizer::Builder::LoadVocabMerges(const fs::path& dir) {
  const std::string vocab_path = (dir / "vocab.json").string();
  ASSIGN_OR_RETURN(const std::string vocab_text, ReadFile(vocab_path));
  vocab.reserve(vocab_text.size() / 16);
  VocabSax sax(&vocab);
  if (!json::sax_parse(vocab_text, &sax) || !sax.error().empty())
    return absl::InvalidArgumentError(absl::StrCat(vocab_path, ": ", sax.error()));
  const std::string merges_path = (dir / "merges.txt").string();
  ASSIGN_OR_RETURN(std::string text, ReadFile(merges_path));
  merges.reserve(text.size() / 12);
  std::string_view rest(text);
  for (size_t line_no = 1; !rest.empty(); ++line_no) {
    const size_t eol = rest.find('\n');
    std::string_view line = rest.substr(0, eol);
    rest = eol == std::string_view::npos ? std::string_view() : rest.substr(eol + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    RETURN_IF_ERROR(AddMerge(line, absl::StrCat(merges_path, ":", line_no)));
  }
  const fs::path config_path = dir / "tokenizer_config.json";
  if (!fs::exists(config_path)) return absl::OkStatus();
  ASSIGN_OR_RETURN(json config, ReadJson(config_path));
  const json decoder = config.value("added_tokens_decoder", json::object());
  for (const auto& [id_text, t] : decoder.items()) {
    const json& content = t.is_object() ? t.value("content", json()) : json();
    const std::string name = content.is_string() ? content.get<std::string>() : "";
    int64_t wide = 0;
    if (!absl::SimpleAtoi(id_text, &wide))
      return absl::InvalidArgumentError(absl::StrCat(config_path.string(), ": added token ",
                                                     QuoteToken(name), " has a bad id '", id_text,
                                                     "'"));
    ASSIGN_OR_RETURN(const int32_t id,
                     CheckedTokenId(wide, name, "added token", config_path.string()));
    RETURN_IF_ERROR(ParseAddedToken(t, id, config_path.string()));
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::Builder::AddQwen3Tokens() {
  for (const AddedToken& q : Tokenizer::Qwen3AddedTokens()) {
    auto same_id =
        std::find_if(added.begin(), added.end(), [&](const AddedToken& a) { return a.id == q.id; });
    if (same_id != added.end()) {
      if (same_id->content != q.content)
        return absl::InvalidArgumentError(absl::StrCat("Qwen3 token ", q.id, " is '", q.content,
                                                       "' but the files declare '",
                                                       same_id->content, "'"));
      same_id->special = q.special;
      continue;
    }
    added.push_back(q);
  }
  return absl::OkStatus();
}

// Every id's bytes and kind, and the byte-level fallback ids.
absl::Status Tokenizer::Builder::BuildVocab(Tokenizer& tok) const {
  tok.vocab_.reserve(vocab.size());
  for (const auto& [token, id] : vocab) {
    ASSIGN_OR_RETURN(std::string bytes, ByteLevelToBytes(token));
    if (tok.id_kind_[id] != 0)
      return absl::InvalidArgumentError(absl::StrCat("id ", id, " appears twice in the vocab"));
    tok.id_kind_[id] = 1;
    tok.id_bytes_[id] = bytes;
    tok.vocab_.emplace(std::move(bytes), id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = tok.vocab_.find(std::string(1, static_cast<char>(b)));
    if (it == tok.vocab_.end())
      return absl::InvalidArgumentError(absl::StrFormat("vocab lacks the byte 0x%02x", b));
    tok.byte_ids_[b] = it->second;
  }
  return absl::OkStatus();
}

// The merge table by pair of ids; `merge_ids` keeps the file's order for the fingerprint.
absl::Status Tokenizer::Builder::BuildMerges(
    Tokenizer& tok, std::vector<std::pair<int32_t, int32_t>>* merge_ids) const {
  tok.merges_.reserve(merges.size());
  merge_ids->reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    ASSIGN_OR_RETURN(std::string lb, ByteLevelToBytes(left));
    ASSIGN_OR_RETURN(std::string rb, ByteLevelToBytes(right));
    auto l = tok.vocab_.find(lb), r = tok.vocab_.find(rb), m = tok.vocab_.find(lb + rb);
    if (l == tok.vocab_.end() || r == tok.vocab_.end() || m == tok.vocab_.end())
      return absl::InvalidArgumentError(
          absl::StrCat("merge ", rank, " '", left, " ", right, "' uses tokens not in the vocab"));
    // Like the Rust library, a repeated pair keeps its last rank.
    tok.merges_[uint64_t(uint32_t(l->second)) << 32 | uint32_t(r->second)] = {
        static_cast<int32_t>(rank), m->second};
    merge_ids->emplace_back(l->second, r->second);
  }
  return absl::OkStatus();
}

// The added tokens by id, by content and by first byte (longest first, for the split).
absl::Status Tokenizer::Builder::BuildAddedTokens(Tokenizer& tok) {
  std::sort(added.begin(), added.end(),
            [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& a = added[i];
    if (a.content.empty()) return absl::InvalidArgumentError("empty added token");
    if (utf8::FindInvalid(a.content) != std::string::npos)
      return absl::InvalidArgumentError("added token is not valid UTF-8");
    if (i > 0 && added[i - 1].id == a.id)
      return absl::InvalidArgumentError(absl::StrCat("added token id ", a.id, " declared twice"));
    if (!tok.added_by_content_.emplace(a.content, static_cast<int32_t>(i)).second)
      return absl::InvalidArgumentError(absl::StrCat("added token '", a.content, "' twice"));
    tok.id_kind_[a.id] = a.special ? 3 : 2;
    tok.id_added_[a.id] = static_cast<int32_t>(i);
    tok.added_by_first_byte_[static_cast<uint8_t>(a.content[0])].push_back(static_cast<int>(i));
    tok.added_first_byte_[static_cast<uint8_t>(a.content[0])] = true;
  }
  tok.added_ = added;
  for (int b = 0; b < 256; ++b) {
    if (!tok.added_first_byte_[b]) continue;
    tok.single_first_byte_ = tok.single_first_byte_ == -1 ? b : -2;
  }
  if (tok.single_first_byte_ == -2) tok.single_first_byte_ = -1;
  for (auto& candidates : tok.added_by_first_byte_) {
    std::stable_sort(candidates.begin(), candidates.end(), [&](int a, int b) {
      return tok.added_[a].content.size() > tok.added_[b].content.size();
    });
  }
  return absl::OkStatus();
}

// What two tokenizers must share to encode alike: the split, the normalizer, every id's bytes and
// kind, and the merges in order.
std::string Tokenizer::Builder::Fingerprint(
    const Tokenizer& tok, const std::vector<std::pair<int32_t, int32_t>>& merge_ids) const {
  Sha256 sha;
  sha.UpdateField("opd-tokenizer-fingerprint-v1");
  sha.UpdateField(pattern);
  sha.UpdateU32(nfc ? 1 : 0);
  sha.UpdateU32(ignore_merges ? 1 : 0);
  sha.UpdateU32(static_cast<uint32_t>(tok.id_bytes_.size()));
  for (size_t id = 0; id < tok.id_bytes_.size(); ++id) {
    if (tok.id_kind_[id] == 0) continue;
    sha.UpdateU32(static_cast<uint32_t>(id));
    sha.UpdateU32(tok.id_kind_[id]);
    const bool is_added = tok.id_kind_[id] >= 2;
    sha.UpdateField(is_added ? tok.added_[tok.id_added_[id]].content : tok.id_bytes_[id]);
  }
  sha.UpdateU32(static_cast<uint32_t>(merge_ids.size()));
  for (const auto& [l, r] : merge_ids) {
    sha.UpdateU32(static_cast<uint32_t>(l));
    sha.UpdateU32(static_cast<uint32_t>(r));
  }
  return sha.HexDigest();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Builder::Build() {
  std::unique_ptr<Tokenizer> tok(new Tokenizer());  // private constructor
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab) max_id = std::max(max_id, id);
  for (const AddedToken& a : added) max_id = std::max(max_id, a.id);
  if (max_id < 0) return absl::InvalidArgumentError("empty vocabulary");
  tok->id_bytes_.assign(max_id + 1, std::string());
  tok->id_kind_.assign(max_id + 1, 0);
  tok->id_added_.assign(max_id + 1, -1);

  RETURN_IF_ERROR(BuildVocab(*tok));
  std::vector<std::pair<int32_t, int32_t>> merge_ids;
  RETURN_IF_ERROR(BuildMerges(*tok, &merge_ids));
  RETURN_IF_ERROR(BuildAddedTokens(*tok));
  tok->pattern_ = pattern;
  tok->nfc_ = nfc;
  tok->ignore_merges_ = ignore_merges;
  ASSIGN_OR_RETURN(tok->regex_, Regex::Compile(pattern));
  tok->fingerprint_ = Fingerprint(*tok, merge_ids);
  return tok;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir_or_file,
                                                           const TokenizerOptions& options) {
  const fs::path path(dir_or_file);
  std::error_code ec;
  if (fs::is_regular_file(path, ec) || fs::exists(path / "tokenizer.json", ec)) {
    const fs::path file = fs::is_regular_file(path, ec) ? path : path / "tokenizer.json";
    ASSIGN_OR_RETURN(const std::string text, ReadFile(file.string()));
    return FromTokenizerJson(text, file.string(), options);
  }
  Builder builder;
  if (fs::exists(path / "vocab.json", ec) && fs::exists(path / "merges.txt", ec)) {
    // A field of an unexpected JSON type (tokenizer_config.json) must be an error, never a crash.
    try {
      RETURN_IF_ERROR(builder.LoadVocabMerges(path));
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir_or_file, ": malformed tokenizer files: ", e.what()));
    }
  } else {
    return absl::NotFoundError(absl::StrCat(
        dir_or_file, ": no tokenizer.json, and no vocab.json + merges.txt, found there"));
  }
  return builder.Finish(options, dir_or_file);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTokenizerJson(
    std::string_view text, const std::string& label, const TokenizerOptions& options) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": bad JSON: ", e.what()));
  }
  Builder builder;
  // A field of an unexpected JSON type must be an error naming the file, never a crash.
  try {
    RETURN_IF_ERROR(builder.ParseTokenizerJson(j, label));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": malformed tokenizer.json: ", e.what()));
  }
  return builder.Finish(options, label);
}

std::vector<AddedToken> Tokenizer::Qwen3AddedTokens() {
  // Ids 151643.. in order; the first 14 are "special" (skipped by skip_special), the tool-call,
  // FIM and think tokens are not, exactly as in Qwen3's tokenizer.json.
  static const char* const kContents[] = {"<|endoftext|>",
                                          "<|im_start|>",
                                          "<|im_end|>",
                                          "<|object_ref_start|>",
                                          "<|object_ref_end|>",
                                          "<|box_start|>",
                                          "<|box_end|>",
                                          "<|quad_start|>",
                                          "<|quad_end|>",
                                          "<|vision_start|>",
                                          "<|vision_end|>",
                                          "<|vision_pad|>",
                                          "<|image_pad|>",
                                          "<|video_pad|>",
                                          "<tool_call>",
                                          "</tool_call>",
                                          "<|fim_prefix|>",
                                          "<|fim_middle|>",
                                          "<|fim_suffix|>",
                                          "<|fim_pad|>",
                                          "<|repo_name|>",
                                          "<|file_sep|>",
                                          "<tool_response>",
                                          "</tool_response>",
                                          "<think>",
                                          "</think>"};
  std::vector<AddedToken> tokens;
  int32_t id = 151643;
  for (const char* content : kContents) {
    tokens.push_back({id, content, id <= 151656});
    ++id;
  }
  return tokens;
}

}  // namespace lm
