// NetworkBuffer: appends never truncate silently.

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <sys/uio.h>
#include <vector>

#include <gtest/gtest.h>
#include <netio3/exceptions.hpp>
#include <netio3/network_buffer.hpp>

namespace netio3 {
namespace {

constexpr std::uint8_t SENTINEL = 0xAA;

// A buffer over storage pre-filled with a sentinel, so that writes past size() show.
struct Fixture {
  explicit Fixture(std::size_t capacity) : storage(capacity, SENTINEL), buffer{storage, 77} {}
  std::vector<std::uint8_t> storage;
  NetworkBuffer buffer;

  [[nodiscard]] bool untouched_after(std::size_t offset) const {
    for (std::size_t i = offset; i < storage.size(); ++i) {
      if (storage[i] != SENTINEL) return false;
    }
    return true;
  }
};

template <typename T>
std::vector<std::uint8_t> bytes_of(T value) {
  std::vector<std::uint8_t> out(sizeof(T));
  std::memcpy(out.data(), &value, sizeof(T));
  return out;
}

TEST(NetworkBuffer, StartsEmpty) {
  Fixture f{32};
  EXPECT_EQ(f.buffer.size(), 0U);
  EXPECT_EQ(f.buffer.capacity(), 32U);
  EXPECT_EQ(f.buffer.available(), 32U);
  EXPECT_EQ(f.buffer.data(), f.storage.data());
  EXPECT_EQ(f.buffer.id(), 77U);
  EXPECT_TRUE(f.buffer.bytes().empty());
}

TEST(NetworkBuffer, WritesAppendSpansIovecsAndIntegrals) {
  Fixture f{64};
  const std::vector<std::uint8_t> span_bytes{1, 2, 3};
  std::array<std::uint8_t, 4> iov_bytes{9, 8, 7, 6};
  f.buffer.write(span_bytes);
  f.buffer.write(iovec{iov_bytes.data(), iov_bytes.size()});
  f.buffer.write(std::uint8_t{0x11});
  f.buffer.write(std::uint16_t{0x2233});
  f.buffer.write(std::uint32_t{0x44556677});
  f.buffer.write(std::int64_t{-2});
  f.buffer.write(std::span<const std::uint8_t>{});  // no-op

  // Reserved up front: growing a 3-byte vector by insert() draws a false -Warray-bounds
  // from GCC 12 at -O3.
  std::vector<std::uint8_t> expected;
  expected.reserve(64);
  expected.insert(expected.end(), span_bytes.begin(), span_bytes.end());
  expected.insert(expected.end(), iov_bytes.begin(), iov_bytes.end());
  for (const auto& part : {bytes_of(std::uint8_t{0x11}), bytes_of(std::uint16_t{0x2233}),
                           bytes_of(std::uint32_t{0x44556677}), bytes_of(std::int64_t{-2})}) {
    expected.insert(expected.end(), part.begin(), part.end());
  }
  ASSERT_EQ(f.buffer.size(), expected.size());
  EXPECT_EQ(std::vector<std::uint8_t>(f.buffer.bytes().begin(), f.buffer.bytes().end()), expected);
  EXPECT_EQ(f.buffer.available(), 64 - expected.size());
  EXPECT_TRUE(f.untouched_after(expected.size()));
}

TEST(NetworkBuffer, ExactFitSucceeds) {
  Fixture f{8};
  f.buffer.write(std::uint32_t{1});
  f.buffer.write(std::uint32_t{2});
  EXPECT_EQ(f.buffer.size(), 8U);
  EXPECT_EQ(f.buffer.available(), 0U);
  EXPECT_NO_THROW(f.buffer.write(std::span<const std::uint8_t>{}));
}

TEST(NetworkBuffer, OverflowThrowsAndWritesNothing) {
  Fixture f{10};
  f.buffer.write(std::vector<std::uint8_t>(7, 0x01));
  const std::vector<std::uint8_t> four(4, 0x02);
  std::array<std::uint8_t, 4> iov_bytes{3, 3, 3, 3};

  EXPECT_THROW(f.buffer.write(four), BufferOverflow);
  EXPECT_THROW(f.buffer.write(iovec{iov_bytes.data(), iov_bytes.size()}), BufferOverflow);
  EXPECT_THROW(f.buffer.write(std::uint32_t{0xFFFFFFFF}), BufferOverflow);
  EXPECT_THROW(f.buffer.write(std::uint64_t{0}), BufferOverflow);
  EXPECT_EQ(f.buffer.size(), 7U);
  EXPECT_TRUE(f.untouched_after(7)) << "a refused write changed bytes past size()";

  // What does fit still works afterwards.
  f.buffer.write(std::uint16_t{0x0404});
  f.buffer.write(std::uint8_t{5});
  EXPECT_EQ(f.buffer.size(), 10U);
  EXPECT_THROW(f.buffer.write(std::uint8_t{6}), BufferOverflow);
}

TEST(NetworkBuffer, OverflowIsANetioExceptionWithAMessage) {
  Fixture f{2};
  try {
    f.buffer.write(std::uint32_t{1});
    FAIL() << "no exception";
  } catch (const NetioException& e) {
    EXPECT_NE(std::string{e.what()}.find("77"), std::string::npos) << "message names the buffer";
  }
}

TEST(NetworkBuffer, ResizeAndClear) {
  Fixture f{16};
  std::memset(f.buffer.data(), 0x42, 12);
  f.buffer.resize(12);
  EXPECT_EQ(f.buffer.size(), 12U);
  EXPECT_EQ(f.buffer.bytes().size(), 12U);
  EXPECT_EQ(f.buffer.bytes()[11], 0x42);
  f.buffer.resize(16);
  EXPECT_EQ(f.buffer.available(), 0U);
  EXPECT_THROW(f.buffer.resize(17), BufferOverflow);
  EXPECT_EQ(f.buffer.size(), 16U);
  f.buffer.resize(3);
  f.buffer.write(std::uint8_t{9});
  EXPECT_EQ(f.buffer.size(), 4U);
  EXPECT_EQ(f.storage[3], 9);

  f.buffer.clear();
  EXPECT_EQ(f.buffer.size(), 0U);
  EXPECT_EQ(f.buffer.capacity(), 16U);
  f.buffer.write(std::uint8_t{1});
  EXPECT_EQ(f.storage[0], 1);
}

}  // namespace
}  // namespace netio3
