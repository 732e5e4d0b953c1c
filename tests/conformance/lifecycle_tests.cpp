// Connection lifecycle conformance: backend x send mode x thread-safety model.
// Refusal, closing (locally, by the peer, through the listener, from inside callbacks),
// cancelled keys, back-pressure, destruction with open connections.

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "conformance.hpp"

namespace netio3::conformance {
namespace {

// Checks the key ledger of one connection: every key of an accepted send appears exactly
// once among completions and cancelled keys, and no completion follows the close.
void expect_ledger_balanced(const std::vector<Recorder::Event>& events,
                            const EndPointAddress& remote,
                            const std::vector<std::uint64_t>& accepted_keys) {
  std::multiset<std::uint64_t> ended;
  bool closed = false;
  std::size_t closed_count = 0;
  for (const auto& e : events) {
    if (e.remote != remote) continue;
    if (e.kind == Kind::COMPLETED) {
      EXPECT_FALSE(closed) << "completion of key " << e.key << " after the closed callback";
      ended.insert(e.key);
    } else if (e.kind == Kind::CLOSED) {
      closed = true;
      ++closed_count;
      ended.insert(e.keys.begin(), e.keys.end());
    }
  }
  EXPECT_EQ(closed_count, 1U);
  EXPECT_EQ(ended, std::multiset<std::uint64_t>(accepted_keys.begin(), accepted_keys.end()))
      << "every accepted send must end exactly once (completed or cancelled)";
}

class Lifecycle : public testing::TestWithParam<ModeParam> {
 protected:
  void SetUp() override {
    const auto& p = GetParam();
    if (p.mode == SendMode::COPY && !traits(p.backend).copy_supported) {
      GTEST_SKIP() << netio3::to_string(p.backend) << " does not support send_data_copy";
    }
    region.resize(std::size_t{1} << 20U);
  }

  std::unique_ptr<Node> make_node(const std::function<void(NetworkConfig&)>& tweak = {}) {
    return std::make_unique<Node>(GetParam().backend, GetParam().model, tweak);
  }

  EndPointAddress listen_on(Node& node, std::size_t max_message = BUF_SIZE) {
    return node.call([&] {
      return node.backend->open_listen_endpoint({test::test_address(), 0},
                                                receiver_params(max_message));
    });
  }

  // With ModeParam::session, the connection has a session (asyncmsg): everything here holds
  // for it as well - a session changes what a cut does, not a close.
  void connect(Node& node, const EndPointAddress& to, std::size_t buf_size = BUF_SIZE) {
    auto params = sender_params(node.traits, GetParam().mode, region, buf_size);
    params.delivery.session.enabled = GetParam().session;
    node.call([&] { node.backend->open_active_endpoint(to, params); });
  }

  // One send attempt of message `index` of `size` bytes (no retry; zero-copy sends it from
  // region[index * size]); records the key if accepted.
  NetioStatus try_send(Node& client, const EndPointAddress& to, std::uint64_t index,
                       std::size_t size, std::vector<std::uint64_t>& accepted) {
    const auto message = test::pattern(index, size);
    NetioStatus status = NetioStatus::FAILED;
    std::uint64_t key = index;
    switch (GetParam().mode) {
      case SendMode::BUFFERED: {
        auto* buffer = client.backend->get_buffer(to);
        if (buffer == nullptr) return NetioStatus::NO_RESOURCES;
        buffer->write(std::span<const std::uint8_t>{message});
        key = buffer->id();
        status = client.backend->send_buffer(to, buffer);
        break;
      }
      case SendMode::ZERO_COPY: {
        auto* where = region.data() + index * size;
        std::memcpy(where, message.data(), size);
        status = client.backend->send_data(to, std::span<std::uint8_t>{where, size}, {}, index);
        break;
      }
      case SendMode::COPY:
        status = client.backend->send_data_copy(to, message, {}, index);
        break;
    }
    if (status == NetioStatus::OK) accepted.push_back(key);
    return status;
  }

