// EpollEventLoop driven by a host loop (attach / fd / run_once / detach), as the Python
// package drives it from asyncio: the host here is a poll() on fd() with a deadline.

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <poll.h>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "test_support.hpp"

namespace netio3::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// The host loop: calls run_once() whenever fd() is readable or the last round asked for
// another, until `done()` or the deadline. Returns done().
template <typename Done>
bool host_until(EpollEventLoop& loop, Done done, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = Clock::now() + timeout;
  bool again = true;
  while (!done()) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return done();
    pollfd p{.fd = loop.fd(), .events = POLLIN, .revents = 0};
    const int ready = ::poll(&p, 1, again ? 0 : static_cast<int>(left.count()));
    if (ready < 0) return false;
    again = !loop.run_once();
  }
  return true;
}

// True when fd() becomes readable within `timeout` (without running the loop).
bool readable_within(const EpollEventLoop& loop, std::chrono::milliseconds timeout) {
  pollfd p{.fd = loop.fd(), .events = POLLIN, .revents = 0};
  return ::poll(&p, 1, static_cast<int>(timeout.count())) == 1;
}

TEST(EvloopEmbed, TheAttachedThreadIsTheLoopThreadUntilDetach) {
  EpollEventLoop loop;
  EXPECT_FALSE(loop.is_running());
  loop.attach();
  EXPECT_TRUE(loop.is_running());
  EXPECT_TRUE(loop.in_loop_thread());
  EXPECT_THROW(loop.attach(), std::logic_error);
  EXPECT_THROW(loop.run(), std::logic_error) << "run() while attached";
  std::thread other{[&] {
    EXPECT_FALSE(loop.in_loop_thread());
    EXPECT_THROW((void)loop.run_once(), std::logic_error);
    EXPECT_THROW(loop.detach(), std::logic_error);
  }};
  other.join();
  loop.detach();
  EXPECT_FALSE(loop.is_running());
  EXPECT_THROW((void)loop.run_once(), std::logic_error) << "run_once() after detach";
}

TEST(EvloopEmbed, PostedWorkMakesTheFdReadableAndRunsInRunOnce) {
  EpollEventLoop loop;
  loop.attach();
  EXPECT_TRUE(loop.run_once()) << "an idle loop may sleep";
  EXPECT_FALSE(readable_within(loop, 0ms)) << "nothing to do: the host may sleep";
  bool ran = false;
  std::thread poster{[&] { loop.post([&] { ran = true; }); }};
  poster.join();
  EXPECT_TRUE(readable_within(loop, 5s));
  EXPECT_FALSE(ran) << "nothing runs outside run_once()";
  EXPECT_TRUE(host_until(loop, [&] { return ran; }));
  loop.detach();
}

TEST(EvloopEmbed, RunSyncFromAnotherThreadWaitsForTheHostsNextRound) {
  EpollEventLoop loop;
  loop.attach();
  std::thread::id ran_on{};
  auto done = std::async(std::launch::async,
                         [&] { loop.run_sync([&] { ran_on = std::this_thread::get_id(); }); });
  // The host runs the round that runs fn (the caller is released after it).
  ASSERT_TRUE(host_until(loop, [&] { return ran_on != std::thread::id{}; }));
  done.get();
  EXPECT_EQ(ran_on, std::this_thread::get_id()) << "run_sync ran on the attached thread";
  loop.detach();
}

TEST(EvloopEmbed, TimersFireThroughTheFd) {
  EpollEventLoop loop;
  loop.attach();
  int fired = 0;
  auto timer = loop.create_timer([&] { ++fired; });
  timer.start_once(20ms);
  EXPECT_FALSE(readable_within(loop, 0ms));
  EXPECT_TRUE(host_until(loop, [&] { return fired == 1; }));
  timer.close();
  loop.detach();
}

TEST(EvloopEmbed, DetachRunsWhatWasPosted) {
  EpollEventLoop loop;
  loop.attach();
  bool ran = false;
  loop.post([&] { ran = true; });
  loop.detach();
  EXPECT_TRUE(ran);
}

// Every backend, with both ends on one attached loop: connect, then sends made on the
// attached thread outside run_once() (as a coroutine makes them) and from inside callbacks,
// all of it driven only by the host's run_once() calls.
class EmbeddedBackend : public testing::TestWithParam<BackendType> {};

TEST_P(EmbeddedBackend, MovesMessagesWithOnlyTheHostDrivingTheLoop) {
  auto loop = std::make_shared<EpollEventLoop>();
  loop->attach();
  std::vector<std::size_t> received;
  std::uint64_t completed = 0;
  int established = 0;
  NetworkConfig config{
      .mode = NetworkMode::TCP,
      .on_data_cb = [&](std::span<const std::uint8_t> data) { received.push_back(data.size()); },
      .on_connection_established_cb = [&](const EndPointAddress&,
                                          EndpointCapabilities) { ++established; },
      .on_send_completed_cb = [&](const EndPointAddress&, std::uint64_t) { ++completed; }};
  auto backend = Netio3Backend::create(GetParam(), std::move(config), loop);
  const auto server = backend->open_listen_endpoint(
      {test_address(), 0}, {.recv_params = {.buf_size = 4096, .num_buf = 64}});
  backend->open_active_endpoint(server,
                                {.send_buffered_params = {.buf_size = 4096, .num_buf = 64}});
  ASSERT_TRUE(host_until(*loop, [&] { return established == 2; }));

  constexpr std::size_t MESSAGES = 200;
  std::size_t sent = 0;
  while (sent < MESSAGES) {
    // Outside run_once(), on the attached thread; the host then runs a round.
    NetworkBuffer* buffer = backend->get_buffer(server);
    if (buffer != nullptr) {
      const std::vector<std::uint8_t> bytes(sent + 1, 7);
      buffer->write(bytes);
      ASSERT_NE(backend->send_buffer(server, buffer), NetioStatus::FAILED);
      ++sent;
      if (sent % 10 != 0) continue;  // a batch of sends, then one round
    }
    ASSERT_TRUE(host_until(
        *loop, [&, before = completed] { return completed > before || completed == sent; }));
  }
  ASSERT_TRUE(
      host_until(*loop, [&] { return received.size() == MESSAGES && completed == MESSAGES; }))
      << received.size() << " received, " << completed << " completed";
  for (std::size_t i = 0; i < MESSAGES; ++i) EXPECT_EQ(received[i], i + 1);
  // Destroyed on the attached thread, outside run_once(): tears down at once.
  backend.reset();
  loop->detach();
}

INSTANTIATE_TEST_SUITE_P(Evloop, EmbeddedBackend, testing::ValuesIn(Netio3Backend::available()),
                         [](const auto& param_info) {
                           return std::string{to_string(param_info.param)};
                         });

}  // namespace
}  // namespace netio3::test
