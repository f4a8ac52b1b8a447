// Job configs: YAML files decoded into typed structs, with command-line overrides.
//
// A config struct declares each field once: its type, its name (the YAML key) and its default, on
// one line between two markers:
//
//   struct OptimConfig {
//     OPD_CONFIG_FIELDS_BEGIN;
//     OPD_FIELD(double, lr) = 1e-5;  // peak learning rate
//     OPD_FIELD(int64_t, warmup_steps) = 0;
//     OPD_CONFIG_FIELDS_END;
//   };
//
// OPD_FIELD declares the member `lr` as written and, beside it, a visitor keyed by its line, so the
// struct is its own field list, in declaration order (config_internal::VisitFields walks the lines
// between the markers). A struct deriving from another config adds OPD_CONFIG_BASE(Base): its own
// fields come first, then the base's. The struct stays a plain struct of its members; a derived
// section may give its base's fields other defaults in a constructor (OpdRolloutConfig).
//
// That one list drives decoding (strict: a key the struct does not list is an error naming its
// full path, so a typo never falls back to a default silently), encoding (the resolved config,
// every field including defaults, written into the run directory) and nothing else. Field types:
// bool, int32_t, int64_t, double, std::string, enums (below), std::vector<T> and nested config
// structs. A key that is absent or null keeps the struct's default.
//
// A field with a fixed set of words is an enum, decoded once here so that the jobs compare enum
// values, never strings. The enum lists its YAML spellings once, in a Choices overload in its own
// namespace (found by argument-dependent lookup):
//
//   enum class LossForm { kSampled, kTopK };
//   inline const ConfigChoices<LossForm>& Choices(LossForm) {
//     static const ConfigChoices<LossForm> c{{"sampled", LossForm::kSampled},
//                                            {"topk", LossForm::kTopK}};
//     return c;
//   }
//
// A word not in the list is an error naming the key and every choice; encoding writes the word.
//
// Overrides `--set a.b.c=VALUE` are applied to the YAML tree before decoding: VALUE is parsed as
// YAML (so `[1, 2]` is a list and `{files: [x]}` a mapping), and it is type-checked by the same
// decoder as the file, against the same field list.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lm/util/config_fields.h"

