#pragma once

// netio3's TCP wire framing, shared by the asyncmsg data stream (docs/asyncmsg.md) and the
// UCX backend's control channel (docs/ucx.md).
//
// Each direction of a TCP connection starts with a 16-byte greeting, then carries frames:
//
//   greeting  0..3  magic "NIO3"
//             4..5  major version (little endian) - it names the protocol, and a
//                   different major is refused
//             6..7  minor version (little endian) - compatible additions
//             8..11 largest message the sender of the greeting accepts (little endian)
//            12..15 flags: 0, except in a refusal greeting (minor 1, below)
//   frame     0..3  message length L (little endian)
//             4     frame type (which ones a protocol accepts: FrameProtocol)
//             5..7  reserved, 0
//             8..   L bytes of message
//
// A refusal greeting (minor version 1) has a maximum message size of 0 and flag bit 0 set
// (GREETING_REFUSED_ADDRESS_IN_USE): the server already has a connection from the client's
// source address and port (docs/semantics.md), and closes after it. A 1.0 peer rejects it as
// a bad greeting (size 0), so it is refused all the same; a 1.1 client retries from another
// source port.
//
// Major versions are allocated across netio3's protocols, so that a peer of the wrong
// backend is refused with a reason that says so: 1 = asyncmsg, 3 = the UCX backend's
// control channel (UCX protocol versions 1 and 2 had none).
//
// FrameDecoder turns a byte stream into messages without ever allocating according to a
// length it has not checked against the configured maximum, and grows a partial message
// only as its bytes actually arrive.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/byte_order.hpp"

