// libfabric connection data: what each side announces at connect/accept.

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/libfabric/fabric.hpp"

namespace netio3::libfabric {
namespace {

TEST(CmData, RoundTripsTheReceiveSize) {
  for (const std::uint64_t size : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{4096},
                                   std::uint64_t{1} << 40U, ~std::uint64_t{0}}) {
    const auto bytes = encode_cm_data(CmData{size});
    std::string error;
    const auto decoded = decode_cm_data(bytes, error);
    ASSERT_TRUE(decoded.has_value()) << error;
    EXPECT_EQ(decoded->recv_buf_size, size);
  }
}

TEST(CmData, LayoutIsLittleEndianWithMagicAndVersion) {
  const auto bytes = encode_cm_data(CmData{.recv_buf_size = 0x0102030405060708ULL,
                                           .flags = CM_SENDS_HEARTBEATS,
                                           .heartbeat_token = 0x1112131415161718ULL});
  const std::vector<std::uint8_t> expected{'N',  'I',  'O',  '3',  1,    0,    2,    0,
                                           8,    7,    6,    5,    4,    3,    2,    1,
                                           0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11};
  EXPECT_EQ(std::vector<std::uint8_t>(bytes.begin(), bytes.end()), expected);
}

// A peer from before heartbeats sends (and reads) only the first 16 bytes: its data reads as
// "no heartbeat token", and ours has its 16 bytes where it expects them.
TEST(CmData, SixteenBytesOfAnOlderPeerMeanNoHeartbeats) {
  const auto ours = encode_cm_data(
      CmData{.recv_buf_size = 4096, .flags = CM_SENDS_HEARTBEATS, .heartbeat_token = 77});
  std::string error;
  const auto old = decode_cm_data(std::span{ours}.first(CM_DATA_MIN_SIZE), error);
  ASSERT_TRUE(old.has_value()) << error;
  EXPECT_EQ(old->recv_buf_size, 4096U);
  EXPECT_EQ(old->heartbeat_token, 0U);
  const auto full = decode_cm_data(ours, error);
  ASSERT_TRUE(full.has_value()) << error;
  EXPECT_EQ(full->heartbeat_token, 77U);
  EXPECT_EQ(full->flags, CM_SENDS_HEARTBEATS);
}

TEST(CmData, ForeignOrShortDataIsRejectedWithAReason) {
  std::string error;
  auto bytes = encode_cm_data(CmData{64});
  EXPECT_FALSE(decode_cm_data(std::span{bytes}.first(CM_DATA_MIN_SIZE - 1), error).has_value());
  EXPECT_NE(error.find("bytes"), std::string::npos) << error;
  EXPECT_FALSE(decode_cm_data({}, error).has_value());
  bytes[0] = 'X';
  EXPECT_FALSE(decode_cm_data(bytes, error).has_value());
  EXPECT_NE(error.find("magic"), std::string::npos) << error;
  bytes = encode_cm_data(CmData{64});
  bytes[4] = 2;  // another version
  EXPECT_FALSE(decode_cm_data(bytes, error).has_value());
  EXPECT_NE(error.find("version 2"), std::string::npos) << error;
  // Longer data (a provider may pad) is fine.
  const auto original = encode_cm_data(CmData{64});
  std::vector<std::uint8_t> padded(original.begin(), original.end());
  padded.resize(56, 0);
  const auto decoded = decode_cm_data(padded, error);
  ASSERT_TRUE(decoded.has_value());
  EXPECT_EQ(decoded->recv_buf_size, 64U);
}

TEST(ProviderChoice, ModeSelectsVerbsOrTcpUnlessFiProviderIsSet) {
  const char* saved = std::getenv("FI_PROVIDER");
  const std::string old = saved != nullptr ? saved : "";
  ::unsetenv("FI_PROVIDER");
  EXPECT_EQ(choose_provider(NetworkMode::RDMA).name, "verbs");
  EXPECT_EQ(choose_provider(NetworkMode::TCP).name, "tcp");
  EXPECT_FALSE(choose_provider(NetworkMode::TCP).from_environment);
  ::setenv("FI_PROVIDER", "sockets", 1);
  EXPECT_EQ(choose_provider(NetworkMode::RDMA).name, "sockets");
  EXPECT_TRUE(choose_provider(NetworkMode::RDMA).from_environment);
  if (saved != nullptr) {
    ::setenv("FI_PROVIDER", old.c_str(), 1);
  } else {
    ::unsetenv("FI_PROVIDER");
  }
}

}  // namespace
}  // namespace netio3::libfabric
