#pragma once

#include <chrono>
#include <optional>
#include <string_view>

namespace netio3::detail {

// Microseconds 0..1000000 from the environment variable `name`, if it is set and valid; an
// invalid value is logged (as `who`'s) and ignored.
[[nodiscard]] std::optional<std::chrono::microseconds> microseconds_from_environment(
    const char* name, std::string_view who);

}  // namespace netio3::detail
