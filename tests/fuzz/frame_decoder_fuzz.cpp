// libFuzzer target for netio3::asyncmsg::FrameDecoder (src/backends/asyncmsg/wire.hpp).
//
// Input layout (docs/asyncmsg.md, "Fuzzing"):
//
//   byte 0  bits 0-2  receive limit (max_message_size) class, see limit_for()
//           bit  3    0: the rest of the input is the byte stream as is
//                     1: the rest is a little program that builds the stream (build_stream()),
//                        so that messages of megabytes come from a few input bytes
//           bit  4    also decode with direct reads (direct_target()/commit_direct())
//           bits 5-7  chunking style, see Chunker
//   byte 1            seed for the chunk sizes
//   bytes 2-3         parameter of the limit class (little endian)
//   byte 4            < 0x80: callbacks always go on; else the callback with index
//                     (byte & 0x7f) returns false (0 = the greeting)
//   bytes 5..         stream (or stream program)
//
// The stream is decoded three times: in one piece, in chunks, and (bit 4) in chunks with
// direct reads wherever the decoder offers them, as the backend does. Every run is checked
// against a straightforward reference parser of the whole stream, and every item handed out
// is re-encoded with encode_greeting()/encode_frame_header() and compared with the stream
// bytes it came from. Any violation aborts with a message on stderr.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backends/asyncmsg/wire.hpp"

namespace {

using netio3::asyncmsg::encode_frame_header;
using netio3::asyncmsg::encode_greeting;
using netio3::asyncmsg::FRAME_DATA;
using netio3::asyncmsg::FRAME_HEADER_SIZE;
using netio3::asyncmsg::FrameDecoder;
using netio3::asyncmsg::Greeting;
using netio3::asyncmsg::GREETING_SIZE;
using netio3::asyncmsg::MAGIC;
using netio3::asyncmsg::VERSION_MAJOR;
using netio3::asyncmsg::WIRE_MAX_MESSAGE_SIZE;
using Status = FrameDecoder::Status;

// Memory promises of the decoder (wire.hpp, wire.cpp and the "Memory and limits" table of
// docs/asyncmsg.md). The values mirror the private constants of wire.cpp.
// A buffer of at most this size may be kept between messages.
constexpr std::size_t kKeepBodyCap = 64 * 1024;
// A partial message may be rounded up to this size however little of it arrived.
constexpr std::size_t kMinBodyCap = 4096;
// A direct read may extend a partial message by this much beyond what arrived.
constexpr std::size_t kDirectStep = std::size_t{1} << 20U;

constexpr std::size_t kConfigSize = 5;
// Largest stream a stream program may build.
constexpr std::size_t kMaxStream = std::size_t{2} << 20U;
// Streams are cut into at most about this many chunks (keeps big streams fast).
constexpr std::size_t kMaxChunks = 8192;

[[noreturn]] void fail(const char* what, std::size_t a = 0, std::size_t b = 0) {
  std::fprintf(stderr, "frame_decoder_fuzz: invariant violated: %s (%zu, %zu)\n", what, a, b);
  std::fflush(stderr);
  __builtin_trap();
}

#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) fail(#cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (false)

std::uint32_t le16(const std::uint8_t* p) {
  return p[0] | (std::uint32_t{p[1]} << 8U);
}
std::uint32_t le32(const std::uint8_t* p) {
  return le16(p) | (le16(p + 2) << 16U);
}

std::size_t limit_for(std::uint8_t mode, std::uint32_t param) {
  switch (mode & 7U) {
    case 0:
      return param & 0xFFU;  // tiny, including 0
    case 1:
      return param;  // up to 64 KiB - 1
    case 2:
      return FrameDecoder::DIRECT_MIN + param;  // around the direct-read minimum
    case 3:
      return std::size_t{1} << 20U;  // 1 MiB
    case 4:
      return std::size_t{64} << 20U;  // the backend's default
    case 5:
      return WIRE_MAX_MESSAGE_SIZE;  // the largest a frame can declare
    case 6:
      return std::numeric_limits<std::size_t>::max();  // clamped by the decoder
    default:
      return std::size_t{param} << 8U;  // up to 16 MiB
  }
}

// Reads the input of a stream program; past its end it yields zeros.
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> in) : m_in{in} {}
  [[nodiscard]] bool done() const { return m_pos >= m_in.size(); }
  std::uint8_t byte() { return done() ? 0 : m_in[m_pos++]; }
  std::uint32_t u16() { return byte() | (std::uint32_t{byte()} << 8U); }
  std::uint32_t u32() { return u16() | (u16() << 16U); }
  std::span<const std::uint8_t> take(std::size_t n) {
    n = std::min(n, m_in.size() - std::min(m_pos, m_in.size()));
    const auto out = m_in.subspan(m_pos, n);
    m_pos += n;
    return out;
  }

 private:
  std::span<const std::uint8_t> m_in;
  std::size_t m_pos{0};
};

