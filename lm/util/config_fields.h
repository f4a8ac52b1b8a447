// The declaration half of the config machinery (lm/util/config.h): the markers and OPD_FIELD,
// without YAML. A struct that a config decodes but that other code uses without any config (the
// sampling settings, lm/generate/sampling.h) declares its fields with this header alone, so its
// users (the torch-free request checks and their fuzz build among them) do not include yaml-cpp.
#pragma once

// Field declarations (see the top of lm/util/config.h). Each field's line keys its visitor, so a
// struct declares at most one field per line. BEGIN also declares opd_marker_ (never defined): a
// struct that inherits its markers instead of writing its own is told apart by that member's class
// (VisitFields checks it).
#define OPD_CONFIG_FIELDS_BEGIN                      \
  static constexpr int opd_fields_begin_ = __LINE__; \
  void opd_marker_()
#define OPD_CONFIG_FIELDS_END static constexpr int opd_fields_end_ = __LINE__
#define OPD_CONFIG_BASE(Base) using opd_config_base_ = Base
#define OPD_FIELD(Type, name)                                      \
  template <class V_>                                              \
  void opd_field_(V_& v_, ::lm::config_internal::Line<__LINE__>) { \
    v_(#name, name);                                               \
  }                                                                \
  Type name

namespace lm::config_internal {

// The type of the key OPD_FIELD gives a field's visitor: its line in the source.
template <int kLine>
struct Line {};

}  // namespace lm::config_internal