  std::vector<std::uint8_t> region;
};

TEST_P(Lifecycle, ConnectingToAPortWithoutListenerIsRefusedOnce) {
  auto client = make_node();
  // Held, not listening: no listener of a test running beside this one can get the port.
  const test::BoundSocket hold{{test::test_address(), 0}};
  ASSERT_EQ(hold.error(), "");
  const EndPointAddress nowhere{test::test_address(), hold.port()};
  connect(*client, nowhere);
  ASSERT_TRUE(
      client->rec.wait([&](const Recorder& r) { return r.count(Kind::REFUSED, nowhere) == 1; }));
  EXPECT_EQ(client->rec.count_now(Kind::ESTABLISHED), 0U);
  EXPECT_EQ(client->rec.count_now(Kind::CLOSED), 0U);
  // After the refusal the endpoint is gone: it may be opened again, and it is unknown.
  EXPECT_THROW(client->call([&] { client->backend->close_active_endpoint(nowhere); }),
               UnknownActiveEndpoint);
  connect(*client, nowhere);
  ASSERT_TRUE(
      client->rec.wait([&](const Recorder& r) { return r.count(Kind::REFUSED, nowhere) == 2; }));
}

TEST_P(Lifecycle, EstablishedCapabilitiesDescribeTheLocalEndpoint) {
  auto server = make_node();
  auto client = make_node();
  const auto listen = listen_on(*server);
  connect(*client, listen);
  ASSERT_TRUE(wait_connected(*client, *server, listen).has_value());
  const auto& t = client->traits;
  for (const auto& e : client->rec.snapshot()) {
    if (e.kind != Kind::ESTABLISHED) continue;
    EXPECT_EQ(e.caps.send_buffered, GetParam().mode == SendMode::BUFFERED);
    EXPECT_EQ(e.caps.send_copy, t.copy_supported);
    if (t.zero_copy_needs_region) {
      EXPECT_EQ(e.caps.send_zero_copy, GetParam().mode == SendMode::ZERO_COPY);
    } else {
      EXPECT_TRUE(e.caps.send_zero_copy);
    }
    EXPECT_TRUE(e.caps.receive);
  }
  for (const auto& e : server->rec.snapshot()) {
    if (e.kind != Kind::ESTABLISHED) continue;
    EXPECT_TRUE(e.caps.receive);
    EXPECT_TRUE(e.caps.send_buffered) << "the listener's parameters request send buffers";
  }
}

// The peer stops reading: sends must end in NO_RESOURCES instead of queueing without
// bound; closing then reports every accepted-but-unfinished key exactly once.
TEST_P(Lifecycle, StalledPeerGivesNoResourcesAndCloseCancelsOutstandingKeys) {
  auto server = make_node();
  auto client =
      make_node([](NetworkConfig& c) { c.limits.max_unsent_bytes = std::size_t{1} << 20U; });
  // More than loopback's kernel buffers (a few MB) plus the 1 MB unsent limit; sized before
  // connecting because zero-copy regions are registered at connect.
  region.assign(std::size_t{32} << 20U, 0);
  const auto listen = listen_on(*server, 64 * 1024);
  connect(*client, listen, 64 * 1024);
  ASSERT_TRUE(wait_connected(*client, *server, listen).has_value());
  server->loop.stop();  // the server no longer reads

  const std::size_t size = 60 * 1024;
  std::vector<std::uint64_t> accepted;
  const auto try_send = [&](std::uint64_t index) {
    return this->try_send(*client, listen, index, size, accepted);
  };
  bool saw_no_resources = false;
  std::uint64_t index = 0;
  while (!saw_no_resources && (index + 1) * size < region.size()) {
    const auto status = client->call([&] { return try_send(index); });
    ASSERT_NE(status, NetioStatus::FAILED);
    saw_no_resources = status == NetioStatus::NO_RESOURCES;
    index += status == NetioStatus::OK ? 1 : 0;
  }
  EXPECT_TRUE(saw_no_resources) << "accepted " << accepted.size() << " messages of " << size
                                << " bytes without back-pressure";
  // Fill up again and ask for the close on the loop thread, where no flush can run in
  // between: what is queued at that moment was not handed to the kernel and must come
  // back as cancelled.
  client->loop.loop()->run_sync([&] {
    while ((index + 1) * size < region.size() && try_send(index) == NetioStatus::OK) ++index;
    client->backend->close_active_endpoint(listen);
  });
  ASSERT_TRUE(
      client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, listen) == 1; }));
  const auto events = client->rec.snapshot();
  expect_ledger_balanced(events, listen, accepted);
  std::size_t cancelled = 0;
  for (const auto& e : events) cancelled += e.kind == Kind::CLOSED ? e.keys.size() : 0;
  EXPECT_GT(cancelled, 0U) << "the stalled peer cannot have taken everything";
  // Cancelled keys come in send order.
  for (const auto& e : events) {
    if (e.kind != Kind::CLOSED || GetParam().mode == SendMode::BUFFERED) continue;
    EXPECT_TRUE(std::is_sorted(e.keys.begin(), e.keys.end()));
  }
}