// Where a stream program writes: counts only (out == nullptr), or writes into a buffer of
// the counted size. Never more than kMaxStream bytes.
class Sink {
 public:
  explicit Sink(std::uint8_t* out) : m_out{out} {}
  [[nodiscard]] std::size_t size() const { return m_size; }
  [[nodiscard]] bool full() const { return m_size == kMaxStream; }

  void bytes(const std::uint8_t* p, std::size_t n) {
    n = std::min(n, kMaxStream - m_size);
    if (m_out != nullptr) std::memcpy(m_out + m_size, p, n);
    m_size += n;
  }
  void bytes(std::span<const std::uint8_t> b) { bytes(b.data(), b.size()); }
  void le32(std::uint32_t v) {
    const std::uint8_t b[4] = {static_cast<std::uint8_t>(v), static_cast<std::uint8_t>(v >> 8U),
                               static_cast<std::uint8_t>(v >> 16U),
                               static_cast<std::uint8_t>(v >> 24U)};
    bytes(b, sizeof b);
  }
  // Written by hand (not with encode_*) so that the re-encoding check stays independent.
  void header(std::uint32_t length) {
    le32(length);
    const std::uint8_t rest[4] = {FRAME_DATA, 0, 0, 0};
    bytes(rest, sizeof rest);
  }
  // n bytes of a pattern that differs from message to message.
  void filler(std::size_t n) {
    static const auto pattern = [] {
      std::array<std::uint8_t, 512> p{};
      for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<std::uint8_t>(i * 131U);
      return p;
    }();
    std::size_t phase = m_size % 256;
    while (n > 0 && !full()) {
      const std::size_t piece = std::min<std::size_t>(n, 256);
      bytes(pattern.data() + phase, piece);
      n -= piece;
      phase = (phase + 7) % 256;
    }
  }

 private:
  std::uint8_t* m_out;
  std::size_t m_size{0};
};

// Stream program: each op byte's low 3 bits select what to append, the high 5 bits are a
// parameter (p).
void run_program(std::span<const std::uint8_t> program, Sink& out) {
  Reader in{program};
  while (!in.done() && !out.full()) {
    const std::uint8_t op = in.byte();
    const unsigned p = op >> 3U;
    switch (op & 7U) {
      case 0:  // p + 1 raw bytes
        out.bytes(in.take(p + 1));
        break;
      case 1: {  // valid greeting, minor version p, limit from 4 bytes
        const std::uint8_t version[4] = {VERSION_MAJOR & 0xFFU, VERSION_MAJOR >> 8U,
                                         static_cast<std::uint8_t>(p), 0};
        out.bytes(MAGIC);
        out.bytes(version, sizeof version);
        out.le32(in.u32());
        out.le32(0);
        break;
      }
      case 2:  // frame header, length from 4 bytes
        out.header(in.u32());
        break;
      case 3:  // frame header, length u16 << (p % 16): up to 2 GiB
        out.header(in.u16() << (p & 15U));
        break;
      case 4:  // filler, (u16 + 1) << (p % 8) bytes
        out.filler(std::size_t{in.u16() + 1} << (p & 7U));
        break;
      case 5: {  // whole frame, length u16 << (p % 8): up to 8 MiB (cut at kMaxStream)
        const std::uint32_t length = in.u16() << (p & 7U);
        out.header(length);
        out.filler(length);
        break;
      }
      case 6:  // p + 1 zero-length frames
        for (unsigned i = 0; i <= p; ++i) out.header(0);
        break;
      default:  // up to 255 raw bytes
        out.bytes(in.take(in.byte()));
        break;
    }
  }
}

// The stream a program builds, in a buffer of exactly its size (so ASan sees reads past it).
struct Built {
  std::unique_ptr<std::uint8_t[]> data;
  std::size_t size{0};
};

Built build_stream(std::span<const std::uint8_t> program) {
  Sink count{nullptr};
  run_program(program, count);
  Built built{std::make_unique_for_overwrite<std::uint8_t[]>(count.size()), count.size()};
  Sink write{built.data.get()};
  run_program(program, write);
  return built;
}

