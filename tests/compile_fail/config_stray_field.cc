// Must not compile: a field written after OPD_CONFIG_FIELDS_END would never be decoded
// (tests/CMakeLists.txt expects lm/util/config.h's static_assert message).
#include "lm/util/config.h"

struct StrayField {
  OPD_CONFIG_FIELDS_BEGIN;
  OPD_FIELD(int64_t, kept) = 1;
  OPD_CONFIG_FIELDS_END;
  OPD_FIELD(int64_t, dropped) = 2;
};

absl::Status Decode(const YAML::Node& n, StrayField* c) {
  return lm::DecodeConfig(n, c);
}