namespace netio3::detail {

inline constexpr std::array<std::uint8_t, 4> MAGIC{'N', 'I', 'O', '3'};
inline constexpr std::uint16_t ASYNCMSG_MAJOR = 1;
inline constexpr std::uint16_t UCX_CONTROL_MAJOR = 3;
inline constexpr std::size_t GREETING_SIZE = 16;
inline constexpr std::uint32_t GREETING_REFUSED_ADDRESS_IN_USE = 1U;
// Admission (asyncmsg 1.3, docs/admission.md). KEYED: the sender holds a partition key, and a
// CHALLENGE frame with its nonce follows the greeting. VERDICT (a server's greeting): the
// server decides about admission; the client is established by its PROOF frame, or refused
// by its REFUSAL frame, not by the greeting.
inline constexpr std::uint32_t GREETING_KEYED = 1U << 1U;
inline constexpr std::uint32_t GREETING_VERDICT = 1U << 2U;
// Delivery acknowledgement (asyncmsg 1.5, the UCX control channel 3.x likewise): the sender of
// the greeting wants its messages acknowledged (DeliveryParameters::acknowledged); the peer
// sends ACK frames (asyncmsg) or messages (UCX) with the count it handed to its application.
inline constexpr std::uint32_t GREETING_ACKNOWLEDGE = 1U << 3U;
inline constexpr std::size_t FRAME_HEADER_SIZE = 8;
inline constexpr std::uint8_t FRAME_DATA = 1;
// No body; sent by asyncmsg 1.2 to a 1.2 peer (common/liveness.hpp).
inline constexpr std::uint8_t FRAME_HEARTBEAT = 2;
// Admission (asyncmsg 1.3): only during set-up, only with the greeting flags above.
inline constexpr std::uint8_t FRAME_CHALLENGE = 3;
inline constexpr std::uint8_t FRAME_PROOF = 4;
inline constexpr std::uint8_t FRAME_REFUSAL = 5;
// No body; sent by asyncmsg 1.4 to a 1.4 peer as the last frame of a connection it closes in
// order: a 1.4 peer whose stream ends without it reads the peer as lost, not closed.
inline constexpr std::uint8_t FRAME_GOODBYE = 6;
// An 8-byte body: the count (little endian) of the peer's DATA messages this side handed to
// its application, since the connection began. Sent by asyncmsg 1.5 to a peer whose greeting
// had GREETING_ACKNOWLEDGE, never otherwise.
inline constexpr std::uint8_t FRAME_ACK = 7;
inline constexpr std::size_t ACK_BODY_SIZE = 8;
// 1.6, sessions (DeliveryParameters::Session; docs/sessions.md): a client whose greeting has
// GREETING_SESSION sends a SESSION frame once admitted (a new session, or the resume of one),
// the server answers with one, and only then is the connection established (a new session)
// or carried on (a resume: the client's third SESSION frame, GO, says the server may send
// again). Body: the session id (16 bytes), the count of the peer's messages the sender
// handed to its application (8), the client's give_up in milliseconds (8), flags (1).
inline constexpr std::uint32_t GREETING_SESSION = 1U << 4U;
inline constexpr std::uint8_t FRAME_SESSION = 8;
inline constexpr std::size_t SESSION_BODY_SIZE = 33;
inline constexpr std::uint8_t SESSION_RESUME = 1;   // client: resume it; server: resumed
inline constexpr std::uint8_t SESSION_UNKNOWN = 2;  // server: no such session (any more)
inline constexpr std::uint8_t SESSION_GO = 4;       // client, after a resume: send again
// Client: its application closed the session while it was interrupted (a connection made
// only to say so; the server closes the session and answers with END); server: ended.
inline constexpr std::uint8_t SESSION_END = 8;
// A SESSION body. The UCX control channel's (3.5) carries one more field after the flags, the
// sender's receive token for the session's messages from then on (8 bytes; 0 outside a
// resume): each transport connection of a session has its own.
using SessionId = std::array<std::uint8_t, 16>;
struct SessionFrame {
  SessionId id{};
  std::uint64_t count{};       // the peer's messages the sender handed to its application
  std::uint64_t give_up_ms{};  // the client's give_up (a new session), else 0
  std::uint8_t flags{};
  std::uint64_t token{};  // only with_token
};
inline constexpr std::size_t SESSION_TOKEN_BODY_SIZE = SESSION_BODY_SIZE + 8;
[[nodiscard]] constexpr std::size_t session_body_size(bool with_token) noexcept {
  return with_token ? SESSION_TOKEN_BODY_SIZE : SESSION_BODY_SIZE;
}
// Writes session_body_size(with_token) bytes at `out`.
void encode_session_body(const SessionFrame& frame, bool with_token, std::uint8_t* out) noexcept;
// nullopt for a body of another size (flags are the caller's to judge).
[[nodiscard]] std::optional<SessionFrame> decode_session_body(std::span<const std::uint8_t> body,
                                                              bool with_token) noexcept;
// Lengths travel as 32-bit numbers.
inline constexpr std::size_t WIRE_MAX_MESSAGE_SIZE = 0xFFFF'FFFFU;

// What a decoder accepts: the major version that names the protocol, and its frame types.
struct FrameProtocol {
  std::string_view name;
  std::uint16_t major{};
  std::uint16_t minor{};
  std::uint32_t frame_types{};  // bit t set: frame type t is accepted (t < 32)
};
// 1.1: the refusal greeting; 1.2: HEARTBEAT frames, sent only to a peer whose greeting says
// 1.2 or later (an older peer rejects the frame type); 1.3: admission (the greeting flags
// KEYED and VERDICT, the frames CHALLENGE, PROOF and REFUSAL); 1.4: the GOODBYE frame, sent
// only to a peer whose greeting says 1.4 or later; 1.5: delivery acknowledgement (the
// greeting flag ACKNOWLEDGE, the ACK frame); 1.6: sessions (the greeting flag SESSION, the
// SESSION frame).
inline constexpr FrameProtocol ASYNCMSG_PROTOCOL{
    "asyncmsg", ASYNCMSG_MAJOR, 6,
    (1U << FRAME_DATA) | (1U << FRAME_HEARTBEAT) | (1U << FRAME_CHALLENGE) | (1U << FRAME_PROOF) |
        (1U << FRAME_REFUSAL) | (1U << FRAME_GOODBYE) | (1U << FRAME_ACK) | (1U << FRAME_SESSION)};
inline constexpr std::uint16_t ASYNCMSG_HEARTBEAT_MINOR = 2;
inline constexpr std::uint16_t ASYNCMSG_ADMISSION_MINOR = 3;
inline constexpr std::uint16_t ASYNCMSG_GOODBYE_MINOR = 4;
inline constexpr std::uint16_t ASYNCMSG_ACK_MINOR = 5;
inline constexpr std::uint16_t ASYNCMSG_SESSION_MINOR = 6;

// The default major is asyncmsg's, whose greeting this layout was first.
struct Greeting {
  std::uint16_t major{ASYNCMSG_MAJOR};
  std::uint16_t minor{0};
  std::uint32_t max_message_size{};
  std::uint32_t flags{};
};

[[nodiscard]] std::array<std::uint8_t, GREETING_SIZE> encode_greeting(const Greeting& greeting);
// The greeting a server sends instead of its own when it refuses a connection because one
// from the same source address and port exists; it closes the connection after it.
[[nodiscard]] std::array<std::uint8_t, GREETING_SIZE> encode_refusal_greeting(
    const FrameProtocol& protocol);

inline void encode_frame_header(std::uint8_t* out, std::uint32_t length,
                                std::uint8_t type = FRAME_DATA) noexcept {
  store_le32(out, length);
  out[4] = type;
  out[5] = 0;
  out[6] = 0;
  out[7] = 0;
}

// A whole frame: header and body (set-up frames; the data path writes headers in place).
[[nodiscard]] std::vector<std::uint8_t> encode_frame(std::uint8_t type,
                                                     std::span<const std::uint8_t> body);

// Bodies of large messages kept for the next one, shared by the decoders of one backend: a
// stream of 1 MiB messages then never goes back to malloc, which handed each body to the
// kernel and back (a brk or mmap pair per message, a third of the rate in a program with the
// default allocator). At most `max_blocks` blocks and `max_bytes` bytes are kept, the oldest
// given up first; what a decoder holds for a message being assembled is its own. Thread-safe
// (a connection, and with it its decoder, may be destroyed on any thread).
class BodyCache {
 public:
  BodyCache(std::size_t max_blocks, std::size_t max_bytes);
  // A block of at least `size` bytes (a kept one of up to twice that, else a new one); its
  // real size in `capacity`.
  [[nodiscard]] std::unique_ptr<std::uint8_t[]> take(std::size_t size, std::size_t& capacity);
  // Keeps `block` of `capacity` bytes for a later take().
  void give(std::unique_ptr<std::uint8_t[]> block, std::size_t capacity) noexcept;
  [[nodiscard]] std::size_t cached_bytes() const;
  [[nodiscard]] std::size_t cached_blocks() const;

