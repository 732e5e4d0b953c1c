// EpollEventLoop::Options::busy_poll: after activity the loop polls without sleeping (and
// tells prepare hooks so through polling()), then sleeps once the window has passed. With a
// polling hook (add_polling_hook) its own descriptors are checked once per
// busy_poll_fd_interval only.

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <sys/epoll.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "evloop_helpers.hpp"

namespace netio3::test::evloop {
namespace {

using std::chrono::milliseconds;

// A loop with the given options, running on its own thread until destroyed.
class OptionsLoop {
 public:
  explicit OptionsLoop(std::shared_ptr<EpollEventLoop> loop)
      : m_loop{std::move(loop)}, m_thread{[l = m_loop] { l->run(); }} {
    settle(*m_loop);
  }
  ~OptionsLoop() {
    m_loop->stop();
    m_thread.join();
  }
  OptionsLoop(const OptionsLoop&) = delete;
  OptionsLoop& operator=(const OptionsLoop&) = delete;
  OptionsLoop(OptionsLoop&&) = delete;
  OptionsLoop& operator=(OptionsLoop&&) = delete;
  EpollEventLoop& loop() { return *m_loop; }

 private:
  std::shared_ptr<EpollEventLoop> m_loop;
  std::thread m_thread;
};

// Counts the prepare-hook rounds, and those in which the loop said it was polling.
struct HookCounts {
  std::atomic<int> rounds{0};
  std::atomic<int> polling_rounds{0};
  Counter polled;           // polling rounds
  Counter sleepable;        // rounds after a polling one in which the loop may sleep again
  bool was_polling{false};  // loop thread only
};

PrepareHookHandle count_rounds(EpollEventLoop& loop, HookCounts& counts) {
  return on_loop(loop, [&] {
    return loop.add_prepare_hook([&] {
      ++counts.rounds;
      const bool polling = loop.polling();
      if (polling) {
        ++counts.polling_rounds;
        counts.polled.add();
      } else if (counts.was_polling) {
        counts.sleepable.add();
      }
      counts.was_polling = polling;
      return true;
    });
  });
}

TEST(EvloopBusyPoll, AfterAnEventTheLoopPollsForTheWindowThenSleeps) {
  OptionsLoop lt{std::make_shared<EpollEventLoop>(
      EpollEventLoop::Options{.busy_poll = std::chrono::microseconds{20'000}})};
  EpollEventLoop& loop = lt.loop();
  HookCounts counts;
  auto hook = count_rounds(loop, counts);
  Counter fired;
  auto signal = loop.create_signal([&] { fired.add(); });

  signal.fire();
  ASSERT_TRUE(fired.wait_at_least(1));
  // A sleeping loop calls the hook once or twice per event; a polling one many times.
  ASSERT_TRUE(counts.polled.wait_at_least(20)) << "the loop did not poll after the event";
  // The window ends: a round in which hooks may arm their wait objects, then sleep.
  ASSERT_TRUE(counts.sleepable.wait_at_least(1)) << "the loop never stopped polling";
  const int rounds_at_sleep = counts.rounds.load();
  const std::uint64_t wakeups_at_sleep = loop.wakeups();
  // Idle afterwards: a timer 100 ms later finds (almost) no rounds in between. A loop that
  // kept polling would have run thousands.
  Counter timer_fired;
  std::atomic<int> rounds_at_timer{0};
  auto timer = loop.create_timer([&] {
    rounds_at_timer = counts.rounds.load();
    timer_fired.add();
  });
  timer.start_once(milliseconds{100});
  ASSERT_TRUE(timer_fired.wait_at_least(1));
  EXPECT_LE(rounds_at_timer.load() - rounds_at_sleep, 4) << "an idle loop kept polling";
  // Empty polls are not wake-ups: the count grows by the events, not by the spinning.
  EXPECT_LE(loop.wakeups() - wakeups_at_sleep, 4U);
  EXPECT_LT(loop.wakeups(), static_cast<std::uint64_t>(counts.polling_rounds.load()));
  on_loop(loop, [&] {
    hook.close();
    timer.close();
    signal.close();
  });
}

TEST(EvloopBusyPoll, ALoopWithoutBusyPollNeverSaysItPolls) {
  OptionsLoop lt{std::make_shared<EpollEventLoop>(EpollEventLoop::Options{})};
  EpollEventLoop& loop = lt.loop();
  HookCounts counts;
  auto hook = count_rounds(loop, counts);
  Counter fired;
  auto signal = loop.create_signal([&] { fired.add(); });
  for (int i = 1; i <= 50; ++i) {
    signal.fire();
    ASSERT_TRUE(fired.wait_at_least(i));
  }
  settle(loop);
  EXPECT_EQ(counts.polling_rounds.load(), 0);
  EXPECT_GE(counts.rounds.load(), 50);
  on_loop(loop, [&] {
    hook.close();
    signal.close();
  });
}

TEST(EvloopBusyPoll, TheDefaultConstructorTakesTheWindowFromTheEnvironment) {
  const char* saved = std::getenv("NETIO3_BUSY_POLL_US");
  const std::string previous = saved != nullptr ? saved : "";
  ::setenv("NETIO3_BUSY_POLL_US", "20000", 1);
  auto from_env = std::make_shared<EpollEventLoop>();
  ::setenv("NETIO3_BUSY_POLL_US", "not a number", 1);
  auto invalid = std::make_shared<EpollEventLoop>();  // logged and ignored: 0
  if (saved != nullptr) {
    ::setenv("NETIO3_BUSY_POLL_US", previous.c_str(), 1);
  } else {
    ::unsetenv("NETIO3_BUSY_POLL_US");
  }
  for (const auto& [loop_ptr, expect_polling] : {std::pair{from_env, true}, {invalid, false}}) {
    OptionsLoop lt{loop_ptr};
    EpollEventLoop& loop = lt.loop();
    HookCounts counts;
    auto hook = count_rounds(loop, counts);
    Counter fired;
    auto signal = loop.create_signal([&] { fired.add(); });
    signal.fire();
    ASSERT_TRUE(fired.wait_at_least(1));
    if (expect_polling) {
      EXPECT_TRUE(counts.polled.wait_at_least(20));
    } else {
      settle(loop);
      EXPECT_EQ(counts.polling_rounds.load(), 0);
    }
    on_loop(loop, [&] {
      hook.close();
      signal.close();
    });
  }
}

// With a descriptor that is always ready, records the hook round and the time of every
// round in which the loop checked its descriptors (the fd callback runs then).
struct FdChecks {
  std::atomic<int> rounds{0};  // hook rounds
  std::mutex mutex;
  std::vector<std::pair<int, std::chrono::steady_clock::time_point>> checks;
  Counter count;
};

// Runs a loop that busy-polls with one hook (a polling one or a plain one) that always
// reports work, and an always-ready pipe; returns once `wanted` descriptor checks were seen.
std::vector<std::pair<int, std::chrono::steady_clock::time_point>> descriptor_checks(
    std::chrono::microseconds fd_interval, bool polling_hook, int wanted) {
  OptionsLoop lt{std::make_shared<EpollEventLoop>(EpollEventLoop::Options{
      .busy_poll = std::chrono::microseconds{10'000'000}, .busy_poll_fd_interval = fd_interval})};
  EpollEventLoop& loop = lt.loop();
  const Pipe pipe = make_pipe();
  const char byte = 1;
  if (::write(pipe.write.get(), &byte, 1) != 1) throw std::runtime_error("pipe write");
  FdChecks checks;
  auto round = [&] {
    ++checks.rounds;
    return false;  // found work: keep polling
  };
  // Both from the loop thread, the hook first: no descriptor check comes before the hook's
  // first round (a loop with the fd but no hook yet checks it round after round).
  std::optional<PrepareHookHandle> hook;
  auto fd = on_loop(loop, [&] {
    hook = polling_hook ? loop.add_polling_hook(round) : loop.add_prepare_hook(round);
    return loop.add_fd(pipe.read.get(), EPOLLIN, [&](std::uint32_t) {
      const std::lock_guard lock{checks.mutex};
      checks.checks.emplace_back(checks.rounds.load(), std::chrono::steady_clock::now());
      checks.count.add();
    });
  });
  EXPECT_TRUE(checks.count.wait_at_least(wanted)) << "the descriptors were not checked";
  on_loop(loop, [&] {
    hook->close();
    fd.close();
  });
  const std::lock_guard lock{checks.mutex};
  return checks.checks;
}

TEST(EvloopBusyPoll, WithAPollingHookDescriptorsAreCheckedOncePerInterval) {
  constexpr auto interval = std::chrono::milliseconds{50};
  const auto checks = descriptor_checks(interval, true, 5);
  ASSERT_GE(checks.size(), 5U);
  // The first check may come before the loop started polling; from then on, one per
  // interval with many hook rounds in between (every round would check them otherwise).
  for (std::size_t i = 2; i < checks.size(); ++i) {
    const auto rounds = checks[i].first - checks[i - 1].first;
    const auto gap = checks[i].second - checks[i - 1].second;
    EXPECT_GT(rounds, 1) << "check " << i;
    EXPECT_GE(gap, interval - std::chrono::milliseconds{5}) << "check " << i;
  }
}

TEST(EvloopBusyPoll, DescriptorsAreCheckedEveryRoundWithoutAPollingHookOrAnInterval) {
  for (const auto& [interval, polling_hook] : {std::pair{std::chrono::microseconds{50'000}, false},
                                               std::pair{std::chrono::microseconds{0}, true}}) {
    const auto checks = descriptor_checks(interval, polling_hook, 50);
    ASSERT_GE(checks.size(), 50U);
    for (std::size_t i = 2; i < checks.size(); ++i) {
      EXPECT_EQ(checks[i].first - checks[i - 1].first, 1)
          << "check " << i << (polling_hook ? ", polling hook, interval 0" : ", plain hook");
    }
  }
}

}  // namespace
}  // namespace netio3::test::evloop
