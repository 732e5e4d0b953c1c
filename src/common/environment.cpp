#include "common/environment.hpp"

#include <charconv>
#include <cstdlib>
#include <system_error>

#include "common/log.hpp"

namespace netio3::detail {

std::optional<std::chrono::microseconds> microseconds_from_environment(const char* name,
                                                                       std::string_view who) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  unsigned long value = 0;
  const std::string_view view{text};
  const auto [end, ec] = std::from_chars(view.data(), view.data() + view.size(), value);
  if (ec != std::errc{} || end != view.data() + view.size() || value > 1'000'000) {
    NETIO3_WARN("{}: {}='{}' is not 0..1000000 microseconds; ignored", who, name, view);
    return std::nullopt;
  }
  return std::chrono::microseconds{value};
}

}  // namespace netio3::detail
