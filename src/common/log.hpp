#pragma once

// Internal logging front end. NETIO3_LOG checks the level before formatting, so disabled
// trace statements on the hot path cost one relaxed atomic load.

#include <atomic>
#include <string_view>

#include <fmt/format.h>
#include <netio3/log.hpp>

namespace netio3::detail {

extern std::atomic<int> g_log_level;

[[nodiscard]] inline bool log_enabled(LogLevel level) noexcept {
  return static_cast<int>(level) >= g_log_level.load(std::memory_order_relaxed);
}

void log_write(LogLevel level, std::string_view message) noexcept;

}  // namespace netio3::detail

#define NETIO3_LOG(level, ...)                                        \
  do {                                                                \
    if (::netio3::detail::log_enabled(level)) {                       \
      ::netio3::detail::log_write(level, ::fmt::format(__VA_ARGS__)); \
    }                                                                 \
  } while (false)

#define NETIO3_TRACE(...) NETIO3_LOG(::netio3::LogLevel::trace, __VA_ARGS__)
#define NETIO3_DEBUG(...) NETIO3_LOG(::netio3::LogLevel::debug, __VA_ARGS__)
#define NETIO3_INFO(...) NETIO3_LOG(::netio3::LogLevel::info, __VA_ARGS__)
#define NETIO3_WARN(...) NETIO3_LOG(::netio3::LogLevel::warn, __VA_ARGS__)
#define NETIO3_ERROR(...) NETIO3_LOG(::netio3::LogLevel::error, __VA_ARGS__)
