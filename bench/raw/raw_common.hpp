// What netio3's raw transport reference programs (netio3-raw-fabric, netio3-raw-ucx) share:
// option parsing, process CPU time, JSON text (the string escaper is tools/common/json_text.hpp's,
// shared with netio3-perf and netio3-bench-idle). Header-only; each program is one translation
// unit.

#pragma once

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/resource.h>

#include <fmt/format.h>

#include "json_text.hpp"

namespace netio3::raw {

// Bad options: exit 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Clock = std::chrono::steady_clock;

// The process's CPU time (user + system) in nanoseconds.
inline double cpu_ns() {
  rusage ru{};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
  const auto tv_ns = [](const timeval& tv) {
    return static_cast<double>(tv.tv_sec) * 1e9 + static_cast<double>(tv.tv_usec) * 1e3;
  };
  return tv_ns(ru.ru_utime) + tv_ns(ru.ru_stime);
}

inline std::uint64_t parse_u64(std::string_view name, std::string_view text) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || text.empty()) {
    throw UsageError(fmt::format("{}: '{}' is not a non-negative integer", name, text));
  }
  return v;
}

inline double parse_double(std::string_view name, std::string_view text) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || text.empty() || !std::isfinite(v)) {
    throw UsageError(fmt::format("{}: '{}' is not a number", name, text));
  }
  return v;
}

using netio3::tools::json_string;

}  // namespace netio3::raw
