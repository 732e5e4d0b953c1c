#pragma once

// The logging hook. netio3 formats its messages with fmt and hands them to one sink, by
// default a line on stderr. The level starts from the environment variable
// NETIO3_LOG_LEVEL (trace, debug, info, warn, error, off; default info). At debug level
// every connection event is logged, at trace level every send and receive with endpoint,
// key and size.

#include <functional>
#include <optional>
#include <string_view>

#include <netio3/export.hpp>

namespace netio3 {

/// Severity of a log message, lowest first; `off` logs nothing. Lower-case enumerators:
/// DEBUG and ERROR are macros in too many build systems.
enum class LogLevel { trace, debug, info, warn, error, off };

/// "trace", "debug", "info", "warn", "error", "off".
[[nodiscard]] NETIO3_API std::string_view to_string(LogLevel level) noexcept;
/// The level named (as to_string writes it, or "warning"; case-insensitive), nullopt for
/// another name.
[[nodiscard]] NETIO3_API std::optional<LogLevel> parse_log_level(std::string_view name) noexcept;

/// Receives one complete message (no trailing newline). Called from whichever thread
/// logged (usually the event-loop thread), concurrently from several threads, never under a
/// lock of the library; it must not throw. It runs on the logging thread, usually the event
/// loop's: a sink that blocks or is slow delays every connection of that loop.
using LogSink = std::function<void(LogLevel level, std::string_view message)>;

/// Messages below this level are not formatted at all.
NETIO3_API void set_log_level(LogLevel level) noexcept;
/// The level set last (initially from NETIO3_LOG_LEVEL, default info).
[[nodiscard]] NETIO3_API LogLevel log_level() noexcept;

/// Replaces the sink; an empty function restores the stderr sink. Thread-safe.
NETIO3_API void set_log_sink(LogSink sink);

}  // namespace netio3
