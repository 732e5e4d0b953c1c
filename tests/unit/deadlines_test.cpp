// Deadlines: many one-shot deadlines on one timer descriptor (sessions' and drains' timers).

#include "common/deadlines.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
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
  // Armed out of order (100 ms apart); 100 of them still take the one descriptor.
  const std::vector<int> delays{400, 100, 300, 200, 500};
  for (std::size_t i = 0; i < 100; ++i) handles.push_back(std::make_unique<Deadline>());
  // On the loop thread: the deadlines are all computed before the loop looks at the timer.
  loop.loop()->run_sync([&] {
    for (std::size_t i = 0; i < delays.size(); ++i) {
      const int d = delays[i];
      deadlines.arm(*handles[i], std::chrono::milliseconds{d}, [&log, d] { log.add(d); });
    }
    for (std::size_t i = delays.size(); i < handles.size(); ++i) {
      deadlines.arm(*handles[i], 600s, [&log] { log.add(-1); });
    }
  });
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

// Deadlines that must not run are due a second after they are cancelled, replaced or closed;
// later ones that run prove the time passed.
TEST(Deadlines, CancelledOrReplacedOrClosedDeadlinesDoNotRun) {
  test::LoopThread loop;
  Deadlines deadlines{*loop.loop()};
  Log log;
  Deadline cancelled;
  Deadline replaced;
  Deadline last;
  loop.loop()->run_sync([&] {
    deadlines.arm(cancelled, 1000ms, [&] { log.add(1); });
    deadlines.arm(replaced, 1000ms, [&] { log.add(2); });
    deadlines.arm(replaced, 1200ms, [&] { log.add(3); });  // replaces the first arming
    cancelled.cancel();
    deadlines.arm(last, 1400ms, [&] { log.add(4); });
  });
  EXPECT_FALSE(cancelled.armed());
  ASSERT_TRUE(log.wait_for_count(2));
  EXPECT_EQ(log.snapshot(), (std::vector<int>{3, 4}));

  Deadline after_close;
  Deadline never;
  Deadlines other{*loop.loop()};
  Deadline probe;
  loop.loop()->run_sync([&] {
    deadlines.arm(after_close, 1000ms, [&] { log.add(5); });
    deadlines.close();
    deadlines.arm(never, 1ms, [&] { log.add(6); });  // ignored once closed
    other.arm(probe, 1200ms, [&] { log.add(7); });
  });
  EXPECT_FALSE(after_close.armed());
  EXPECT_FALSE(never.armed());
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
  // Due together (armed in one loop callback, nanoseconds apart): one expiry takes both and
  // runs them in order.
  loop.loop()->run_sync([&] {
    deadlines.arm(*first, 5ms, [&] {
      log.add(1);
      second.cancel();
      first.reset();
      deadlines.arm(third, 5ms, [&] { log.add(3); });
    });
    deadlines.arm(second, 5ms, [&] { log.add(2); });
  });
  ASSERT_TRUE(log.wait_for_count(2));
  EXPECT_EQ(log.snapshot(), (std::vector<int>{1, 3}));
}

// A callback that throws does not keep the others of its expiry from running.
TEST(Deadlines, AThrowingCallbackDoesNotStopTheOthers) {
  test::LoopThread loop;
  Deadlines deadlines{*loop.loop()};
  Log log;
  Deadline throws;
  Deadline runs;
  loop.loop()->run_sync([&] {
    deadlines.arm(throws, 5ms, [] { throw std::runtime_error{"test"}; });
    deadlines.arm(runs, 5ms, [&] { log.add(1); });
  });
  ASSERT_TRUE(log.wait_for_count(1));
  EXPECT_FALSE(runs.armed());
  EXPECT_FALSE(throws.armed());
}

}  // namespace
}  // namespace netio3::detail
