// Event loop: cost per dispatched callback (post, ready fd, signal, timer), signal round
// trips between threads, and the cost of the calls other threads make into a loop.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <string>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <thread>
#include <type_traits>
#include <unistd.h>
#include <vector>

#include <benchmark/benchmark.h>
#include <netio3/event_loop.hpp>

#include "bench_util.hpp"

namespace netio3::bench {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t BATCH = 1000;  // callbacks per benchmark iteration

double thread_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// ---- post() from the loop thread -----------------------------------------------------

// Each posted function posts the next one: every item is a full wake cycle (post writes the
// wake eventfd, epoll_wait returns, the loop reads it and swaps the queue). range(0) prepare
// hooks (returning true) are registered, as every backend registers one: they run once per
// loop iteration.
void BM_Loop_PostChain(benchmark::State& state) {
  EpollEventLoop loop;
  std::vector<PrepareHookHandle> hooks;
  std::uint64_t hook_calls = 0;
  for (std::int64_t i = 0; i < state.range(0); ++i) {
    hooks.push_back(loop.add_prepare_hook([&hook_calls] {
      ++hook_calls;
      return true;
    }));
  }
  struct Chain {
    EpollEventLoop* loop;
    std::uint64_t count;
    void step() {
      if (++count % BATCH == 0) {
        loop->stop();
        return;
      }
      loop->post([this] { step(); });
    }
  } chain{&loop, 0};
  for (auto _ : state) {
    loop.post([&chain] { chain.step(); });
    loop.run();
  }
  const auto expected = static_cast<std::uint64_t>(state.iterations()) * BATCH;
  if (chain.count != expected) {
    fail(state, "ran " + std::to_string(chain.count) + " posted functions, expected " +
                    std::to_string(expected));
  }
  if (state.range(0) > 0 && hook_calls < expected) fail(state, "prepare hooks did not run");
  state.SetItemsProcessed(static_cast<std::int64_t>(expected));
  state.SetLabel("1 post per wakeup");
}
BENCHMARK(BM_Loop_PostChain)->ArgName("hooks")->Arg(0)->Arg(1)->Arg(4);

// One function posts BATCH functions at once; they run in one wakeup: the per-item cost of
// post() (lock, std::function move, vector push) and of dispatching it. CaptureWords: the
// size of the posted lambda in 8-byte words. 1 fits std::function's small buffer; 4 (a
// weak_ptr plus a shared_ptr, what the backends post) makes every post() allocate.
template <std::size_t CaptureWords>
void BM_Loop_PostBatch(benchmark::State& state) {
  static_assert(CaptureWords >= 1);
  EpollEventLoop loop;
  struct Ctx {
    EpollEventLoop* loop;
    std::uint64_t count;
    std::uint64_t target;
  } ctx{&loop, 0, 0};
  struct Empty {};
  using Pad =
      std::conditional_t<CaptureWords == 1, Empty, std::array<std::uint64_t, CaptureWords - 1>>;
  struct Capture {
    Ctx* ctx;
    [[no_unique_address]] Pad pad;
  };
  const Capture capture{&ctx, {}};
  const auto item = [capture] {
    benchmark::DoNotOptimize(capture.pad);
    if (++capture.ctx->count == capture.ctx->target) capture.ctx->loop->stop();
  };
  static_assert(sizeof(item) == 8 * CaptureWords);
  for (auto _ : state) {
    ctx.target += BATCH;
    loop.post([&] {
      for (std::uint64_t i = 0; i < BATCH; ++i) loop.post(item);
    });
    loop.run();
  }
  if (ctx.count != ctx.target) fail(state, "posted functions lost or run twice");
  state.SetItemsProcessed(static_cast<std::int64_t>(ctx.count));
  state.SetLabel(std::to_string(8 * CaptureWords) + "-byte capture");
}
BENCHMARK_TEMPLATE(BM_Loop_PostBatch, 1);
BENCHMARK_TEMPLATE(BM_Loop_PostBatch, 4);

// ---- post() and run_sync() from another thread ----------------------------------------

// The benchmark thread posts BATCH functions to a loop running on another thread and waits
// until all have run: throughput of cross-thread posting (producer and loop race).
void BM_Loop_PostFromOtherThread(benchmark::State& state) {
  std::atomic<std::uint64_t> done{0};  // outlives the loop thread
  LoopThread lt;
  std::uint64_t target = 0;
  for (auto _ : state) {
    target += BATCH;
    for (std::uint64_t i = 0; i < BATCH; ++i) {
      lt.loop().post([&done, target] {
        if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == target) done.notify_one();
      });
    }
    wait_until(done, target);
  }
  if (done.load() != target) fail(state, "posted functions lost or run twice");
  state.SetItemsProcessed(static_cast<std::int64_t>(target));
  state.counters["wakeups_per_item"] =
      static_cast<double>(lt.loop().wakeups()) / static_cast<double>(target);
}
BENCHMARK(BM_Loop_PostFromOtherThread)->UseRealTime();

