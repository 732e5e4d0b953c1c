// Fairness of the loop under a flood of completions (label `reliability`): sending threads
// whose sends end quickly, and a completion callback slower than a send. Each ended send is
// reported on the loop thread, and reporting it frees what lets the next send start, so the
// senders can keep the loop supplied for as long as they run. A loop that reports everything
// before it turns to other work then runs no timer and reads no other descriptor: its
// heartbeats stop, and the peer closes the connection as silent (seen with UCX under TSan,
// then reproduced on every backend with this test: the loop's timer did not tick for 11-20 s).
// Each backend stops after a time budget and comes back on the loop's next round.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "test_support.hpp"

namespace netio3::reliability {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::Recorder;

class Fairness : public ::testing::TestWithParam<BackendType> {};

TEST_P(Fairness, ALoopFloodedWithCompletionsStillRunsItsTimers) {
  constexpr auto PEER_TIMEOUT = 2000ms;
  constexpr auto TICK = 10ms;
  constexpr std::size_t TICKS = 50;  // the flood lasts until then, or FLOOD
  constexpr auto FLOOD = 3000ms;     // more than PEER_TIMEOUT: a starved loop loses the peer
  constexpr std::size_t SENDERS = 2;
  constexpr std::size_t SIZE = 64;
  const BackendType type = GetParam();
  const NetworkMode mode = test::mode_for(type);
  Recorder server_rec;
  Recorder client_rec;
  test::LoopThread server_loop;
  test::LoopThread client_loop;
  std::atomic<std::uint64_t> received{0};
  std::atomic<std::uint64_t> completed{0};
  auto server_config = server_rec.config(ThreadSafetyModel::SAFE, mode);
  server_config.limits.peer_timeout = PEER_TIMEOUT;
  server_config.on_data_cb = [&](std::span<const std::uint8_t>) { ++received; };
  auto client_config = client_rec.config(ThreadSafetyModel::SAFE, mode);
  client_config.limits.peer_timeout = PEER_TIMEOUT;
  client_config.on_send_completed_cb = [&](const EndPointAddress&, std::uint64_t) {
    const auto until = Clock::now() + 20us;  // an application that does some work per key
    while (Clock::now() < until) {
    }
    ++completed;
  };
  auto server = Netio3Backend::create(type, std::move(server_config), server_loop.loop());
  auto client = Netio3Backend::create(type, std::move(client_config), client_loop.loop());
  const ConnectionParameters params{.recv_params = {.buf_size = 4096, .num_buf = 256},
                                    .send_buffered_params = {.buf_size = 4096, .num_buf = 256}};
  const auto listener = server->open_listen_endpoint({"127.0.0.1", 0}, params);
  client->open_active_endpoint(listener, params);
  ASSERT_TRUE(
      client_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));

  // The client's loop's own timer: the longest gap between its ticks.
  std::mutex mutex;
  std::condition_variable cv;
  std::size_t ticks = 0;
  Clock::duration longest{};
  Clock::time_point last = Clock::now();
  auto timer = client_loop.loop()->create_timer([&] {
    const auto now = Clock::now();
    const std::lock_guard lock{mutex};
    longest = std::max(longest, now - last);
    last = now;
    ++ticks;
    cv.notify_all();
  });
  // Copy sends where the connection has them (asyncmsg packs many into one write, UCX ends
  // them at once), else buffered sends (libfabric: RDMA from registered memory only).
  const auto established = client_rec.snapshot();
  const auto opened = std::find_if(established.begin(), established.end(), [](const auto& e) {
    return e.kind == Recorder::Kind::ESTABLISHED;
  });
  ASSERT_NE(opened, established.end());
  const bool copy = opened->caps.send_copy;
  std::atomic<bool> stop{false};
  std::vector<std::thread> senders;
  for (std::size_t i = 0; i < SENDERS; ++i) {
    senders.emplace_back([&, i] {
      const std::vector<std::uint8_t> payload(SIZE, static_cast<std::uint8_t>(i));
      std::uint64_t key = std::uint64_t{i} << 48U;
      while (!stop.load(std::memory_order_relaxed)) {
        try {
          NetioStatus status = NetioStatus::NO_RESOURCES;
          if (copy) {
            status = client->send_data_copy(listener, payload, {}, key);
            key += status == NetioStatus::OK ? 1 : 0;
          } else {
            // A buffer lives until the connection's closed callback (hold_buffers).
            const auto hold = client_rec.hold_buffers();
            NetworkBuffer* buffer = client->get_buffer(listener);
            if (buffer != nullptr) {
              buffer->resize(SIZE);
              status = client->send_buffer(listener, buffer);
            }
          }
          if (status == NetioStatus::FAILED) return;
          // NO_RESOURCES: the loop reports completions first.
          if (status != NetioStatus::OK) std::this_thread::yield();
        } catch (const UnknownActiveEndpoint&) {
          return;  // closed: the test fails on the closed callback below
        }
      }
    });
  }
  {
    const std::lock_guard lock{mutex};
    last = Clock::now();
  }
  timer.start(TICK);
  {
    // The flood's length, not a synchronisation: whatever the loop did meanwhile is judged.
    std::unique_lock lock{mutex};
    (void)cv.wait_for(lock, FLOOD, [&] { return ticks >= TICKS; });
    longest = std::max(longest, Clock::now() - last);  // a loop that stopped ticking
  }
  stop = true;
  for (auto& t : senders) t.join();
  client_loop.loop()->run_sync([&] { timer.close(); });
  const auto ms = [](auto d) {
    return static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
  };
  const std::lock_guard lock{mutex};
  std::printf(
      "[ measure  ] %s: %zu ticks, longest gap %lld ms, %llu sends completed, %llu "
      "received\n",
      std::string{to_string(type)}.c_str(), ticks, ms(longest),
      static_cast<unsigned long long>(completed.load()),
      static_cast<unsigned long long>(received.load()));
  EXPECT_GE(ticks, 2U) << "the client's loop's timer";
  EXPECT_LT(longest, PEER_TIMEOUT / 2)
      << "the client's loop did not tick for " << ms(longest) << " ms";
  EXPECT_GT(completed.load(), 0U);
  EXPECT_EQ(client_rec.count_now(Recorder::Kind::CLOSED), 0U)
      << "the connection closed during the flood";
  EXPECT_EQ(server_rec.count_now(Recorder::Kind::CLOSED), 0U)
      << "the connection closed during the flood";
}

INSTANTIATE_TEST_SUITE_P(Backends, Fairness, ::testing::ValuesIn(Netio3Backend::available()),
                         [](const ::testing::TestParamInfo<BackendType>& p) {
                           return std::string{to_string(p.param)};
                         });

}  // namespace
}  // namespace netio3::reliability
