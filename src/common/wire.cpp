#include "common/wire.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace netio3::detail {
namespace {
// A partial body keeps at least this much room so that small messages split across two
// reads do not reallocate byte by byte.
constexpr std::size_t MIN_BODY_CAP = 4096;
// Step by which a direct read may extend a partial message beyond what arrived so far.
constexpr std::size_t DIRECT_STEP = std::size_t{1} << 20U;
// A major version of another netio3 protocol: the peer is a backend of another type.
std::string other_protocol_hint(std::uint16_t major) {
  switch (major) {
    case ASYNCMSG_MAJOR:
      return ": the peer is a netio3 asyncmsg backend";
    case UCX_CONTROL_MAJOR:
      return ": the peer is a netio3 ucx backend";
    default:
      return {};
  }
}
}  // namespace

std::array<std::uint8_t, GREETING_SIZE> encode_greeting(const Greeting& greeting) {
  std::array<std::uint8_t, GREETING_SIZE> out{};
  std::copy(MAGIC.begin(), MAGIC.end(), out.begin());
  store_le16(out.data() + 4, greeting.major);
  store_le16(out.data() + 6, greeting.minor);
  store_le32(out.data() + 8, greeting.max_message_size);
  store_le32(out.data() + 12, greeting.flags);
  return out;
}

std::array<std::uint8_t, GREETING_SIZE> encode_refusal_greeting(const FrameProtocol& protocol) {
  return encode_greeting(Greeting{.major = protocol.major,
                                  .minor = protocol.minor,
                                  .max_message_size = 0,
                                  .flags = GREETING_REFUSED_ADDRESS_IN_USE});
}

void FrameDecoder::reset() noexcept {
  release_body();
  m_stage = Stage::GREETING;
  m_type = 0;
  m_small_have = 0;
  m_body_have = 0;
  m_body_len = 0;
  m_pending.clear();
  m_error.clear();
  m_refused_address_in_use = false;
  m_greeting_rejected = false;
}

void FrameDecoder::reset_to_frames() noexcept {
  reset();
  m_stage = Stage::HEADER;
}

bool FrameDecoder::parse_greeting(const std::uint8_t* p, Greeting& out) {
  if (!std::equal(MAGIC.begin(), MAGIC.end(), p)) {
    m_error = fmt::format(
        "bad greeting: expected magic 4e494f33 (\"NIO3\"), got {:02x}{:02x}{:02x}{:02x}; the peer "
        "does not speak the netio3 {} protocol",
        p[0], p[1], p[2], p[3], m_protocol.name);
    return false;
  }
  out.major = load_le16(p + 4);
  out.minor = load_le16(p + 6);
  out.max_message_size = load_le32(p + 8);
  out.flags = load_le32(p + 12);
  if (out.major != m_protocol.major) {
    m_greeting_rejected = true;
    m_error = fmt::format("unsupported protocol version {}.{} (this side speaks {} {}.{}){}",
                          out.major, out.minor, m_protocol.name, m_protocol.major, m_protocol.minor,
                          other_protocol_hint(out.major));
    return false;
  }
  if (out.max_message_size == 0 && (out.flags & GREETING_REFUSED_ADDRESS_IN_USE) != 0) {
    m_refused_address_in_use = true;
    m_greeting_rejected = true;
    m_error = "refused by the peer: it has a connection from this source address and port already";
    return false;
  }
  if (out.max_message_size == 0) {
    m_error = "bad greeting: peer announces a maximum message size of 0";
    return false;
  }
  return true;
}

bool FrameDecoder::parse_header(const std::uint8_t* p, std::size_t& length) {
  const std::uint32_t len = load_le32(p);
  if (p[4] >= 32 || (m_protocol.frame_types & (1U << p[4])) == 0) {
    m_error = fmt::format("unknown frame type {} (length field {})", p[4], len);
    return false;
  }
  m_type = p[4];
  if ((p[5] | p[6] | p[7]) != 0) {
    m_error = fmt::format("reserved frame header bytes are not zero ({:02x}{:02x}{:02x})", p[5],
                          p[6], p[7]);
    return false;
  }
  if (len > m_max_message_size) {
    m_error = fmt::format("frame declares a message of {} bytes, the limit is {}", len,
                          m_max_message_size);
    return false;
  }
  length = len;
  return true;
}

BodyCache::BodyCache(std::size_t max_blocks, std::size_t max_bytes)
    : m_max_blocks{max_blocks}, m_max_bytes{max_bytes} {
  m_free.reserve(max_blocks);  // give() never allocates
}

