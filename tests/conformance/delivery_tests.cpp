// Delivery acknowledgement (DeliveryParameters, docs/semantics.md "Delivery"): on an
// acknowledged connection a send completes once the peer's application was handed the
// message; the replay window bounds what is held; a close lists what was not acknowledged.
// Every backend x send mode x thread-safety model, the sender without receive buffers (a
// readout only sends: libfabric must still receive the acknowledgements). On asyncmsg once
// more with sessions (delivery.session): a session's sends are acknowledged the same way.

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>

#include "conformance.hpp"

namespace netio3::conformance {
namespace {

constexpr std::size_t SIZE = 64;
constexpr std::size_t COUNT = 8;

class Delivery : public testing::TestWithParam<ModeParam> {
 protected:
  void SetUp() override {
    const auto& p = GetParam();
    if (p.mode == SendMode::COPY && !traits(p.backend).copy_supported) {
      GTEST_SKIP() << netio3::to_string(p.backend) << " does not support send_data_copy";
    }
    server = std::make_unique<Node>(p.backend, p.model);
    client = std::make_unique<Node>(p.backend, p.model);
    region.resize(COUNT * 4 * SIZE);
    server->rec.set_hook([this](const Recorder::Event& e, std::span<const std::uint8_t>) {
      if (e.kind == Kind::DATA) delivered.fetch_add(1);
    });
    client->rec.set_hook([this](const Recorder::Event& e, std::span<const std::uint8_t>) {
      if (e.kind != Kind::COMPLETED) return;
      {
        const std::lock_guard lock{mutex};
        delivered_at_completion.push_back(delivered.load());
      }
      hooked.notify_all();
    });
    listen = server->call([&] {
      return server->backend->open_listen_endpoint({test::test_address(), 0},
                                                   receiver_params(BUF_SIZE));
    });
    ASSERT_NE(listen.port, 0);
  }

  void TearDown() override {
    release_server();
    client.reset();
    server.reset();
  }

  // The client's connection: sends in the test's mode, has no receive buffers.
  void connect(bool acknowledged, std::size_t window = DeliveryParameters{}.replay_window) {
    auto params = sender_params(traits(GetParam().backend), GetParam().mode, region, BUF_SIZE);
    params.recv_params = {};
    params.delivery = {.acknowledged = acknowledged, .replay_window = window};
    params.delivery.session.enabled = acknowledged && GetParam().session;
    client->call([&] { client->backend->open_active_endpoint(listen, params); });
    auto remote = wait_connected(*client, *server, listen);
    ASSERT_TRUE(remote.has_value()) << "connection was not established on both sides";
  }

  // The server's loop thread waits (at most 20 s) until release_server(): nothing the peer
  // sends is handed to its application meanwhile.
  void block_server() {
    auto blocked = std::make_shared<std::promise<void>>();
    auto started = blocked->get_future();
    server->loop.loop()->post([blocked, gate = m_gate.get_future().share()] {
      blocked->set_value();
      (void)gate.wait_for(std::chrono::seconds{20});
    });
    ASSERT_EQ(started.wait_for(std::chrono::seconds{10}), std::future_status::ready);
  }
  void release_server() {
    if (!m_released) m_gate.set_value();
    m_released = true;
  }

  std::vector<std::uint64_t> send(std::size_t first, std::size_t n) {
    std::vector<std::uint64_t> keys;
    for (std::size_t i = first; i < first + n; ++i) {
      std::uint64_t key = 0;
      const auto status =
          try_send(*client, listen, GetParam().mode, test::pattern(i, SIZE), region, i, &key);
      EXPECT_EQ(status, NetioStatus::OK) << "message " << i;
      keys.push_back(key);
    }
    return keys;
  }

  // The client's hook saw `n` completions (it runs after the recorder counted them).
  bool hook_saw(std::size_t n) {
    std::unique_lock lock{mutex};
    return hooked.wait_for(lock, test::DEFAULT_TIMEOUT,
                           [&] { return delivered_at_completion.size() >= n; });
  }

  std::vector<std::uint64_t> completed_keys() const {
    std::vector<std::uint64_t> keys;
    for (const auto& e : client->rec.snapshot()) {
      if (e.kind == Kind::COMPLETED) keys.push_back(e.key);
    }
    return keys;
  }