// run_sync() from another thread: post, wake, run, condition variable back. Latency.
void BM_Loop_RunSyncFromOtherThread(benchmark::State& state) {
  std::uint64_t runs = 0;  // loop thread only; run_sync orders it with this thread
  bool wrong_thread = false;
  LoopThread lt;
  for (auto _ : state) {
    lt.loop().run_sync([&] {
      ++runs;
      if (!lt.loop().in_loop_thread()) wrong_thread = true;
    });
  }
  if (runs != static_cast<std::uint64_t>(state.iterations())) fail(state, "run_sync lost a call");
  if (wrong_thread) fail(state, "run_sync ran the function outside the loop thread");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Loop_RunSyncFromOtherThread)->UseRealTime();

// ---- ready file descriptors -------------------------------------------------------------

// range(0) eventfds that stay readable (level-triggered, never read): each epoll_wait
// returns all of them; the cost per fd callback is dispatch plus a share of epoll_wait.
void BM_Loop_FdReady(benchmark::State& state) {
  EpollEventLoop loop;
  const auto fds = static_cast<std::size_t>(state.range(0));
  std::vector<int> efds;
  std::vector<FdHandle> handles;
  std::uint64_t count = 0;
  std::uint64_t target = 0;
  bool wrong_events = false;
  for (std::size_t i = 0; i < fds; ++i) {
    const int efd = ::eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd < 0) {
      fail(state, "eventfd failed");
      for (const int fd : efds) ::close(fd);
      return;
    }
    efds.push_back(efd);
    handles.push_back(loop.add_fd(efd, EPOLLIN, [&](std::uint32_t events) {
      if ((events & EPOLLIN) == 0) wrong_events = true;
      if (++count == target) loop.stop();
    }));
  }
  for (auto _ : state) {
    target += BATCH;
    loop.run();
  }
  if (count != target) fail(state, "fd callbacks: wrong count");
  if (wrong_events) fail(state, "fd callback without EPOLLIN");
  state.SetItemsProcessed(static_cast<std::int64_t>(count));
  state.counters["callbacks_per_wakeup"] =
      static_cast<double>(count) / static_cast<double>(loop.wakeups());
  handles.clear();
  for (const int fd : efds) ::close(fd);
}
BENCHMARK(BM_Loop_FdReady)->ArgName("fds")->Arg(1)->Arg(16);

// ---- signals ----------------------------------------------------------------------------

// A signal whose callback fires it again (loop thread only): write, epoll_wait, read and
// dispatch per callback.
void BM_Loop_SignalSelfFire(benchmark::State& state) {
  EpollEventLoop loop;
  std::uint64_t count = 0;
  EventSignalHandle signal;
  signal = loop.create_signal([&] {
    if (++count % BATCH == 0) {
      loop.stop();
    } else {
      signal.fire();
    }
  });
  for (auto _ : state) {
    signal.fire();
    loop.run();
  }
  const auto expected = static_cast<std::uint64_t>(state.iterations()) * BATCH;
  if (count != expected) fail(state, "signal callbacks: wrong count");
  state.SetItemsProcessed(static_cast<std::int64_t>(count));
}
BENCHMARK(BM_Loop_SignalSelfFire);

// fire() of a signal that is already pending (the loop is not running): the coalescing
// case of many senders kicking the same flush signal. Afterwards the callback must run
// exactly once.
void BM_Signal_FirePending(benchmark::State& state) {
  EpollEventLoop loop;
  std::uint64_t calls = 0;
  auto signal = loop.create_signal([&] {
    ++calls;
    loop.post([&loop] { loop.stop(); });
  });
  signal.fire();
  for (auto _ : state) signal.fire();
  loop.run();
  if (calls != 1) fail(state, "coalesced signal ran " + std::to_string(calls) + " times");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Signal_FirePending);