namespace lm {

// The YAML document in `path` (an empty file is an empty mapping). Errors name the file and line.
// A key written twice in one mapping (a second `train:` block, `{a: 1, a: 2}`) is an error naming
// the key's path and both lines: yaml-cpp keeps both entries and a lookup finds the first, so the
// second would be ignored without a word.
absl::StatusOr<YAML::Node> LoadYamlFile(const std::string& path);
absl::StatusOr<YAML::Node> ParseYaml(const std::string& text, const std::string& label);

// Applies `assignment` ("a.b.c=value") to `root`. Intermediate mappings are created when absent
// (decoding then rejects unknown keys); a numeric component indexes into a sequence. The value is
// checked for duplicate keys as a file is.
absl::Status ApplyOverride(YAML::Node& root, const std::string& assignment);

// An enum field's YAML spellings, one per value (see the top of this file).
template <class E>
using ConfigChoices = std::vector<std::pair<const char*, E>>;

// The YAML spelling of `value` (for logs and messages); "?" for a value Choices does not list.
template <class E>
const char* ChoiceName(E value) {
  for (const auto& [name, v] : Choices(value))
    if (v == value) return name;
  return "?";
}

namespace config_internal {
// INVALID_ARGUMENT "'word' is not one of a, b, c".
absl::Status NotOneOf(std::string_view word, const std::vector<const char*>& names);
}  // namespace config_internal

// The value spelled `word`, else INVALID_ARGUMENT listing the choices (for flags that take the
// same words as a config field).
template <class E>
absl::StatusOr<E> ParseChoice(std::string_view word) {
  std::vector<const char*> names;
  for (const auto& [name, v] : Choices(E{})) {
    if (word == name) return v;
    names.push_back(name);
  }
  return config_internal::NotOneOf(word, names);
}

namespace config_internal {

// True when `T` declares its fields (OPD_CONFIG_FIELDS_BEGIN): it is decoded as a nested mapping.
template <class T, class = void>
struct IsStruct : std::false_type {};
template <class T>
struct IsStruct<T, std::void_t<decltype(T::opd_fields_end_)>> : std::true_type {};

// The struct `T` names with OPD_CONFIG_BASE, or void.
template <class T, class = void>
struct ConfigBase {
  using type = void;
};
template <class T>
struct ConfigBase<T, std::void_t<typename T::opd_config_base_>> {
  using type = typename T::opd_config_base_;
};

// Visits the field declared on line kLine of `T`, if one is.
template <class V, class T, int kLine, class = void>
struct FieldOnLine {
  static void Visit(V&, T&) {}
};
template <class V, class T, int kLine>
struct FieldOnLine<
    V, T, kLine,
    std::void_t<decltype(std::declval<T&>().opd_field_(std::declval<V&>(), Line<kLine>{}))>> {
  static void Visit(V& v, T& c) { c.opd_field_(v, Line<kLine>{}); }
};

template <class V, class T, size_t... kOffset>
void VisitLines(V& v, T& c, std::index_sequence<kOffset...>) {
  (FieldOnLine<V, T, T::opd_fields_begin_ + 1 + static_cast<int>(kOffset)>::Visit(v, c), ...);
}

// Whether `T` has a field visitor on line kLine (declared there by OPD_FIELD).
struct AnyVisitor {
  template <class F>
  void operator()(const char*, F&) {}
};
template <class T, int kLine, class = void>
struct HasFieldOnLine : std::false_type {};
template <class T, int kLine>
struct HasFieldOnLine<T, kLine,
                      std::void_t<decltype(std::declval<T&>().opd_field_(
                          std::declval<AnyVisitor&>(), Line<kLine>{}))>> : std::true_type {};
template <class T, int kFrom, size_t... kOffset>
constexpr bool AnyFieldOnLines(std::index_sequence<kOffset...>) {
  return (HasFieldOnLine<T, kFrom + static_cast<int>(kOffset)>::value || ...);
}
// Lines either side of the markers searched for a field written outside them.
inline constexpr int kStrayFieldWindow = 48;

// The two ways a config struct could drop fields without a word, as compile errors: a field
// written just outside its markers, and a struct (a derived section) without markers of its own,
// whose fields the inherited markers never reach.
template <class C>
constexpr void CheckFieldMarkers() {
  using T = std::remove_cv_t<C>;
  static_assert(std::is_same_v<decltype(&T::opd_marker_), void (T::*)()>,
                "a config struct needs its own OPD_CONFIG_FIELDS_BEGIN/END (a derived section "
                "adds OPD_CONFIG_BASE(Base) and its own markers)");
  static_assert(
      !AnyFieldOnLines<T, T::opd_fields_end_ + 1>(std::make_index_sequence<kStrayFieldWindow>{}),
      "an OPD_FIELD after OPD_CONFIG_FIELDS_END is never decoded");
  static_assert(!AnyFieldOnLines<T, T::opd_fields_begin_ - kStrayFieldWindow>(
                    std::make_index_sequence<kStrayFieldWindow>{}),
                "an OPD_FIELD before OPD_CONFIG_FIELDS_BEGIN is never decoded");
}

// Calls v(key, field) for every field of `c`, in declaration order, then its base's.
template <class V, class T>
void VisitFields(V& v, T& c) {
  CheckFieldMarkers<T>();
  VisitLines(v, c, std::make_index_sequence<T::opd_fields_end_ - T::opd_fields_begin_ - 1>{});
  using Base = typename ConfigBase<T>::type;
  if constexpr (!std::is_void_v<Base>) VisitFields(v, static_cast<Base&>(c));
}

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};

std::string JoinPath(const std::string& path, const std::string& key);
absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, bool* out);
absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, int32_t* out);
absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, int64_t* out);
absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, double* out);
absl::Status DecodeScalar(const YAML::Node& node, const std::string& path, std::string* out);
// The error of a node that is not one word (a list, a mapping).
absl::Status ExpectWord(const YAML::Node& node, const std::string& path);
absl::Status ExpectMap(const YAML::Node& node, const std::string& path);
absl::Status ExpectSequence(const YAML::Node& node, const std::string& path);
// Error naming the first key of the mapping `node` that is not in `known`.
absl::Status CheckKnownKeys(const YAML::Node& node, const std::string& path,
                            const std::unordered_set<std::string>& known);

void EmitScalar(YAML::Emitter& out, bool v);
void EmitScalar(YAML::Emitter& out, int32_t v);
void EmitScalar(YAML::Emitter& out, int64_t v);
void EmitScalar(YAML::Emitter& out, double v);  // shortest text that reads back to the same double
void EmitScalar(YAML::Emitter& out, const std::string& v);

class Reader;
class Writer;

template <class T>
absl::Status Decode(const YAML::Node& node, const std::string& path, T* out);
template <class T>
void Encode(YAML::Emitter& out, T& value);

// Decoding visitor for one mapping: remembers the keys the struct knows.
class Reader {
 public:
  Reader(YAML::Node node, std::string path) : node_(std::move(node)), path_(std::move(path)) {}

  template <class T>
  void operator()(const char* key, T& field) {
    known_.insert(key);
    if (!status_.ok()) return;
    const YAML::Node child = static_cast<const YAML::Node&>(node_)[key];
    if (!child.IsDefined() || child.IsNull()) return;  // keep the default
    status_ = Decode(child, JoinPath(path_, key), &field);
  }

  absl::Status Finish() const {
    if (!status_.ok()) return status_;
    return CheckKnownKeys(node_, path_, known_);
  }

 private:
  YAML::Node node_;
  std::string path_;
  std::unordered_set<std::string> known_;
  absl::Status status_;
};

