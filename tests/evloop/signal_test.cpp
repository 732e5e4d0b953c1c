// EpollEventLoop: signals (eventfd-backed, fire() from any thread).

#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "evloop_helpers.hpp"

namespace netio3::test::evloop {
namespace {

constexpr int THREADS = 8;
constexpr int FIRES_PER_THREAD = 200;

TEST(EvloopSignal, SemaphoreSignalRunsOncePerFireFromManyThreadsOnLoopThread) {
  Counter calls;
  std::atomic<int> wrong_thread{0};
  std::atomic<std::thread::id> loop_tid{};
  std::optional<EventSignalHandle> signal;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  loop_tid = loop_thread_id(loop);

  signal = loop.create_signal(
      [&] {
        if (std::this_thread::get_id() != loop_tid.load()) ++wrong_thread;
        calls.add();
      },
      true);
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < THREADS; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < FIRES_PER_THREAD; ++i) signal->fire();
      });
    }
  }
  ASSERT_TRUE(calls.wait_at_least(THREADS * FIRES_PER_THREAD));
  settle(loop);
  EXPECT_EQ(calls.value(), THREADS * FIRES_PER_THREAD);
  EXPECT_EQ(wrong_thread.load(), 0);
}

TEST(EvloopSignal, CoalescingSignalNeverLosesTheLastFire) {
  // Each thread counts a fire before calling fire(). With coalescing semantics callbacks
  // may be fewer than fires, but some callback must start after the last fire and so see
  // the final count.
  constexpr int TOTAL = THREADS * FIRES_PER_THREAD;
  std::atomic<int> fired{0};
  std::atomic<int> wrong_thread{0};
  std::atomic<std::thread::id> loop_tid{};
  Counter calls;
  Counter saw_all;
  std::optional<EventSignalHandle> signal;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  loop_tid = loop_thread_id(loop);

  signal = loop.create_signal([&] {
    if (std::this_thread::get_id() != loop_tid.load()) ++wrong_thread;
    if (fired.load() == TOTAL) saw_all.add();
    calls.add();
  });
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < THREADS; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < FIRES_PER_THREAD; ++i) {
          ++fired;
          signal->fire();
        }
      });
    }
  }
  ASSERT_TRUE(saw_all.wait_at_least(1)) << "no callback ran after the last fire()";
  settle(loop);
  EXPECT_GE(calls.value(), 1);
  EXPECT_LE(calls.value(), TOTAL);
  EXPECT_EQ(wrong_thread.load(), 0);
}

TEST(EvloopSignal, FiresBeforeTheLoopWakesCoalesceByDefault) {
  Counter calls;
  std::optional<EventSignalHandle> signal;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    signal = loop.create_signal([&] { calls.add(); });
    // The loop is busy running this task: all five fires happen before it waits again.
    for (int i = 0; i < 5; ++i) signal->fire();
  });
  ASSERT_TRUE(calls.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(calls.value(), 1);

  // A fire after the callback ran triggers it again.
  on_loop(loop, [&] { signal->fire(); });
  ASSERT_TRUE(calls.wait_at_least(2));
  settle(loop);
  EXPECT_EQ(calls.value(), 2);
}

TEST(EvloopSignal, SemaphoreSignalRunsOncePerFireEvenWhenFiredBeforeTheLoopWakes) {
  Counter calls;
  std::optional<EventSignalHandle> signal;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    signal = loop.create_signal([&] { calls.add(); }, true);
    for (int i = 0; i < 5; ++i) signal->fire();
  });
  ASSERT_TRUE(calls.wait_at_least(5));
  settle(loop);
  EXPECT_EQ(calls.value(), 5);
}

TEST(EvloopSignal, FireBeforeRunIsDeliveredOnceTheLoopRuns) {
  Counter calls;
  auto loop = std::make_shared<EpollEventLoop>();
  EventSignalHandle signal = loop->create_signal([&] { calls.add(); });
  signal.fire();
  AsyncRun run{loop};
  ASSERT_TRUE(calls.wait_at_least(1));
  loop->stop();
  ASSERT_TRUE(run.returned_within(DEFAULT_TIMEOUT));
}

TEST(EvloopSignal, ClosingSignalInsideItsOwnCallback) {
  Counter calls;
  std::optional<EventSignalHandle> signal;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    // Semaphore semantics: without the close, the three fires would run it three times.
    signal = loop.create_signal(
        [&] {
          calls.add();
          signal.reset();
        },
        true);
    for (int i = 0; i < 3; ++i) signal->fire();
  });
  ASSERT_TRUE(calls.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(calls.value(), 1);
  EXPECT_FALSE(signal.has_value());
}

TEST(EvloopSignal, ClosedSignalIsNotCalledForEarlierFires) {
  Counter calls;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  on_loop(loop, [&] {
    EventSignalHandle signal = loop.create_signal([&] { calls.add(); });
    signal.fire();
    // Destroyed here, before the loop could dispatch the fire.
  });
  settle(loop);
  EXPECT_EQ(calls.value(), 0);
}

}  // namespace
}  // namespace netio3::test::evloop
