// The UCX backend's active-message protocol header and handshake, and its transport choice.

#include <array>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/ucx/ucp.hpp"

namespace netio3::ucx {
namespace {

TEST(UcxProtocol, HeaderRoundTripsEveryTypeAndSequenceNumber) {
  for (const auto type :
       {MessageType::HELLO, MessageType::HELLO_ACK, MessageType::DATA, MessageType::BYE}) {
    for (const std::uint64_t seq : {std::uint64_t{0}, std::uint64_t{1}, ~std::uint64_t{0}}) {
      const auto bytes = encode_header(AmHeader{type, seq});
      std::string error;
      const auto decoded = decode_header(bytes, error);
      ASSERT_TRUE(decoded.has_value()) << error;
      EXPECT_EQ(decoded->type, type);
      EXPECT_EQ(decoded->seq, seq);
    }
  }
}

TEST(UcxProtocol, HeaderLayoutIsTypeVersionPrefixLengthZerosThenLittleEndianSequence) {
  const auto bytes = encode_header(AmHeader{MessageType::DATA, 0x0102030405060708ULL, 5});
  const std::vector<std::uint8_t> expected{3, 2, 5, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1};
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
  EXPECT_NE(error.find("control message"), std::string::npos) << error;
}

TEST(UcxProtocol, MalformedHeadersAreRejectedWithTheReason) {
  const auto good = encode_header(AmHeader{MessageType::DATA, 5});
  const auto rejected = [](std::span<const std::uint8_t> bytes) {
    std::string error;
    const bool ok = decode_header(bytes, error).has_value();
    return ok ? std::string{} : error;
  };
  EXPECT_NE(rejected(std::span{good}.first(15)).find("15 bytes"), std::string::npos);
  auto version = good;
  version[1] = 1;
  EXPECT_NE(rejected(version).find("protocol version 1"), std::string::npos);
  auto reserved = good;
  reserved[5] = 1;
  EXPECT_NE(rejected(reserved).find("reserved"), std::string::npos);
  for (const std::uint8_t type : {0, 5, 255}) {
    auto unknown = good;
    unknown[0] = type;
    EXPECT_NE(rejected(unknown).find("unknown message type"), std::string::npos) << int{type};
  }
}

TEST(UcxProtocol, HelloCarriesTheMessageSizeLimitAndNothingElse) {
  const auto bytes = encode_hello(64ULL << 20U);
  EXPECT_EQ(decode_hello(bytes), 64ULL << 20U);
  EXPECT_FALSE(decode_hello(std::span{bytes}.first(7)).has_value());
  const std::array<std::uint8_t, 9> longer{};
  EXPECT_FALSE(decode_hello(longer).has_value());
}

TEST(UcxTransports, ModeChoosesAndUcxTlsWins) {
  const char* saved = std::getenv("UCX_TLS");
  const std::string previous = saved != nullptr ? saved : "";
  ::unsetenv("UCX_TLS");
  EXPECT_EQ(choose_transports(NetworkMode::TCP).tls, "tcp");
  EXPECT_EQ(choose_transports(NetworkMode::RDMA).tls, "");
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
