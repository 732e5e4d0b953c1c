// EpollEventLoop: handle lifetime, descriptor accounting and wake-ups (no busy looping).

#include <atomic>
#include <chrono>
#include <optional>
#include <sys/epoll.h>
#include <vector>

#include <gtest/gtest.h>

#include "evloop_helpers.hpp"

namespace netio3::test::evloop {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr int MANY = 1000;

// Creates and destroys MANY signals and timers (fired and started) plus as many fd
// registrations and prepare hooks.
void churn(EpollEventLoop& loop, int pipe_fd) {
  for (int i = 0; i < MANY; ++i) {
    const EventSignalHandle signal = loop.create_signal([] {}, i % 2 == 0);
    signal.fire();
    const EventTimerHandle timer = loop.create_timer([] {});
    timer.start(milliseconds{1 + i % 3});
    const FdHandle fd = loop.add_fd(pipe_fd, EPOLLIN, [](std::uint32_t) {});
    const PrepareHookHandle hook = loop.add_prepare_hook([] { return true; });
  }
}

TEST(EvloopResources, ChurnOnARunningLoopReturnsToTheBaselineDescriptorCount) {
  const Pipe pipe = make_pipe();
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  settle(loop);
  const std::size_t baseline = open_fd_count();

  // From a foreign thread...
  churn(loop, pipe.read.get());
  settle(loop);
  EXPECT_EQ(open_fd_count(), baseline);

  // ...and on the loop thread.
  on_loop(loop, [&] { churn(loop, pipe.read.get()); });
  settle(loop);
  EXPECT_EQ(open_fd_count(), baseline);
}

TEST(EvloopResources, ChurnOnALoopThatIsNotRunningReturnsToTheBaselineDescriptorCount) {
  const Pipe pipe = make_pipe();
  EpollEventLoop loop;
  const std::size_t baseline = open_fd_count();
  churn(loop, pipe.read.get());
  EXPECT_EQ(open_fd_count(), baseline) << "closed registrations keep their descriptors open";
}

TEST(EvloopResources, LoopReleasesItsOwnDescriptors) {
  const std::size_t baseline = open_fd_count();
  {
    auto loop = std::make_shared<EpollEventLoop>();
    AsyncRun run{loop};
    settle(*loop);
    loop->stop();
    ASSERT_TRUE(run.returned_within(DEFAULT_TIMEOUT));
  }
  EXPECT_EQ(open_fd_count(), baseline);
}

TEST(EvloopLifetime, HandlesOutlivingTheLoopCloseHarmlessly) {
  const Pipe pipe = make_pipe();
  const std::size_t baseline = open_fd_count();
  Counter signalled;
  std::optional<FdHandle> fd;
  std::optional<EventSignalHandle> signal;
  std::optional<EventTimerHandle> timer;
  std::optional<PrepareHookHandle> hook;
  {
    auto loop = std::make_shared<EpollEventLoop>();
    fd = loop->add_fd(pipe.read.get(), EPOLLIN, [](std::uint32_t) {});
    signal = loop->create_signal([&] { signalled.add(); });
    timer = loop->create_timer([] {});
    hook = loop->add_prepare_hook([] { return true; });
    AsyncRun run{loop};
    timer->start(milliseconds{1});
    signal->fire();
    ASSERT_TRUE(signalled.wait_at_least(1));
    loop->stop();
    ASSERT_TRUE(run.returned_within(DEFAULT_TIMEOUT));
  }
  // The loop is gone; the handles still work as far as they can and close quietly.
  signal->fire();
  timer->stop();
  timer->start(milliseconds{1});
  EXPECT_NO_THROW(fd->modify(EPOLLIN | EPOLLOUT));
  fd.reset();
  signal.reset();
  timer.reset();
  hook.reset();
  EXPECT_EQ(signalled.value(), 1);
  EXPECT_EQ(open_fd_count(), baseline);
}

TEST(EvloopLifetime, HandlesOfALoopThatNeverRanCloseHarmlessly) {
  const std::size_t baseline = open_fd_count();
  std::optional<EventSignalHandle> signal;
  std::optional<EventTimerHandle> timer;
  std::optional<PrepareHookHandle> hook;
  {
    EpollEventLoop loop;
    signal = loop.create_signal([] {});
    timer = loop.create_timer([] {});
    hook = loop.add_prepare_hook([] { return true; });
    signal->fire();
    timer->start_once(milliseconds{1});
  }
  signal.reset();
  timer.reset();
  hook.reset();
  EXPECT_EQ(open_fd_count(), baseline);
}

TEST(EvloopWakeups, IdleLoopDoesNotWakeUp) {
  Counter fired;
  std::atomic<std::uint64_t> wakeups_at_fire{0};
  std::atomic<steady_clock::time_point> fired_at{};
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  timer = loop.create_timer([&] {
    wakeups_at_fire = loop.wakeups();
    fired_at = steady_clock::now();
    fired.add();
  });
  settle(loop);

  const std::uint64_t before = loop.wakeups();
  const auto started = steady_clock::now();
  timer->start_once(milliseconds{200});
  ASSERT_TRUE(fired.wait_at_least(1));
  EXPECT_GE(fired_at.load() - started, milliseconds{200});
  // Ideally exactly one wake-up: the timer's.
  EXPECT_LE(wakeups_at_fire.load() - before, 3U);
  EXPECT_GE(wakeups_at_fire.load() - before, 1U);
}

TEST(EvloopWakeups, PeriodicTimerWakesAboutOncePerTick) {
  constexpr int TICKS = 20;
  Counter ticks;
  std::atomic<std::uint64_t> first{0};
  std::atomic<std::uint64_t> last{0};
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  timer = loop.create_timer([&] {
    const int n = ticks.value() + 1;
    if (n == 1) first = loop.wakeups();
    if (n == TICKS + 1) {
      last = loop.wakeups();
      timer->stop();
    }
    ticks.add();
  });
  on_loop(loop, [&] { timer->start(milliseconds{10}); });
  ASSERT_TRUE(ticks.wait_at_least(TICKS + 1));
  const std::uint64_t delta = last.load() - first.load();
  // Every callback needs a wake-up of its own; a busy loop would wake far more often.
  EXPECT_GE(delta, static_cast<std::uint64_t>(TICKS));
  EXPECT_LE(delta, static_cast<std::uint64_t>(2 * TICKS + 3));
}

}  // namespace
}  // namespace netio3::test::evloop