// ---- Reference parser: what any correct decoder must report for the whole stream. ----

struct Item {
  bool greeting{false};
  std::size_t begin{0};       // first byte of the greeting / frame header
  std::size_t body_begin{0};  // first byte of the message (frames)
  std::size_t end{0};         // one past the last byte
  Greeting fields{};          // greetings
};

struct Expected {
  std::vector<Item> items;  // delivered, in order (up to and including a stopping one)
  Item partial{};           // a frame whose header arrived but whose message did not
  bool has_partial{false};
  Status status{Status::OK};
  std::size_t end{0};  // where decoding ends: the stream's end, or the bad / stopping item's
  bool mid_item{false};
  bool greeted{false};
};

Expected reference(std::span<const std::uint8_t> s, std::size_t limit, std::size_t stop_at) {
  Expected e;
  const auto finish_ok = [&](bool mid) {
    e.status = Status::OK;
    e.end = s.size();
    e.mid_item = mid;
    return e;
  };
  if (s.size() < GREETING_SIZE) return finish_ok(!s.empty());
  const std::uint8_t* g = s.data();
  if (!std::equal(MAGIC.begin(), MAGIC.end(), g) || le16(g + 4) != VERSION_MAJOR ||
      le32(g + 8) == 0) {
    e.status = Status::ERROR;
    e.end = GREETING_SIZE;
    return e;
  }
  Item greeting{.greeting = true, .begin = 0, .body_begin = 0, .end = GREETING_SIZE};
  greeting.fields = Greeting{.major = static_cast<std::uint16_t>(le16(g + 4)),
                             .minor = static_cast<std::uint16_t>(le16(g + 6)),
                             .max_message_size = le32(g + 8),
                             .flags = le32(g + 12)};
  e.items.push_back(greeting);
  e.greeted = true;
  if (stop_at == 0) {
    e.status = Status::STOPPED;
    e.end = GREETING_SIZE;
    return e;
  }
  std::size_t pos = GREETING_SIZE;
  while (true) {
    if (pos == s.size()) return finish_ok(false);
    if (s.size() - pos < FRAME_HEADER_SIZE) return finish_ok(true);
    const std::uint8_t* h = s.data() + pos;
    const std::size_t length = le32(h);
    // The frame types of the protocol (asyncmsg 1.6: DATA, HEARTBEAT, the admission frames
    // CHALLENGE, PROOF and REFUSAL, GOODBYE, ACK and SESSION) - the decoder takes them all;
    // which ones a connection accepts when is the backend's business (docs/asyncmsg.md). Read
    // from the protocol's table, so that a new frame type does not make this model stale.
    const bool known_type =
        h[4] < 32 && ((netio3::detail::ASYNCMSG_PROTOCOL.frame_types >> h[4]) & 1U) != 0;
    if (!known_type || h[5] != 0 || h[6] != 0 || h[7] != 0 || length > limit) {
      e.status = Status::ERROR;
      e.end = pos + FRAME_HEADER_SIZE;
      return e;
    }
    const Item frame{.begin = pos,
                     .body_begin = pos + FRAME_HEADER_SIZE,
                     .end = pos + FRAME_HEADER_SIZE + length};
    if (frame.end > s.size()) {
      e.partial = frame;
      e.has_partial = true;
      return finish_ok(true);
    }
    e.items.push_back(frame);
    if (e.items.size() - 1 == stop_at) {
      e.status = Status::STOPPED;
      e.end = frame.end;
      return e;
    }
    pos = frame.end;
  }
}

// ---- Chunk sizes. ----

class Chunker {
 public:
  Chunker(std::uint8_t style, std::uint64_t seed, std::size_t stream_size)
      : m_style{style}, m_state{seed}, m_min{std::max<std::size_t>(1, stream_size / kMaxChunks)} {}

  std::uint64_t next() {  // splitmix64
    std::uint64_t z = (m_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30U)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27U)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31U);
  }

  std::size_t size() {
    static constexpr std::size_t kAroundHeaders[] = {1, 7, 8, 9, 15, 16, 17, 24};
    const std::uint64_t r = next();
    std::size_t n = 0;
    switch (m_style) {
      case 0:
        n = 1;
        break;
      case 1:
        n = 1 + r % 8;
        break;
      case 2:
        n = 1 + r % 64;
        break;
      case 3:
        n = 1 + r % 4096;
        break;
      case 4:
        n = 1 + r % (std::size_t{1} << 20U);
        break;
      case 5:
        n = kAroundHeaders[r % 8];
        break;
      case 6:
        n = 1 + (r >> 8U) % (std::size_t{1} << (r % 22));
        break;  // log-uniform
      default:
        n = std::numeric_limits<std::size_t>::max();
        break;  // everything left
    }
    return std::max(n, m_min);
  }

 private:
  std::uint8_t m_style;
  std::uint64_t m_state;
  std::size_t m_min;
};

