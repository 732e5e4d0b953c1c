#pragma once

// netio3-perf's own small protocol, carried inside netio3 messages.
//
// Every message starts with a 16-byte header (host byte order: both ends run the same
// build on the same kind of machine; the server checks a magic value and refuses the rest):
//
//   u16 magic  u16 type  u32 token  u64 seq
//
// `token` names the client connection at the server. netio3's on_data_cb does not say
// which connection a message came from, so the server hands every accepted connection a
// token (HELLO) and the client puts it into everything it sends. A client sets up its
// connections one after the other, so the HELLO that arrives belongs to the only connection
// still without a token.
//
//   HELLO   S->C  token = the connection's token
//   OPEN    C->S  seq = n: open n more listeners (one per extra connection of the client:
//                 netio3 names an active endpoint by the address it connects to)
//   PORTS   S->C  seq = n, body = n x u16 port
//   START   C->S  body = StartBody: what follows on this connection
//   DATA    C->S  seq = per-connection sequence number, payload = Pattern::payload(seq)
//   END     C->S  seq = number of DATA messages sent on this connection
//   REPORT  S->C  seq = number of DATA messages received, body = ReportBody
//   PING    C->S  a latency probe; the server sends it back unchanged as PONG
//   PONG    S->C

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

namespace netio3::perf {

inline constexpr std::uint16_t MAGIC = 0x4e33;  // "N3"
inline constexpr std::size_t HEADER_SIZE = 16;
// The largest control message (PORTS with MAX_CONNECTIONS ports) fits in this many bytes.
inline constexpr std::size_t MAX_CONNECTIONS = 256;
inline constexpr std::size_t CONTROL_SIZE = HEADER_SIZE + 2 * MAX_CONNECTIONS;

enum class Type : std::uint16_t { HELLO = 1, OPEN, PORTS, START, DATA, END, REPORT, PING, PONG };
enum class Test : std::uint32_t { THROUGHPUT = 1, LATENCY = 2 };
// SIZE: sizes and order only (--same-buffer: every payload is the same bytes).
enum class Verify : std::uint32_t { LIGHT = 1, FULL = 2, SIZE = 3 };

struct Header {
  Type type{};
  std::uint32_t token{};
  std::uint64_t seq{};
};

struct StartBody {
  Test test{};
  std::uint32_t size{};  // every DATA/PING message has exactly this many bytes
  Verify verify{};
  std::uint32_t reserved{};
};

struct ReportBody {
  std::uint64_t bytes{};       // DATA bytes received
  std::uint64_t errors{};      // messages out of order, of the wrong size or content
  std::uint64_t cpu_ns{};      // server process CPU time (user + system) from START to END
  std::uint64_t elapsed_ns{};  // server wall time from START to END
};

inline void encode(const Header& h, std::span<std::uint8_t> out) {
  const auto type = static_cast<std::uint16_t>(h.type);
  std::memcpy(out.data(), &MAGIC, 2);
  std::memcpy(out.data() + 2, &type, 2);
  std::memcpy(out.data() + 4, &h.token, 4);
  std::memcpy(out.data() + 8, &h.seq, 8);
}

inline std::array<std::uint8_t, HEADER_SIZE> encode(const Header& h) {
  std::array<std::uint8_t, HEADER_SIZE> out{};
  encode(h, out);
  return out;
}

// nullopt: too short or not ours.
inline std::optional<Header> decode(std::span<const std::uint8_t> in) {
  if (in.size() < HEADER_SIZE) return std::nullopt;
  std::uint16_t magic = 0;
  std::uint16_t type = 0;
  Header h;
  std::memcpy(&magic, in.data(), 2);
  std::memcpy(&type, in.data() + 2, 2);
  std::memcpy(&h.token, in.data() + 4, 4);
  std::memcpy(&h.seq, in.data() + 8, 8);
  if (magic != MAGIC || type < 1 || type > static_cast<std::uint16_t>(Type::PONG)) {
    return std::nullopt;
  }
  h.type = static_cast<Type>(type);
  return h;
}

template <typename Body>
std::vector<std::uint8_t> message(const Header& h, const Body& body) {
  std::vector<std::uint8_t> out(HEADER_SIZE + sizeof(Body));
  encode(h, out);
  std::memcpy(out.data() + HEADER_SIZE, &body, sizeof(Body));
  return out;
}

template <typename Body>
std::optional<Body> body(std::span<const std::uint8_t> in) {
  if (in.size() != HEADER_SIZE + sizeof(Body)) return std::nullopt;
  Body b;
  std::memcpy(&b, in.data() + HEADER_SIZE, sizeof(Body));
  return b;
}

// The payload of DATA message `seq` is table[seq % PERIOD, seq % PERIOD + n) with
// table[k] = k % PERIOD: a payload of another sequence number (mod PERIOD), shifted,
// truncated or overwritten does not compare equal. LIGHT verification compares the first
// and the last byte (it catches shifts and mix-ups, costs nothing per byte); FULL compares
// every byte; SIZE none (sizes and order are checked by the caller).
class Pattern {
 public:
  static constexpr std::size_t PERIOD = 251;
  explicit Pattern(std::size_t payload_size)
      : m_size{payload_size}, m_table(payload_size + PERIOD) {
    for (std::size_t k = 0; k < m_table.size(); ++k) {
      m_table[k] = static_cast<std::uint8_t>(k % PERIOD);
    }
  }
  [[nodiscard]] std::size_t size() const { return m_size; }
  [[nodiscard]] std::span<const std::uint8_t> payload(std::uint64_t seq) const {
    return std::span{m_table}.subspan(seq % PERIOD, m_size);
  }
  [[nodiscard]] bool check(std::uint64_t seq, std::span<const std::uint8_t> got,
                           Verify verify) const {
    if (got.size() != m_size) return false;
    if (m_size == 0 || verify == Verify::SIZE) return true;
    const auto want = payload(seq);
    if (verify == Verify::FULL) return std::memcmp(got.data(), want.data(), m_size) == 0;
    return got.front() == want.front() && got.back() == want.back();
  }

 private:
  std::size_t m_size;
  std::vector<std::uint8_t> m_table;
};

}  // namespace netio3::perf
