// UCX in RDMA mode between two processes of one host: 1 MiB zero-copy sends go by rendezvous
// (the receiver fetches the payload, by CMA here). With the receiving peer stopped (SIGSTOP)
// every such send stays pending in UCX; this process then ends them itself:
//
// * a local close: the close waits close_timeout for the sends, then closes the endpoint by
//   force. The closed callback comes, every key is reported exactly once (completed or
//   cancelled; the stopped peer fetched none, so at least one is cancelled), nothing after
//   the closed callback, one log line for the connection at most a few, none per message.
// * the backend destroyed: the destructor returns, no callback runs (sends still outstanding
//   are dropped: docs/semantics.md), no log line per message.
//
// Then the peer continues and must see its connection end, with what it received an intact,
// in-order prefix of the stream (a rendezvous it fetches after the end reads memory this
// process still holds: docs/ucx.md says what that means for the application).

#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "fault_fixture.hpp"

namespace netio3::faults {
namespace {

constexpr std::size_t SIZE = std::size_t{1} << 20U;
constexpr std::uint64_t WARM_UP = 16;  // delivered before the peer is stopped
constexpr std::uint64_t PENDING = 24;  // sent to the stopped peer
constexpr std::size_t SLOTS = 64;      // zero-copy region: WARM_UP + PENDING fit without reuse
constexpr auto CLOSE_TIMEOUT = std::chrono::milliseconds{300};
// Log lines of info and above that ending the connection may add: the close, the endpoint's
// error. One per message would be PENDING.
constexpr std::size_t MAX_LOG_LINES = 4;

enum class End { LOCAL_CLOSE, BACKEND_DESTROYED };

class RendezvousPending : public ::testing::TestWithParam<End> {};

TEST_P(RendezvousPending, EveryKeyEndsOnceWithoutALogLinePerMessage) {
  if (!Netio3Backend::is_available(BackendType::UCX))
    GTEST_SKIP() << "the UCX backend is not built";
  test::LogCapture log{LogLevel::info};
  std::vector<std::uint8_t> region(SLOTS * SIZE);  // outlives the backend (declared first)
  Side side{BackendType::UCX, SIZE,
            [](NetworkConfig& c) {
              c.limits.close_timeout = CLOSE_TIMEOUT;
              c.limits.max_unsent_bytes = SLOTS * SIZE;  // all PENDING accepted
            },
            NetworkMode::RDMA};
  PeerOptions options;
  options.backend = BackendType::UCX;
  options.network = NetworkMode::RDMA;
  options.listen = test::test_address();
  options.size = SIZE;
  options.progress = 1;
  std::unique_ptr<ChildProcess> peer;
  const auto remote = connect_peer(
      side, peer, options, connection_params(SendMode::ZERO_COPY, SIZE, region), std::nullopt);
  ASSERT_TRUE(remote.has_value());

  StreamSender sender{*side.backend, side.observer,
                      StreamPlan{.to = *remote,
                                 .mode = SendMode::ZERO_COPY,
                                 .message_size = SIZE,
                                 .stream = 1,
                                 .count = WARM_UP + PENDING},
                      region};
  ASSERT_EQ(sender.run({}, Clock::now() + WAIT, WARM_UP), StreamEnd::COUNT_REACHED)
      << sender.error();
  ASSERT_TRUE(side.observer.wait(
      [&](const Observer& o) { return o.connection(*remote)->ledger.completed == WARM_UP; },
      Clock::now() + WAIT))
      << side.observer.connection_copy(*remote)->ledger.summary() << "\n"
      << peer->describe();

  // ---- The peer stops; the rest is sent and cannot be fetched.
  ASSERT_TRUE(peer->stop()) << peer->describe();
  for (std::uint64_t i = 0; i < PENDING; ++i) {
    ASSERT_EQ(sender.try_send(), NetioStatus::OK) << "send " << WARM_UP + i;
  }
  const std::size_t lines_before = log.count("", LogLevel::info);
  const std::uint64_t generation_before = side.observer.generation_now();

  const auto started = Clock::now();
  if (GetParam() == End::LOCAL_CLOSE) {
    side.backend->close_active_endpoint(*remote);
    const auto closed_at = side.wait_closed(*remote, Clock::now() + WAIT);
    ASSERT_TRUE(closed_at.has_value())
        << side.observer.connection_copy(*remote)->ledger.summary() << "\n"
        << log.text();
    report_measurement(
        "close_ms", std::chrono::duration<double, std::milli>(*closed_at - started).count(), "ms");
    const auto conn = side.observer.connection_copy(*remote);
    EXPECT_TRUE(conn->ledger.violations.empty()) << conn->ledger.summary();
    EXPECT_EQ(conn->ledger.ok_sends, WARM_UP + PENDING) << conn->ledger.summary();
    EXPECT_EQ(conn->ledger.unreported(), 0U) << conn->ledger.summary();
    EXPECT_EQ(conn->ledger.completed + conn->ledger.cancelled, WARM_UP + PENDING)
        << conn->ledger.summary();
    EXPECT_GT(conn->ledger.cancelled, 0U)
        << "sends to a stopped peer completed: not by rendezvous?\n"
        << conn->ledger.summary();
  } else {
    side.backend.reset();
    report_measurement("destroy_ms",
                       std::chrono::duration<double, std::milli>(Clock::now() - started).count(),
                       "ms");
    EXPECT_EQ(side.observer.generation_now(), generation_before)
        << "a callback ran while the backend was destroyed";
  }
  const std::size_t lines = log.count("", LogLevel::info) - lines_before;
  EXPECT_LE(lines, MAX_LOG_LINES) << log.text();
  EXPECT_TRUE(side.observer.violations_copy().empty());

  // ---- The peer continues: its connection ends, what it got is an intact prefix.
  peer->signal(SIGCONT);
  ASSERT_TRUE(peer->read_until(
      [](const std::string& out) { return line_starting(out, "CLOSED ").has_value(); },
      Clock::now() + WAIT))
      << peer->describe();
  const auto closed = line_starting(peer->out(), "CLOSED ");
  const auto received = field(*closed, "received");
  ASSERT_TRUE(received.has_value()) << *closed;
  EXPECT_GE(*received, static_cast<std::int64_t>(WARM_UP)) << peer->describe();
  EXPECT_LE(*received, static_cast<std::int64_t>(WARM_UP + PENDING)) << peer->describe();
  EXPECT_EQ(field(*closed, "bad"), 0) << peer->describe();
  report_measurement("fetched_after_the_end", static_cast<double>(*received) - WARM_UP, "messages");
}

INSTANTIATE_TEST_SUITE_P(Faults, RendezvousPending,
                         ::testing::Values(End::LOCAL_CLOSE, End::BACKEND_DESTROYED),
                         [](const auto& param_info) {
                           return std::string{param_info.param == End::LOCAL_CLOSE
                                                  ? "LocalClose"
                                                  : "BackendDestroyed"};
                         });

}  // namespace
}  // namespace netio3::faults
