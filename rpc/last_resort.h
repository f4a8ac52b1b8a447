// The last resort at a process boundary (the mains of opd-teacher, opd-rollout, opd-ctl and
// opd-trainer): an exception that escapes a program's body (a c10::Error from a LibTorch kernel or
// loader, std::bad_alloc, any other exception) is reported as one line naming the program, what it
// was doing (the model directory when known) and the error, and the process exits 1. Without it
// the exception reaches std::terminate and the process aborts (exit 134) with a backtrace of
// LibTorch internals and nothing saying which model or command failed. Code that can fail returns
// absl::Status; this only catches what slipped through.
#pragma once

#include <cstdlib>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

#include <c10/util/Exception.h>

namespace opd::rpc {

// Tests: when $OPD_DEBUG_THROW names an exception (c10, bad_alloc, std), DebugThrowForTests throws
// it, so that the catch below is exercised through the real binaries. Each main calls it where its
// real work would start (after its flags are checked, before the model loads).
inline constexpr const char* kDebugThrowEnv = "OPD_DEBUG_THROW";

inline void DebugThrowForTests() {
  const char* kind = std::getenv(kDebugThrowEnv);
  if (!kind) return;
  const std::string_view k(kind);
  if (k == "c10") TORCH_CHECK(false, "debug exception from $", kDebugThrowEnv);
  if (k == "bad_alloc") throw std::bad_alloc();
  if (k == "std") throw std::runtime_error("debug exception from $OPD_DEBUG_THROW");
}

namespace last_resort_internal {

inline int Report(std::string_view program, std::string_view context, std::string_view what) {
  std::cerr << program << ": " << what;
  if (!context.empty()) std::cerr << " (" << context << ")";
  std::cerr << "\n";
  return 1;
}

}  // namespace last_resort_internal

// Returns body()'s exit code, or 1 after printing "<program>: <error> (<context>)" when body
// throws. `context` says what the program was working on ("model /path"), empty when nothing is
// known; it is read when an exception is caught, so the body may fill it in once it knows.
template <class Body>
int ExitCodeCatchingExceptions(std::string_view program, const std::string& context, Body&& body) {
  namespace in = last_resort_internal;
  try {
    return body();
  } catch (const c10::Error& e) {
    return in::Report(program, context,
                      std::string("LibTorch error (c10::Error): ") + e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return in::Report(program, context, "out of memory (std::bad_alloc)");
  } catch (const std::exception& e) {
    return in::Report(program, context, std::string("uncaught exception: ") + e.what());
  } catch (...) {
    return in::Report(program, context, "uncaught exception of an unknown type");
  }
}

}  // namespace opd::rpc
