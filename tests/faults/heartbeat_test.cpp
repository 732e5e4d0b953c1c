// Heartbeats on a healthy connection (limits.peer_timeout, src/common/liveness.hpp): an idle
// connection between two backends, each on its own loop, peer_timeout 1 s (heartbeats every
// 100 ms). Over 15 s - fifteen timeouts, 150 heartbeats each way - neither side closes it,
// and each loop wakes at the heartbeat rate: its own tick and the peer's heartbeat, about
// 20 times a second, not more (the loop sleeps in between) and not much less (the
// heartbeats are really sent and read). The other half, a dead peer noticed within the timeout, is
// LinkCut (link_cut_test.cpp).

#include <algorithm>
#include <array>
#include <chrono>
#include <iostream>
#include <vector>

#include <gtest/gtest.h>

#include "fault_fixture.hpp"

namespace netio3::faults {
namespace {

constexpr auto PEER_TIMEOUT = 1000ms;
// docs/reliability.md: a heartbeat every peer_timeout / 10.
constexpr auto PERIOD = PEER_TIMEOUT / 10;
constexpr auto IDLE = 15s;
constexpr std::size_t SIZE = 1024;

class Heartbeats : public ::testing::TestWithParam<BackendType> {};

TEST_P(Heartbeats, AnIdleHealthyConnectionStaysOpenAndItsLoopsWakeOnlyForHeartbeats) {
  const ProviderEnvironment env{GetParam()};
  const auto tweak = [](NetworkConfig& config) { config.limits.peer_timeout = PEER_TIMEOUT; };
  Side server{GetParam(), SIZE, tweak};
  Side client{GetParam(), SIZE, tweak};
  std::array<std::uint8_t, SIZE> region{};
  const auto params = connection_params(SendMode::BUFFERED, SIZE, region, 8);
  const auto listen = server.backend->open_listen_endpoint({"127.0.0.1", 0}, params);
  client.backend->open_active_endpoint(listen, params);
  const auto established = [](const Observer& o) { return o.established_count() == 1; };
  ASSERT_TRUE(server.observer.wait(established, Clock::now() + WAIT));
  ASSERT_TRUE(client.observer.wait(established, Clock::now() + WAIT));

  const std::array<Side*, 2> sides{&server, &client};
  std::array<std::uint64_t, 2> before{};
  for (std::size_t i = 0; i < sides.size(); ++i) before.at(i) = sides.at(i)->loop.loop()->wakeups();
  const auto started = Clock::now();
  const auto closed = [](const Observer& o) {
    return std::ranges::any_of(o.connections(), [](const auto& c) { return c.closed; });
  };
  // Waits out IDLE unless the connection closes.
  EXPECT_FALSE(server.observer.wait(closed, started + IDLE)) << "the server closed it";
  EXPECT_FALSE(client.observer.holds(closed)) << "the client closed it";
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();

  const double period = std::chrono::duration<double>(PERIOD).count();
  const double expected = 2.0 / period;  // own tick + the peer's heartbeat, per second
  for (std::size_t i = 0; i < sides.size(); ++i) {
    const auto woke = sides.at(i)->loop.loop()->wakeups() - before.at(i);
    const double rate = static_cast<double>(woke) / seconds;
    report_measurement(i == 0 ? "server_wakeups_per_s" : "client_wakeups_per_s", rate, "1/s");
    EXPECT_LE(rate, 1.5 * expected + 1.0) << "the idle loop wakes for more than heartbeats";
    EXPECT_GE(rate, 0.4 * expected) << "the heartbeat timer does not run";
  }
  EXPECT_TRUE(server.observer.violations_copy().empty());
  EXPECT_TRUE(client.observer.violations_copy().empty());
}

INSTANTIATE_TEST_SUITE_P(Faults, Heartbeats, ::testing::ValuesIn(backends()),
                         [](const auto& param_info) { return name_of(param_info.param); });

}  // namespace
}  // namespace netio3::faults
