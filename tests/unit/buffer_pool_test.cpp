// BufferPool: FREE -> LENT -> IN_FLIGHT -> FREE, headroom, concurrency.

#include "common/buffer_pool.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace netio3::detail {
namespace {

std::vector<NetworkBuffer*> acquire_all(BufferPool& pool) {
  std::vector<NetworkBuffer*> out;
  while (NetworkBuffer* b = pool.acquire()) {
    out.push_back(b);
    if (out.size() > pool.num_buf()) break;  // a broken pool would never run dry
  }
  return out;
}

TEST(BufferPool, AcquireUntilExhaustedThenNull) {
  BufferPool pool{8, 1024, 0, false};
  EXPECT_EQ(pool.free_count(), 8U);
  const auto buffers = acquire_all(pool);
  ASSERT_EQ(buffers.size(), 8U);
  EXPECT_EQ(pool.acquire(), nullptr);
  EXPECT_EQ(pool.free_count(), 0U);
  std::set<NetworkBuffer*> distinct(buffers.begin(), buffers.end());
  std::set<std::uint64_t> ids;
  for (NetworkBuffer* b : buffers) {
    EXPECT_EQ(b->capacity(), 1024U);
    EXPECT_EQ(b->size(), 0U);
    EXPECT_TRUE(pool.owns(b));
    ids.insert(b->id());
  }
  EXPECT_EQ(distinct.size(), 8U);
  EXPECT_EQ(ids.size(), 8U) << "buffer ids are the send keys and must be unique";
}

TEST(BufferPool, BuffersAndTheirHeadroomDoNotOverlapAndLieInTheRegion) {
  constexpr std::size_t HEADROOM = 16;
  BufferPool pool{16, 1000, HEADROOM, false};
  const auto buffers = acquire_all(pool);
  ASSERT_EQ(buffers.size(), 16U);
  const auto region = pool.region();
  std::vector<std::pair<const std::uint8_t*, const std::uint8_t*>> ranges;
  for (NetworkBuffer* b : buffers) {
    std::uint8_t* head = BufferPool::headroom_of(b, HEADROOM);
    EXPECT_EQ(head + HEADROOM, b->data());
    EXPECT_GE(head, region.data());
    EXPECT_LE(b->data() + b->capacity(), region.data() + region.size());
    ranges.emplace_back(head, b->data() + b->capacity());
    // Every byte of headroom and payload is writable (the sanitizers check the bounds).
    std::fill(head, b->data() + b->capacity(), static_cast<std::uint8_t>(b->id()));
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    EXPECT_LE(ranges[i - 1].second, ranges[i].first) << "buffers overlap";
  }
  // Nothing written into one buffer leaked into another.
  for (NetworkBuffer* b : buffers) {
    const std::uint8_t* head = BufferPool::headroom_of(b, HEADROOM);
    const std::uint8_t* end = b->data() + b->capacity();
    EXPECT_TRUE(std::all_of(
        head, end, [&](std::uint8_t v) { return v == static_cast<std::uint8_t>(b->id()); }));
  }
}

TEST(BufferPool, ReleasedBufferIsHandedOutAgainEmpty) {
  BufferPool pool{2, 64, 0, false};
  NetworkBuffer* a = pool.acquire();
  ASSERT_NE(a, nullptr);
  a->write(std::uint32_t{42});
  pool.release(a);
  EXPECT_EQ(pool.free_count(), 2U);
  const auto again = acquire_all(pool);
  ASSERT_EQ(again.size(), 2U);
  EXPECT_TRUE(std::find(again.begin(), again.end(), a) != again.end());
  EXPECT_EQ(a->size(), 0U);
}

TEST(BufferPool, BeginSendOnlyForLentBuffersOfThisPool) {
  BufferPool pool{2, 64, 0, false};
  BufferPool other{2, 64, 0, false};
  std::array<std::uint8_t, 64> storage{};
  NetworkBuffer standalone{storage, 0};

  NetworkBuffer* foreign = other.acquire();
  ASSERT_NE(foreign, nullptr);
  EXPECT_FALSE(pool.owns(foreign));
  EXPECT_FALSE(pool.begin_send(foreign));
  EXPECT_FALSE(pool.owns(&standalone));
  EXPECT_FALSE(pool.begin_send(&standalone));
  EXPECT_FALSE(pool.begin_send(nullptr));

  NetworkBuffer* b = pool.acquire();
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(pool.begin_send(b));
  EXPECT_FALSE(pool.begin_send(b)) << "a buffer already in flight was sent twice";
  pool.release(b);
  EXPECT_FALSE(pool.begin_send(b)) << "a free (not lent) buffer was accepted";

  // The other buffer of the pool was never lent.
  NetworkBuffer* c = pool.acquire();
  NetworkBuffer* d = pool.acquire();
  ASSERT_NE(c, nullptr);
  ASSERT_NE(d, nullptr);
  pool.release(d);
  EXPECT_FALSE(pool.begin_send(d));
  EXPECT_TRUE(pool.begin_send(c));
}

// An application may hand back a pointer whose connection, and pool, are gone: the check
// must not read through it (under ASan, reading the freed object here fails the test).
TEST(BufferPool, OwnsJudgesAPointerWithoutReadingIt) {
  std::array<std::uint8_t, 16> storage{};
  auto gone = std::make_unique<NetworkBuffer>(std::span<std::uint8_t>{storage}, 0);
  const NetworkBuffer* dangling = gone.get();
  gone.reset();
  BufferPool pool{4, 64, 0, true};
  EXPECT_FALSE(pool.owns(dangling));
  EXPECT_FALSE(pool.begin_send(const_cast<NetworkBuffer*>(dangling)));  // NOLINT
  // Inside the pool's objects but not at the start of one.
  NetworkBuffer* first = pool.acquire();
  ASSERT_NE(first, nullptr);
  const auto* inside = reinterpret_cast<const NetworkBuffer*>(  // NOLINT
      reinterpret_cast<const std::uint8_t*>(first) + 1);        // NOLINT
  EXPECT_FALSE(pool.owns(inside));
  EXPECT_TRUE(pool.owns(first));
}

TEST(BufferPool, AbortSendMakesTheBufferLentAgain) {
  BufferPool pool{1, 64, 0, false};
  NetworkBuffer* b = pool.acquire();
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(pool.begin_send(b));
  pool.abort_send(b);
  EXPECT_EQ(pool.free_count(), 0U) << "abort_send must not free the buffer";
  EXPECT_TRUE(pool.begin_send(b));
  // abort_send on a lent buffer or a foreign one changes nothing.
  pool.abort_send(b);
  pool.abort_send(b);
  EXPECT_TRUE(pool.begin_send(b));
  BufferPool other{1, 64, 0, false};
  pool.abort_send(other.acquire());
  EXPECT_EQ(pool.free_count(), 0U);
}

TEST(BufferPool, ReleaseFromInFlightOrLentAndDoubleReleaseIsHarmless) {
  BufferPool pool{3, 64, 0, false};
  NetworkBuffer* a = pool.acquire();
  NetworkBuffer* b = pool.acquire();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(pool.begin_send(a));
  pool.release(a);  // IN_FLIGHT -> FREE
  pool.release(b);  // LENT -> FREE
  EXPECT_EQ(pool.free_count(), 3U);
  pool.release(a);  // already free
  pool.release(b);
  BufferPool other{1, 64, 0, false};
  pool.release(other.acquire());
  pool.release(nullptr);
  EXPECT_EQ(pool.free_count(), 3U);
  // No buffer is handed out twice.
  const auto all = acquire_all(pool);
  EXPECT_EQ(all.size(), 3U);
  EXPECT_EQ(std::set<NetworkBuffer*>(all.begin(), all.end()).size(), 3U);
  EXPECT_EQ(pool.acquire(), nullptr);
}

TEST(BufferPool, InvalidConstructionThrows) {
  EXPECT_THROW((BufferPool{0, 64, 0, false}), std::invalid_argument);
  EXPECT_THROW((BufferPool{4, 0, 0, false}), std::invalid_argument);
}

TEST(BufferPool, ConcurrentAcquireReleaseNeverHandsOutABufferTwice) {
  constexpr std::size_t NUM_BUF = 4;
  constexpr int THREADS = 8;
  constexpr int ITERATIONS = 3000;
  BufferPool pool{NUM_BUF, 128, 8, true};
  std::vector<std::atomic<int>> holders(NUM_BUF);
  std::atomic<int> double_handouts{0};
  std::atomic<int> failed_sends{0};
  std::atomic<int> acquired{0};
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < THREADS; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < ITERATIONS; ++i) {
          NetworkBuffer* b = pool.acquire();
          if (b == nullptr) continue;
          ++acquired;
          auto& holder = holders.at(b->id());
          if (holder.fetch_add(1) != 0) ++double_handouts;
          b->write(static_cast<std::uint32_t>(t));
          if (i % 2 == 0) {
            if (!pool.begin_send(b)) ++failed_sends;
            if (i % 4 == 0) {
              pool.abort_send(b);
              if (!pool.begin_send(b)) ++failed_sends;
            }
          }
          holder.fetch_sub(1);
          pool.release(b);
        }
      });
    }
  }
  EXPECT_EQ(double_handouts.load(), 0);
  EXPECT_EQ(failed_sends.load(), 0);
  EXPECT_GT(acquired.load(), 0);
  EXPECT_EQ(pool.free_count(), NUM_BUF);
  EXPECT_EQ(acquire_all(pool).size(), NUM_BUF);
}

}  // namespace
}  // namespace netio3::detail
