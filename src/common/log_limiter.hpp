#pragma once

// A bound on log lines about what strangers and misbehaving peers send: at most `burst` lines
// per `period`; the lines held back are counted and said in the next line written. A flood of
// forged messages then writes a few lines a second, not one per message. Thread-safe.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "common/log.hpp"

namespace netio3::detail {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LogLimiter(unsigned burst = 5, Clock::duration period = std::chrono::seconds{1}) noexcept
      : m_burst{burst}, m_period{period} {}

  // Writes `message` at `level` unless this period's lines are spent (then counts it).
  void write(LogLevel level, const std::string& message) {
    std::uint64_t held_back = 0;
    {
      const std::lock_guard lock{m_mutex};
      const auto now = Clock::now();
      if (now - m_start >= m_period) {
        m_start = now;
        m_written = 0;
      }
      if (m_written >= m_burst) {
        ++m_held_back;
        return;
      }
      ++m_written;
      held_back = std::exchange(m_held_back, 0);
    }
    if (held_back == 0) {
      log_write(level, message);
    } else {
      log_write(level, fmt::format("{} ({} similar line(s) held back)", message, held_back));
    }
  }

  // Lines held back since the last line written (tests).
  [[nodiscard]] std::uint64_t held_back() const {
    const std::lock_guard lock{m_mutex};
    return m_held_back;
  }

 private:
  const unsigned m_burst;
  const Clock::duration m_period;
  mutable std::mutex m_mutex;
  Clock::time_point m_start{};
  unsigned m_written{0};
  std::uint64_t m_held_back{0};
};

}  // namespace netio3::detail

// Formats and writes through `limiter` only when `level` is enabled.
#define NETIO3_LOG_LIMITED(limiter, level, ...)           \
  do {                                                    \
    if (::netio3::detail::log_enabled(level)) {           \
      (limiter).write(level, ::fmt::format(__VA_ARGS__)); \
    }                                                     \
  } while (false)