 private:
  struct Block {
    std::unique_ptr<std::uint8_t[]> data;
    std::size_t capacity;
  };
  mutable std::mutex m_mutex;
  std::vector<Block> m_free;  // oldest first
  std::size_t m_bytes{0};
  const std::size_t m_max_blocks;
  const std::size_t m_max_bytes;
};

class FrameDecoder {
 public:
  // PAUSED: a message body must be admitted (see feed) and was not; the decoder keeps the
  // rest of the input and waits for resume().
  enum class Status { OK, STOPPED, ERROR, PAUSED };

  explicit FrameDecoder(std::size_t max_message_size,
                        const FrameProtocol& protocol = ASYNCMSG_PROTOCOL) noexcept
      : m_protocol{protocol},
        m_max_message_size{max_message_size < WIRE_MAX_MESSAGE_SIZE ? max_message_size
                                                                    : WIRE_MAX_MESSAGE_SIZE} {}

  // Consumes all of `bytes` (unless a callback stops it or the input is malformed).
  // on_greeting(const Greeting&) -> bool and on_message(std::span<const std::uint8_t>) ->
  // bool are called for each complete item; returning false stops decoding (the rest of
  // the input is dropped: the connection is going away). Messages lying wholly inside
  // `bytes` are handed out in place, without a copy.
  template <typename OnGreeting, typename OnMessage>
  Status feed(std::span<const std::uint8_t> bytes, OnGreeting&& on_greeting,
              OnMessage&& on_message) {
    return feed(bytes, on_greeting, on_message, [](std::size_t) { return true; });
  }
  // As above; admit(std::size_t length) -> bool is asked before the decoder starts holding
  // a message body that is not wholly inside `bytes` (memory it will hold until the message
  // is complete). On false the decoder copies the rest of `bytes` (at most one read) and
  // returns PAUSED; resume() asks again and goes on with the kept bytes.
  template <typename OnGreeting, typename OnMessage, typename Admit>
  Status feed(std::span<const std::uint8_t> bytes, OnGreeting&& on_greeting, OnMessage&& on_message,
              Admit&& admit);
  template <typename OnGreeting, typename OnMessage, typename Admit>
  Status resume(OnGreeting&& on_greeting, OnMessage&& on_message, Admit&& admit);
  [[nodiscard]] bool paused() const noexcept { return m_stage == Stage::WAIT; }
  // Back to the start of a stream (the connection was made again): a greeting comes next.
  void reset() noexcept;
  // The start of a stream whose greeting another decoder read (a resumed session's new
  // connection): a frame header comes next.
  void reset_to_frames() noexcept;
  // A message body is being assembled (the memory admitted for it is in use).
  [[nodiscard]] bool in_body() const noexcept { return m_stage == Stage::BODY; }
  // Bytes of that body still to come (0 outside a body).
  [[nodiscard]] std::size_t body_remaining() const noexcept {
    return m_stage == Stage::BODY ? m_body_len - m_body_have : 0;
  }

