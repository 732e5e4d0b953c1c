// EpollEventLoop: file descriptor registrations.

#include <atomic>
#include <optional>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <vector>

#include <gtest/gtest.h>

#include "evloop_helpers.hpp"

namespace netio3::test::evloop {
namespace {

TEST(EvloopFd, ReadinessCallbackRunsOnLoopThreadWithEventMask) {
  const Pipe pipe = make_pipe();
  Counter calls;
  std::atomic<std::uint32_t> last_events{0};
  std::atomic<std::thread::id> callback_thread{};
  std::optional<FdHandle> handle;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  const auto loop_tid = loop_thread_id(loop);

  handle = loop.add_fd(pipe.read.get(), EPOLLIN, [&](std::uint32_t events) {
    last_events = events;
    callback_thread = std::this_thread::get_id();
    drain(pipe.read.get());
    calls.add();
  });
  settle(loop);
  EXPECT_EQ(calls.value(), 0) << "callback ran although the fd was not readable";

  ASSERT_TRUE(write_byte(pipe.write.get()));
  ASSERT_TRUE(calls.wait_at_least(1));
  EXPECT_NE(last_events.load() & EPOLLIN, 0U);
  EXPECT_EQ(callback_thread.load(), loop_tid);
  EXPECT_NE(callback_thread.load(), std::this_thread::get_id());

  ASSERT_TRUE(write_byte(pipe.write.get()));
  ASSERT_TRUE(calls.wait_at_least(2));
  settle(loop);
  EXPECT_EQ(calls.value(), 2) << "the callback drains the pipe: one call per write";
}

TEST(EvloopFd, LevelTriggeredUntilDrained) {
  const Pipe pipe = make_pipe();
  Counter calls;
  std::optional<FdHandle> handle;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  // Drains only on the third call: a level-triggered registration is reported again and
  // again while the data is there.
  on_loop(loop, [&] {
    handle = loop.add_fd(pipe.read.get(), EPOLLIN, [&](std::uint32_t) {
      calls.add();
      if (calls.value() == 3) drain(pipe.read.get());
    });
  });
  ASSERT_TRUE(write_byte(pipe.write.get()));
  ASSERT_TRUE(calls.wait_at_least(3));
  settle(loop);
  EXPECT_EQ(calls.value(), 3);
}

TEST(EvloopFd, ModifyChangesTheAwaitedEvents) {
  std::array<int, 2> sv{};
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv.data()), 0);
  const Fd local{sv[0]};
  const Fd peer{sv[1]};
  std::mutex mutex;
  std::vector<std::uint32_t> masks;  // guarded by mutex
  Counter calls;
  std::optional<FdHandle> handle;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    handle = loop.add_fd(local.get(), EPOLLIN, [&](std::uint32_t events) {
      {
        const std::lock_guard lock{mutex};
        masks.push_back(events);
      }
      if ((events & EPOLLOUT) != 0U) handle->modify(EPOLLIN);  // writable once is enough
      if ((events & EPOLLIN) != 0U) drain(local.get());
      calls.add();
    });
  });
  // A fresh socket is writable but not readable: nothing to report for EPOLLIN.
  settle(loop);
  EXPECT_EQ(calls.value(), 0);

  on_loop(loop, [&] { handle->modify(EPOLLIN | EPOLLOUT); });
  ASSERT_TRUE(calls.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(calls.value(), 1) << "after modify(EPOLLIN) the writable socket must not be reported";

  ASSERT_TRUE(write_byte(peer.get()));
  ASSERT_TRUE(calls.wait_at_least(2));
  settle(loop);
  const std::lock_guard lock{mutex};
  ASSERT_EQ(masks.size(), 2U);
  EXPECT_NE(masks[0] & EPOLLOUT, 0U);
  EXPECT_EQ(masks[0] & EPOLLIN, 0U);
  EXPECT_NE(masks[1] & EPOLLIN, 0U);
  EXPECT_EQ(masks[1] & EPOLLOUT, 0U);
}