// ---- One decoding run. ----

struct Config {
  std::size_t limit{0};      // as given to the decoder
  std::size_t effective{0};  // what the decoder must enforce
  std::uint8_t chunk_style{0};
  std::uint64_t chunk_seed{0};
  std::size_t stop_at{std::numeric_limits<std::size_t>::max()};
};

enum class Mode { ONE_PIECE, CHUNKS, DIRECT };

struct Outcome {
  Status status{Status::OK};
  std::string error;
};

class Run {
 public:
  Run(std::span<const std::uint8_t> stream, const Expected& expected, const Config& config)
      : m_stream{stream}, m_expected{expected}, m_config{config}, m_decoder{config.limit} {}

 private:
  // The decoder's callbacks.
  auto greeting_cb() {
    return [this](const Greeting& g) { return on_greeting(g); };
  }
  auto message_cb() {
    return [this](std::span<const std::uint8_t> message) { return on_message(message); };
  }

 public:
  Outcome go(Mode mode) {
    CHECK(m_decoder.max_message_size() == m_config.effective, m_decoder.max_message_size());
    CHECK(!m_decoder.mid_item() && !m_decoder.greeted() && m_decoder.buffered_capacity() == 0);
    Chunker chunker{m_config.chunk_style, m_config.chunk_seed, m_stream.size()};
    Status status = Status::OK;
    while (m_pos < m_stream.size() && status == Status::OK) {
      const std::size_t left = m_stream.size() - m_pos;
      if (mode == Mode::ONE_PIECE) {  // the whole stream, in place
        status = feed(left, m_stream.data());
        continue;
      }
      const std::size_t n = std::min(chunker.size(), left);
      if (chunker.next() % 16 == 0) {  // an empty read changes nothing
        CHECK(m_decoder.feed({}, greeting_cb(), message_cb()) == Status::OK);
        check_between_items();
      }
      if (mode == Mode::DIRECT) {
        const std::span<std::uint8_t> target = m_decoder.direct_target();
        const Item* body = body_at(m_pos);
        const bool expect_target = body != nullptr && body->end - m_pos >= FrameDecoder::DIRECT_MIN;
        CHECK(target.empty() != expect_target, m_pos, target.size());
        if (!target.empty()) {
          // Never past the end of the message, and memory follows the bytes that arrived.
          CHECK(target.size() <= body->end - m_pos, target.size(), body->end - m_pos);
          const std::size_t arrived = m_pos - body->body_begin;
          m_direct_wanted = std::max(m_direct_wanted, arrived + std::max(kDirectStep, arrived));
          check_capacity();
          status = commit(std::min(n, target.size()), target);
          continue;
        }
      }
      status = feed(n);
    }
    if (status == Status::OK) CHECK(m_pos == m_stream.size());
    CHECK(status == m_expected.status, static_cast<std::size_t>(status), m_pos);
    CHECK(m_pos >= m_expected.end, m_pos, m_expected.end);
    CHECK(m_callbacks == m_expected.items.size(), m_callbacks, m_expected.items.size());
    CHECK(m_reencoded == (m_expected.items.empty() ? 0 : m_expected.items.back().end));
    switch (status) {
      case Status::OK:
        CHECK(m_decoder.error().empty());
        CHECK(m_decoder.mid_item() == m_expected.mid_item);
        CHECK(m_decoder.greeted() == m_expected.greeted);
        check_rest_incomplete();
        break;
      case Status::STOPPED:
        CHECK(m_stopped);
        CHECK(m_decoder.error().empty());
        CHECK(!m_decoder.mid_item());  // the stopping item was complete
        CHECK(m_decoder.greeted());
        break;
      case Status::ERROR:
        CHECK(!m_decoder.error().empty());
        CHECK(m_decoder.greeted() == m_expected.greeted);
        break;
      case Status::PAUSED:  // only when a body is not admitted; the fuzzer admits every one
        CHECK(status != Status::PAUSED);
        break;
    }
    return Outcome{status, m_decoder.error()};
  }