// fire() from another thread while the loop runs and drains the signal: what a sending
// thread pays to kick the loop (the write wakes the loop thread).
void BM_Signal_FireToRunningLoop(benchmark::State& state) {
  std::atomic<std::uint64_t> calls{0};
  {
    LoopThread lt;
    auto signal = lt.loop().create_signal([&] { calls.fetch_add(1, std::memory_order_relaxed); });
    for (auto _ : state) signal.fire();
    // The loop thread may not have been scheduled yet (busy machine): give it time to see
    // the last fire; coalesced fires run the callback once.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (calls.load() == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
  }
  const auto n = calls.load();
  if (n == 0 || n > static_cast<std::uint64_t>(state.iterations())) {
    fail(state, "signal callbacks: " + std::to_string(n));
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["callbacks_per_fire"] =
      static_cast<double>(n) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_Signal_FireToRunningLoop)->UseRealTime();

// Round trip: the benchmark thread fires a signal; its callback on the loop thread bumps
// an atomic the benchmark thread waits on. range(0): 0 = the waiter blocks (futex),
// 1 = it spins.
void BM_Signal_RoundTripThreadLoop(benchmark::State& state) {
  const bool spin = state.range(0) != 0;
  std::atomic<std::uint64_t> acks{0};
  std::uint64_t sent = 0;
  {
    LoopThread lt;
    auto signal = lt.loop().create_signal([&] {
      acks.fetch_add(1, std::memory_order_acq_rel);
      if (!spin) acks.notify_one();
    });
    for (auto _ : state) {
      signal.fire();
      ++sent;
      if (spin) {
        while (acks.load(std::memory_order_acquire) < sent) {
        }
      } else {
        wait_until(acks, sent);
      }
    }
  }
  if (acks.load() != sent) fail(state, "round trips lost");
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(spin ? "waiter spins" : "waiter blocks");
}
BENCHMARK(BM_Signal_RoundTripThreadLoop)->ArgName("spin")->Arg(0)->Arg(1)->UseRealTime();

// Ping-pong between two loops on two threads: loop A's signal callback fires loop B's, whose
// callback fires A's again. One item = one round trip (two cross-thread signals).
void BM_Signal_PingPongTwoLoops(benchmark::State& state) {
  constexpr std::uint64_t ROUNDS = 100;
  std::atomic<std::uint64_t> finished{0};
  std::uint64_t rounds = 0;  // loop A's thread only (read after it joined)
  std::uint64_t target = 0;
  {
    LoopThread a;
    LoopThread b;
    EventSignalHandle to_a;
    EventSignalHandle to_b;
    to_a = a.loop().create_signal([&] {
      if (++rounds % ROUNDS == 0) {
        finished.fetch_add(1, std::memory_order_acq_rel);
        finished.notify_one();
      } else {
        to_b.fire();
      }
    });
    to_b = b.loop().create_signal([&] { to_a.fire(); });
    for (auto _ : state) {
      ++target;
      to_b.fire();
      wait_until(finished, target);
    }
    a.loop().run_sync([] {});
  }
  const auto expected = static_cast<std::uint64_t>(state.iterations()) * ROUNDS;
  if (rounds != expected) fail(state, "ping-pong lost a round");
  state.SetItemsProcessed(static_cast<std::int64_t>(expected));
  state.counters["round_trip"] = per_item(static_cast<double>(expected));
}
BENCHMARK(BM_Signal_PingPongTwoLoops)->UseRealTime();

// ---- timers -------------------------------------------------------------------------------

// A periodic 1 ms timer: each iteration waits for one callback. The rate is fixed by the
// period; what matters is the loop thread's CPU time per timer callback (cpu_per_cb) and
// that the timer neither fires early nor is lost (mean interval close to 1 ms).
void BM_Loop_Timer1ms(benchmark::State& state) {
  EpollEventLoop loop;
  std::uint64_t calls = 0;
  auto timer = loop.create_timer([&] {
    ++calls;
    loop.stop();
  });
  timer.start(1ms);
  const auto t0 = std::chrono::steady_clock::now();
  const double cpu0 = thread_cpu_seconds();
  for (auto _ : state) loop.run();
  const double cpu = thread_cpu_seconds() - cpu0;
  const std::chrono::duration<double> wall = std::chrono::steady_clock::now() - t0;
  timer.stop();
  if (calls != static_cast<std::uint64_t>(state.iterations())) fail(state, "timer: wrong count");
  const double interval = wall.count() / static_cast<double>(calls);
  if (interval < 0.9e-3) fail(state, "timer fires faster than its period");
  state.SetItemsProcessed(state.iterations());
  state.counters["cpu_per_cb_us"] = cpu / static_cast<double>(calls) * 1e6;
  state.counters["interval_us"] = interval * 1e6;
}
BENCHMARK(BM_Loop_Timer1ms)->UseRealTime();

// Re-arming and stopping a timer (start_once + stop: two timerfd_settime calls), as the
// set-up deadline and close paths do. Afterwards a 1 ms one-shot must fire exactly once.
void BM_Timer_ArmStop(benchmark::State& state) {
  EpollEventLoop loop;
  std::uint64_t calls = 0;
  auto timer = loop.create_timer([&] {
    ++calls;
    loop.post([&loop] { loop.stop(); });
  });
  for (auto _ : state) {
    timer.start_once(10s);
    timer.stop();
  }
  timer.start_once(1ms);
  loop.run();
  if (calls != 1) fail(state, "one-shot timer ran " + std::to_string(calls) + " times");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Timer_ArmStop);

// Registering and closing a signal (eventfd, epoll_ctl ADD/DEL, allocations) on a running
// loop, from another thread: per-connection set-up cost, not per message.
void BM_Loop_CreateCloseSignal(benchmark::State& state) {
  LoopThread lt;
  std::uint64_t created = 0;
  for (auto _ : state) {
    auto signal = lt.loop().create_signal([] {});
    if (signal) ++created;
    signal.close();
  }
  if (created != static_cast<std::uint64_t>(state.iterations())) fail(state, "create failed");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Loop_CreateCloseSignal)->UseRealTime();

}  // namespace
}  // namespace netio3::bench
