// A tiny flag parser for opd-ctl sub-commands: `--name value` or `--name=value`, every flag
// declared up front with its kind, so that a typo or a malformed number is an error naming the
// flag rather than a silently ignored word or an uncaught exception. `--help` / `-h` is always
// accepted.
#pragma once

#include <cmath>
#include <cstdint>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ctl {

enum class Kind {
  kString,
  kBool,    // takes no value (--flag), or --flag=true|false
  kInt,     // fits in int32
  kInt64,   // fits in int64
  kUint64,  // non-negative, fits in uint64
  kNumber,  // a finite double
};

// Flag names (without dashes) and their kinds.
using FlagSpec = std::map<std::string, Kind>;

class Args {
 public:
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& words, const FlagSpec& spec) {
    Args a;
    for (size_t i = 0; i < words.size(); ++i) {
      const std::string& w = words[i];
      if (w == "--help" || w == "-h") {
        a.help_ = true;
        continue;
      }
      if (w.rfind("--", 0) != 0)
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", w, "'"));
      std::string name = w.substr(2), value;
      const size_t eq = name.find('=');
      const bool has_eq = eq != std::string::npos;
      if (has_eq) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      }
      auto it = spec.find(name);
      if (it == spec.end())
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
      if (it->second == Kind::kBool) {
        value = has_eq ? value : "true";
      } else if (!has_eq) {
        if (i + 1 >= words.size())
          return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
        value = words[++i];
      }
      if (absl::Status s = CheckValue(name, it->second, value); !s.ok()) return s;
      a.values_[name] = value;
    }
    return a;
  }

  bool help() const { return help_; }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  bool Flag(const std::string& name) const { return Get(name, "false") == "true"; }
  // Typed values (checked by Parse against the flag's kind), or `fallback` when absent.
  int32_t Int(const std::string& name, int32_t fallback) const {
    return Has(name) ? static_cast<int32_t>(Int64(name, 0)) : fallback;
  }
  int64_t Int64(const std::string& name, int64_t fallback) const {
    int64_t v = fallback;
    if (Has(name)) (void)absl::SimpleAtoi(Get(name), &v);
    return v;
  }
  uint64_t Uint64(const std::string& name, uint64_t fallback) const {
    uint64_t v = fallback;
    if (Has(name)) (void)absl::SimpleAtoi(Get(name), &v);
    return v;
  }
  double Number(const std::string& name, double fallback) const {
    double v = fallback;
    if (Has(name)) (void)absl::SimpleAtod(Get(name), &v);
    return v;
  }

 private:
  static absl::Status CheckValue(const std::string& name, Kind kind, const std::string& value) {
    bool ok = true;
    const char* expected = "";
    switch (kind) {
      case Kind::kString:
        return absl::OkStatus();
      case Kind::kBool:
        ok = value == "true" || value == "false";
        expected = "true or false";
        break;
      case Kind::kInt: {
        int32_t v = 0;
        ok = absl::SimpleAtoi(value, &v);
        expected = "an integer (32-bit)";
        break;
      }
      case Kind::kInt64: {
        int64_t v = 0;
        ok = absl::SimpleAtoi(value, &v);
        expected = "an integer";
        break;
      }
      case Kind::kUint64: {
        uint64_t v = 0;
        ok = value.find('-') == std::string::npos && absl::SimpleAtoi(value, &v);
        expected = "a non-negative integer";
        break;
      }
      case Kind::kNumber: {
        double v = 0;
        ok = absl::SimpleAtod(value, &v) && std::isfinite(v);
        expected = "a number";
        break;
      }
    }
    if (ok) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": expected ", expected, ", got '", value, "'"));
  }

  std::map<std::string, std::string> values_;
  bool help_ = false;
};

// Parses a sub-command's words into `*out`. Returns -1 to go on; 0 after printing `usage` to
// stdout for --help; 2 after printing the error (a bad flag, or a flag of `required` missing)
// and `usage` to stderr.
inline int ParseCommandArgs(const char* command, const std::vector<std::string>& words,
                            const FlagSpec& spec, const std::vector<std::string>& required,
                            const std::string& usage, Args* out) {
  for (const auto& w : words) {
    if (w == "--help" || w == "-h") {
      std::cout << usage;
      return 0;
    }
  }
  absl::StatusOr<Args> args = Args::Parse(words, spec);
  absl::Status st = args.status();
  for (size_t i = 0; st.ok() && i < required.size(); ++i) {
    if (!args->Has(required[i]))
      st = absl::InvalidArgumentError(absl::StrCat("--", required[i], " is required"));
  }
  if (!st.ok()) {
    std::cerr << "opd-ctl " << command << ": " << st.message() << "\n" << usage;
    return 2;
  }
  *out = std::move(*args);
  return -1;
}

}  // namespace ctl