std::unique_ptr<std::uint8_t[]> BodyCache::take(std::size_t size, std::size_t& capacity) {
  {
    const std::lock_guard lock{m_mutex};
    // The smallest kept block that fits and wastes at most half of itself.
    auto best = m_free.end();
    for (auto it = m_free.begin(); it != m_free.end(); ++it) {
      if (it->capacity >= size && it->capacity / 2 <= size &&
          (best == m_free.end() || it->capacity < best->capacity)) {
        best = it;
      }
    }
    if (best != m_free.end()) {
      capacity = best->capacity;
      auto block = std::move(best->data);
      m_bytes -= capacity;
      m_free.erase(best);
      return block;
    }
  }
  capacity = size;
  return std::make_unique_for_overwrite<std::uint8_t[]>(size);
}

void BodyCache::give(std::unique_ptr<std::uint8_t[]> block, std::size_t capacity) noexcept {
  if (!block || capacity > m_max_bytes || m_max_blocks == 0) return;  // freed here
  std::vector<Block> dropped;                                         // freed after the lock
  const std::lock_guard lock{m_mutex};
  while (!m_free.empty() && (m_free.size() >= m_max_blocks || m_bytes + capacity > m_max_bytes)) {
    m_bytes -= m_free.front().capacity;
    m_free.erase(m_free.begin());  // the oldest: its memory is the least likely in cache
  }
  m_free.push_back(Block{std::move(block), capacity});
  m_bytes += capacity;
}

std::size_t BodyCache::cached_bytes() const {
  const std::lock_guard lock{m_mutex};
  return m_bytes;
}

std::size_t BodyCache::cached_blocks() const {
  const std::lock_guard lock{m_mutex};
  return m_free.size();
}

void FrameDecoder::grow_body(std::size_t wanted) {
  if (wanted <= m_body_cap) return;
  // Grow geometrically but never past the (already validated) message length.
  const std::size_t cap = std::min(m_body_len, std::max({wanted, m_body_cap * 2, MIN_BODY_CAP}));
  if (cap <= m_block_cap) {  // a kept block larger than the part used so far
    m_body_cap = cap;
    return;
  }
  std::size_t block_cap = cap;
  auto next = m_cache && cap > KEEP_BODY_CAP ? m_cache->take(cap, block_cap)
                                             : std::make_unique_for_overwrite<std::uint8_t[]>(cap);
  if (m_body_have > 0) std::memcpy(next.get(), m_body.get(), m_body_have);
  auto previous = std::exchange(m_body, std::move(next));
  if (m_cache && m_block_cap > KEEP_BODY_CAP) m_cache->give(std::move(previous), m_block_cap);
  m_body_cap = cap;
  m_block_cap = block_cap;
}

void FrameDecoder::release_body() noexcept {
  m_body_have = 0;
  m_body_len = 0;
  if (m_block_cap > KEEP_BODY_CAP) {
    if (m_cache) m_cache->give(std::move(m_body), m_block_cap);
    m_body.reset();
    m_body_cap = 0;
    m_block_cap = 0;
  } else {
    m_body_cap = 0;  // the block stays; grow_body() hands out of it what a message needs
  }
}

std::span<std::uint8_t> FrameDecoder::direct_target() {
  if (m_stage != Stage::BODY) return {};
  const std::size_t remaining = m_body_len - m_body_have;
  if (remaining < DIRECT_MIN) return {};
  // Room for what has arrived plus one step, so memory follows the bytes that came in.
  grow_body(std::min(m_body_len, m_body_have + std::max(DIRECT_STEP, m_body_have)));
  return {m_body.get() + m_body_have, m_body_cap - m_body_have};
}

std::vector<std::uint8_t> encode_frame(std::uint8_t type, std::span<const std::uint8_t> body) {
  std::vector<std::uint8_t> out(FRAME_HEADER_SIZE + body.size());
  encode_frame_header(out.data(), static_cast<std::uint32_t>(body.size()), type);
  std::copy(body.begin(), body.end(), out.begin() + FRAME_HEADER_SIZE);
  return out;
}

void encode_session_body(const SessionFrame& frame, bool with_token, std::uint8_t* out) noexcept {
  std::copy(frame.id.begin(), frame.id.end(), out);
  out += frame.id.size();
  store_le64(out, frame.count);
  store_le64(out + 8, frame.give_up_ms);
  out[16] = frame.flags;
  if (with_token) store_le64(out + 17, frame.token);
}

std::optional<SessionFrame> decode_session_body(std::span<const std::uint8_t> body,
                                                bool with_token) noexcept {
  if (body.size() != session_body_size(with_token)) return std::nullopt;
  SessionFrame frame;
  std::copy_n(body.begin(), frame.id.size(), frame.id.begin());
  const std::uint8_t* rest = body.data() + frame.id.size();
  frame.count = load_le64(rest);
  frame.give_up_ms = load_le64(rest + 8);
  frame.flags = rest[16];
  if (with_token) frame.token = load_le64(rest + 17);
  return frame;
}

}  // namespace netio3::detail
