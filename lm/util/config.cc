#include "lm/util/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "lm/util/file.h"
#include "lm/util/status.h"

namespace lm {
namespace {

// yaml-cpp reports a parse error's position 0-based.
std::string YamlError(const std::string& label, const YAML::Exception& e) {
  if (e.mark.is_null()) return absl::StrCat(label, ": ", e.msg);
  return absl::StrCat(label, ":", e.mark.line + 1, ":", e.mark.column + 1, ": ", e.msg);
}

bool IsIndex(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string Describe(const YAML::Node& node) {
  if (node.IsScalar()) return absl::StrCat("'", node.Scalar(), "'");
  if (node.IsSequence()) return "a list";
  if (node.IsMap()) return "a mapping";
  return "nothing";
}

constexpr int64_t kMaxYamlNodes = int64_t{1} << 20;

std::string Position(const std::string& label, const YAML::Mark& m) {
  if (m.is_null()) return label;
  return absl::StrCat(label, ":", m.line + 1, ":", m.column + 1);
}

// yaml-cpp keeps every entry of a mapping, duplicates included, and a lookup returns the first:
// a repeated key must be refused here or its second value is silently dropped. `path` is the
// key path as decoding errors write it (train.threads, stages[0].name). Aliases are walked
// wherever they are used, so `budget` (nodes left to visit) stops an alias bomb: a real config
// has hundreds of nodes.
absl::Status CheckDuplicateKeys(const YAML::Node& node, const std::string& label,
                                const std::string& path, int64_t* budget) {
  if (--*budget < 0)
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": more than ", kMaxYamlNodes, " YAML nodes (aliases?)"));
  if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i)
      RETURN_IF_ERROR(CheckDuplicateKeys(node[i], label, absl::StrCat(path, "[", i, "]"), budget));
    return absl::OkStatus();
  }
  if (!node.IsMap()) return absl::OkStatus();
  std::map<std::string, YAML::Mark> seen;
  for (const auto& kv : node) {
    const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "";
    const std::string child = config_internal::JoinPath(path, key);
    if (kv.first.IsScalar()) {
      const auto [first, fresh] = seen.emplace(key, kv.first.Mark());
      if (!fresh)
        return absl::InvalidArgumentError(
            absl::StrCat(Position(label, kv.first.Mark()), ": duplicate key '", child, "'",
                         first->second.is_null()
                             ? ""
                             : absl::StrCat(" (first at line ", first->second.line + 1, ")")));
    }
    RETURN_IF_ERROR(CheckDuplicateKeys(kv.second, label, child, budget));
  }
  return absl::OkStatus();
}

absl::Status CheckDuplicateKeys(const YAML::Node& root, const std::string& label,
                                const std::string& path) {
  int64_t budget = kMaxYamlNodes;
  return CheckDuplicateKeys(root, label, path, &budget);
}

}  // namespace

absl::StatusOr<YAML::Node> ParseYaml(const std::string& text, const std::string& label) {
  try {
    YAML::Node root = YAML::Load(text);
    if (root.IsNull() || !root.IsDefined()) return YAML::Node(YAML::NodeType::Map);
    if (!root.IsMap())
      return absl::InvalidArgumentError(label + ": the top level must be a mapping");
    RETURN_IF_ERROR(CheckDuplicateKeys(root, label, ""));
    return root;
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(YamlError(label, e));
  }
}

absl::StatusOr<YAML::Node> LoadYamlFile(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
  return ParseYaml(text, path);
}

