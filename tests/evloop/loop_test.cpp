// EpollEventLoop: run/stop, post, run_sync, exceptions in callbacks, prepare hooks.

#include <atomic>
#include <future>
#include <optional>
#include <stdexcept>
#include <sys/epoll.h>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "evloop_helpers.hpp"

namespace netio3::test::evloop {
namespace {

using std::chrono::milliseconds;

// ---------------------------------------------------------------------------- post()

TEST(EvloopPost, TasksRunInPostingOrderOnTheLoopThread) {
  constexpr int N = 1000;
  std::vector<int> order;  // touched on the loop thread only, read after the last task
  std::atomic<int> wrong_thread{0};
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  const auto loop_tid = loop_thread_id(loop);

  for (int i = 0; i < N; ++i) {
    loop.post([&, i] {
      if (std::this_thread::get_id() != loop_tid) ++wrong_thread;
      order.push_back(i);
    });
  }
  const auto seen = on_loop(loop, [&] { return order; });
  ASSERT_EQ(seen.size(), static_cast<std::size_t>(N));
  for (int i = 0; i < N; ++i) EXPECT_EQ(seen[static_cast<std::size_t>(i)], i);
  EXPECT_EQ(wrong_thread.load(), 0);
}

TEST(EvloopPost, OrderPerPosterIsKeptWithConcurrentPosters) {
  constexpr int THREADS = 4;
  constexpr int PER_THREAD = 500;
  std::vector<std::vector<int>> per_thread(THREADS);  // loop thread only
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < THREADS; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < PER_THREAD; ++i) {
          loop.post([&, t, i] { per_thread[static_cast<std::size_t>(t)].push_back(i); });
        }
      });
    }
  }
  const auto seen = on_loop(loop, [&] { return per_thread; });
  for (int t = 0; t < THREADS; ++t) {
    const auto& v = seen[static_cast<std::size_t>(t)];
    ASSERT_EQ(v.size(), static_cast<std::size_t>(PER_THREAD));
    for (int i = 0; i < PER_THREAD; ++i) EXPECT_EQ(v[static_cast<std::size_t>(i)], i);
  }
}

TEST(EvloopPost, PostFromTheLoopThreadNeverRunsInline) {
  // Everything the loop thread touches outlives the loop thread.
  Counter ran;
  bool ran_inside_post = true;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  on_loop(loop, [&] {
    loop.post([&] { ran.add(); });
    ran_inside_post = ran.value() != 0;
  });
  EXPECT_FALSE(ran_inside_post);
  EXPECT_TRUE(ran.wait_at_least(1));
}

// ------------------------------------------------------------------------ run_sync()

TEST(EvloopRunSync, FromAnotherThreadWaitsForTheTaskOnTheLoopThread) {
  std::mutex gate_mutex;
  std::condition_variable gate_cv;
  bool gate_open = false;
  Counter entered;
  std::thread::id ran_on{};
  bool finished = false;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  const auto loop_tid = loop_thread_id(loop);

  auto caller = std::async(std::launch::async, [&] {
    loop.run_sync([&] {
      ran_on = std::this_thread::get_id();
      entered.add();
      std::unique_lock lock{gate_mutex};
      gate_cv.wait_for(lock, DEFAULT_TIMEOUT, [&] { return gate_open; });
      finished = true;
    });
    // Written by the task on the loop thread, read here without further synchronisation:
    // run_sync must have waited for the task to finish.
    return finished;
  });
  ASSERT_TRUE(entered.wait_at_least(1));
  // The task is blocked on the gate, so run_sync cannot have returned.
  EXPECT_EQ(caller.wait_for(milliseconds{0}), std::future_status::timeout);
  {
    const std::lock_guard lock{gate_mutex};
    gate_open = true;
  }
  gate_cv.notify_all();
  ASSERT_EQ(caller.wait_for(DEFAULT_TIMEOUT), std::future_status::ready);
  EXPECT_TRUE(caller.get());
  EXPECT_EQ(ran_on, loop_tid);
}