// The peer sends a message and closes as soon as it went out. The client's sends from that
// message's data callback, which a transport may finish at once and report from a queue
// (UCX), race with the close: each one accepted ends exactly once, and every completion
// comes before the closed callback, on every round. A send may also be refused (FAILED)
// when the transport learnt of the close first (UCX under load: "Endpoint timeout").
TEST_P(Lifecycle, SendsFromTheLastDataCallbackEndBeforeThePeersClose) {
  auto server = make_node();
  auto client = make_node();
  const auto listen = listen_on(*server);
  constexpr std::size_t SIZE = 64;
  constexpr std::uint64_t SENDS = 8;
  constexpr std::size_t ROUNDS = 5;
  // On the client's loop thread until its closed callback.
  std::vector<std::uint64_t> accepted;
  std::uint64_t next = 0;
  std::size_t attempts = 0;
  std::size_t accepted_in_all = 0;
  client->rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t>) {
    if (e.kind != Kind::DATA) return;
    for (std::uint64_t i = 0; i < SENDS; ++i, ++attempts) {
      EXPECT_NE(try_send(*client, listen, next++, SIZE, accepted), NetioStatus::NO_RESOURCES);
    }
  });
  // The server closes as soon as its message went out (a close on the loop thread would
  // cancel it while it is queued).
  server->rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t>) {
    if (e.kind == Kind::COMPLETED) server->backend->close_active_endpoint(e.remote);
  });
  for (std::size_t round = 0; round < ROUNDS; ++round) {
    // This round's events are those from here on (a late completion of an earlier round
    // would be among them and unbalance the ledger).
    const std::size_t start = client->rec.snapshot().size();
    connect(*client, listen);
    ASSERT_TRUE(server->rec.wait(
        [&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == round + 1; }));
    ASSERT_TRUE(client->rec.wait(
        [&](const Recorder& r) { return r.count(Kind::ESTABLISHED, listen) == round + 1; }));
    EndPointAddress accepted_side;
    for (const auto& e : server->rec.snapshot()) {
      if (e.kind == Kind::ESTABLISHED) accepted_side = e.remote;  // the newest
    }
    server->loop.loop()->run_sync([&] {
      NetworkBuffer* buffer = server->backend->get_buffer(accepted_side);
      ASSERT_NE(buffer, nullptr);
      buffer->write(std::span<const std::uint8_t>{test::pattern(round, SIZE)});
      ASSERT_EQ(server->backend->send_buffer(accepted_side, buffer), NetioStatus::OK);
    });
    ASSERT_TRUE(client->rec.wait(
        [&](const Recorder& r) { return r.count(Kind::CLOSED, listen) == round + 1; }));
    const auto events = client->rec.snapshot();
    std::vector<std::uint64_t> keys;
    std::size_t tried = 0;
    client->loop.loop()->run_sync([&] {
      keys = std::exchange(accepted, {});
      tried = std::exchange(attempts, 0);
    });
    EXPECT_EQ(tried, SENDS) << "the data callback ran once, before the close";
    accepted_in_all += keys.size();
    expect_ledger_balanced({events.begin() + static_cast<std::ptrdiff_t>(start), events.end()},
                           listen, keys);
    // A client's source port may come again in a later round (its connection closed): this
    // round's is closed when every connection established from that address is.
    ASSERT_TRUE(server->rec.wait([&](const Recorder& r) {
      return r.count(Kind::CLOSED, accepted_side) == r.count(Kind::ESTABLISHED, accepted_side);
    }));
  }
  std::printf("[ measure  ] %zu of %zu sends accepted\n", accepted_in_all, ROUNDS * SENDS);
}

