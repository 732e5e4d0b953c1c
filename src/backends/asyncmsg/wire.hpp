#pragma once

// The asyncmsg wire format, version 1.0 (docs/asyncmsg.md): netio3's greeting and DATA
// frames (common/wire.hpp) on one TCP connection per netio3 connection.

#include "common/wire.hpp"

namespace netio3::asyncmsg {

inline constexpr std::uint16_t VERSION_MAJOR = detail::ASYNCMSG_MAJOR;
inline constexpr std::uint16_t VERSION_MINOR = detail::ASYNCMSG_PROTOCOL.minor;
using detail::encode_frame_header;
using detail::encode_greeting;
using detail::FRAME_DATA;
using detail::FRAME_HEADER_SIZE;
using detail::FrameDecoder;
using detail::Greeting;
using detail::GREETING_SIZE;
using detail::load_le16;
using detail::load_le32;
using detail::MAGIC;
using detail::store_le16;
using detail::store_le32;
using detail::WIRE_MAX_MESSAGE_SIZE;

}  // namespace netio3::asyncmsg
