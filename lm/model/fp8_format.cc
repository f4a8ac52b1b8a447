#include "lm/model/fp8_format.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"
#include "lm/util/status.h"

namespace lm {

// modules_to_not_convert compiled once: each pattern p as transformers matches it,
// re.match(rf"(?:{p}){boundary}", name) with boundary (?:(?<=\.)|(?=\.|$)), i.e. anchored at the
// start of the name and ending at a module boundary. A match limit keeps a pathological pattern
// from spinning: such a pattern simply does not match.
class Fp8NotConvertedPatterns {
 public:
  static absl::StatusOr<std::shared_ptr<const Fp8NotConvertedPatterns>> Compile(
      const std::vector<std::string>& patterns) {
    auto out = std::shared_ptr<Fp8NotConvertedPatterns>(new Fp8NotConvertedPatterns());
    out->context_ = pcre2_match_context_create(nullptr);
    pcre2_set_match_limit(out->context_, 100000);
    for (size_t i = 0; i < patterns.size(); ++i) {
      const std::string wrapped = absl::StrCat("(?:", patterns[i], ")(?:(?<=\\.)|(?=\\.|$))");
      int error = 0;
      PCRE2_SIZE offset = 0;
      pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(wrapped.data()), wrapped.size(),
                                       PCRE2_ANCHORED, &error, &offset, nullptr);
      if (code == nullptr) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(error, message, sizeof(message));
        return absl::InvalidArgumentError(absl::StrCat(
            "config.json: quantization_config.modules_to_not_convert[", i, "] '", patterns[i],
            "' is not a valid regular expression: ", reinterpret_cast<const char*>(message)));
      }
      out->codes_.push_back(code);
    }
    out->suffixes_ = patterns;
    return std::shared_ptr<const Fp8NotConvertedPatterns>(std::move(out));
  }

  Fp8NotConvertedPatterns(const Fp8NotConvertedPatterns&) = delete;
  Fp8NotConvertedPatterns& operator=(const Fp8NotConvertedPatterns&) = delete;
  ~Fp8NotConvertedPatterns() {
    for (pcre2_code* c : codes_) pcre2_code_free(c);
    pcre2_match_context_free(context_);
  }

  bool Excludes(const std::string& name) const {
    for (const std::string& s : suffixes_) {
      if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0)
        return true;
    }
    for (pcre2_code* code : codes_) {
      pcre2_match_data* data = pcre2_match_data_create_from_pattern(code, nullptr);
      const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(name.data()), name.size(), 0, 0,
                                 data, context_);
      pcre2_match_data_free(data);
      if (rc > 0) return true;
    }
    return false;
  }

 private:
  Fp8NotConvertedPatterns() = default;
  std::vector<pcre2_code*> codes_;
  std::vector<std::string> suffixes_;
  pcre2_match_context* context_ = nullptr;
};

bool Fp8Format::Converts(const std::string& module) const {
  return patterns == nullptr || !patterns->Excludes(module);
}

namespace {

using nlohmann::json;

absl::Status Field(const std::string& key, const std::string& problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: quantization_config.", key, " ", problem));
}

// A string field, `fallback` when absent or null.
absl::StatusOr<std::string> StringField(const json& q, const char* key, const char* fallback) {
  auto it = q.find(key);
  if (it == q.end() || it->is_null()) return std::string(fallback);
  if (!it->is_string()) return Field(key, absl::StrCat("is ", it->dump(), ", expected a string"));
  return it->get<std::string>();
}

absl::Status ReadBlock(const json& q, Fp8Format* f) {
  auto it = q.find("weight_block_size");
  // transformers' FineGrainedFP8Config defaults to 128 x 128 when the field is absent.
  if (it == q.end() || it->is_null()) return absl::OkStatus();
  const auto bad = [&] {
    return Field("weight_block_size",
                 absl::StrCat("is ", it->dump(), ", expected two positive integers [rows, cols]"));
  };
  if (!it->is_array() || it->size() != 2) return bad();
  for (const json& v : *it) {
    if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > (int64_t{1} << 20))
      return bad();
  }
  f->block_rows = (*it)[0].get<int64_t>();
  f->block_cols = (*it)[1].get<int64_t>();
  return absl::OkStatus();
}

absl::Status ReadNotConverted(const json& q, Fp8Format* f) {
  auto it = q.find("modules_to_not_convert");
  if (it == q.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_array())
    return Field("modules_to_not_convert",
                 absl::StrCat("is a JSON ", it->type_name(), ", expected a list of names"));
  for (size_t i = 0; i < it->size(); ++i) {
    const json& v = (*it)[i];
    if (!v.is_string())
      return Field(absl::StrCat("modules_to_not_convert[", i, "]"),
                   absl::StrCat("is a JSON ", v.type_name(), ", expected a module name"));
    f->modules_to_not_convert.push_back(v.get<std::string>());
  }
  ASSIGN_OR_RETURN(f->patterns, Fp8NotConvertedPatterns::Compile(f->modules_to_not_convert));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::optional<Fp8Format>> ParseFp8QuantizationConfig(const json& root) {
  auto it = root.find("quantization_config");
  if (it == root.end() || it->is_null()) return std::optional<Fp8Format>();
  const json& q = *it;
  if (!q.is_object())
    return absl::InvalidArgumentError(absl::StrCat("config.json: quantization_config is a JSON ",
                                                   q.type_name(), ", expected an object"));
  ASSIGN_OR_RETURN(const std::string method, StringField(q, "quant_method", ""));
  if (method != "fp8")
    return absl::UnimplementedError(absl::StrCat(
        "config.json: quantization_config.quant_method '", method,
        "' is not supported (only block-wise \"fp8\" checkpoints: quant_method fp8, fmt e4m3)"));
  ASSIGN_OR_RETURN(const std::string fmt, StringField(q, "fmt", "e4m3"));
  if (fmt == "e5m2")
    return absl::UnimplementedError(
        "config.json: quantization_config.fmt 'e5m2' is not supported (only e4m3)");
  if (fmt != "e4m3")
    return Field("fmt", absl::StrCat("'", fmt, "' is not an FP8 format (expected e4m3)"));
  ASSIGN_OR_RETURN(const std::string scheme, StringField(q, "activation_scheme", "dynamic"));
  if (scheme == "static")
    return absl::UnimplementedError(
        "config.json: quantization_config.activation_scheme 'static' is not supported (only "
        "dynamic: activations quantized per token at run time)");
  if (scheme != "dynamic")
    return Field("activation_scheme", absl::StrCat("'", scheme, "' is neither dynamic nor static"));
  ASSIGN_OR_RETURN(const std::string scale_fmt, StringField(q, "scale_fmt", ""));
  if (!scale_fmt.empty() && scale_fmt != "float32")
    return absl::UnimplementedError(absl::StrCat("config.json: quantization_config.scale_fmt '",
                                                 scale_fmt,
                                                 "' is not supported (only fp32 scales)"));
  Fp8Format f;
  RETURN_IF_ERROR(ReadBlock(q, &f));
  RETURN_IF_ERROR(ReadNotConverted(q, &f));
  return std::optional<Fp8Format>(std::move(f));
}

}  // namespace lm