TEST_P(Lifecycle, PeerCloseReachesBothSidesAndTheAddressCanBeReused) {
  auto server = make_node();
  auto client = make_node();
  const auto listen = listen_on(*server);
  connect(*client, listen);
  auto server_side = wait_connected(*client, *server, listen);
  ASSERT_TRUE(server_side.has_value());
  // The server closes the accepted connection; the client learns it from the network.
  server->call([&] { server->backend->close_active_endpoint(*server_side); });
  ASSERT_TRUE(server->rec.wait(
      [&](const Recorder& r) { return r.count(Kind::CLOSED, *server_side) == 1; }));
  ASSERT_TRUE(
      client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, listen) == 1; }));
  // Once the closed callback has returned, the address is unknown (inside it, sends are
  // FAILED).
  client->loop.loop()->run_sync([] {});
  EXPECT_THROW(client->call([&] { return client->backend->get_buffer(listen); }),
               UnknownActiveEndpoint);
  // Reconnect to the same listener.
  connect(*client, listen);
  ASSERT_TRUE(
      client->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED, listen) == 2; }));
  ASSERT_EQ(send_one(*client, listen, GetParam().mode, test::pattern(7, 100), region, 7),
            NetioStatus::OK);
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == 1; }));
  EXPECT_EQ(server->rec.messages_snapshot().at(0), test::pattern(7, 100));
}

// The guide's sending loop sends from its completion callback and has no try/catch: once the
// peer closed the connection, a send made before the closed callback has run - from a
// completion of the stream, or from the closed callback itself - returns FAILED (or no
// buffer), never throws; after the closed callback the address is unknown.
TEST_P(Lifecycle, SendsAfterThePeerClosedAreFailedUntilTheClosedCallbackReturned) {
  auto server = make_node();
  auto client = make_node();
  const auto listen = listen_on(*server);
  connect(*client, listen);
  auto server_side = wait_connected(*client, *server, listen);
  ASSERT_TRUE(server_side.has_value());
  constexpr std::size_t SIZE = 512;
  constexpr std::uint64_t LAST = 1500;  // the region holds 2048 messages of SIZE
  std::mutex mutex;
  std::condition_variable done;
  std::vector<std::uint64_t> accepted;      // under mutex
  std::vector<std::string> thrown;          // what a send inside a callback threw
  std::optional<NetioStatus> in_closed_cb;  // the send inside the closed callback
  SendFailure closed_failure;               // and its reason
  bool hook_returned = false;
  std::uint64_t next = 0;  // loop thread (the hook) or the test thread before the stream
  const auto send_next = [&] {
    const std::lock_guard lock{mutex};
    try {
      if (next < LAST && try_send(*client, listen, next, SIZE, accepted) == NetioStatus::OK) {
        ++next;
      }
    } catch (const std::exception& e) {
      thrown.emplace_back(e.what());
    }
  };
  client->rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t>) {
    if (e.remote != listen) return;
    if (e.kind == Kind::COMPLETED) send_next();
    if (e.kind != Kind::CLOSED) return;
    const std::lock_guard lock{mutex};
    try {
      const auto status = try_send(*client, listen, LAST + 1, SIZE, accepted);
      in_closed_cb = status;
      if (status == NetioStatus::FAILED) closed_failure = last_send_failure();
    } catch (const std::exception& error) {
      thrown.emplace_back(error.what());
    }
    hook_returned = true;
    done.notify_all();
  });
  // The server closes after a few messages; the client keeps sending from its completions.
  server->rec.set_hook(
      [&, closed = false](const Recorder::Event& e, std::span<const std::uint8_t>) mutable {
        if (e.kind == Kind::DATA && server->rec.count_now(Kind::DATA) >= 20 &&
            !std::exchange(closed, true)) {
          server->backend->close_active_endpoint(*server_side);
        }
      });
  // On the loop thread, as the rest of the stream: a send from another thread after the
  // closed callback would rightly throw.
  client->loop.loop()->run_sync([&] {
    for (int i = 0; i < 8; ++i) send_next();
  });
  {
    std::unique_lock lock{mutex};
    ASSERT_TRUE(done.wait_for(lock, test::DEFAULT_TIMEOUT, [&] { return hook_returned; }));
    EXPECT_TRUE(thrown.empty()) << "a send inside a callback threw: " << thrown.front();
    ASSERT_TRUE(in_closed_cb.has_value());
    // Buffered sends find no buffer (get_buffer returns none); the others are FAILED.
    EXPECT_EQ(*in_closed_cb, GetParam().mode == SendMode::BUFFERED ? NetioStatus::NO_RESOURCES
                                                                   : NetioStatus::FAILED);
    if (*in_closed_cb == NetioStatus::FAILED) {
      EXPECT_EQ(closed_failure.cause, SendFailureCause::CLOSING) << closed_failure.message;
    }
  }
  client->rec.set_hook({});
  client->loop.loop()->run_sync([] {});  // the closed callback has returned
  EXPECT_THROW(client->call([&] {
    std::uint8_t byte = 0;
    return client->backend->send_data(listen, std::span{&byte, 1}, {}, 0);
  }),
               UnknownActiveEndpoint);
  const std::lock_guard lock{mutex};
  expect_ledger_balanced(client->rec.snapshot(), listen, accepted);
}

