// Must not compile: a derived section without markers of its own would decode its base's fields
// only (tests/CMakeLists.txt expects lm/util/config.h's static_assert message).
#include "lm/util/config.h"

struct Base {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(int64_t, a) = 1;
  OPD_CONFIG_FIELDS_END;
};

struct Derived : Base {
  OPD_FIELD(int64_t, dropped) = 2;
};

absl::Status Decode(const YAML::Node& n, Derived* c) {
  return lm::DecodeConfig(n, c);
}
