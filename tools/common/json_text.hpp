// JSON text for the JSON lines that netio3's measuring programs write (netio3-perf,
// netio3-bench-idle, the raw transport references): one string escaper for all of them.
// Header-only; nothing of the library.

#pragma once

#include <string>
#include <string_view>

#include <fmt/format.h>

namespace netio3::tools {

// `s` as a JSON string, quotes included: '"' and '\' escaped, control characters as \u00XX.
inline std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(ch));
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

}  // namespace netio3::tools