TEST_P(Lifecycle, ClosingTheListenerClosesEveryConnectionItSpawned) {
  auto server = make_node();
  constexpr int CLIENTS = 4;
  std::vector<std::unique_ptr<Node>> clients;
  const auto listen = listen_on(*server);
  for (int i = 0; i < CLIENTS; ++i) {
    clients.push_back(make_node());
    connect(*clients.back(), listen);
  }
  ASSERT_TRUE(
      server->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == CLIENTS; }));
  for (auto& c : clients) {
    ASSERT_TRUE(c->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
  }
  // A second listener that never spawned anything: closing it calls nothing.
  const auto idle = listen_on(*server);
  server->call([&] { server->backend->close_listen_endpoint(idle); });
  server->call([&] { server->backend->close_listen_endpoint(listen); });
  ASSERT_TRUE(
      server->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == CLIENTS; }));
  for (auto& c : clients) {
    ASSERT_TRUE(c->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, listen) == 1; }));
  }
  EXPECT_THROW(server->call([&] { server->backend->close_listen_endpoint(listen); }),
               UnknownListenEndpoint);
  // The listener is really gone: a new connection is refused.
  auto late = make_node();
  connect(*late, listen);
  ASSERT_TRUE(late->rec.wait([&](const Recorder& r) { return r.count(Kind::REFUSED) == 1; }));
  EXPECT_EQ(server->rec.count_now(Kind::CLOSED), static_cast<std::size_t>(CLIENTS));
}

// close_active_endpoint from inside the established, data and completion callbacks.
TEST_P(Lifecycle, ClosingFromInsideCallbacksIsSafe) {
  for (const Kind trigger : {Kind::ESTABLISHED, Kind::COMPLETED}) {
    auto server = make_node();
    auto client = make_node();
    const auto listen = listen_on(*server);
    bool closed = false;  // loop thread only
    client->rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t>) {
      if (e.kind == trigger && e.remote == listen && !std::exchange(closed, true)) {
        client->backend->close_active_endpoint(listen);
      }
    });
    connect(*client, listen);
    if (trigger == Kind::COMPLETED) {
      ASSERT_TRUE(
          client->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
      // Several sends: the close happens at the first completion, the rest end as
      // completed or cancelled, exactly once each.
      std::vector<std::uint64_t> keys;
      try {
        for (std::uint64_t i = 0; i < 8; ++i) {
          std::uint64_t key = 0;
          const auto status =
              send_one(*client, listen, GetParam().mode, test::pattern(i, 512), region, i, &key);
          if (status == NetioStatus::OK) keys.push_back(key);
        }
      } catch (const UnknownActiveEndpoint&) {
        // The close from the completion callback already went through: not accepted.
      }
      ASSERT_TRUE(client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
      expect_ledger_balanced(client->rec.snapshot(), listen, keys);
    }
    ASSERT_TRUE(
        client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, listen) == 1; }));
    ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  }
  // From inside on_data_cb, on the receiving side.
  auto server = make_node();
  auto client = make_node();
  const auto listen = listen_on(*server);
  connect(*client, listen);
  auto server_side = wait_connected(*client, *server, listen);
  ASSERT_TRUE(server_side.has_value());
  bool closed = false;  // loop thread only
  server->rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t>) {
    if (e.kind == Kind::DATA && !std::exchange(closed, true)) {
      server->backend->close_active_endpoint(*server_side);
    }
  });
  ASSERT_EQ(send_one(*client, listen, GetParam().mode, test::pattern(1, 100), region, 1),
            NetioStatus::OK);
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  ASSERT_TRUE(client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
}