  std::unique_ptr<Node> server;
  std::unique_ptr<Node> client;
  std::vector<std::uint8_t> region;
  EndPointAddress listen;
  std::atomic<std::size_t> delivered{0};
  std::mutex mutex;
  std::condition_variable hooked;
  std::vector<std::size_t> delivered_at_completion;  // the server's count at each completion

 private:
  std::promise<void> m_gate;
  bool m_released{false};
};

// The control: without acknowledgement a send completes while the receiver's application
// has not been handed it (the receiver's loop is blocked) - what the acknowledged test
// below must not see.
TEST_P(Delivery, APlainSendCompletesBeforeThePeerWasHandedIt) {
  connect(false);
  block_server();
  const auto keys = send(0, COUNT);
  ASSERT_TRUE(client->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) >= COUNT; }))
      << "plain sends did not complete while the receiver's loop was blocked";
  EXPECT_EQ(delivered.load(), 0U);
  release_server();
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) >= COUNT; }));
}

TEST_P(Delivery, AnAcknowledgedSendCompletesOnlyOnceThePeerWasHandedIt) {
  connect(true);
  block_server();
  const auto keys = send(0, COUNT);
  release_server();
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) >= COUNT; }));
  ASSERT_TRUE(client->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) >= COUNT; }))
      << "acknowledged sends did not complete after their delivery";
  EXPECT_EQ(completed_keys(), keys) << "every key once, in send order";
  ASSERT_TRUE(hook_saw(COUNT));
  const std::lock_guard lock{mutex};
  ASSERT_EQ(delivered_at_completion.size(), COUNT);
  for (std::size_t i = 0; i < COUNT; ++i) {
    EXPECT_GE(delivered_at_completion[i], i + 1)
        << "send " << i << " completed before the peer's application was handed it";
  }
  // The received messages are intact and in order.
  const auto messages = server->rec.messages_snapshot();
  ASSERT_EQ(messages.size(), COUNT);
  for (std::size_t i = 0; i < COUNT; ++i) EXPECT_TRUE(test::matches_pattern(messages[i], i));
}

TEST_P(Delivery, TheReplayWindowRefusesPastItAndTheReadyCallbackFollowsTheAcknowledgements) {
  constexpr std::size_t HELD = 3;
  connect(true, HELD * SIZE);
  block_server();
  const auto keys = send(0, HELD);
  std::uint64_t key = 0;
  EXPECT_EQ(
      try_send(*client, listen, GetParam().mode, test::pattern(HELD, SIZE), region, HELD, &key),
      NetioStatus::NO_RESOURCES)
      << "a send past the replay window was accepted";
  EXPECT_EQ(client->rec.count_now(Kind::COMPLETED), 0U);
  release_server();
  ASSERT_TRUE(client->rec.wait([](const Recorder& r) { return r.count(Kind::READY) >= 1; }))
      << "no on_ready_to_send_cb after the acknowledgements";
  // It follows the first acknowledgement that freed room (the receiver may acknowledge the
  // three in more than one round).
  EXPECT_GE(client->rec.count_now(Kind::COMPLETED), 1U);
  EXPECT_EQ(send(HELD, 1).size(), 1U);
  ASSERT_TRUE(
      client->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) >= HELD + 1; }));
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) >= HELD + 1; }));
}

// close_active_endpoint drains: the connection stays until what was sent before the close is
// acknowledged (sends meanwhile are FAILED), then closes with no key cancelled.
TEST_P(Delivery, ACloseWaitsForWhatWasSentBeforeIt) {
  connect(true);
  block_server();
  const auto keys = send(0, COUNT);
  client->call([&] { client->backend->close_active_endpoint(listen); });
  std::uint64_t key = 0;
  EXPECT_EQ(
      try_send(*client, listen, GetParam().mode, test::pattern(COUNT, SIZE), region, COUNT, &key),
      NetioStatus::FAILED)
      << "a send on a draining connection";
  // The calling thread's failure (UNSAFE: the loop thread, where the send ran).
  EXPECT_EQ(client->call([] { return netio3::last_send_failure().cause; }),
            SendFailureCause::CLOSING);
  EXPECT_EQ(client->rec.count_now(Kind::CLOSED), 0U) << "closed before the drain";
  release_server();
  ASSERT_TRUE(client->rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) >= 1; }));
  EXPECT_EQ(completed_keys(), keys) << "every send before the close completed, in order";
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) >= COUNT; }));
  for (const auto& e : client->rec.snapshot()) {
    if (e.kind == Kind::CLOSED) {
      EXPECT_TRUE(e.keys.empty());
    }
  }
  EXPECT_EQ(server->rec.count_now(Kind::DATA), COUNT) << "nothing after the close was sent";
}