TEST(EvloopRunSync, RethrowsTheTasksExceptionAndTheLoopKeepsRunning) {
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  auto caller = std::async(
      std::launch::async, [&] { loop.run_sync([] { throw std::out_of_range{"run_sync boom"}; }); });
  ASSERT_EQ(caller.wait_for(DEFAULT_TIMEOUT), std::future_status::ready);
  try {
    caller.get();
    ADD_FAILURE() << "run_sync swallowed the exception";
  } catch (const std::out_of_range& e) {
    EXPECT_STREQ(e.what(), "run_sync boom");
  }
  EXPECT_TRUE(loop.is_running());
  settle(loop);
}

TEST(EvloopRunSync, FromTheLoopThreadRunsInline) {
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  const auto order = on_loop(loop, [&] {
    std::vector<int> v;
    loop.post([] {});  // queued work must not get in front of the inline call
    loop.run_sync([&] { v.push_back(1); });
    v.push_back(2);
    bool threw = false;
    try {
      loop.run_sync([] { throw std::logic_error{"inline boom"}; });
    } catch (const std::logic_error&) {
      threw = true;
    }
    if (threw) v.push_back(3);
    return v;
  });
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

TEST(EvloopRunSync, WhenTheLoopIsNotRunningRunsOnTheCallingThread) {
  EpollEventLoop loop;
  std::thread::id ran_on{};
  loop.run_sync([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_THROW(loop.run_sync([] { throw std::runtime_error{"not running"}; }), std::runtime_error);
}

TEST(EvloopRunSync, AfterTheLoopStoppedRunsOnTheCallingThread) {
  auto loop = std::make_shared<EpollEventLoop>();
  {
    AsyncRun run{loop};
    settle(*loop);
    loop->stop();
    ASSERT_TRUE(run.returned_within(DEFAULT_TIMEOUT));
  }
  std::thread::id ran_on{};
  loop->run_sync([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

// --------------------------------------------------------------------------- run/stop

TEST(EvloopRunStop, StopBeforeRunMakesRunReturnAtOnceAndIsConsumed) {
  auto loop = std::make_shared<EpollEventLoop>();
  loop->stop();
  {
    AsyncRun first{loop};
    ASSERT_TRUE(first.returned_within(DEFAULT_TIMEOUT));
    first.get();
  }
  EXPECT_FALSE(loop->is_running());

  // The request was cleared: a second run() dispatches events (fd events are dispatched
  // only by the running loop, never while run() winds down).
  Counter signalled;
  const EventSignalHandle signal = loop->create_signal([&] { signalled.add(); });
  AsyncRun second{loop};
  signal.fire();
  ASSERT_TRUE(signalled.wait_at_least(1)) << "the second run() returned at once";
  EXPECT_TRUE(loop->is_running());
  EXPECT_FALSE(second.returned_within(milliseconds{0}));
  loop->stop();
  ASSERT_TRUE(second.returned_within(DEFAULT_TIMEOUT));
  EXPECT_FALSE(loop->is_running());
}

TEST(EvloopRunStop, StopFromACallbackEndsRun) {
  auto loop = std::make_shared<EpollEventLoop>();
  const EventSignalHandle signal = loop->create_signal([&] { loop->stop(); });
  AsyncRun run{loop};
  settle(*loop);
  signal.fire();
  ASSERT_TRUE(run.returned_within(DEFAULT_TIMEOUT));
  run.get();
  EXPECT_FALSE(loop->is_running());
}

TEST(EvloopRunStop, RunTwiceSequentially) {
  auto loop = std::make_shared<EpollEventLoop>();
  Counter signalled;
  const EventSignalHandle signal = loop->create_signal([&] { signalled.add(); });
  for (int round = 1; round <= 2; ++round) {
    AsyncRun run{loop};
    const auto tid = loop_thread_id(*loop);
    EXPECT_NE(tid, std::this_thread::get_id());
    signal.fire();
    ASSERT_TRUE(signalled.wait_at_least(round));
    loop->stop();
    ASSERT_TRUE(run.returned_within(DEFAULT_TIMEOUT));
    run.get();
    EXPECT_FALSE(loop->is_running());
  }
}

TEST(EvloopRunStop, RunWhileRunningThrowsLogicError) {
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  settle(loop);
  EXPECT_THROW(loop.run(), std::logic_error);
  // The running loop is unaffected.
  EXPECT_TRUE(loop.is_running());
  EXPECT_FALSE(loop.in_loop_thread());
  EXPECT_TRUE(on_loop(loop, [&] { return loop.in_loop_thread(); }));
}

TEST(EvloopRunStop, TasksPostedBeforeStopStillRun) {
  auto loop = std::make_shared<EpollEventLoop>();
  std::vector<int> order;  // loop thread only; read after run() returned
  Counter stopped;
  Counter gate;
  AsyncRun run{loop};
  settle(*loop);
  loop->post([&] {
    order.push_back(1);
    loop->stop();
    loop->post([&] {
      order.push_back(2);
      // Posted while the loop drains its queue: still runs before run() returns.
      loop->post([&] { order.push_back(4); });
    });
    // Keep run() from returning until another thread has posted as well.
    stopped.add();
    (void)gate.wait_at_least(1);
  });
  ASSERT_TRUE(stopped.wait_at_least(1));
  loop->post([&] { order.push_back(3); });
  gate.add();
  ASSERT_TRUE(run.returned_within(DEFAULT_TIMEOUT));
  run.get();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 4}));
}

// ------------------------------------------------------------------------ exceptions

TEST(EvloopExceptions, EscapingCallbackExceptionsAreLoggedAndTheLoopKeepsRunning) {
  LogCapture log;
  const Pipe pipe = make_pipe();
  Counter fd_calls;
  Counter signal_calls;
  Counter timer_calls;
  std::optional<FdHandle> fd;
  std::optional<EventSignalHandle> signal;
  std::optional<EventTimerHandle> timer;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  fd = loop.add_fd(pipe.read.get(), EPOLLIN, [&](std::uint32_t) {
    drain(pipe.read.get());
    fd_calls.add();
    throw std::runtime_error{"fd callback failure"};
  });
  signal = loop.create_signal([&] {
    signal_calls.add();
    throw 42;  // not a std::exception
  });
  timer = loop.create_timer([&] {
    timer_calls.add();
    throw std::runtime_error{"timer callback failure"};
  });
  loop.post([] { throw std::runtime_error{"posted task failure"}; });

  ASSERT_TRUE(write_byte(pipe.write.get()));
  signal->fire();
  timer->start_once(milliseconds{1});
  ASSERT_TRUE(fd_calls.wait_at_least(1));
  ASSERT_TRUE(signal_calls.wait_at_least(1));
  ASSERT_TRUE(timer_calls.wait_at_least(1));
  EXPECT_TRUE(log.wait("fd callback failure", 1, LogLevel::error));
  EXPECT_TRUE(log.wait("timer callback failure", 1, LogLevel::error));
  EXPECT_TRUE(log.wait("posted task failure", 1, LogLevel::error));
  EXPECT_TRUE(log.wait("unknown exception", 1, LogLevel::error));

  // Still dispatching everything.
  EXPECT_TRUE(loop.is_running());
  ASSERT_TRUE(write_byte(pipe.write.get()));
  signal->fire();
  EXPECT_TRUE(fd_calls.wait_at_least(2));
  EXPECT_TRUE(signal_calls.wait_at_least(2));
  settle(loop);
}

// ----------------------------------------------------------------------- prepare hooks

TEST(EvloopPrepareHook, CalledOnTheLoopThreadAfterDispatchBeforeSleeping) {
  Counter signal_calls;
  std::atomic<int> wrong_thread{0};
  std::atomic<std::thread::id> loop_tid{};
  Counter hook_saw_signal;
  std::optional<PrepareHookHandle> hook;
  std::optional<EventSignalHandle> signal;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  loop_tid = loop_thread_id(loop);

  signal = loop.create_signal([&] { signal_calls.add(); });
  on_loop(loop, [&] {
    hook = loop.add_prepare_hook([&] {
      if (std::this_thread::get_id() != loop_tid.load()) ++wrong_thread;
      if (signal_calls.value() == 1 && hook_saw_signal.value() == 0) hook_saw_signal.add();
      return true;
    });
  });
  signal->fire();
  // After dispatching the signal the loop goes back to sleep, calling the hook first.
  ASSERT_TRUE(hook_saw_signal.wait_at_least(1));
  EXPECT_EQ(wrong_thread.load(), 0);
}

TEST(EvloopPrepareHook, ReturningFalseMakesTheLoopPollAgainWithoutSleeping) {
  constexpr int REFUSALS = 5;
  Counter calls;
  std::optional<PrepareHookHandle> hook;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    hook = loop.add_prepare_hook([&] {
      calls.add();
      return calls.value() > REFUSALS;
    });
  });
  // Nothing else happens on the loop: only polling again without sleeping gets the hook
  // called REFUSALS + 1 times.
  ASSERT_TRUE(calls.wait_at_least(REFUSALS + 1));
}

TEST(EvloopPrepareHook, ClosingTheHandleStopsCalls) {
  Counter calls;
  std::optional<PrepareHookHandle> hook;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    hook = loop.add_prepare_hook([&] {
      calls.add();
      return true;
    });
  });
  settle(loop);
  ASSERT_GE(calls.value(), 1);
  const int at_close = on_loop(loop, [&] {
    hook.reset();
    return calls.value();
  });
  settle(loop);
  EXPECT_EQ(calls.value(), at_close);
}