TEST_P(Lifecycle, DestroyingTheBackendInsideACallbackIsSafe) {
  auto server = make_node();
  auto client = make_node();
  const auto listen = listen_on(*server);
  connect(*client, listen);
  ASSERT_TRUE(wait_connected(*client, *server, listen).has_value());
  std::atomic<bool> destroyed{false};
  server->rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t>) {
    if (e.kind == Kind::DATA && !destroyed.exchange(true)) server->backend.reset();
  });
  try {
    for (std::uint64_t i = 0; i < 4; ++i) {
      const auto status =
          send_one(*client, listen, GetParam().mode, test::pattern(i, 1000), region, i);
      ASSERT_NE(status, NetioStatus::NO_RESOURCES);
      if (status != NetioStatus::OK) break;  // the peer is already gone
    }
  } catch (const UnknownActiveEndpoint&) {
    // The peer's backend was destroyed after the first message: the connection is gone.
  }
  ASSERT_TRUE(client->rec.wait([&](const Recorder& r) {
    return r.count(Kind::CLOSED, listen) == 1;
  })) << "the peer of a destroyed backend must see the connection close";
  EXPECT_TRUE(destroyed.load());
  // Destroyed means silent: at most the messages that were dispatched in the same read.
  const auto events = server->rec.snapshot();
  EXPECT_EQ(std::count_if(events.begin(), events.end(),
                          [](const auto& e) { return e.kind == Kind::CLOSED; }),
            0);
}

TEST_P(Lifecycle, DestroyingTheBackendWithOpenConnectionsClosesThemAtThePeer) {
  auto server = make_node();
  const auto listen = listen_on(*server);
  std::vector<std::unique_ptr<Node>> clients;
  for (int i = 0; i < 3; ++i) {
    clients.push_back(make_node());
    connect(*clients.back(), listen);
  }
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 3; }));
  // Open at both ends: a client that has not yet seen its connection established when the
  // server goes would rightly report it refused (UCX: the server reports established on
  // HELLO, the client on HELLO_ACK, which may still be on its way).
  for (auto& c : clients) {
    ASSERT_TRUE(
        c->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED, listen) == 1; }));
  }
  const std::size_t fds_with_server = test::open_fd_count();
  server->destroy_backend();  // from the test thread while the server loop runs
  for (auto& c : clients) {
    ASSERT_TRUE(c->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, listen) == 1; }));
  }
  EXPECT_LT(test::open_fd_count(), fds_with_server) << "the backend's sockets were not closed";
  EXPECT_EQ(server->rec.count_now(Kind::CLOSED), 0U) << "a destroyed backend calls no callback";
}