TEST(EvloopFd, ModifyFromAnotherThreadTakesEffect) {
  std::array<int, 2> sv{};
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv.data()), 0);
  const Fd local{sv[0]};
  const Fd peer{sv[1]};
  Counter writable;
  std::optional<FdHandle> handle;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  handle = loop.add_fd(local.get(), 0, [&](std::uint32_t events) {
    if ((events & EPOLLOUT) != 0U) writable.add();
  });
  settle(loop);
  EXPECT_EQ(writable.value(), 0);
  handle->modify(EPOLLOUT | EPOLLONESHOT);
  ASSERT_TRUE(writable.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(writable.value(), 1) << "EPOLLONESHOT passed through modify() reports once";
  // Re-arming a one-shot registration is what modify() is for.
  handle->modify(EPOLLOUT | EPOLLONESHOT);
  ASSERT_TRUE(writable.wait_at_least(2));
}

TEST(EvloopFd, ClosingOwnHandleInsideCallbackStopsCalls) {
  const Pipe pipe = make_pipe();
  Counter calls;
  std::optional<FdHandle> handle;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    handle = loop.add_fd(pipe.read.get(), EPOLLIN, [&](std::uint32_t) {
      calls.add();
      handle.reset();  // destroys the handle (and its source) inside its own callback
    });
  });
  // The pipe stays readable (nothing drains it): a live level-triggered registration would
  // be reported in every following iteration.
  ASSERT_TRUE(write_byte(pipe.write.get()));
  ASSERT_TRUE(calls.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(calls.value(), 1);
}

TEST(EvloopFd, ClosingAnotherHandleInTheSameBatchPreventsItsCallback) {
  constexpr int N = 8;
  std::vector<Pipe> pipes;
  for (int i = 0; i < N; ++i) pipes.push_back(make_pipe());
  Counter calls;
  std::vector<std::optional<FdHandle>> handles(N);
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    for (int i = 0; i < N; ++i) {
      handles[static_cast<std::size_t>(i)] = loop.add_fd(
          pipes[static_cast<std::size_t>(i)].read.get(), EPOLLIN, [&, i](std::uint32_t) {
            calls.add();
            drain(pipes[static_cast<std::size_t>(i)].read.get());
            // Whoever runs first destroys every other registration; they are all in this
            // epoll batch already.
            for (int j = 0; j < N; ++j) {
              if (j != i) handles[static_cast<std::size_t>(j)].reset();
            }
          });
    }
    // All pipes become readable before the loop waits again: one epoll_wait returns all.
    for (auto& p : pipes) ASSERT_TRUE(write_byte(p.write.get()));
  });
  ASSERT_TRUE(calls.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(calls.value(), 1) << "a registration closed earlier in the same batch was called";
}

TEST(EvloopFd, ClosingFromAnotherThreadStopsCalls) {
  const Pipe pipe = make_pipe();
  Counter calls;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  FdHandle handle = loop.add_fd(pipe.read.get(), EPOLLIN, [&](std::uint32_t) { calls.add(); });
  ASSERT_TRUE(write_byte(pipe.write.get()));  // never drained: reported on every iteration
  ASSERT_TRUE(calls.wait_at_least(1));
  handle.close();
  EXPECT_FALSE(handle);
  // A callback already running when close() returned may finish, nothing starts afterwards.
  settle(loop);
  const int after_close = calls.value();
  settle(loop);
  EXPECT_EQ(calls.value(), after_close);
}

TEST(EvloopFd, RegistrationErrorsThrow) {
  EpollEventLoop loop;
  EXPECT_THROW((void)loop.add_fd(-1, EPOLLIN, [](std::uint32_t) {}), std::invalid_argument);
  const Pipe pipe = make_pipe();
  const int stale = pipe.read.get();
  {
    const FdHandle first = loop.add_fd(stale, EPOLLIN, [](std::uint32_t) {});
    // The same fd twice is an epoll error; the first registration stays intact.
    EXPECT_THROW((void)loop.add_fd(stale, EPOLLIN, [](std::uint32_t) {}), std::system_error);
  }
  Fd closed = make_pipe().read;
  const int closed_fd = closed.get();
  closed.reset();
  EXPECT_THROW((void)loop.add_fd(closed_fd, EPOLLIN, [](std::uint32_t) {}), std::system_error);
}

}  // namespace
}  // namespace netio3::test::evloop
