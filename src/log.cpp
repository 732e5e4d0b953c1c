#include "common/log.hpp"

#include <array>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unistd.h>

namespace netio3 {
namespace {

constexpr std::array<std::string_view, 6> LEVEL_NAMES{"trace", "debug", "info",
                                                      "warn",  "error", "off"};

int initial_level() noexcept {
  const char* env = std::getenv("NETIO3_LOG_LEVEL");
  if (env != nullptr) {
    if (auto level = parse_log_level(env)) return static_cast<int>(*level);
  }
  return static_cast<int>(LogLevel::info);
}

void stderr_sink(LogLevel level, std::string_view message) {
  const auto now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch());
  // One write(2) per line so that lines from several threads do not interleave.
  std::string line = fmt::format("[{:.6f}] [{}] NETIO3 {:5} {}\n", now.count(), ::getpid(),
                                 to_string(level), message);
  std::string_view rest{line};
  while (!rest.empty()) {
    const auto n = ::write(STDERR_FILENO, rest.data(), rest.size());
    if (n <= 0) break;
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
}

std::mutex& sink_mutex() {
  static std::mutex m;
  return m;
}

std::shared_ptr<const LogSink>& sink_slot() {
  static std::shared_ptr<const LogSink> sink;
  return sink;
}

}  // namespace

namespace detail {

std::atomic<int> g_log_level{initial_level()};

void log_write(LogLevel level, std::string_view message) noexcept {
  std::shared_ptr<const LogSink> sink;
  {
    const std::lock_guard lock{sink_mutex()};
    sink = sink_slot();
  }
  try {
    if (sink && *sink) {
      (*sink)(level, message);
    } else {
      stderr_sink(level, message);
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch): a sink must not throw; if it does,
                   // the message is dropped rather than unwinding through the loop.
  }
}

}  // namespace detail

std::string_view to_string(LogLevel level) noexcept {
  const auto i = static_cast<std::size_t>(level);
  return i < LEVEL_NAMES.size() ? LEVEL_NAMES.at(i) : "?";
}

std::optional<LogLevel> parse_log_level(std::string_view name) noexcept {
  std::string lower;
  for (const char c : name)
    lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "warning") lower = "warn";
  for (std::size_t i = 0; i < LEVEL_NAMES.size(); ++i) {
    if (LEVEL_NAMES.at(i) == lower) return static_cast<LogLevel>(i);
  }
  return std::nullopt;
}

void set_log_level(LogLevel level) noexcept {
  detail::g_log_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

LogLevel log_level() noexcept {
  return static_cast<LogLevel>(detail::g_log_level.load(std::memory_order_relaxed));
}

void set_log_sink(LogSink sink) {
  auto next = sink ? std::make_shared<const LogSink>(std::move(sink)) : nullptr;
  const std::lock_guard lock{sink_mutex()};
  sink_slot() = std::move(next);
}

}  // namespace netio3
