// A tiny flag parser for opd-ctl sub-commands: `--name value` or `--name=value`, every flag
// declared up front so that a typo is an error rather than a silently ignored word.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace ctl {

class Args {
 public:
  // `known`: flag names without dashes; `bool_flags`: those that take no value.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& words,
                                    const std::set<std::string>& known,
                                    const std::set<std::string>& bool_flags = {}) {
    Args a;
    for (size_t i = 0; i < words.size(); ++i) {
      const std::string& w = words[i];
      if (w.rfind("--", 0) != 0)
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", w, "'"));
      std::string name = w.substr(2), value;
      const size_t eq = name.find('=');
      const bool has_eq = eq != std::string::npos;
      if (has_eq) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      }
      if (!known.count(name))
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
      if (bool_flags.count(name)) {
        value = has_eq ? value : "true";
      } else if (!has_eq) {
        if (i + 1 >= words.size())
          return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
        value = words[++i];
      }
      a.values_[name] = value;
    }
    return a;
  }

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  bool Flag(const std::string& name) const { return Get(name, "false") == "true"; }

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace ctl