  // While a large message is being assembled, the space the next read may fill directly
  // (never past the end of that message); empty otherwise. Follow a read into it with
  // commit_direct().
  [[nodiscard]] std::span<std::uint8_t> direct_target();
  template <typename OnMessage>
  Status commit_direct(std::size_t n, OnMessage&& on_message);

  [[nodiscard]] const std::string& error() const noexcept { return m_error; }
  // The ERROR was a refusal greeting: the peer has a connection from this side's source
  // address and port already (a new source port may succeed).
  [[nodiscard]] bool refused_address_in_use() const noexcept { return m_refused_address_in_use; }
  // The error is a netio3 greeting this side cannot accept (another protocol version or
  // backend, a refusal): the peer is netio3 and said no, rather than sent garbage.
  [[nodiscard]] bool greeting_rejected() const noexcept { return m_greeting_rejected; }
  // The type of the frame whose message on_message is being given (valid during the call).
  [[nodiscard]] std::uint8_t frame_type() const noexcept { return m_type; }
  [[nodiscard]] bool greeted() const noexcept { return m_stage != Stage::GREETING; }
  // True while a greeting, frame header or message has been started but not completed.
  // True between frames: the next byte is the first of a frame header.
  [[nodiscard]] bool at_frame_start() const noexcept {
    return m_stage == Stage::HEADER && m_small_have == 0;
  }
  [[nodiscard]] bool mid_item() const noexcept {
    return m_small_have > 0 || m_stage == Stage::BODY || m_stage == Stage::WAIT;
  }
  // Bytes held for an incomplete message (for memory accounting and tests).
  [[nodiscard]] std::size_t buffered_capacity() const noexcept { return m_body_cap; }
  [[nodiscard]] std::size_t max_message_size() const noexcept { return m_max_message_size; }
  // Changes the largest message accepted from the next frame header on (admission bounds the
  // frames of a connection's set-up far below the configured size).
  void set_max_message_size(std::size_t max_message_size) noexcept {
    m_max_message_size =
        max_message_size < WIRE_MAX_MESSAGE_SIZE ? max_message_size : WIRE_MAX_MESSAGE_SIZE;
  }

  // Minimum remaining size of a message for direct reads to be worth it.
  static constexpr std::size_t DIRECT_MIN = std::size_t{64} << 10U;
  // Bodies larger than this are not kept by the decoder between messages (an idle connection
  // holds no receive memory): they go back to the cache, if there is one, or are freed.
  static constexpr std::size_t KEEP_BODY_CAP = std::size_t{64} << 10U;

  // Large bodies come from `cache` and go back to it (without one: malloc and free).
  void set_body_cache(std::shared_ptr<BodyCache> cache) noexcept { m_cache = std::move(cache); }

 private:
  enum class Stage { GREETING, HEADER, BODY, WAIT };

  // Validates a complete greeting / frame header; false sets m_error.
  bool parse_greeting(const std::uint8_t* p, Greeting& out);
  bool parse_header(const std::uint8_t* p, std::size_t& length);  // sets m_type
  void grow_body(std::size_t wanted);
  void release_body() noexcept;