absl::Status ApplyOverride(YAML::Node& root, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--set ", assignment, ": expected key.path=value"));
  const std::string key = assignment.substr(0, eq);
  YAML::Node value;
  try {
    value = YAML::Load(assignment.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(YamlError("--set " + key, e));
  }
  RETURN_IF_ERROR(CheckDuplicateKeys(value, "--set " + key, key));
  const std::vector<std::string> parts = absl::StrSplit(key, '.');
  // yaml-cpp nodes are references: `node = x` would overwrite the referenced value, so walking the
  // tree rebinds with reset().
  YAML::Node node;
  node.reset(root);
  std::string path;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    path = config_internal::JoinPath(path, parts[i]);
    if (parts[i].empty())
      return absl::InvalidArgumentError("--set " + key + ": empty key component");
    if (node.IsSequence() && IsIndex(parts[i])) {
      const size_t idx = std::stoul(parts[i]);
      if (idx >= node.size())
        return absl::InvalidArgumentError(
            absl::StrCat("--set ", key, ": ", path, " is out of range (", node.size(), " items)"));
      YAML::Node next = node[idx];
      node.reset(next);
      continue;
    }
    if (!node.IsMap() && !node.IsNull())
      return absl::InvalidArgumentError(absl::StrCat("--set ", key, ": cannot set a key inside ",
                                                     path, ", which is ", Describe(node)));
    YAML::Node next = node[parts[i]];
    if (!next.IsDefined() || next.IsNull()) next = YAML::Node(YAML::NodeType::Map);
    node.reset(next);
  }
  const std::string& last = parts.back();
  if (last.empty()) return absl::InvalidArgumentError("--set " + key + ": empty key component");
  if (node.IsSequence() && IsIndex(last)) {
    const size_t idx = std::stoul(last);
    if (idx >= node.size())
      return absl::InvalidArgumentError(absl::StrCat("--set ", key, ": index out of range"));
    node[idx] = value;
    return absl::OkStatus();
  }
  if (!node.IsMap() && !node.IsNull())
    return absl::InvalidArgumentError(absl::StrCat("--set ", key, ": cannot set a key inside ",
                                                   path.empty() ? "the config" : path,
                                                   ", which is ", Describe(node)));
  node[last] = value;
  return absl::OkStatus();
}

namespace config_internal {

std::string JoinPath(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

absl::Status ExpectMap(const YAML::Node& node, const std::string& path) {
  if (node.IsMap()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(path.empty() ? "config" : path, ": expected a mapping, got ", Describe(node)));
}

absl::Status NotOneOf(std::string_view word, const std::vector<const char*>& names) {
  return absl::InvalidArgumentError(
      absl::StrCat("'", std::string(word), "' is not one of ", absl::StrJoin(names, ", ")));
}

absl::Status ExpectWord(const YAML::Node& node, const std::string& path) {
  if (node.IsScalar()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(path, ": expected a word, got ", Describe(node)));
}

absl::Status ExpectSequence(const YAML::Node& node, const std::string& path) {
  if (node.IsSequence()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(path, ": expected a list, got ", Describe(node)));
}

absl::Status CheckKnownKeys(const YAML::Node& node, const std::string& path,
                            const std::unordered_set<std::string>& known) {
  for (const auto& kv : node) {
    const std::string key = kv.first.Scalar();
    if (known.count(key)) continue;
    std::vector<std::string> names(known.begin(), known.end());
    std::sort(names.begin(), names.end());
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown key '", JoinPath(path, key), "' (known here: ", absl::StrJoin(names, ", "), ")"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status TypeError(const YAML::Node& node, const std::string& path, const char* expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": expected ", expected, ", got ", Describe(node)));
}

template <class Int>
std::string IntRange() {
  return absl::StrCat("an integer in [", std::numeric_limits<Int>::min(), ", ",
                      std::numeric_limits<Int>::max(), "]");
}

}  // namespace

absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, bool* out) {
  if (!node.IsScalar() || !YAML::convert<bool>::decode(node, *out))
    return TypeError(node, path, "true or false");
  return absl::OkStatus();
}

absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, int64_t* out) {
  // yaml-cpp's integer conversion accepts "1.5" as 1 in some versions; parse strictly instead.
  if (!node.IsScalar()) return TypeError(node, path, "an integer");
  const std::string& s = node.Scalar();
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  // Out of range is refused, never clamped or wrapped.
  if (ec == std::errc::result_out_of_range && end == s.data() + s.size())
    return TypeError(node, path, IntRange<int64_t>().c_str());
  if (ec != std::errc() || end != s.data() + s.size()) return TypeError(node, path, "an integer");
  *out = v;
  return absl::OkStatus();
}

absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, int32_t* out) {
  int64_t v = 0;
  if (absl::Status s = DecodeScalar(node, path, &v); !s.ok()) return s;
  if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
    return TypeError(node, path, IntRange<int32_t>().c_str());
  *out = static_cast<int32_t>(v);
  return absl::OkStatus();
}

absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, double* out) {
  if (!node.IsScalar() || !YAML::convert<double>::decode(node, *out))
    return TypeError(node, path, "a number");
  return absl::OkStatus();
}

absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, std::string* out) {
  if (!node.IsScalar()) return TypeError(node, path, "a string");
  *out = node.Scalar();
  return absl::OkStatus();
}