// A peer that does not acknowledge within delivery.drain_timeout: the close lists every key
// it did not acknowledge.
TEST_P(Delivery, ADrainThatTimesOutListsEveryKeyNotAcknowledged) {
  auto params = sender_params(traits(GetParam().backend), GetParam().mode, region, BUF_SIZE);
  params.recv_params = {};
  params.delivery = {.acknowledged = true, .drain_timeout = std::chrono::milliseconds{200}};
  params.delivery.session.enabled = GetParam().session;
  client->call([&] { client->backend->open_active_endpoint(listen, params); });
  ASSERT_TRUE(wait_connected(*client, *server, listen).has_value());
  block_server();
  const auto keys = send(0, COUNT);
  client->call([&] { client->backend->close_active_endpoint(listen); });
  ASSERT_TRUE(client->rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) >= 1; }));
  release_server();
  EXPECT_EQ(client->rec.count_now(Kind::COMPLETED), 0U);
  for (const auto& e : client->rec.snapshot()) {
    if (e.kind == Kind::CLOSED) {
      EXPECT_EQ(e.keys, keys);
    }
  }
}

// A second close_active_endpoint does not wait.
TEST_P(Delivery, ASecondCloseEndsTheDrainAtOnce) {
  connect(true);
  block_server();
  const auto keys = send(0, COUNT);
  client->call([&] { client->backend->close_active_endpoint(listen); });
  client->call([&] { client->backend->close_active_endpoint(listen); });
  ASSERT_TRUE(client->rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) >= 1; }));
  release_server();
  for (const auto& e : client->rec.snapshot()) {
    if (e.kind == Kind::CLOSED) {
      EXPECT_EQ(e.keys, keys);
    }
  }
}

// Both directions acknowledged: each side's sends complete on the other's delivery, and an
// echo server's replies (sent from on_data_cb) complete too.
TEST_P(Delivery, BothDirectionsAcknowledged) {
  const auto& p = GetParam();
  if (p.mode != SendMode::BUFFERED) GTEST_SKIP() << "the echo replies from buffers";
  server->call([&] { server->backend->close_listen_endpoint(listen); });
  auto rx = receiver_params(BUF_SIZE);
  rx.delivery.acknowledged = true;
  listen = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0}, rx);
  });
  auto params = sender_params(traits(p.backend), p.mode, region, BUF_SIZE);
  params.delivery.acknowledged = true;
  params.delivery.session.enabled = p.session;
  client->call([&] { client->backend->open_active_endpoint(listen, params); });
  auto remote = wait_connected(*client, *server, listen);
  ASSERT_TRUE(remote.has_value());
  const auto keys = send(0, COUNT);
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) >= COUNT; }));
  std::vector<std::uint64_t> replies;
  for (std::size_t i = 0; i < COUNT; ++i) {
    std::uint64_t key = 0;
    ASSERT_EQ(send_one(*server, *remote, SendMode::BUFFERED, test::pattern(i, SIZE), {}, i, &key),
              NetioStatus::OK);
    replies.push_back(key);
  }
  ASSERT_TRUE(client->rec.wait([](const Recorder& r) {
    return r.count(Kind::DATA) >= COUNT && r.count(Kind::COMPLETED) >= COUNT;
  }));
  ASSERT_TRUE(
      server->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) >= COUNT; }));
  EXPECT_EQ(completed_keys(), keys);
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Conformance, Delivery, testing::ValuesIn(mode_params_with_sessions()),
                         mode_param_name);

}  // namespace netio3::conformance
