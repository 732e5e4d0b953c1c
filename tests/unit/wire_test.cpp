// asyncmsg wire format: greeting encoding and FrameDecoder.

#include "backends/asyncmsg/wire.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <netio3/types.hpp>

#include "test_support.hpp"

// Records the largest array allocation (FrameDecoder allocates its body buffers with
// new[]), so that a test can prove that a length was rejected before anything was
// allocated for it. Forwarding to the scalar operators keeps allocation and deallocation
// paired for the sanitizers.
namespace {
std::atomic<std::size_t> g_largest_array_new{0};
// Array allocations of 256 KiB or more: a body buffer of a large message.
constexpr std::size_t LARGE_ARRAY = std::size_t{256} << 10U;
std::atomic<std::size_t> g_large_array_news{0};
}  // namespace

void* operator new[](std::size_t n) {
  if (n >= LARGE_ARRAY) g_large_array_news.fetch_add(1, std::memory_order_relaxed);
  std::size_t prev = g_largest_array_new.load(std::memory_order_relaxed);
  while (n > prev && !g_largest_array_new.compare_exchange_weak(prev, n)) {
  }
  return ::operator new(n);
}
void operator delete[](void* p) noexcept {
  ::operator delete(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  ::operator delete(p);
}

namespace netio3::asyncmsg {
namespace {

using Bytes = std::vector<std::uint8_t>;
using Status = FrameDecoder::Status;

void reset_largest_array_new() {
  g_largest_array_new.store(0);
}
std::size_t largest_array_new() {
  return g_largest_array_new.load();
}

Bytes greeting_bytes(const Greeting& g) {
  const auto a = encode_greeting(g);
  return {a.begin(), a.end()};
}

void append_frame(Bytes& out, std::span<const std::uint8_t> message) {
  const std::size_t at = out.size();
  out.resize(at + FRAME_HEADER_SIZE);
  encode_frame_header(out.data() + at, static_cast<std::uint32_t>(message.size()));
  out.insert(out.end(), message.begin(), message.end());
}

// A raw frame header with every field chosen by the caller.
Bytes raw_header(std::uint32_t length, std::uint8_t type, std::uint8_t r5 = 0, std::uint8_t r6 = 0,
                 std::uint8_t r7 = 0) {
  Bytes h(FRAME_HEADER_SIZE);
  store_le32(h.data(), length);
  h[4] = type;
  h[5] = r5;
  h[6] = r6;
  h[7] = r7;
  return h;
}

struct Stream {
  Bytes bytes;
  std::vector<Bytes> messages;
};

// A greeting followed by one frame per size, each carrying test::pattern(i, size).
Stream make_stream(const std::vector<std::size_t>& sizes, std::uint32_t max = 1U << 20U) {
  Stream s;
  s.bytes = greeting_bytes(Greeting{.max_message_size = max});
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    s.messages.push_back(test::pattern(i, sizes[i]));
    append_frame(s.bytes, s.messages.back());
  }
  return s;
}

struct Decoded {
  std::vector<Greeting> greetings;
  std::vector<Bytes> messages;
  Status status{Status::OK};
};

// Feeds `stream` cut at the given (sorted) offsets.
Decoded decode(FrameDecoder& decoder, std::span<const std::uint8_t> stream,
               const std::vector<std::size_t>& cuts) {
  Decoded out;
  std::size_t from = 0;
  auto feed_until = [&](std::size_t to) {
    if (out.status != Status::OK || to <= from) return;
    out.status = decoder.feed(
        stream.subspan(from, to - from),
        [&](const Greeting& g) {
          out.greetings.push_back(g);
          return true;
        },
        [&](std::span<const std::uint8_t> m) {
          out.messages.emplace_back(m.begin(), m.end());
          return true;
        });
    from = to;
  };
  for (const std::size_t cut : cuts) feed_until(cut);
  feed_until(stream.size());
  return out;
}

Decoded decode(std::span<const std::uint8_t> stream, const std::vector<std::size_t>& cuts,
               std::size_t max = std::size_t{1} << 20U) {
  FrameDecoder decoder{max};
  return decode(decoder, stream, cuts);
}

void expect_decoded(const Decoded& d, const Stream& s, const std::string& context) {
  ASSERT_EQ(d.status, Status::OK) << context;
  ASSERT_EQ(d.greetings.size(), 1U) << context;
  ASSERT_EQ(d.messages.size(), s.messages.size()) << context;
  for (std::size_t i = 0; i < s.messages.size(); ++i) {
    ASSERT_EQ(d.messages[i], s.messages[i]) << context << ", message " << i;
  }
}

auto accept_greeting = [](const Greeting&) { return true; };

// ------------------------------------------------------------------------- greeting

TEST(WireGreeting, EncodesTheDocumentedLayout) {
  const Bytes g = greeting_bytes(
      Greeting{.major = 0x0102, .minor = 0x0304, .max_message_size = 0x0A0B0C0D, .flags = 0});
  ASSERT_EQ(g.size(), GREETING_SIZE);
  EXPECT_EQ(Bytes(g.begin(), g.begin() + 4), (Bytes{'N', 'I', 'O', '3'}));
  EXPECT_EQ(Bytes(g.begin() + 4, g.end()),
            (Bytes{0x02, 0x01, 0x04, 0x03, 0x0D, 0x0C, 0x0B, 0x0A, 0, 0, 0, 0}));
}

TEST(WireGreeting, RoundTripsThroughTheDecoder) {
  const Greeting sent{.minor = 7, .max_message_size = 123456, .flags = 0};
  const Bytes bytes = greeting_bytes(sent);
  FrameDecoder decoder{1024};
  EXPECT_FALSE(decoder.greeted());
  const Decoded d = decode(decoder, bytes, {});
  ASSERT_EQ(d.status, Status::OK);
  ASSERT_EQ(d.greetings.size(), 1U);
  EXPECT_EQ(d.greetings[0].major, VERSION_MAJOR);
  EXPECT_EQ(d.greetings[0].minor, 7);
  EXPECT_EQ(d.greetings[0].max_message_size, 123456U);
  EXPECT_EQ(d.greetings[0].flags, 0U);
  EXPECT_TRUE(decoder.greeted());
  EXPECT_TRUE(d.messages.empty());
}

TEST(WireGreeting, NewerMinorVersionIsAccepted) {
  const Decoded d = decode(greeting_bytes(Greeting{.minor = 9, .max_message_size = 1}), {});
  ASSERT_EQ(d.status, Status::OK);
  ASSERT_EQ(d.greetings.size(), 1U);
  EXPECT_EQ(d.greetings[0].minor, 9);
}

TEST(WireGreeting, BadMagicIsAnError) {
  for (std::size_t bad = 0; bad < MAGIC.size(); ++bad) {
    Bytes bytes = greeting_bytes(Greeting{.max_message_size = 100});
    bytes[bad] = 'x';
    for (const auto& cuts : {std::vector<std::size_t>{}, std::vector<std::size_t>{1, 5, 9, 15}}) {
      FrameDecoder decoder{1024};
      const Decoded d = decode(decoder, bytes, cuts);
      EXPECT_EQ(d.status, Status::ERROR) << "byte " << bad;
      EXPECT_TRUE(d.greetings.empty());
      EXPECT_NE(decoder.error().find("magic"), std::string::npos) << decoder.error();
    }
  }
}

TEST(WireGreeting, OtherMajorVersionIsAnError) {
  for (const std::uint16_t major : {std::uint16_t{0}, std::uint16_t{2}, std::uint16_t{0xFFFF}}) {
    FrameDecoder decoder{1024};
    const Decoded d =
        decode(decoder, greeting_bytes(Greeting{.major = major, .max_message_size = 100}), {});
    EXPECT_EQ(d.status, Status::ERROR) << "major " << major;
    EXPECT_TRUE(d.greetings.empty());
    EXPECT_NE(decoder.error().find("version"), std::string::npos) << decoder.error();
  }
}

TEST(WireGreeting, ZeroMaximumMessageSizeIsAnError) {
  FrameDecoder decoder{1024};
  const Decoded d = decode(decoder, greeting_bytes(Greeting{.max_message_size = 0}), {});
  EXPECT_EQ(d.status, Status::ERROR);
  EXPECT_TRUE(d.greetings.empty());
  EXPECT_FALSE(decoder.error().empty());
}

TEST(WireGreeting, IncompleteGreetingWaitsForMoreBytes) {
  const Bytes bytes = greeting_bytes(Greeting{.max_message_size = 100});
  FrameDecoder decoder{1024};
  const Decoded first = decode(decoder, std::span{bytes}.first(GREETING_SIZE - 1), {});
  EXPECT_EQ(first.status, Status::OK);
  EXPECT_TRUE(first.greetings.empty());
  EXPECT_FALSE(decoder.greeted());
  const Decoded rest = decode(decoder, std::span{bytes}.last(1), {});
  EXPECT_EQ(rest.greetings.size(), 1U);
  EXPECT_TRUE(decoder.greeted());
}

// --------------------------------------------------------------------------- framing

TEST(WireDecoder, WholeStreamAtOnce) {
  const Stream s = make_stream({0, 1, 7, 8, 9, 100, 5000, 0, 70000, 3});
  expect_decoded(decode(s.bytes, {}), s, "whole stream");
}

TEST(WireDecoder, EverySingleSplitPointGivesTheSameMessages) {
  const Stream s = make_stream({0, 1, 2, 7, 8, 9, 15, 16, 17, 0, 0, 100, 300, 1});
  const Decoded whole = decode(s.bytes, {});
  expect_decoded(whole, s, "whole");
  for (std::size_t k = 1; k < s.bytes.size(); ++k) {
    expect_decoded(decode(s.bytes, {k}), s, "split at " + std::to_string(k));
    if (HasFatalFailure()) return;
  }
}

TEST(WireDecoder, EveryPairOfSplitPointsGivesTheSameMessages) {
  const Stream s = make_stream({0, 3, 9, 0, 12, 1});
  for (std::size_t a = 1; a < s.bytes.size(); ++a) {
    for (std::size_t b = a + 1; b < s.bytes.size(); ++b) {
      expect_decoded(decode(s.bytes, {a, b}), s,
                     "split at " + std::to_string(a) + " and " + std::to_string(b));
      if (HasFatalFailure()) return;
    }
  }
}

TEST(WireDecoder, ByteByByte) {
  const Stream s = make_stream({0, 1, 7, 8, 9, 100, 5000, 0, 3});
  std::vector<std::size_t> cuts(s.bytes.size() - 1);
  for (std::size_t i = 0; i < cuts.size(); ++i) cuts[i] = i + 1;
  expect_decoded(decode(s.bytes, cuts), s, "byte by byte");
}

TEST(WireDecoder, PseudoRandomChunkingsIncludingLargeMessages) {
  const Stream s = make_stream({0, 5000, 1, 70000, 0, 200000, 8, 65536, 4096, 4097});
  std::mt19937 rng{12345};
  for (int round = 0; round < 20; ++round) {
    const std::size_t max_chunk = std::size_t{1} << static_cast<unsigned>(round % 17);
    std::uniform_int_distribution<std::size_t> step{1, max_chunk};
    std::vector<std::size_t> cuts;
    for (std::size_t at = step(rng); at < s.bytes.size(); at += step(rng)) cuts.push_back(at);
    expect_decoded(decode(s.bytes, cuts), s, "round " + std::to_string(round));
    if (HasFatalFailure()) return;
  }
}

TEST(WireDecoder, ZeroLengthMessages) {
  const Stream s = make_stream({0, 0, 0, 1, 0});
  for (const auto& cuts : {std::vector<std::size_t>{}, std::vector<std::size_t>{20, 21, 30}}) {
    const Decoded d = decode(s.bytes, cuts);
    expect_decoded(d, s, "zero-length");
    ASSERT_EQ(d.messages.size(), 5U);
    EXPECT_TRUE(d.messages[0].empty());
    EXPECT_TRUE(d.messages[4].empty());
  }
}

TEST(WireDecoder, MessagesWhollyInsideTheInputAreDeliveredInPlace) {
  const Stream s = make_stream({10, 0, 4000});
  FrameDecoder decoder{1U << 20U};
  std::vector<bool> in_place;
  const auto* begin = s.bytes.data();
  const auto* end = begin + s.bytes.size();
  const Status status =
      decoder.feed(s.bytes, accept_greeting, [&](std::span<const std::uint8_t> m) {
        in_place.push_back(m.empty() || (m.data() >= begin && m.data() + m.size() <= end));
        return true;
      });
  EXPECT_EQ(status, Status::OK);
  EXPECT_EQ(in_place, (std::vector<bool>{true, true, true}));
}

TEST(WireDecoder, MessageOfExactlyTheMaximumSizeIsAccepted) {
  const Stream s = make_stream({1000});
  expect_decoded(decode(s.bytes, {}, 1000), s, "exact maximum");
  expect_decoded(decode(s.bytes, {GREETING_SIZE + 3, GREETING_SIZE + 500}, 1000), s,
                 "exact maximum, split");
}

TEST(WireDecoder, OversizedFrameIsAnErrorWithoutAllocating) {
  struct Case {
    std::size_t max;
    std::uint32_t declared;
  };
  for (const Case c : {Case{1000, 1001}, Case{DEFAULT_MAX_MESSAGE_SIZE, 0xFFFF'FFFFU},
                       Case{DEFAULT_MAX_MESSAGE_SIZE, DEFAULT_MAX_MESSAGE_SIZE + 1}}) {
    for (const bool split : {false, true}) {
      Bytes bytes = greeting_bytes(Greeting{.max_message_size = 100});
      const Bytes header = raw_header(c.declared, FRAME_DATA);
      bytes.insert(bytes.end(), header.begin(), header.end());
      bytes.resize(bytes.size() + 64, 0xAB);  // some body bytes follow
      FrameDecoder decoder{c.max};
      reset_largest_array_new();
      const Decoded d =
          decode(decoder, bytes,
                 split ? std::vector<std::size_t>{GREETING_SIZE + 2, GREETING_SIZE + 7}
                       : std::vector<std::size_t>{});
      const std::string context =
          "declared " + std::to_string(c.declared) + (split ? " split" : "");
      EXPECT_EQ(d.status, Status::ERROR) << context;
      EXPECT_TRUE(d.messages.empty()) << context;
      EXPECT_EQ(decoder.buffered_capacity(), 0U) << context;
      EXPECT_LT(largest_array_new(), std::size_t{c.declared}) << context;
      EXPECT_NE(decoder.error().find(std::to_string(c.declared)), std::string::npos)
          << decoder.error();
    }
  }
}

TEST(WireDecoder, UnknownFrameTypeIsAnError) {
  for (const std::uint8_t type : {std::uint8_t{0}, std::uint8_t{9}, std::uint8_t{0xFF}}) {
    for (const bool split : {false, true}) {
      Stream s = make_stream({5});  // one good message first
      const Bytes header = raw_header(4, type);
      s.bytes.insert(s.bytes.end(), header.begin(), header.end());
      s.bytes.insert(s.bytes.end(), {1, 2, 3, 4});
      std::vector<std::size_t> cuts;
      if (split) {
        for (std::size_t i = 1; i < s.bytes.size(); ++i) cuts.push_back(i);
      }
      FrameDecoder decoder{1024};
      const Decoded d = decode(decoder, s.bytes, cuts);
      EXPECT_EQ(d.status, Status::ERROR) << "type " << int{type};
      ASSERT_EQ(d.messages.size(), 1U);
      EXPECT_EQ(d.messages[0], s.messages[0]);
      EXPECT_NE(decoder.error().find("type"), std::string::npos) << decoder.error();
    }
  }
}

TEST(WireDecoder, NonZeroReservedBytesAreAnError) {
  for (int which = 5; which <= 7; ++which) {
    for (const bool split : {false, true}) {
      Bytes bytes = greeting_bytes(Greeting{.max_message_size = 100});
      const Bytes header =
          raw_header(2, FRAME_DATA, which == 5 ? 1 : 0, which == 6 ? 0x80 : 0, which == 7 ? 1 : 0);
      bytes.insert(bytes.end(), header.begin(), header.end());
      bytes.insert(bytes.end(), {9, 9});
      FrameDecoder decoder{1024};
      const Decoded d =
          decode(decoder, bytes,
                 split ? std::vector<std::size_t>{GREETING_SIZE + 1, GREETING_SIZE + 6}
                       : std::vector<std::size_t>{});
      EXPECT_EQ(d.status, Status::ERROR) << "reserved byte " << which;
      EXPECT_TRUE(d.messages.empty());
      EXPECT_NE(decoder.error().find("reserved"), std::string::npos) << decoder.error();
    }
  }
}

// ------------------------------------------------------------------ stopping decoding

TEST(WireDecoder, GreetingCallbackReturningFalseStops) {
  const Stream s = make_stream({3, 4});
  FrameDecoder decoder{1024};
  int messages = 0;
  const Status status = decoder.feed(
      s.bytes, [](const Greeting&) { return false; },
      [&](std::span<const std::uint8_t>) {
        ++messages;
        return true;
      });
  EXPECT_EQ(status, Status::STOPPED);
  EXPECT_EQ(messages, 0);
}

TEST(WireDecoder, MessageCallbackReturningFalseStops) {
  // In place, assembled from two feeds, and for a zero-length message.
  const Stream s = make_stream({3, 5000, 0, 7});
  for (const std::size_t stop_at : {std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
    FrameDecoder decoder{1U << 20U};
    std::size_t calls = 0;
    auto on_message = [&](std::span<const std::uint8_t>) { return ++calls < stop_at; };
    const std::size_t cut = GREETING_SIZE + 8 + 3 + 8 + 100;  // inside the 5000-byte message
    Status status = decoder.feed(std::span{s.bytes}.first(cut), accept_greeting, on_message);
    if (status == Status::OK) {
      status = decoder.feed(std::span{s.bytes}.subspan(cut), accept_greeting, on_message);
    }
    EXPECT_EQ(status, Status::STOPPED) << "stop at " << stop_at;
    EXPECT_EQ(calls, stop_at);
  }
}

// A body that is refused admission pauses the decoder with the rest of the input kept;
// resume() asks again and delivers everything intact and in order.
TEST(WireDecoder, RefusedAdmissionPausesAndResumeDeliversInOrder) {
  const Stream s = make_stream({3, 5000, 0, 70000, 7});
  FrameDecoder decoder{1U << 20U};
  std::vector<Bytes> got;
  auto on_message = [&](std::span<const std::uint8_t> m) {
    got.emplace_back(m.begin(), m.end());
    return true;
  };
  std::vector<std::size_t> asked;
  bool allow = false;
  auto admit = [&](std::size_t length) {
    asked.push_back(length);
    return allow;
  };
  // The 5000-byte message is cut: it must be admitted, and is not.
  const std::size_t cut = GREETING_SIZE + 8 + 3 + 8 + 100;
  EXPECT_EQ(decoder.feed(std::span{s.bytes}.first(cut), accept_greeting, on_message, admit),
            Status::PAUSED);
  EXPECT_TRUE(decoder.paused());
  EXPECT_TRUE(decoder.mid_item());
  EXPECT_EQ(asked, std::vector<std::size_t>{5000});
  EXPECT_EQ(got.size(), 1U);
  // While paused, nothing more is consumed.
  EXPECT_EQ(decoder.feed(std::span{s.bytes}.subspan(cut, 10), accept_greeting, on_message, admit),
            Status::PAUSED);
  EXPECT_EQ(decoder.resume(accept_greeting, on_message, admit), Status::PAUSED);
  allow = true;
  EXPECT_EQ(decoder.resume(accept_greeting, on_message, admit), Status::OK);
  EXPECT_TRUE(decoder.in_body());
  EXPECT_EQ(decoder.feed(std::span{s.bytes}.subspan(cut), accept_greeting, on_message, admit),
            Status::OK);
  EXPECT_FALSE(decoder.mid_item());
  ASSERT_EQ(got.size(), s.messages.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], s.messages[i]) << i;
}

// ---------------------------------------------------------- direct reads, memory use

TEST(WireDecoder, DirectTargetAssemblesALargeMessage) {
  constexpr std::size_t SIZE = (std::size_t{3} << 20U) + 12345;
  const Bytes message = test::pattern(7, SIZE);
  Bytes stream = greeting_bytes(Greeting{.max_message_size = 100});
  append_frame(stream, message);
  append_frame(stream, Bytes{1, 2, 3});  // a small message follows

  FrameDecoder decoder{std::size_t{8} << 20U};
  std::vector<Bytes> got;
  auto on_message = [&](std::span<const std::uint8_t> m) {
    got.emplace_back(m.begin(), m.end());
    return true;
  };
  EXPECT_TRUE(decoder.direct_target().empty()) << "no message in progress";
  const std::size_t first = GREETING_SIZE + FRAME_HEADER_SIZE + 1000;
  ASSERT_EQ(decoder.feed(std::span{stream}.first(first), accept_greeting, on_message), Status::OK);

  std::size_t pos = first;
  const std::size_t message_end = GREETING_SIZE + FRAME_HEADER_SIZE + SIZE;
  bool used_direct = false;
  while (pos < message_end) {
    const std::span<std::uint8_t> target = decoder.direct_target();
    if (target.empty()) {
      // Close to the end: the rest goes through feed().
      ASSERT_EQ(decoder.feed(std::span{stream}.subspan(pos, message_end - pos), accept_greeting,
                             on_message),
                Status::OK);
      pos = message_end;
      break;
    }
    used_direct = true;
    ASSERT_LE(target.size(), message_end - pos) << "direct target runs past the message";
    // Memory follows the bytes that arrived (geometric growth plus one read's worth), it
    // does not jump to the declared size.
    const std::size_t have = pos - (GREETING_SIZE + FRAME_HEADER_SIZE);
    EXPECT_LE(decoder.buffered_capacity(), 2 * have + (std::size_t{2} << 20U));
    // Partial reads, as a socket would deliver them.
    const std::size_t n = std::min(target.size(), std::size_t{200'000});
    std::copy_n(stream.begin() + static_cast<std::ptrdiff_t>(pos), n, target.begin());
    ASSERT_EQ(decoder.commit_direct(n, on_message), Status::OK);
    pos += n;
  }
  EXPECT_TRUE(used_direct);
  ASSERT_EQ(got.size(), 1U);
  EXPECT_EQ(got[0], message);
  EXPECT_TRUE(decoder.direct_target().empty());
  ASSERT_EQ(decoder.feed(std::span{stream}.subspan(pos), accept_greeting, on_message), Status::OK);
  ASSERT_EQ(got.size(), 2U);
  EXPECT_EQ(got[1], (Bytes{1, 2, 3}));
}

TEST(WireDecoder, CommitDirectCallbackReturningFalseStops) {
  constexpr std::size_t SIZE = std::size_t{1} << 20U;
  Bytes stream = greeting_bytes(Greeting{.max_message_size = 100});
  append_frame(stream, test::pattern(1, SIZE));
  FrameDecoder decoder{SIZE};
  const std::size_t head = GREETING_SIZE + FRAME_HEADER_SIZE;
  ASSERT_EQ(decoder.feed(std::span{stream}.first(head), accept_greeting,
                         [](std::span<const std::uint8_t>) { return true; }),
            Status::OK);
  std::size_t pos = head;
  Status status = Status::OK;
  int calls = 0;
  while (pos < stream.size() && status == Status::OK) {
    const auto target = decoder.direct_target();
    ASSERT_FALSE(target.empty());
    const std::size_t n = std::min(target.size(), stream.size() - pos);
    std::copy_n(stream.begin() + static_cast<std::ptrdiff_t>(pos), n, target.begin());
    pos += n;
    status = decoder.commit_direct(n, [&](std::span<const std::uint8_t> m) {
      ++calls;
      EXPECT_EQ(m.size(), SIZE);
      return false;
    });
  }
  EXPECT_EQ(status, Status::STOPPED);
  EXPECT_EQ(calls, 1);
}

TEST(WireDecoder, BufferedCapacityGrowsOnlyWithReceivedBytes) {
  constexpr std::uint32_t DECLARED = 60U << 20U;
  Bytes stream = greeting_bytes(Greeting{.max_message_size = 100});
  const Bytes header = raw_header(DECLARED, FRAME_DATA);
  stream.insert(stream.end(), header.begin(), header.end());
  FrameDecoder decoder{DEFAULT_MAX_MESSAGE_SIZE};
  auto no_message = [](std::span<const std::uint8_t>) {
    ADD_FAILURE() << "incomplete message delivered";
    return true;
  };
  ASSERT_EQ(decoder.feed(stream, accept_greeting, no_message), Status::OK);

  reset_largest_array_new();
  const Bytes kilobyte = test::pattern(3, 1024);
  ASSERT_EQ(decoder.feed(kilobyte, accept_greeting, no_message), Status::OK);
  EXPECT_GE(decoder.buffered_capacity(), kilobyte.size());
  EXPECT_LE(decoder.buffered_capacity(), std::size_t{64} << 10U);
  EXPECT_LE(largest_array_new(), std::size_t{64} << 10U);

  // Growth stays proportional to what arrived.
  std::size_t received = kilobyte.size();
  const Bytes chunk = test::pattern(4, 64 * 1024);
  for (int i = 0; i < 16; ++i) {
    ASSERT_EQ(decoder.feed(chunk, accept_greeting, no_message), Status::OK);
    received += chunk.size();
    EXPECT_GE(decoder.buffered_capacity(), received);
    EXPECT_LE(decoder.buffered_capacity(), 2 * received + (std::size_t{64} << 10U));
  }
  EXPECT_LE(largest_array_new(), 2 * received + (std::size_t{64} << 10U));
  // Offering a direct read does not jump to the declared size either.
  const auto target = decoder.direct_target();
  EXPECT_FALSE(target.empty());
  EXPECT_LE(decoder.buffered_capacity(), received + (std::size_t{4} << 20U));
}

TEST(WireDecoder, LargeBodyBufferIsReleasedAfterDelivery) {
  const Stream s = make_stream({200000, 10});
  FrameDecoder decoder{1U << 20U};
  // Cut the large message so that it is assembled in the decoder's own buffer.
  const std::size_t cut = GREETING_SIZE + FRAME_HEADER_SIZE + 100;
  std::size_t delivered = 0;
  std::size_t capacity_after_large = 0;
  auto on_message = [&](std::span<const std::uint8_t>) {
    ++delivered;
    return true;
  };
  ASSERT_EQ(decoder.feed(std::span{s.bytes}.first(cut), accept_greeting, on_message), Status::OK);
  EXPECT_GT(decoder.buffered_capacity(), 0U);
  const std::size_t large_end = GREETING_SIZE + FRAME_HEADER_SIZE + 200000;
  ASSERT_EQ(
      decoder.feed(std::span{s.bytes}.subspan(cut, large_end - cut), accept_greeting, on_message),
      Status::OK);
  capacity_after_large = decoder.buffered_capacity();
  EXPECT_EQ(delivered, 1U);
  EXPECT_LE(capacity_after_large, std::size_t{64} << 10U)
      << "an idle connection keeps a large receive buffer";
}

// A stream of large messages reads each into a body that comes from the backend's cache and
// goes back to it after delivery: after the first message nothing is allocated (glibc handed
// each freed 1 MiB body to the kernel and took it back for the next: a third of the rate).
TEST(WireDecoder, LargeBodiesComeFromTheCacheAndGoBackToIt) {
  constexpr std::size_t SIZE = std::size_t{1} << 20U;
  constexpr int MESSAGES = 5;
  Bytes stream = greeting_bytes(Greeting{.max_message_size = 100});
  for (int i = 0; i < MESSAGES; ++i) append_frame(stream, test::pattern(i, SIZE));
  auto cache = std::make_shared<detail::BodyCache>(4, std::size_t{8} << 20U);
  FrameDecoder decoder{std::size_t{2} << 20U};
  decoder.set_body_cache(cache);
  int delivered = 0;
  auto on_message = [&](std::span<const std::uint8_t> m) {
    EXPECT_EQ(Bytes(m.begin(), m.end()), test::pattern(delivered, SIZE));
    ++delivered;
    return true;
  };
  std::size_t pos = 0;
  std::size_t news_after_first = 0;
  while (pos < stream.size()) {
    // A frame header (and the greeting) through feed(), the body by direct reads.
    const std::size_t head =
        delivered == 0 && pos == 0 ? GREETING_SIZE + FRAME_HEADER_SIZE : FRAME_HEADER_SIZE;
    ASSERT_EQ(decoder.feed(std::span{stream}.subspan(pos, head), accept_greeting, on_message),
              Status::OK);
    pos += head;
    const int before = delivered;
    while (delivered == before) {
      const auto target = decoder.direct_target();
      ASSERT_FALSE(target.empty());
      const std::size_t n = std::min(target.size(), std::size_t{300'000});
      std::copy_n(stream.begin() + static_cast<std::ptrdiff_t>(pos), n, target.begin());
      pos += n;
      ASSERT_EQ(decoder.commit_direct(n, on_message), Status::OK);
    }
    // Delivered: the decoder holds nothing, the cache holds the body.
    EXPECT_EQ(decoder.buffered_capacity(), 0U);
    EXPECT_EQ(cache->cached_blocks(), 1U);
    EXPECT_EQ(cache->cached_bytes(), SIZE);
    if (delivered == 1) news_after_first = g_large_array_news.load();
  }
  EXPECT_EQ(delivered, MESSAGES);
  EXPECT_EQ(g_large_array_news.load(), news_after_first) << "a later message allocated its body";
}

// The cache keeps at most its number of blocks and bytes (the oldest go first), and gives a
// block only to a request it fits without wasting more than half of it.
TEST(BodyCache, KeepsItsBoundsAndGivesOnlyFittingBlocks) {
  constexpr std::size_t MIB = std::size_t{1} << 20U;
  detail::BodyCache cache{3, 4 * MIB};
  std::size_t capacity = 0;
  auto taken = cache.take(MIB, capacity);  // nothing kept yet: a new block
  EXPECT_EQ(capacity, MIB);
  for (int i = 0; i < 5; ++i) cache.give(std::make_unique<std::uint8_t[]>(MIB), MIB);
  EXPECT_EQ(cache.cached_blocks(), 3U);
  EXPECT_EQ(cache.cached_bytes(), 3 * MIB);
  cache.give(std::make_unique<std::uint8_t[]>(2 * MIB), 2 * MIB);  // 4 blocks: the oldest goes
  EXPECT_EQ(cache.cached_bytes(), 4 * MIB);
  EXPECT_EQ(cache.cached_blocks(), 3U);
  cache.give(std::make_unique<std::uint8_t[]>(2 * MIB), 2 * MIB);  // 6 MiB: two go
  EXPECT_EQ(cache.cached_bytes(), 4 * MIB);
  EXPECT_EQ(cache.cached_blocks(), 2U);
  cache.give(std::make_unique<std::uint8_t[]>(8 * MIB), 8 * MIB);  // over the bound: not kept
  EXPECT_LE(cache.cached_bytes(), 4 * MIB);
  cache.give(std::make_unique<std::uint8_t[]>(MIB), MIB);  // beside one block of 2 MiB
  EXPECT_EQ(cache.cached_bytes(), 3 * MIB);
  // 300 KiB does not take the 1 MiB block (it would waste more than half); 600 KiB does, the
  // smallest that fits.
  const std::size_t before = cache.cached_blocks();
  auto small = cache.take(300 * 1024, capacity);
  EXPECT_EQ(capacity, std::size_t{300} * 1024);
  EXPECT_EQ(cache.cached_blocks(), before);
  auto medium = cache.take(600 * 1024, capacity);
  EXPECT_EQ(capacity, MIB);
  EXPECT_EQ(cache.cached_blocks(), before - 1);
}

// The SESSION body: asyncmsg's 33 bytes, the UCX control channel's 41 (a receive token after
// the flags); every field where the layout puts it, and a body of another size refused.
TEST(SessionBody, EncodesEveryFieldAndRefusesOtherSizes) {
  netio3::detail::SessionFrame frame;
  for (std::size_t i = 0; i < frame.id.size(); ++i) frame.id[i] = static_cast<std::uint8_t>(i + 1);
  frame.count = 0x0102030405060708ULL;
  frame.give_up_ms = 60'000;
  frame.flags = netio3::detail::SESSION_RESUME;
  frame.token = 0xA1B2C3D4E5F60718ULL;
  for (const bool with_token : {false, true}) {
    SCOPED_TRACE(with_token ? "with a token" : "without");
    std::vector<std::uint8_t> body(netio3::detail::session_body_size(with_token));
    netio3::detail::encode_session_body(frame, with_token, body.data());
    EXPECT_EQ(body[0], 1);
    EXPECT_EQ(body[15], 16);
    EXPECT_EQ(body[16], 0x08) << "the count, little endian";
    EXPECT_EQ(body[23], 0x01);
    EXPECT_EQ(body[24], 0x60) << "give_up_ms 60000 = 0xEA60";
    EXPECT_EQ(body[25], 0xEA);
    EXPECT_EQ(body[32], netio3::detail::SESSION_RESUME);
    if (with_token) {
      EXPECT_EQ(body[33], 0x18);
      EXPECT_EQ(body[40], 0xA1);
    }
    const auto back = netio3::detail::decode_session_body(body, with_token);
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(back->id, frame.id);
    EXPECT_EQ(back->count, frame.count);
    EXPECT_EQ(back->give_up_ms, frame.give_up_ms);
    EXPECT_EQ(back->flags, frame.flags);
    EXPECT_EQ(back->token, with_token ? frame.token : 0U);
    EXPECT_FALSE(netio3::detail::decode_session_body(body, !with_token).has_value());
    body.pop_back();
    EXPECT_FALSE(netio3::detail::decode_session_body(body, with_token).has_value());
  }
}

}  // namespace
}  // namespace netio3::asyncmsg