 private:
  // Hands the next n bytes to feed(): at `where`, or else in a buffer of their own, so that
  // ASan sees any read outside them and any pointer kept into them.
  Status feed(std::size_t n, const std::uint8_t* where = nullptr) {
    std::unique_ptr<std::uint8_t[]> copy;
    if (where == nullptr) {
      copy = std::make_unique_for_overwrite<std::uint8_t[]>(n);
      std::memcpy(copy.get(), m_stream.data() + m_pos, n);
      where = copy.get();
    }
    m_chunk = where;
    m_chunk_begin = m_pos;
    m_chunk_end = m_pos + n;
    const Status status =
        m_decoder.feed(std::span<const std::uint8_t>{where, n}, greeting_cb(), message_cb());
    m_chunk = nullptr;
    return after(status, n);
  }

  Status commit(std::size_t n, std::span<std::uint8_t> target) {
    std::memcpy(target.data(), m_stream.data() + m_pos, n);
    m_chunk = nullptr;  // the message is the decoder's buffer, there is no read to point into
    return after(m_decoder.commit_direct(n, message_cb()), n);
  }

  Status after(Status status, std::size_t n) {
    const std::size_t before = m_pos;
    m_pos += n;
    switch (status) {
      case Status::OK:
        CHECK(m_expected.status == Status::OK || m_pos < m_expected.end, m_pos);
        CHECK(m_decoder.error().empty());
        check_between_items();
        break;
      case Status::STOPPED:
        CHECK(m_stopped);
        [[fallthrough]];
      case Status::ERROR:
        // The offending item ends inside this read.
        CHECK(before < m_expected.end && m_expected.end <= m_pos, before, m_expected.end);
        break;
      case Status::PAUSED:  // only when a body is not admitted; the fuzzer admits every one
        CHECK(status != Status::PAUSED);
        break;
    }
    return status;
  }

  // Checks after a read that was consumed completely.
  void check_between_items() {
    CHECK(m_decoder.mid_item() == mid_item_at(m_pos), m_pos);
    check_capacity();
  }

  void check_capacity() {
    const std::size_t cap = m_decoder.buffered_capacity();
    CHECK(cap <= m_config.effective, cap, m_config.effective);
    if (cap <= kKeepBodyCap) return;  // may be kept from an earlier message
    // Otherwise it was grown for the message in progress: never beyond its (checked)
    // length, and only as its bytes arrive: a growth to hold `wanted` bytes allocates at most
    // max(2 * wanted, kMinBodyCap), where `wanted` is what arrived or, for a direct read, what
    // arrived plus the larger of kDirectStep and what arrived.
    const Item* body = body_at(m_pos);
    CHECK(body != nullptr, cap, m_pos);
    CHECK(cap <= body->end - body->body_begin, cap, body->end - body->body_begin);
    const std::size_t arrived = m_pos - body->body_begin;
    const std::size_t allowed = std::max({kMinBodyCap, 2 * arrived, 2 * m_direct_wanted});
    CHECK(cap <= allowed, cap, allowed);
  }

  // The message whose header arrived and whose last byte is beyond pos, if any.
  const Item* body_at(std::size_t pos) {
    const auto& items = m_expected.items;
    while (m_body_cursor < items.size() &&
           (items[m_body_cursor].greeting || items[m_body_cursor].end <= pos)) {
      ++m_body_cursor;
      m_direct_wanted = 0;
    }
    const Item* item = m_body_cursor < items.size() ? &items[m_body_cursor]
                       : m_expected.has_partial     ? &m_expected.partial
                                                    : nullptr;
    if (item == nullptr || pos < item->body_begin || pos >= item->end) return nullptr;
    return item;
  }

  // Whether pos lies inside an item (the decoder holds part of it).
  [[nodiscard]] bool mid_item_at(std::size_t pos) const {
    if (pos == 0) return false;
    // Item ends increase strictly.
    return !std::ranges::binary_search(m_expected.items, pos, {}, &Item::end);
  }

  // With status OK, what follows the last item is an incomplete greeting, header or message.
  void check_rest_incomplete() const {
    const std::size_t rest = m_stream.size() - m_reencoded;
    if (!m_decoder.greeted()) {
      CHECK(rest < GREETING_SIZE, rest);
    } else if (rest >= FRAME_HEADER_SIZE) {
      CHECK(FRAME_HEADER_SIZE + le32(m_stream.data() + m_reencoded) > rest, rest);
    }
    CHECK(m_decoder.mid_item() == (rest > 0), rest);
  }

