// Destruction from another thread while the loop runs (issue 22): once the backend's
// destructor has begun, no callback starts. The one running when it begins ends normally.
//
// Deterministic: the server's first data callback blocks the loop thread while the client
// has more messages on their way; another thread then destroys the server backend, whose
// destructor has to wait for the loop; the blocked callback is released. Without the guard
// the loop goes on to deliver the rest of the batch (and other events) to the application,
// which is tearing itself down (netio3-perf crashed so, issue 22).

#include <atomic>
#include <cstdio>
#include <fstream>
#include <future>
#include <string>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>

#include "conformance.hpp"

namespace netio3::conformance {
namespace {

using namespace std::chrono_literals;

// The scheduler state of thread `tid` of this process ('R', 'S', ...; 0 if unknown).
char thread_state(pid_t tid) {
  std::ifstream stat{"/proc/self/task/" + std::to_string(tid) + "/stat"};
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() ? '\0' : line[paren + 2];
}

class Destruction : public testing::TestWithParam<BackendType> {};

TEST_P(Destruction, NoCallbackStartsOnceTheDestructorHasBegun) {
  constexpr int ROUNDS = 20;
  constexpr std::uint64_t BURST = 12;  // below NUM_BUF: every send is accepted at once
  for (int round = 1; round <= ROUNDS; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Node server{GetParam(), ThreadSafetyModel::SAFE};
    Node client{GetParam(), ThreadSafetyModel::SAFE};
    const auto listen = server.backend->open_listen_endpoint({test::test_address(), 0},
                                                             receiver_params(BUF_SIZE));
    std::vector<std::uint8_t> region;
    client.backend->open_active_endpoint(
        listen, sender_params(client.traits, SendMode::BUFFERED, region));
    ASSERT_TRUE(wait_connected(client, server, listen).has_value());

    std::atomic<bool> destroying{false};
    std::atomic<int> after{0};
    std::atomic<bool> blocked{false};
    std::promise<void> inside;
    std::promise<void> release;
    auto released = release.get_future().share();
    server.rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t>) {
      if (destroying.load()) after.fetch_add(1);
      if (e.kind == Kind::DATA && !blocked.exchange(true)) {
        inside.set_value();
        released.wait();
      }
    });
    for (std::uint64_t i = 0; i < BURST; ++i) {
      auto* buffer = client.backend->get_buffer(listen);
      ASSERT_NE(buffer, nullptr);
      const auto message = test::pattern(i, 200);
      buffer->write(std::span<const std::uint8_t>{message});
      ASSERT_EQ(client.backend->send_buffer(listen, buffer), NetioStatus::OK);
    }
    ASSERT_EQ(inside.get_future().wait_for(test::DEFAULT_TIMEOUT), std::future_status::ready);

    destroying.store(true);
    std::atomic<pid_t> tid{0};
    std::thread destroyer{[&] {
      tid.store(static_cast<pid_t>(::syscall(SYS_gettid)));
      server.destroy_backend();
    }};
    // The destructor waits for the loop thread, which is in our callback: the destroyer
    // sleeps in that wait (it takes no lock and makes no other blocking call before it).
    const bool waiting = test::eventually(
        [&] { return tid.load() != 0 && thread_state(tid.load()) == 'S'; }, 10s);
    release.set_value();
    destroyer.join();
    ASSERT_TRUE(waiting) << "the destroying thread never waited for the loop";
    EXPECT_EQ(after.load(), 0) << "callbacks started after the destructor had begun";
    // The client sees the connection end; the server's Recorder saw no close either.
    EXPECT_TRUE(client.rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
    EXPECT_EQ(server.rec.count_now(Kind::CLOSED), 0U);
  }
}

std::string backend_name(const testing::TestParamInfo<BackendType>& param_info) {
  return std::string{netio3::to_string(param_info.param)};
}

INSTANTIATE_TEST_SUITE_P(Conformance, Destruction, testing::ValuesIn(backends()), backend_name);

}  // namespace
}  // namespace netio3::conformance
