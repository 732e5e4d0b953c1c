// Deadlines: many one-shot deadlines on one timer descriptor (sessions' and drains' timers).

#include "common/deadlines.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "test_support.hpp"

namespace netio3::detail {
namespace {

using namespace std::chrono_literals;

// What ran, in order, and a wait for it.
struct Log {
  void add(int what) {
    const std::lock_guard lock{mutex};
    ran.push_back(what);
    cv.notify_all();
  }
  bool wait_for_count(std::size_t n) {
    std::unique_lock lock{mutex};
    return cv.wait_for(lock, test::DEFAULT_TIMEOUT, [&] { return ran.size() >= n; });
  }
  std::vector<int> snapshot() {
    const std::lock_guard lock{mutex};
    return ran;
  }
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<int> ran;
};

TEST(Deadlines, RunInDeadlineOrderOnOneDescriptor) {
  test::LoopThread loop;
  const auto fds = test::open_fd_count();
  Deadlines deadlines{*loop.loop()};
  EXPECT_EQ(test::open_fd_count(), fds + 1);
  Log log;
  std::vector<std::unique_ptr<Deadline>> handles;
  // Armed out of order; 100 of them still take the one descriptor.
  const std::vector<int> delays{40, 10, 30, 20, 50};
  for (const int d : delays) {
    handles.push_back(std::make_unique<Deadline>());
    deadlines.arm(*handles.back(), std::chrono::milliseconds{d}, [&log, d] { log.add(d); });
  }
  for (int i = 0; i < 95; ++i) {
    handles.push_back(std::make_unique<Deadline>());
    deadlines.arm(*handles.back(), 60s, [&log] { log.add(-1); });
  }
  EXPECT_EQ(test::open_fd_count(), fds + 1);
  EXPECT_EQ(deadlines.pending(), 100U);
  ASSERT_TRUE(log.wait_for_count(delays.size()));
  auto sorted = delays;
  std::ranges::sort(sorted);
  EXPECT_EQ(log.snapshot(), sorted);
  EXPECT_FALSE(handles[0]->armed());
  EXPECT_TRUE(handles.back()->armed());
  EXPECT_EQ(deadlines.pending(), 95U);
  handles.clear();  // destroying a handle cancels its deadline
  EXPECT_EQ(deadlines.pending(), 0U);
}

TEST(Deadlines, CancelledOrReplacedOrClosedDeadlinesDoNotRun) {
  test::LoopThread loop;
  Deadlines deadlines{*loop.loop()};
  Log log;
  Deadline cancelled;
  Deadline replaced;
  Deadline last;
  deadlines.arm(cancelled, 10ms, [&] { log.add(1); });
  deadlines.arm(replaced, 10ms, [&] { log.add(2); });
  deadlines.arm(replaced, 30ms, [&] { log.add(3); });  // replaces the 10 ms arming
  cancelled.cancel();
  EXPECT_FALSE(cancelled.armed());
  deadlines.arm(last, 50ms, [&] { log.add(4); });
  ASSERT_TRUE(log.wait_for_count(2));
  EXPECT_EQ(log.snapshot(), (std::vector<int>{3, 4}));

  Deadline after_close;
  deadlines.arm(after_close, 10ms, [&] { log.add(5); });
  deadlines.close();
  EXPECT_FALSE(after_close.armed());
  Deadline never;
  deadlines.arm(never, 1ms, [&] { log.add(6); });  // ignored once closed
  EXPECT_FALSE(never.armed());
  // A deadline armed after these, on another queue, runs: by then these would have too.
  Deadlines other{*loop.loop()};
  Deadline probe;
  other.arm(probe, 30ms, [&] { log.add(7); });
  ASSERT_TRUE(log.wait_for_count(3));
  EXPECT_EQ(log.snapshot(), (std::vector<int>{3, 4, 7}));
}

// A callback may cancel a deadline that expired in the same round (it does not run), arm
// another, and destroy its own handle.
TEST(Deadlines, ACallbackMayCancelArmAndDestroy) {
  test::LoopThread loop;
  Deadlines deadlines{*loop.loop()};
  Log log;
  auto first = std::make_unique<Deadline>();
  Deadline second;
  Deadline third;
  // Due together (nanoseconds apart): one expiry takes both, and runs them in order.
  deadlines.arm(*first, 5ms, [&] {
    log.add(1);
    second.cancel();
    first.reset();
    deadlines.arm(third, 5ms, [&] { log.add(3); });
  });
  deadlines.arm(second, 5ms, [&] { log.add(2); });
  ASSERT_TRUE(log.wait_for_count(2));
  EXPECT_EQ(log.snapshot(), (std::vector<int>{1, 3}));
}

}  // namespace
}  // namespace netio3::detail