  void stop_check(bool& go_on) {
    if (m_callbacks == m_config.stop_at) {
      go_on = false;
      m_stopped = true;
    }
    ++m_callbacks;
  }

  bool on_greeting(const Greeting& g) {
    CHECK(!m_stopped);  // nothing is handed out after a callback said stop
    CHECK(m_callbacks < m_expected.items.size() && m_expected.items[m_callbacks].greeting,
          m_callbacks);
    const Greeting& want = m_expected.items[m_callbacks].fields;
    CHECK(g.major == want.major && g.minor == want.minor &&
          g.max_message_size == want.max_message_size && g.flags == want.flags);
    CHECK(m_reencoded == 0);
    const auto bytes = encode_greeting(g);
    CHECK(m_stream.size() >= GREETING_SIZE &&
          std::memcmp(bytes.data(), m_stream.data(), GREETING_SIZE) == 0);
    m_reencoded = GREETING_SIZE;
    bool go_on = true;
    stop_check(go_on);
    return go_on;
  }

  bool on_message(std::span<const std::uint8_t> message) {
    CHECK(!m_stopped);
    CHECK(m_decoder.greeted());
    CHECK(message.size() <= m_config.effective, message.size(), m_config.effective);
    CHECK(m_callbacks < m_expected.items.size() && !m_expected.items[m_callbacks].greeting,
          m_callbacks);
    const Item& want = m_expected.items[m_callbacks];
    CHECK(message.size() == want.end - want.body_begin, message.size(), m_callbacks);
    // Re-encoded, the message gives back exactly the bytes it was decoded from.
    CHECK(want.begin == m_reencoded, want.begin, m_reencoded);
    std::uint8_t header[FRAME_HEADER_SIZE];
    encode_frame_header(header, static_cast<std::uint32_t>(message.size()), m_decoder.frame_type());
    CHECK(std::memcmp(header, m_stream.data() + m_reencoded, FRAME_HEADER_SIZE) == 0);
    CHECK(message.empty() ||
          std::memcmp(message.data(), m_stream.data() + want.body_begin, message.size()) == 0);
    m_reencoded = want.end;
    // A frame lying wholly inside one read is handed out in place.
    if (!message.empty() && m_chunk != nullptr && want.begin >= m_chunk_begin &&
        want.end <= m_chunk_end) {
      CHECK(message.data() == m_chunk + (want.body_begin - m_chunk_begin), want.begin);
    }
    bool go_on = true;
    stop_check(go_on);
    return go_on;
  }

  std::span<const std::uint8_t> m_stream;
  const Expected& m_expected;
  const Config& m_config;
  FrameDecoder m_decoder;
  std::size_t m_pos{0};  // stream bytes handed to the decoder
  const std::uint8_t* m_chunk{nullptr};
  std::size_t m_chunk_begin{0};
  std::size_t m_chunk_end{0};
  std::size_t m_callbacks{0};
  std::size_t m_reencoded{0};  // stream bytes accounted for by re-encoded items
  bool m_stopped{false};
  std::size_t m_body_cursor{0};
  std::size_t m_direct_wanted{0};  // largest room asked for by a direct read of this body
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < kConfigSize) return 0;
  const std::uint8_t mode = data[0];
  Config config;
  config.limit = limit_for(mode, le16(data + 2));
  config.effective = std::min(config.limit, WIRE_MAX_MESSAGE_SIZE);
  config.chunk_style = static_cast<std::uint8_t>(mode >> 5U);
  config.chunk_seed = data[1] | (std::uint64_t{mode} << 8U);
  if (data[4] >= 0x80) config.stop_at = data[4] & 0x7FU;
  const std::span<const std::uint8_t> rest{data + kConfigSize, size - kConfigSize};

  Built built;
  std::span<const std::uint8_t> stream = rest;
  if ((mode & 0x08U) != 0) {
    built = build_stream(rest);
    stream = {built.data.get(), built.size};
  }

  const Expected expected = reference(stream, config.effective, config.stop_at);
  const Outcome one = Run{stream, expected, config}.go(Mode::ONE_PIECE);
  const Outcome chunks = Run{stream, expected, config}.go(Mode::CHUNKS);
  CHECK(chunks.status == one.status && chunks.error == one.error);
  if ((mode & 0x10U) != 0) {
    const Outcome direct = Run{stream, expected, config}.go(Mode::DIRECT);
    CHECK(direct.status == one.status && direct.error == one.error);
  }
  return 0;
}
