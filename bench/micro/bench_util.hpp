#pragma once

// Helpers shared by the microbenchmarks.

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <future>
#include <string>
#include <thread>

#include <benchmark/benchmark.h>
#include <netio3/event_loop.hpp>

namespace netio3::bench {

// Set when any benchmark found a wrong result; main() then exits with status 1 (Google
// Benchmark itself exits 0 after SkipWithError).
inline std::atomic<bool> g_failed{false};

inline void fail(benchmark::State& state, const std::string& what) {
  g_failed.store(true);
  std::fprintf(stderr, "netio3-microbench: wrong result: %s\n", what.c_str());
  state.SkipWithError(what.c_str());
}

// An EpollEventLoop running on its own thread for the lifetime of this object.
class LoopThread {
 public:
  LoopThread() {
    m_thread = std::thread{[this] { m_loop.run(); }};
    // Posted work runs only inside the dispatch loop: once it ran, run() is past its
    // start-up and run_sync() really goes through the loop.
    std::promise<void> started;
    auto ready = started.get_future();
    m_loop.post([&started] { started.set_value(); });
    ready.wait();
  }
  LoopThread(const LoopThread&) = delete;
  LoopThread& operator=(const LoopThread&) = delete;
  LoopThread(LoopThread&&) = delete;
  LoopThread& operator=(LoopThread&&) = delete;
  ~LoopThread() {
    m_loop.stop();
    m_thread.join();
  }
  [[nodiscard]] EpollEventLoop& loop() noexcept { return m_loop; }

 private:
  EpollEventLoop m_loop;
  std::thread m_thread;
};

// Blocks (futex) until `counter` reaches at least `target`.
inline void wait_until(const std::atomic<std::uint64_t>& counter, std::uint64_t target) {
  for (std::uint64_t seen = counter.load(std::memory_order_acquire); seen < target;
       seen = counter.load(std::memory_order_acquire)) {
    counter.wait(seen, std::memory_order_acquire);
  }
}

// Seconds per item (shown as e.g. "12.3us" in the counters column).
inline benchmark::Counter per_item(double items) {
  return benchmark::Counter{items, benchmark::Counter::kIsRate | benchmark::Counter::kInvert};
}

}  // namespace netio3::bench
