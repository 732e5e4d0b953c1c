// EpollEventLoop: timers (timerfd-backed, periodic and one-shot).

#include <atomic>
#include <chrono>
#include <optional>

#include <gtest/gtest.h>

#include "evloop_helpers.hpp"

namespace netio3::test::evloop {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

TEST(EvloopTimer, PeriodicTimerTicksOnLoopThreadUntilStopped) {
  Counter ticks;
  std::atomic<int> wrong_thread{0};
  std::atomic<std::thread::id> loop_tid{};
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  loop_tid = loop_thread_id(loop);

  timer = loop.create_timer([&] {
    if (std::this_thread::get_id() != loop_tid.load()) ++wrong_thread;
    ticks.add();
  });
  settle(loop);
  EXPECT_EQ(ticks.value(), 0) << "a timer is stopped until started";

  const auto started = steady_clock::now();
  timer->start(milliseconds{5});
  ASSERT_TRUE(ticks.wait_at_least(3));
  // Three periods cannot pass in less than 15 ms.
  EXPECT_GE(steady_clock::now() - started, milliseconds{15});
  EXPECT_EQ(wrong_thread.load(), 0);

  on_loop(loop, [&] { timer->stop(); });
  const int stopped_at = ticks.value();
  // Six periods pass: a running timer would have ticked.
  ASSERT_TRUE(let_time_pass(milliseconds{30}));
  settle(loop);
  EXPECT_EQ(ticks.value(), stopped_at);
}

TEST(EvloopTimer, OneShotFiresOnceAfterTheDelay) {
  Counter ticks;
  std::atomic<steady_clock::time_point> fired_at{};
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  timer = loop.create_timer([&] {
    fired_at = steady_clock::now();
    ticks.add();
  });
  const auto started = steady_clock::now();
  timer->start_once(milliseconds{20});
  ASSERT_TRUE(ticks.wait_at_least(1));
  EXPECT_GE(fired_at.load() - started, milliseconds{20});
  ASSERT_TRUE(let_time_pass(milliseconds{40}));
  settle(loop);
  EXPECT_EQ(ticks.value(), 1);

  // A one-shot timer can be started again.
  timer->start_once(milliseconds{1});
  ASSERT_TRUE(ticks.wait_at_least(2));
}

TEST(EvloopTimer, InvalidPeriodThrowsAndLeavesTimerStopped) {
  Counter ticks;
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  timer = loop.create_timer([&] { ticks.add(); });

  EXPECT_THROW(timer->start(milliseconds{0}), std::invalid_argument);
  EXPECT_THROW(timer->start(milliseconds{-5}), std::invalid_argument);
  ASSERT_TRUE(let_time_pass(milliseconds{10}));
  settle(loop);
  EXPECT_EQ(ticks.value(), 0);

  // A running timer keeps its schedule when a bad period is refused.
  timer->start(milliseconds{2});
  EXPECT_THROW(timer->start(milliseconds{0}), std::invalid_argument);
  EXPECT_TRUE(ticks.wait_at_least(2));
}

TEST(EvloopTimer, RestartReplacesTheSchedule) {
  Counter ticks;
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  timer = loop.create_timer([&] { ticks.add(); });

  // A one-hour period replaced by a short one: ticks come quickly.
  timer->start(std::chrono::hours{1});
  timer->start(milliseconds{2});
  ASSERT_TRUE(ticks.wait_at_least(3));

  // Periodic replaced by one-shot: exactly one more tick.
  // Read on the loop thread, where the callbacks run: no tick can slip in between.
  const int before = on_loop(loop, [&] {
    timer->start_once(milliseconds{5});
    return ticks.value();
  });
  ASSERT_TRUE(ticks.wait_at_least(before + 1));
  ASSERT_TRUE(let_time_pass(milliseconds{30}));
  settle(loop);
  EXPECT_EQ(ticks.value(), before + 1);

  // Stopped, then started again.
  on_loop(loop, [&] {
    timer->start(milliseconds{2});
    timer->stop();
  });
  ASSERT_TRUE(let_time_pass(milliseconds{10}));
  settle(loop);
  EXPECT_EQ(ticks.value(), before + 1);
  timer->start(milliseconds{2});
  EXPECT_TRUE(ticks.wait_at_least(before + 3));
}

TEST(EvloopTimer, StopOnLoopThreadDiscardsAnExpiryThatIsAlreadyPending) {
  Counter ticks;
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  bool expired = false;
  on_loop(loop, [&] {
    timer = loop.create_timer([&] { ticks.add(); });
    timer->start_once(milliseconds{1});
    // Block the loop thread until the expiry is certainly pending, then stop.
    expired = let_time_pass(milliseconds{10});
    timer->stop();
  });
  ASSERT_TRUE(expired);
  settle(loop);
  EXPECT_EQ(ticks.value(), 0) << "the callback of a stopped timer ran";
}

TEST(EvloopTimer, RestartOnLoopThreadDiscardsAnExpiryThatIsAlreadyPending) {
  Counter ticks;
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  bool expired = false;
  on_loop(loop, [&] {
    timer = loop.create_timer([&] { ticks.add(); });
    timer->start(milliseconds{1});
    expired = let_time_pass(milliseconds{10});
    timer->start_once(std::chrono::hours{1});  // re-armed: the old expiries are void
  });
  ASSERT_TRUE(expired);
  settle(loop);
  EXPECT_EQ(ticks.value(), 0);
}

TEST(EvloopTimer, StopFromAnotherCallbackInTheSameBatch) {
  // Both timers expire while the loop is blocked, so one epoll_wait reports both. Whichever
  // callback runs first stops the other, whose callback must then not run.
  Counter ticks;
  std::optional<EventTimerHandle> a;
  std::optional<EventTimerHandle> b;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  bool expired = false;
  on_loop(loop, [&] {
    a = loop.create_timer([&] {
      ticks.add();
      b->stop();
    });
    b = loop.create_timer([&] {
      ticks.add();
      a->stop();
    });
    a->start_once(milliseconds{1});
    b->start_once(milliseconds{1});
    expired = let_time_pass(milliseconds{10});
  });
  ASSERT_TRUE(expired);
  ASSERT_TRUE(ticks.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(ticks.value(), 1);
}

TEST(EvloopTimer, ExpiriesPilingUpWhileBusyRunTheCallbackOnce) {
  Counter ticks;
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  bool expired = false;
  on_loop(loop, [&] {
    timer = loop.create_timer([&] {
      ticks.add();
      timer->stop();
    });
    timer->start(milliseconds{1});
    // About 20 periods pass while the loop is busy.
    expired = let_time_pass(milliseconds{20});
  });
  ASSERT_TRUE(expired);
  ASSERT_TRUE(ticks.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(ticks.value(), 1);
}

TEST(EvloopTimer, ClosingTimerInsideItsOwnCallback) {
  Counter ticks;
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  on_loop(loop, [&] {
    timer = loop.create_timer([&] {
      ticks.add();
      timer.reset();
    });
    timer->start(milliseconds{1});
  });
  ASSERT_TRUE(ticks.wait_at_least(1));
  ASSERT_TRUE(let_time_pass(milliseconds{10}));
  settle(loop);
  EXPECT_EQ(ticks.value(), 1);
}

}  // namespace
}  // namespace netio3::test::evloop