// The ledger balances with several threads sending at once (SAFE only).
TEST_P(Lifecycle, ConcurrentSendersEveryKeyEndsExactlyOnce) {
  if (GetParam().model == ThreadSafetyModel::UNSAFE) {
    GTEST_SKIP() << "concurrent senders need ThreadSafetyModel::SAFE";
  }
  if (GetParam().mode == SendMode::BUFFERED) {
    GTEST_SKIP() << "buffer ids are reused as keys; the data test covers buffered keys";
  }
  auto server = make_node();
  auto client = make_node();
  const auto listen = listen_on(*server);
  connect(*client, listen);
  ASSERT_TRUE(wait_connected(*client, *server, listen).has_value());
  constexpr std::uint64_t THREADS = 4;
  constexpr std::uint64_t PER_THREAD = 500;
  constexpr std::size_t SIZE = 200;
  std::vector<std::vector<std::uint64_t>> accepted(THREADS);
  {
    std::vector<std::jthread> senders;
    for (std::uint64_t t = 0; t < THREADS; ++t) {
      senders.emplace_back([&, t] {
        for (std::uint64_t i = 0; i < PER_THREAD; ++i) {
          const std::uint64_t index = t * PER_THREAD + i;
          if (send_one(*client, listen, GetParam().mode, test::pattern(index, SIZE), region,
                       index) == NetioStatus::OK) {
            accepted[t].push_back(index);
          }
        }
      });
    }
  }
  std::vector<std::uint64_t> all;
  for (const auto& a : accepted) all.insert(all.end(), a.begin(), a.end());
  ASSERT_EQ(all.size(), THREADS * PER_THREAD);
  ASSERT_TRUE(
      server->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == all.size(); }));
  // Each thread's messages arrive in that thread's order, intact.
  std::map<std::uint64_t, std::uint64_t> next;  // thread -> next expected index
  for (const auto& m : server->rec.messages_snapshot()) {
    bool matched = false;
    for (std::uint64_t t = 0; t < THREADS && !matched; ++t) {
      const std::uint64_t expected = t * PER_THREAD + next[t];
      if (next[t] < PER_THREAD && test::matches_pattern(m, expected)) {
        ++next[t];
        matched = true;
      }
    }
    ASSERT_TRUE(matched) << "a message arrived corrupted or out of its thread's order";
  }
  client->call([&] { client->backend->close_active_endpoint(listen); });
  ASSERT_TRUE(client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  expect_ledger_balanced(client->rec.snapshot(), listen, all);
}

// Before the connection is established, sends are "retry later", not failures.
TEST_P(Lifecycle, SendingBeforeEstablishedIsNoResources) {
  auto client = make_node();
  // A listener that accepts TCP but never speaks: the connection stays in set-up.
  const test::RawListener listener;
  const EndPointAddress silent = listener.address();
  connect(*client, silent);
  const auto message = test::pattern(0, 10);
  NetioStatus status = NetioStatus::OK;
  switch (GetParam().mode) {
    case SendMode::BUFFERED:
      status = client->call([&] {
        auto* b = client->backend->get_buffer(silent);
        if (b == nullptr) return NetioStatus::NO_RESOURCES;
        b->write(std::span<const std::uint8_t>{message});
        return client->backend->send_buffer(silent, b);
      });
      break;
    case SendMode::ZERO_COPY:
      std::memcpy(region.data(), message.data(), message.size());
      status = client->call([&] {
        return client->backend->send_data(silent, std::span<std::uint8_t>{region.data(), 10}, {},
                                          0);
      });
      break;
    case SendMode::COPY:
      status =
          client->call([&] { return client->backend->send_data_copy(silent, message, {}, 0); });
      break;
  }
  EXPECT_EQ(status, NetioStatus::NO_RESOURCES);
  // Closing a connection still in set-up ends it with on_connection_closed_cb.
  client->call([&] { client->backend->close_active_endpoint(silent); });
  ASSERT_TRUE(
      client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, silent) == 1; }));
  EXPECT_EQ(client->rec.count_now(Kind::ESTABLISHED), 0U);
}

