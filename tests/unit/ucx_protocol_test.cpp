// The UCX backend's protocol (version 3): the active-message header, the control channel's
// HELLO and CLOSE frames, and the transport choice.

#include <algorithm>
#include <array>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/ucx/ucp.hpp"

namespace netio3::ucx {
namespace {

TEST(UcxProtocol, HeaderRoundTripsEveryTypeSequenceNumberAndToken) {
  for (const auto type : {MessageType::DATA, MessageType::BYE}) {
    for (const std::uint64_t seq : {std::uint64_t{0}, std::uint64_t{1}, ~std::uint64_t{0}}) {
      const std::uint64_t token = seq * 31 + 7;
      const auto bytes = encode_header(AmHeader{type, seq, 0, token});
      std::string error;
      const auto decoded = decode_header(bytes, error);
      ASSERT_TRUE(decoded.has_value()) << error;
      EXPECT_EQ(decoded->type, type);
      EXPECT_EQ(decoded->seq, seq);
      EXPECT_EQ(decoded->token, token);
    }
  }
}

TEST(UcxProtocol, HeaderLayoutIsTypeVersionPrefixLengthZerosThenSequenceAndToken) {
  const auto bytes =
      encode_header(AmHeader{MessageType::DATA, 0x0102030405060708ULL, 5, 0x1112131415161718ULL});
  const std::vector<std::uint8_t> expected{3,    3,    5,    0,    0,    0,    0,    0,
                                           8,    7,    6,    5,    4,    3,    2,    1,
                                           0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11};
  EXPECT_EQ(std::vector<std::uint8_t>(bytes.begin(), bytes.end()), expected);
}

TEST(UcxProtocol, APrefixFollowsTheFixedPartAndItsLengthMustMatch) {
  const auto fixed = encode_header(AmHeader{MessageType::DATA, 9, 3});
  std::vector<std::uint8_t> bytes(fixed.begin(), fixed.end());
  bytes.insert(bytes.end(), {0xaa, 0xbb, 0xcc});
  std::string error;
  const auto decoded = decode_header(bytes, error);
  ASSERT_TRUE(decoded.has_value()) << error;
  EXPECT_EQ(decoded->prefix_len, 3);
  EXPECT_EQ(decoded->seq, 9U);
  bytes.pop_back();  // one prefix byte missing
  EXPECT_FALSE(decode_header(bytes, error).has_value());
  EXPECT_NE(error.find("prefix of 3"), std::string::npos) << error;
  // Longer than any header_data, or on a control message: refused.
  auto huge = encode_header(AmHeader{MessageType::DATA, 1, 17});
  std::vector<std::uint8_t> with_17(huge.begin(), huge.end());
  with_17.resize(AM_HEADER_SIZE + 17);
  EXPECT_FALSE(decode_header(with_17, error).has_value());
  const auto bye = encode_header(AmHeader{MessageType::BYE, 1, 1});
  std::vector<std::uint8_t> bye_prefixed(bye.begin(), bye.end());
  bye_prefixed.push_back(0);
  EXPECT_FALSE(decode_header(bye_prefixed, error).has_value());
  EXPECT_NE(error.find("BYE"), std::string::npos) << error;
}

TEST(UcxProtocol, MalformedHeadersAreRejectedWithTheReason) {
  const auto good = encode_header(AmHeader{MessageType::DATA, 5});
  const auto rejected = [](std::span<const std::uint8_t> bytes) {
    std::string error;
    const bool ok = decode_header(bytes, error).has_value();
    return ok ? std::string{} : error;
  };
  EXPECT_NE(rejected(std::span{good}.first(23)).find("23 bytes"), std::string::npos);
  auto version = good;
  version[1] = 2;  // the protocol of UCX's connection manager days
  EXPECT_NE(rejected(version).find("protocol version 2"), std::string::npos);
  auto reserved = good;
  reserved[5] = 1;
  EXPECT_NE(rejected(reserved).find("reserved"), std::string::npos);
  for (const std::uint8_t type : {0, 1, 2, 7, 255}) {
    auto unknown = good;
    unknown[0] = type;
    EXPECT_NE(rejected(unknown).find("unknown message type"), std::string::npos) << int{type};
  }
  // 3.4: an ACK carries its count in an 8-byte prefix, and nothing else.
  auto ack = good;
  ack[0] = static_cast<std::uint8_t>(MessageType::ACK);
  EXPECT_NE(rejected(ack).find("an ACK message with a prefix of 0 bytes"), std::string::npos);
  std::vector<std::uint8_t> with_count(ack.begin(), ack.end());
  with_count[2] = 8;
  with_count.insert(with_count.end(), 8, 0);
  with_count[AM_HEADER_SIZE] = 42;
  std::string error;
  const auto decoded = decode_header(with_count, error);
  ASSERT_TRUE(decoded.has_value()) << error;
  EXPECT_EQ(decoded->type, MessageType::ACK);
  EXPECT_EQ(decoded->prefix_len, 8);
}

// The opening of the control channel: netio3's greeting with the control protocol's major
// version, then a HELLO frame. Decoded here with the decoder the backend uses.
TEST(UcxControl, OpeningIsAGreetingAndAHelloThatRoundTrips) {
  const std::vector<std::uint8_t> address{1, 2, 3, 4, 5, 6, 7};
  const auto bytes = encode_opening(Hello{
      .mode = 1, .max_message_size = 5ULL << 32U, .token = 0xABCDEF, .worker_address = address});
  ASSERT_EQ(bytes.size(), detail::GREETING_SIZE + detail::FRAME_HEADER_SIZE + HELLO_FIXED_SIZE + 7);
  EXPECT_EQ(bytes[4], detail::UCX_CONTROL_MAJOR);
  EXPECT_EQ(bytes[20], FRAME_HELLO);
  detail::FrameDecoder decoder{MAX_CONTROL_FRAME, CONTROL_PROTOCOL};
  std::optional<Hello> hello;
  std::vector<std::uint8_t> got_address;
  int greetings = 0;
  const auto status = decoder.feed(
      bytes,
      [&](const detail::Greeting& g) {
        ++greetings;
        EXPECT_EQ(g.max_message_size, 0xFFFF'FFFFU) << "the greeting's 32 bits saturate";
        return true;
      },
      [&](std::span<const std::uint8_t> frame) {
        EXPECT_EQ(decoder.frame_type(), FRAME_HELLO);
        std::string error;
        hello = decode_hello(frame, error);
        EXPECT_TRUE(hello.has_value()) << error;
        if (hello) got_address.assign(hello->worker_address.begin(), hello->worker_address.end());
        return true;
      });
  EXPECT_EQ(status, detail::FrameDecoder::Status::OK) << decoder.error();
  EXPECT_EQ(greetings, 1);
  ASSERT_TRUE(hello.has_value());
  EXPECT_EQ(hello->mode, 1);
  EXPECT_EQ(hello->max_message_size, 5ULL << 32U);
  EXPECT_EQ(hello->token, 0xABCDEFU);
  EXPECT_EQ(got_address, address);
}

TEST(UcxControl, MalformedHellosAreRejectedWithTheReason) {
  const std::vector<std::uint8_t> address{9};
  const auto good = encode_opening(
      Hello{.mode = 0, .max_message_size = 100, .token = 1, .worker_address = address});
  const std::vector<std::uint8_t> frame(
      good.begin() + detail::GREETING_SIZE + detail::FRAME_HEADER_SIZE, good.end());
  const auto rejected = [](std::vector<std::uint8_t> bytes) {
    std::string error;
    return decode_hello(bytes, error).has_value() ? std::string{} : error;
  };
  EXPECT_EQ(rejected(frame), "");
  EXPECT_NE(rejected({frame.begin(), frame.begin() + HELLO_FIXED_SIZE}).find("worker address"),
            std::string::npos);
  auto asyncmsg = frame;
  asyncmsg[0] = 1;
  EXPECT_NE(rejected(asyncmsg).find("backend type 1"), std::string::npos);
  auto mode = frame;
  mode[1] = 2;
  EXPECT_NE(rejected(mode).find("network mode"), std::string::npos);
  auto reserved = frame;
  reserved[7] = 1;
  EXPECT_NE(rejected(reserved).find("reserved"), std::string::npos);
  auto no_limit = frame;
  std::fill(no_limit.begin() + 8, no_limit.begin() + 16, 0);
  EXPECT_NE(rejected(no_limit).find("maximum message size of 0"), std::string::npos);
  auto no_token = frame;
  std::fill(no_token.begin() + 16, no_token.begin() + 24, 0);
  EXPECT_NE(rejected(no_token).find("token 0"), std::string::npos);
}

TEST(UcxControl, TheDecoderRefusesWhatIsNotTheControlProtocol) {
  const auto decode = [](std::vector<std::uint8_t> bytes) {
    detail::FrameDecoder decoder{MAX_CONTROL_FRAME, CONTROL_PROTOCOL};
    const auto status = decoder.feed(
        bytes, [](const detail::Greeting&) { return true; },
        [](std::span<const std::uint8_t>) { return true; });
    return status == detail::FrameDecoder::Status::ERROR ? decoder.error() : std::string{};
  };
  // An asyncmsg peer: its greeting names its protocol.
  const auto asyncmsg = detail::encode_greeting(detail::Greeting{.max_message_size = 100});
  EXPECT_NE(decode({asyncmsg.begin(), asyncmsg.end()}).find("netio3 asyncmsg backend"),
            std::string::npos);
  // A DATA frame (asyncmsg's) is not a control frame.
  auto opening = encode_opening(Hello{.max_message_size = 1, .token = 1, .worker_address = {}});
  std::vector<std::uint8_t> data(opening.begin(), opening.begin() + detail::GREETING_SIZE);
  std::array<std::uint8_t, detail::FRAME_HEADER_SIZE> header{};
  detail::encode_frame_header(header.data(), 4, detail::FRAME_DATA);
  data.insert(data.end(), header.begin(), header.end());
  data.insert(data.end(), 4, 0);
  EXPECT_NE(decode(data).find("unknown frame type 1"), std::string::npos);
  // A length beyond any HELLO is refused before anything is allocated for it.
  std::vector<std::uint8_t> huge(opening.begin(), opening.begin() + detail::GREETING_SIZE);
  detail::encode_frame_header(header.data(), 0x7FFF'FFFF, FRAME_HELLO);
  huge.insert(huge.end(), header.begin(), header.end());
  EXPECT_NE(decode(huge).find("frame declares a message of 2147483647 bytes"), std::string::npos);
}

TEST(UcxControl, CloseCarriesTheNumberOfMessagesSent) {
  const auto bytes = encode_close(0x0102030405060708ULL);
  EXPECT_EQ(bytes[4], FRAME_CLOSE);
  const std::span<const std::uint8_t> body = std::span{bytes}.subspan(detail::FRAME_HEADER_SIZE);
  EXPECT_EQ(decode_close(body), 0x0102030405060708ULL);
  EXPECT_FALSE(decode_close(body.first(7)).has_value());
}

TEST(UcxTransports, ModeChoosesAndUcxTlsWins) {
  const char* saved = std::getenv("UCX_TLS");
  const std::string previous = saved != nullptr ? saved : "";
  ::unsetenv("UCX_TLS");
  EXPECT_EQ(choose_transports(NetworkMode::TCP).tls, "tcp");
  EXPECT_EQ(choose_transports(NetworkMode::RDMA).tls, RDMA_TRANSPORTS);
  EXPECT_FALSE(choose_transports(NetworkMode::TCP).from_environment);
  ::setenv("UCX_TLS", "rc,sm", 1);
  const auto chosen = choose_transports(NetworkMode::TCP);
  EXPECT_EQ(chosen.tls, "rc,sm");
  EXPECT_TRUE(chosen.from_environment);
  if (saved != nullptr) {
    ::setenv("UCX_TLS", previous.c_str(), 1);
  } else {
    ::unsetenv("UCX_TLS");
  }
}

}  // namespace
}  // namespace netio3::ucx