TEST(EvloopPrepareHook, ClosingTheHandleInsideTheHook) {
  Counter calls;
  std::optional<PrepareHookHandle> hook;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  on_loop(loop, [&] {
    hook = loop.add_prepare_hook([&] {
      calls.add();
      hook.reset();
      return true;
    });
  });
  ASSERT_TRUE(calls.wait_at_least(1));
  settle(loop);
  EXPECT_EQ(calls.value(), 1);
}

TEST(EvloopPrepareHook, HookClosedByAnEarlierHookOfTheSameRoundIsNotCalled) {
  Counter first_calls;
  std::atomic<bool> second_closed{false};
  std::atomic<int> second_calls_after_close{0};
  std::optional<PrepareHookHandle> first;
  std::optional<PrepareHookHandle> second;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();

  on_loop(loop, [&] {
    first = loop.add_prepare_hook([&] {
      if (second.has_value()) {
        second.reset();
        second_closed = true;
      }
      first_calls.add();
      return true;
    });
    second = loop.add_prepare_hook([&] {
      if (second_closed.load()) ++second_calls_after_close;
      return true;
    });
  });
  ASSERT_TRUE(first_calls.wait_at_least(1));
  settle(loop);
  EXPECT_TRUE(second_closed.load());
  EXPECT_EQ(second_calls_after_close.load(), 0) << "a closed prepare hook was called";
}

TEST(EvloopPrepareHook, ThrowingHookIsLoggedAndTheLoopKeepsRunning) {
  LogCapture log;
  Counter calls;
  std::optional<PrepareHookHandle> hook;
  LoopThread lt;
  EpollEventLoop& loop = *lt.loop();
  on_loop(loop, [&] {
    hook = loop.add_prepare_hook([&]() -> bool {
      calls.add();
      if (calls.value() == 1) throw std::runtime_error{"hook failure"};
      if (calls.value() == 2) throw 7;  // not a std::exception
      return true;
    });
  });
  ASSERT_TRUE(calls.wait_at_least(1));
  settle(loop);
  EXPECT_GE(calls.value(), 3);
  EXPECT_TRUE(loop.is_running());
  EXPECT_TRUE(log.wait("hook failure", 1, LogLevel::error));
  EXPECT_EQ(log.count("prepare hook", LogLevel::error), 2U);
}

}  // namespace
}  // namespace netio3::test::evloop