// No callback runs inside open_active_endpoint, send_*, close_active_endpoint or
// close_listen_endpoint called on the loop thread (docs/semantics.md): what they cause (a
// refusal, completions of sends that went out at once, the close of the connection) is
// reported from the loop after the call has returned. Each call below is made on its node's
// loop thread between two marks, and every callback of both nodes looks at the mark of the
// thread it runs on.
TEST_P(Lifecycle, NoCallbackRunsInsideAnApiCallOnTheLoopThread) {
  // Declared before the nodes: their callbacks use them until the nodes are gone.
  static thread_local int in_api = 0;
  std::mutex mutex;
  std::vector<std::string> nested;
  auto server = make_node();
  auto client = make_node();
  for (auto* node : {server.get(), client.get()}) {
    const std::string name = node == server.get() ? "server" : "client";
    node->rec.set_hook([&, name](const Recorder::Event& e, std::span<const std::uint8_t>) {
      if (in_api == 0) return;
      const std::lock_guard lock{mutex};
      constexpr std::array<std::string_view, 5> NAMES{"established", "closed", "refused",
                                                      "send completed", "data"};
      nested.push_back(fmt::format("{}: {} callback inside an API call", name,
                                   NAMES.at(static_cast<std::size_t>(e.kind))));
    });
  }
  const auto on_loop = [](Node& node, const std::function<void()>& f) {
    node.loop.loop()->run_sync([&] {
      ++in_api;
      f();
      --in_api;
    });
  };
  const auto params = [&] { return sender_params(client->traits, GetParam().mode, region); };

  // A refusal (nothing listens there), and a close during set-up.
  const test::BoundSocket hold{{test::test_address(), 0}};
  ASSERT_EQ(hold.error(), "");
  const EndPointAddress nobody{test::test_address(), hold.port()};
  on_loop(*client, [&] { client->backend->open_active_endpoint(nobody, params()); });
  ASSERT_TRUE(client->rec.wait([&](const Recorder& r) {
    return r.count(Kind::REFUSED, nobody) + r.count(Kind::CLOSED, nobody) == 1;
  }));
  const auto listen = listen_on(*server);
  on_loop(*client, [&] {
    client->backend->open_active_endpoint(listen, params());
    client->backend->close_active_endpoint(listen);
  });
  ASSERT_TRUE(
      client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, listen) == 1; }));

  // Sends, several per call (completing while the calls go on); then more sends and the close
  // in one call, from the client (round 0) or from the server with its listener (round 1).
  for (std::size_t round = 0; round < 2; ++round) {
    on_loop(*client, [&] { client->backend->open_active_endpoint(listen, params()); });
    ASSERT_TRUE(client->rec.wait(
        [&](const Recorder& r) { return r.count(Kind::ESTABLISHED, listen) == round + 1; }));
    ASSERT_TRUE(server->rec.wait(
        [&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == round + 1; }));
    std::optional<EndPointAddress> server_side;
    for (const auto& e : server->rec.snapshot()) {
      if (e.kind == Kind::ESTABLISHED) server_side = e.remote;
    }
    ASSERT_TRUE(server_side.has_value());
    std::vector<std::uint64_t> accepted;
    const std::size_t completed_before = client->rec.count_now(Kind::COMPLETED);
    for (std::uint64_t burst = 0; burst < 4; ++burst) {
      on_loop(*client, [&] {
        for (std::uint64_t i = 0; i < 4; ++i)
          (void)try_send(*client, listen, burst * 4 + i, 256, accepted);
      });
      ASSERT_TRUE(client->rec.wait([&](const Recorder& r) {
        return r.count(Kind::COMPLETED) == completed_before + accepted.size();
      }));
    }
    EXPECT_EQ(accepted.size(), 16U);
    if (round == 0) {
      on_loop(*client, [&] {
        for (std::uint64_t i = 0; i < 4; ++i)
          (void)try_send(*client, listen, 16 + i, 256, accepted);
        client->backend->close_active_endpoint(listen);
      });
    } else {
      on_loop(*client, [&] {
        for (std::uint64_t i = 0; i < 4; ++i)
          (void)try_send(*client, listen, 16 + i, 256, accepted);
      });
      on_loop(*server, [&] {
        server->backend->close_active_endpoint(*server_side);
        server->backend->close_listen_endpoint(listen);
      });
    }
    ASSERT_TRUE(client->rec.wait(
        [&](const Recorder& r) { return r.count(Kind::CLOSED, listen) == 2 + round; }));
    ASSERT_TRUE(
        server->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1 + round; }));
  }
  const std::lock_guard lock{mutex};
  EXPECT_TRUE(nested.empty()) << fmt::format("{}", fmt::join(nested, "\n"));
}

INSTANTIATE_TEST_SUITE_P(Conformance, Lifecycle, testing::ValuesIn(mode_params_with_sessions()),
                         mode_param_name);

}  // namespace
}  // namespace netio3::conformance
