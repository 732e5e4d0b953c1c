#pragma once

// Little-endian stores and loads for wire formats (independent of the host's byte order).

#include <cstdint>

namespace netio3::detail {

inline void store_le16(std::uint8_t* p, std::uint16_t v) noexcept {
  p[0] = static_cast<std::uint8_t>(v);
  p[1] = static_cast<std::uint8_t>(v >> 8U);
}
inline void store_le32(std::uint8_t* p, std::uint32_t v) noexcept {
  for (unsigned i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8U * i));
}
inline void store_le64(std::uint8_t* p, std::uint64_t v) noexcept {
  for (unsigned i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8U * i));
}
[[nodiscard]] inline std::uint16_t load_le16(const std::uint8_t* p) noexcept {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8U));
}
[[nodiscard]] inline std::uint32_t load_le32(const std::uint8_t* p) noexcept {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8U) |
         (static_cast<std::uint32_t>(p[2]) << 16U) | (static_cast<std::uint32_t>(p[3]) << 24U);
}
[[nodiscard]] inline std::uint64_t load_le64(const std::uint8_t* p) noexcept {
  return std::uint64_t{load_le32(p)} | (std::uint64_t{load_le32(p + 4)} << 32U);
}

}  // namespace netio3::detail
