// A peer that stops reading: the receiving peer process is stopped with SIGSTOP while this
// process keeps sending, on every backend, buffered and (where supported) copying.
//
// What must hold: sends run into NO_RESOURCES (measured: the time from the stop to the first
// one), the memory of this process stays bounded while it keeps trying (it is the library,
// not the caller, that must refuse; RSS growth below max_unsent_bytes + the pools + a
// margin), and nothing is lost: once the peer continues, the rest of the stream goes out and
// the peer reports every message in order and intact.

#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "fault_fixture.hpp"

namespace netio3::faults {
namespace {

constexpr std::size_t SIZE = 4096;  // below UCX's rendezvous threshold: eager sends
// Smaller than the default so that the bound below is tight: the test checks that this
// limit, not the caller's patience, stops the sender.
constexpr std::size_t MAX_UNSENT = std::size_t{1} << 20U;
// Buffered: more buffers than MAX_UNSENT needs, so that max_unsent_bytes (send_buffer's
// NO_RESOURCES), not an empty pool (get_buffer's nullptr), is what stops the sender.
constexpr std::size_t NUM_BUF = 2 * MAX_UNSENT / SIZE;
constexpr std::uint64_t WARM_UP = 200;  // messages the peer reads before it is stopped
constexpr std::uint64_t TOTAL = 12000;  // the whole stream, ~47 MiB
// Sends tried after the first NO_RESOURCES while the peer is still stopped (~78 MiB if
// they were all taken: far above the RSS bound).
constexpr std::uint64_t PRESSURE = 20000;
// asyncmsg keeps up to 32 staging chunks of 256 KiB for copied bytes; the other backends
// copy into per-send memory that counts against max_unsent_bytes.
constexpr std::size_t STAGING = std::size_t{32} * (256U << 10U);
// Allocator slack, UCX and libfabric internals touched for the first time, page tables.
// Under a sanitizer more: ASan keeps freed memory in quarantine (256 MiB by default); both
// sanitizers' shadow memory grows with what the process touches (measured growth: ~11 MiB
// under both, ~2 MiB without).
constexpr std::size_t MARGIN = std::size_t{test::SANITIZED ? 64 : 16} << 20U;

class PeerStopped : public ::testing::TestWithParam<std::tuple<BackendType, SendMode>> {
 protected:
  [[nodiscard]] BackendType type() const { return std::get<0>(GetParam()); }
  [[nodiscard]] SendMode mode() const { return std::get<1>(GetParam()); }
  ProviderEnvironment env{type()};
};

TEST_P(PeerStopped, SendsHitNoResourcesMemoryStaysBoundedAndNothingIsLost) {
  if (mode() == SendMode::COPY && type() == BackendType::LIBFABRIC) {
    GTEST_SKIP() << "libfabric: send_data_copy is NotSupported (docs/libfabric.md)";
  }
  Side side{type(), SIZE, [](NetworkConfig& c) { c.limits.max_unsent_bytes = MAX_UNSENT; }};
  auto params = connection_params(mode(), SIZE, {}, NUM_BUF);
  params.recv_params.num_buf = 4;  // this side only sends

  PeerOptions options;
  options.backend = type();
  options.listen = test::test_address();
  options.messages = TOTAL;
  options.size = SIZE;
  options.progress = 100;
  std::unique_ptr<ChildProcess> peer;
  const auto remote = connect_peer(side, peer, options, params, std::nullopt);
  ASSERT_TRUE(remote.has_value());

  StreamSender sender{
      *side.backend, side.observer,
      StreamPlan{.to = *remote, .mode = mode(), .message_size = SIZE, .stream = 1, .count = TOTAL}};
  ASSERT_EQ(sender.run({}, Clock::now() + WAIT, WARM_UP), StreamEnd::COUNT_REACHED)
      << sender.error();
  ASSERT_TRUE(peer->read_until(
      [](const std::string& out) { return last_number(out, "RECEIVED ").value_or(0) >= WARM_UP; },
      Clock::now() + WAIT))
      << peer->describe();

  // ---- The peer stops reading.
  const std::size_t rss_before = test::rss_bytes();
  ASSERT_TRUE(peer->stop()) << peer->describe();
  const auto stopped_at = Clock::now();
  NetioStatus status = NetioStatus::OK;
  while (sender.sent() < TOTAL && status == NetioStatus::OK) status = sender.try_send();
  ASSERT_EQ(status, NetioStatus::NO_RESOURCES)
      << "all " << TOTAL << " messages (" << TOTAL * SIZE
      << " bytes) were accepted for a peer that does not read";
  const auto first_no_resources = Clock::now();
  const std::uint64_t accepted_until_refused = sender.sent() - WARM_UP;
  // The caller insists; the library must keep refusing instead of queueing.
  std::uint64_t accepted_under_pressure = 0;
  // Until send_buffer itself refuses, too: get_buffer may run dry first while the loop has
  // not yet handed back the buffers of sends the transport took at once (UCX), which a
  // loaded machine makes likely.
  const auto pressure_deadline = Clock::now() + WAIT;
  for (std::uint64_t i = 0; (i < PRESSURE || sender.no_resources() == 0) && sender.sent() < TOTAL &&
                            Clock::now() < pressure_deadline;
       ++i) {
    status = sender.try_send();
    ASSERT_NE(status, NetioStatus::FAILED);
    if (status == NetioStatus::OK) ++accepted_under_pressure;
  }
  const std::size_t rss_after = test::rss_bytes();
  const std::size_t growth = rss_after > rss_before ? rss_after - rss_before : 0;

  report_measurement(
      "time_to_no_resources",
      std::chrono::duration<double, std::milli>(first_no_resources - stopped_at).count(), "ms");
  report_measurement(
      "accepted_while_stopped",
      static_cast<double>((accepted_until_refused + accepted_under_pressure) * SIZE) / 1024.0,
      "KiB");
  report_measurement("rss_growth", static_cast<double>(growth) / 1024.0, "KiB");
  // send_buffer / send_data_copy said NO_RESOURCES (not only get_buffer running dry).
  EXPECT_GT(sender.no_resources(), 0U) << "no_buffer=" << sender.no_buffer();
  const std::size_t pools = mode() == SendMode::BUFFERED ? NUM_BUF * SIZE : STAGING;
  EXPECT_LT(growth, MAX_UNSENT + pools + MARGIN)
      << "RSS grew by " << growth << " bytes while the peer was stopped; "
      << accepted_until_refused + accepted_under_pressure << " messages accepted";

  // ---- The peer reads again: the rest of the stream goes out, nothing was lost.
  peer->signal(SIGCONT);
  ASSERT_EQ(sender.run({}, Clock::now() + WAIT), StreamEnd::COUNT_REACHED) << sender.error();
  ASSERT_TRUE(peer->read_until(
      [](const std::string& out) { return line_starting(out, "DONE ").has_value(); },
      Clock::now() + WAIT))
      << peer->describe();
  EXPECT_EQ(line_starting(peer->out(), "DONE "), fmt::format("DONE received={} bad=0", TOTAL))
      << peer->describe();
  ASSERT_TRUE(side.observer.wait(
      [&](const Observer& o) { return o.connection(*remote)->ledger.completed == TOTAL; },
      Clock::now() + WAIT))
      << side.observer.connection_copy(*remote)->ledger.summary();
  side.backend->close_active_endpoint(*remote);
  ASSERT_TRUE(side.wait_closed(*remote, Clock::now() + WAIT).has_value());
  EXPECT_EQ(peer->wait(), 0) << peer->describe();
  const auto conn = side.observer.connection_copy(*remote);
  EXPECT_TRUE(conn->ledger.violations.empty()) << conn->ledger.summary();
  EXPECT_EQ(conn->ledger.ok_sends, TOTAL) << conn->ledger.summary();
  EXPECT_EQ(conn->ledger.cancelled, 0U) << conn->ledger.summary();
}

INSTANTIATE_TEST_SUITE_P(Faults, PeerStopped,
                         ::testing::Combine(::testing::ValuesIn(backends()),
                                            ::testing::Values(SendMode::BUFFERED, SendMode::COPY)),
                         [](const auto& param_info) {
                           return name_of(std::get<0>(param_info.param)) + "_" +
                                  std::string{to_string(std::get<1>(param_info.param))};
                         });

}  // namespace
}  // namespace netio3::faults