// Encoding visitor: one key/value pair per field.
class Writer {
 public:
  explicit Writer(YAML::Emitter& out) : out_(out) {}
  template <class T>
  void operator()(const char* key, T& field) {
    out_ << YAML::Key << key << YAML::Value;
    Encode(out_, field);
  }

 private:
  YAML::Emitter& out_;
};

template <class T>
absl::Status Decode(const YAML::Node& node, const std::string& path, T* out) {
  if constexpr (IsStruct<T>::value) {
    if (absl::Status s = ExpectMap(node, path); !s.ok()) return s;
    Reader reader(node, path);
    VisitFields(reader, *out);
    return reader.Finish();
  } else if constexpr (IsVector<T>::value) {
    if (absl::Status s = ExpectSequence(node, path); !s.ok()) return s;
    T items(node.size());
    for (size_t i = 0; i < node.size(); ++i) {
      absl::Status s = Decode(node[i], path + "[" + std::to_string(i) + "]", &items[i]);
      if (!s.ok()) return s;
    }
    *out = std::move(items);
    return absl::OkStatus();
  } else if constexpr (std::is_enum_v<T>) {
    if (absl::Status s = ExpectWord(node, path); !s.ok()) return s;
    absl::StatusOr<T> v = ParseChoice<T>(node.Scalar());
    if (!v.ok()) return absl::InvalidArgumentError(path + ": " + std::string(v.status().message()));
    *out = *v;
    return absl::OkStatus();
  } else {
    return DecodeScalar(node, path, out);
  }
}

template <class T>
void Encode(YAML::Emitter& out, T& value) {
  if constexpr (IsStruct<T>::value) {
    out << YAML::BeginMap;
    Writer writer(out);
    VisitFields(writer, value);
    out << YAML::EndMap;
  } else if constexpr (IsVector<T>::value) {
    // Scalars on one line ([a, b]); mappings one per line.
    const bool flow = !IsStruct<typename T::value_type>::value;
    out << (flow ? YAML::Flow : YAML::Block) << YAML::BeginSeq;
    for (auto& item : value) Encode(out, item);
    out << YAML::EndSeq;
  } else if constexpr (std::is_enum_v<T>) {
    EmitScalar(out, std::string(ChoiceName(value)));  // quoted, as a string field is
  } else {
    EmitScalar(out, value);
  }
}

}  // namespace config_internal

// Decodes `root` (a mapping) into `out`, whose fields keep their defaults where `root` is silent.
template <class T>
absl::Status DecodeConfig(const YAML::Node& root, T* out) {
  return config_internal::Decode(root, "", out);
}

// Every field of `config` as YAML text (the resolved config).
template <class T>
std::string EncodeConfig(T config) {
  YAML::Emitter out;
  config_internal::Encode(out, config);
  return std::string(out.c_str()) + "\n";
}

// Reads the YAML file, applies the overrides in order and decodes: the whole config pipeline.
template <class T>
absl::StatusOr<T> LoadConfig(const std::string& path, const std::vector<std::string>& overrides) {
  absl::StatusOr<YAML::Node> root = LoadYamlFile(path);
  if (!root.ok()) return root.status();
  for (const std::string& o : overrides) {
    if (absl::Status s = ApplyOverride(*root, o); !s.ok()) return s;
  }
  T config;
  if (absl::Status s = DecodeConfig(*root, &config); !s.ok()) {
    const std::string where = overrides.empty() ? path : path + " with the --set overrides";
    return absl::InvalidArgumentError(where + ": " + std::string(s.message()));
  }
  return config;
}

// Checks for the Validate*Config functions: each error names the key and the value. Every range
// check fails on NaN and +-inf too (a NaN compares false with everything, so a bare `x <= 0`
// test lets `lr: .nan` through).
namespace validate {

absl::Status Finite(const std::string& key, double v);                             // any finite
absl::Status Above(const std::string& key, double v, double lo);                   // lo < v
absl::Status AtLeast(const std::string& key, double v, double lo);                 // lo <= v
absl::Status InRange(const std::string& key, double v, double lo, double hi);      // lo <= v <= hi
absl::Status InHalfOpen(const std::string& key, double v, double lo, double hi);   // lo <= v < hi
absl::Status AboveAtMost(const std::string& key, double v, double lo, double hi);  // lo < v <= hi
absl::Status IntAtLeast(const std::string& key, int64_t v, int64_t lo);
// lo <= v <= hi: every integer field has one (the job narrows some to int32, sums others).
absl::Status IntInRange(const std::string& key, int64_t v, int64_t lo, int64_t hi);
// Each item non-empty and none twice (endpoint lists: a replica listed twice would be connected,
// loaded and counted twice). Errors name the item as key[i].
absl::Status DistinctNonEmpty(const std::string& key, const std::vector<std::string>& items);
absl::Status OneOf(const std::string& key, const std::string& v,
                   std::initializer_list<const char*> allowed);
absl::Status Required(const std::string& key, const std::string& v, const std::string& what);

}  // namespace validate
}  // namespace lm