void EmitScalar(YAML::Emitter& out, bool v) {
  out << (v ? "true" : "false");
}
void EmitScalar(YAML::Emitter& out, int32_t v) {
  out << v;
}
void EmitScalar(YAML::Emitter& out, int64_t v) {
  out << static_cast<long long>(v);
}

void EmitScalar(YAML::Emitter& out, double v) {
  if (std::isnan(v)) {
    out << ".nan";
    return;
  }
  if (std::isinf(v)) {
    out << (v > 0 ? ".inf" : "-.inf");
    return;
  }
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);  // shortest round-trip form
  std::string text(buf, end);
  // YAML 1.1 readers (PyYAML) only take floats with a point in the mantissa: "1e-08" would read
  // back as a string and "1" as an integer, so write "1.0e-08" and "1.0".
  if (text.find('.') == std::string::npos) {
    const size_t e = text.find_first_of("eE");
    text.insert(e == std::string::npos ? text.size() : e, ".0");
  }
  out << text;
}

void EmitScalar(YAML::Emitter& out, const std::string& v) {
  out << YAML::DoubleQuoted << v;
}

}  // namespace config_internal

namespace validate {
namespace {

// The shortest text that reads back as `v`: StrCat's 6 digits would print 1048576 as 1.04858e+06
// and make a bound look unlike the value that fails it.
std::string Num(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, end);
}

absl::Status Bad(const std::string& key, double v, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": must be ", want, ", got ", Num(v)));
}

}  // namespace

absl::Status Finite(const std::string& key, double v) {
  return std::isfinite(v) ? absl::OkStatus() : Bad(key, v, "a finite number");
}

absl::Status Above(const std::string& key, double v, double lo) {
  return std::isfinite(v) && v > lo ? absl::OkStatus()
                                    : Bad(key, v, absl::StrCat("finite and > ", Num(lo)));
}

absl::Status AtLeast(const std::string& key, double v, double lo) {
  return std::isfinite(v) && v >= lo ? absl::OkStatus()
                                     : Bad(key, v, absl::StrCat("finite and >= ", Num(lo)));
}

absl::Status InRange(const std::string& key, double v, double lo, double hi) {
  return v >= lo && v <= hi && std::isfinite(v)
             ? absl::OkStatus()
             : Bad(key, v, absl::StrCat("in [", Num(lo), ", ", Num(hi), "]"));
}

absl::Status InHalfOpen(const std::string& key, double v, double lo, double hi) {
  return v >= lo && v < hi && std::isfinite(v)
             ? absl::OkStatus()
             : Bad(key, v, absl::StrCat("in [", Num(lo), ", ", Num(hi), ")"));
}

absl::Status AboveAtMost(const std::string& key, double v, double lo, double hi) {
  return v > lo && v <= hi && std::isfinite(v)
             ? absl::OkStatus()
             : Bad(key, v, absl::StrCat("in (", Num(lo), ", ", Num(hi), "]"));
}

absl::Status IntAtLeast(const std::string& key, int64_t v, int64_t lo) {
  if (v >= lo) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(key, ": must be >= ", lo, ", got ", v));
}

absl::Status IntInRange(const std::string& key, int64_t v, int64_t lo, int64_t hi) {
  if (v >= lo && v <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(key, ": must be in [", lo, ", ", hi, "], got ", v));
}

absl::Status DistinctNonEmpty(const std::string& key, const std::vector<std::string>& items) {
  std::map<std::string, size_t> first;
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string at = absl::StrCat(key, "[", i, "]");
    if (items[i].empty()) return absl::InvalidArgumentError(at + ": empty");
    const auto [it, fresh] = first.emplace(items[i], i);
    if (!fresh)
      return absl::InvalidArgumentError(absl::StrCat(
          at, ": '", items[i], "' is listed twice (also ", key, "[", it->second, "])"));
  }
  return absl::OkStatus();
}

absl::Status OneOf(const std::string& key, const std::string& v,
                   std::initializer_list<const char*> allowed) {
  for (const char* a : allowed) {
    if (v == a) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(key, ": '", v, "' is not one of ", absl::StrJoin(allowed, ", ")));
}

absl::Status Required(const std::string& key, const std::string& v, const std::string& what) {
  if (!v.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(key, ": required (", what, ")"));
}

}  // namespace validate
}  // namespace lm
