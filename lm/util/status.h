// Abseil status helpers used at every boundary of the core library.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LM_CONCAT_INNER(a, b) a##b
#define LM_CONCAT(a, b) LM_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status _lm_status = (expr);        \
    if (!_lm_status.ok()) return _lm_status;   \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` unwraps a StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  LM_ASSIGN_OR_RETURN_IMPL(LM_CONCAT(_lm_statusor_, __LINE__), lhs, rexpr)
#define LM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                             \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
