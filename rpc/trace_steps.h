#pragma once

// The syntax of a window of traced steps (Note [Tracing] in
// torchrpc/rpc/tracing.h, "When"): TORCHRPC_TRACE_STEPS, which
// Options::fromEnvironment() reads, and torchrpc-launch's --trace-steps,
// which sets it. Header-only and standard C++ only, so that the launcher,
// which does not link torchrpc, refuses exactly what a worker would.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace torchrpc {
namespace rpc {

// Steps [first, first + count) (Options::traceFirstStep, traceStepCount).
struct TraceStepWindow {
  int64_t first = 0;
  int64_t count = 0;
};

// What parseTraceSteps() accepts, worded for error messages.
inline constexpr const char* kTraceStepsSyntax =
    "FIRST:COUNT, or COUNT for FIRST 0, in decimal digits, with COUNT > 0 "
    "and FIRST + COUNT at most 2^63 - 1";

// "FIRST:COUNT", or "COUNT" for FIRST 0: decimal digits only (no sign, no
// space), COUNT > 0, and FIRST + COUNT an int64, as Tracer::traceSteps()
// needs the window's end to be. Anything else is nullopt, a number too
// large for an int64 included.
inline std::optional<TraceStepWindow> parseTraceSteps(std::string_view text) {
  auto number = [](std::string_view digits) -> std::optional<int64_t> {
    if (digits.empty()) {
      return std::nullopt;
    }
    int64_t value = 0;
    for (char c : digits) {
      if (c < '0' || c > '9') {
        return std::nullopt;
      }
      const int digit = c - '0';
      if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) {
        return std::nullopt;
      }
      value = value * 10 + digit;
    }
    return value;
  };
  const size_t colon = text.find(':');
  const std::optional<int64_t> first = colon == std::string_view::npos
      ? std::optional<int64_t>(0)
      : number(text.substr(0, colon));
  const std::optional<int64_t> count =
      number(colon == std::string_view::npos ? text : text.substr(colon + 1));
  if (!first || !count || *count == 0 ||
      *first > std::numeric_limits<int64_t>::max() - *count) {
    return std::nullopt;
  }
  return TraceStepWindow{*first, *count};
}

} // namespace rpc
} // namespace torchrpc