  const FrameProtocol m_protocol;
  std::size_t m_max_message_size;
  Stage m_stage{Stage::GREETING};
  std::uint8_t m_type{0};
  // Incomplete greeting or frame header.
  std::array<std::uint8_t, GREETING_SIZE> m_small{};
  std::size_t m_small_have{0};
  // Incomplete message body: m_body_cap bytes of it may be filled (never past the message's
  // end), of a block of m_block_cap bytes (from the cache, possibly larger).
  std::shared_ptr<BodyCache> m_cache;
  std::unique_ptr<std::uint8_t[]> m_body;
  std::size_t m_body_cap{0};
  std::size_t m_block_cap{0};
  std::size_t m_body_have{0};
  std::size_t m_body_len{0};
  std::vector<std::uint8_t> m_pending;  // WAIT: input after the header, kept for resume()
  std::string m_error;
  bool m_refused_address_in_use{false};
  bool m_greeting_rejected{false};
};

template <typename OnGreeting, typename OnMessage, typename Admit>
FrameDecoder::Status FrameDecoder::feed(std::span<const std::uint8_t> bytes,
                                        OnGreeting&& on_greeting, OnMessage&& on_message,
                                        Admit&& admit) {
  const std::uint8_t* p = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    switch (m_stage) {
      case Stage::GREETING: {
        const std::size_t take = std::min(left, GREETING_SIZE - m_small_have);
        std::memcpy(m_small.data() + m_small_have, p, take);
        m_small_have += take;
        p += take;
        left -= take;
        if (m_small_have < GREETING_SIZE) return Status::OK;
        m_small_have = 0;
        Greeting greeting;
        if (!parse_greeting(m_small.data(), greeting)) return Status::ERROR;
        m_stage = Stage::HEADER;
        if (!on_greeting(greeting)) return Status::STOPPED;
        break;
      }
      case Stage::HEADER: {
        std::size_t length = 0;
        if (m_small_have == 0 && left >= FRAME_HEADER_SIZE) {
          // Fast path: the header and perhaps the whole message are in `bytes`.
          if (!parse_header(p, length)) return Status::ERROR;
          p += FRAME_HEADER_SIZE;
          left -= FRAME_HEADER_SIZE;
          if (left >= length) {
            const std::span<const std::uint8_t> message{p, length};
            p += length;
            left -= length;
            if (!on_message(message)) return Status::STOPPED;
            break;
          }
        } else {
          const std::size_t take = std::min(left, FRAME_HEADER_SIZE - m_small_have);
          std::memcpy(m_small.data() + m_small_have, p, take);
          m_small_have += take;
          p += take;
          left -= take;
          if (m_small_have < FRAME_HEADER_SIZE) return Status::OK;
          m_small_have = 0;
          if (!parse_header(m_small.data(), length)) return Status::ERROR;
          if (length == 0) {
            if (!on_message(std::span<const std::uint8_t>{})) return Status::STOPPED;
            break;
          }
        }
        m_body_len = length;
        m_body_have = 0;
        if (!admit(length)) {
          m_stage = Stage::WAIT;
          m_pending.assign(p, p + left);
          return Status::PAUSED;
        }
        m_stage = Stage::BODY;
        break;
      }
      case Stage::WAIT:
        return Status::PAUSED;  // resume() first
      case Stage::BODY: {
        const std::size_t take = std::min(left, m_body_len - m_body_have);
        grow_body(m_body_have + take);
        std::memcpy(m_body.get() + m_body_have, p, take);
        m_body_have += take;
        p += take;
        left -= take;
        if (m_body_have < m_body_len) return Status::OK;
        m_stage = Stage::HEADER;
        const bool go_on = on_message(std::span<const std::uint8_t>{m_body.get(), m_body_len});
        release_body();
        if (!go_on) return Status::STOPPED;
        break;
      }
    }
  }
  return Status::OK;
}

template <typename OnGreeting, typename OnMessage, typename Admit>
FrameDecoder::Status FrameDecoder::resume(OnGreeting&& on_greeting, OnMessage&& on_message,
                                          Admit&& admit) {
  if (m_stage != Stage::WAIT) return Status::OK;
  if (!admit(m_body_len)) return Status::PAUSED;
  m_stage = Stage::BODY;
  const std::vector<std::uint8_t> pending = std::exchange(m_pending, {});
  return feed(pending, on_greeting, on_message, admit);
}

template <typename OnMessage>
FrameDecoder::Status FrameDecoder::commit_direct(std::size_t n, OnMessage&& on_message) {
  m_body_have += n;
  if (m_body_have < m_body_len) return Status::OK;
  m_stage = Stage::HEADER;
  const bool go_on = on_message(std::span<const std::uint8_t>{m_body.get(), m_body_len});
  release_body();
  return go_on ? Status::OK : Status::STOPPED;
}

}  // namespace netio3::detail
