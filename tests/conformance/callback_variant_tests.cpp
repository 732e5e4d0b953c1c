// The optional callback variants, per backend: on_data_from_cb names the connection every
// message came from, on_connection_refused_reason_cb says why a connection could not be set
// up (a closed port, a set-up the peer dropped, one that never finished).

#include <array>
#include <atomic>
#include <map>
#include <poll.h>
#include <set>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include <gmock/gmock.h>

#include "conformance.hpp"

namespace netio3::conformance {
namespace {

using Callbacks = Recorder::Callbacks;

std::string param_name(const testing::TestParamInfo<BackendType>& info) {
  return std::string{netio3::to_string(info.param)};
}

// A plain TCP listener that accepts every connection and closes it at once: a peer that
// drops the set-up. Stops (and closes its sockets) on destruction.
class AcceptAndClose {
 public:
  AcceptAndClose()
      : m_thread{[this](const std::stop_token& stop) {
          while (!stop.stop_requested()) {
            pollfd p{.fd = m_listener.fd(), .events = POLLIN, .revents = 0};
            if (::poll(&p, 1, 20) == 1) {  // 20 ms: how soon the destructor is noticed
              const int fd = ::accept(m_listener.fd(), nullptr, nullptr);
              if (fd >= 0) {
                m_accepted.fetch_add(1);
                ::close(fd);
              }
            }
          }
        }} {}

  [[nodiscard]] EndPointAddress address() const { return m_listener.address(); }
  [[nodiscard]] int accepted() const { return m_accepted.load(); }

 private:
  test::RawListener m_listener;
  std::atomic<int> m_accepted{0};
  std::jthread m_thread;  // last: stopped and joined before the listener closes
};

class CallbackVariants : public testing::TestWithParam<BackendType> {
 protected:
  std::unique_ptr<Node> make_node(const std::function<void(NetworkConfig&)>& tweak = {}) {
    return std::make_unique<Node>(GetParam(), ThreadSafetyModel::SAFE, tweak,
                                  Callbacks::WITH_SENDER_AND_REASON);
  }

  // Connects and waits for the one refusal; returns its reason.
  static std::optional<RefusalReason> refusal_of(Node& client, const EndPointAddress& to) {
    client.call([&] {
      client.backend->open_active_endpoint(
          to, sender_params(client.traits, SendMode::BUFFERED, {}, BUF_SIZE, BUF_SIZE));
    });
    if (!client.rec.wait([&](const Recorder& r) { return r.count(Kind::REFUSED, to) == 1; })) {
      return std::nullopt;
    }
    for (const auto& e : client.rec.snapshot()) {
      if (e.kind == Kind::REFUSED) return e.refusal;
    }
    return std::nullopt;
  }
};

// Receive buffers of the server's connections in DataFromNamesTheConnectionOfEveryMessage:
// each its own, one pool per listener, one pool for the backend. Shared pools matter to
// libfabric: a shared receive context does not say which endpoint a message came from.
enum class Receive { OWN, LISTENER_SHARED, BACKEND_SHARED };

class DataFrom : public testing::TestWithParam<std::tuple<BackendType, Receive>> {
 public:
  static std::string name(const testing::TestParamInfo<std::tuple<BackendType, Receive>>& info) {
    constexpr std::array<std::string_view, 3> NAMES{"own", "listener_shared", "backend_shared"};
    return fmt::format("{}_{}", netio3::to_string(std::get<0>(info.param)),
                       NAMES.at(static_cast<std::size_t>(std::get<1>(info.param))));
  }
};

TEST_P(DataFrom, NamesTheConnectionOfEveryMessage) {
  const auto [type, receive] = GetParam();
  const auto make = [type = type](const std::function<void(NetworkConfig&)>& tweak = {}) {
    return std::make_unique<Node>(type, ThreadSafetyModel::SAFE, tweak,
                                  Callbacks::WITH_SENDER_AND_REASON);
  };
  auto server = make([receive = receive](NetworkConfig& c) {
    if (receive == Receive::BACKEND_SHARED) {
      c.shared_receive_buffers = {
          .use_shared_receive_buffers = true, .buf_size = BUF_SIZE, .num_buf = 8 * NUM_BUF};
    }
  });
  auto params = receiver_params(BUF_SIZE);
  if (receive == Receive::LISTENER_SHARED) params.recv_params.use_shared_receive_buffers = true;
  if (receive == Receive::BACKEND_SHARED) params.recv_params = {};
  const auto listen = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0}, params);
  });
  // Two senders; the messages of sender s carry the indices s * 1000 + i.
  constexpr std::uint64_t MESSAGES = 200;
  std::array<std::unique_ptr<Node>, 2> clients{make(), make()};
  for (auto& client : clients) {
    client->call([&] {
      client->backend->open_active_endpoint(
          listen, sender_params(client->traits, SendMode::BUFFERED, {}, BUF_SIZE, BUF_SIZE));
    });
    ASSERT_TRUE(client->rec.wait(
        [&](const Recorder& r) { return r.count(Kind::ESTABLISHED, listen) == 1; }));
  }
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 2; }));
  std::set<EndPointAddress> accepted;
  for (const auto& e : server->rec.snapshot()) {
    if (e.kind == Kind::ESTABLISHED) accepted.insert(e.remote);
  }
  ASSERT_EQ(accepted.size(), 2U);
  // Interleaved, so that the server gets the two streams mixed.
  for (std::uint64_t i = 0; i < MESSAGES; ++i) {
    for (std::uint64_t s = 0; s < clients.size(); ++s) {
      const auto message = test::pattern(s * 1000 + i, 64);
      ASSERT_EQ(send_one(*clients[s], listen, SendMode::BUFFERED, message, {}, i), NetioStatus::OK);
    }
  }
  ASSERT_TRUE(server->rec.wait(
      [&](const Recorder& r) { return r.count(Kind::DATA) == clients.size() * MESSAGES; }));

  // Every message names an accepted connection, each connection carries one sender's
  // messages only, in order, and the two connections are the two senders.
  const auto events = server->rec.snapshot();
  const auto messages = server->rec.messages_snapshot();
  std::map<EndPointAddress, std::vector<std::uint64_t>> by_remote;
  std::size_t m = 0;
  for (const auto& e : events) {
    if (e.kind != Kind::DATA) continue;
    const auto& bytes = messages.at(m++);
    ASSERT_TRUE(accepted.contains(e.remote)) << "a message from " << e.remote;
    std::optional<std::uint64_t> index;
    for (std::uint64_t s = 0; s < clients.size() && !index; ++s) {
      for (std::uint64_t i = 0; i < MESSAGES && !index; ++i) {
        if (test::matches_pattern(bytes, s * 1000 + i)) index = s * 1000 + i;
      }
    }
    ASSERT_TRUE(index.has_value()) << "message " << m << " is no sender's";
    by_remote[e.remote].push_back(*index);
  }
  ASSERT_EQ(by_remote.size(), 2U);
  std::set<std::uint64_t> senders;
  for (const auto& [remote, indices] : by_remote) {
    ASSERT_EQ(indices.size(), MESSAGES) << remote;
    const std::uint64_t sender = indices.front() / 1000;
    senders.insert(sender);
    for (std::uint64_t i = 0; i < MESSAGES; ++i) {
      EXPECT_EQ(indices[i], sender * 1000 + i) << remote << " message " << i;
    }
  }
  EXPECT_EQ(senders, (std::set<std::uint64_t>{0, 1}));
}

TEST_P(CallbackVariants, ARefusalOfAClosedPortSaysWhy) {
  auto client = make_node();
  // Held, not listening: no listener of a test running beside this one can get the port.
  const test::BoundSocket hold{{test::test_address(), 0}};
  ASSERT_EQ(hold.error(), "");
  const auto reason = refusal_of(*client, {test::test_address(), hold.port()});
  ASSERT_TRUE(reason.has_value());
  EXPECT_EQ(reason->cause, RefusalCause::UNREACHABLE) << reason->message;
  EXPECT_THAT(reason->message, testing::HasSubstr("refused")) << reason->message;
  EXPECT_THAT(reason->message, testing::Not(testing::HasSubstr("Success")));
}

TEST_P(CallbackVariants, ARefusalOfADroppedSetUpSaysWhy) {
  auto client = make_node();
  const AcceptAndClose server;
  const auto reason = refusal_of(*client, server.address());
  ASSERT_TRUE(reason.has_value());
  EXPECT_GE(server.accepted(), 1) << "the connection reached the server";
  EXPECT_EQ(reason->cause, RefusalCause::SETUP_FAILED) << reason->message;
  EXPECT_FALSE(reason->message.empty());
  EXPECT_THAT(reason->message, testing::Not(testing::HasSubstr("Success")));
}

TEST_P(CallbackVariants, ASetUpThatNeverFinishesTimesOut) {
  auto client = make_node(
      [](NetworkConfig& c) { c.limits.connect_timeout = std::chrono::milliseconds{300}; });
  const test::RawListener silent;  // accepts into its backlog, never speaks
  const auto reason = refusal_of(*client, silent.address());
  ASSERT_TRUE(reason.has_value());
  EXPECT_EQ(reason->cause, RefusalCause::TIMED_OUT) << reason->message;
  EXPECT_THAT(reason->message, testing::HasSubstr("timed out")) << reason->message;
}

TEST_P(CallbackVariants, SettingBothVariantsOfACallbackIsAnInvalidConfiguration) {
  const auto create = [&](const std::function<void(NetworkConfig&)>& tweak) {
    NetworkConfig config{};
    tweak(config);
    test::LoopThread loop;
    (void)Netio3Backend::create(GetParam(), std::move(config), loop.loop());
  };
  EXPECT_THROW(create([](NetworkConfig& c) {
                 c.on_data_cb = [](std::span<const std::uint8_t>) {};
                 c.on_data_from_cb = [](const EndPointAddress&, std::span<const std::uint8_t>) {};
               }),
               InvalidConfiguration);
  EXPECT_THROW(create([](NetworkConfig& c) {
                 c.on_connection_refused_cb = [](const EndPointAddress&) {};
                 c.on_connection_refused_reason_cb = [](const EndPointAddress&,
                                                        const RefusalReason&) {};
               }),
               InvalidConfiguration);
  EXPECT_THROW(create([](NetworkConfig& c) {
                 c.on_connection_closed_cb = [](const EndPointAddress&,
                                                const std::vector<std::uint64_t>&) {};
                 c.on_connection_closed_reason_cb = [](const EndPointAddress&,
                                                       const std::vector<std::uint64_t>&,
                                                       const CloseReason&) {};
               }),
               InvalidConfiguration);
  EXPECT_NO_THROW(create([](NetworkConfig& c) {
    c.on_data_from_cb = [](const EndPointAddress&, std::span<const std::uint8_t>) {};
    c.on_connection_refused_reason_cb = [](const EndPointAddress&, const RefusalReason&) {};
    c.on_connection_closed_reason_cb = [](const EndPointAddress&, const std::vector<std::uint64_t>&,
                                          const CloseReason&) {};
  }));
}

// on_connection_closed_reason_cb says how a connection ended: the side that closed it reads
// LOCAL, the other PEER_CLOSED; closing a listener ends its connections as LOCAL too. (A peer
// killed, a silent peer and a protocol error: tests/faults, tests/hostile, tests/ucx,
// tests/admission.)
TEST_P(CallbackVariants, AClosedConnectionSaysWhyOnBothSides) {
  auto server = make_node();
  auto client = make_node();
  const auto listen = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0},
                                                 receiver_params(BUF_SIZE));
  });
  // The reason of the n-th end of a connection with `remote`.
  const auto reason_of = [](Node& node, const EndPointAddress& remote,
                            std::size_t n = 1) -> std::optional<CloseReason> {
    if (!node.rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, remote) >= n; })) {
      return std::nullopt;
    }
    std::size_t seen = 0;
    for (const auto& e : node.rec.snapshot()) {
      if (e.kind == Kind::CLOSED && e.remote == remote && ++seen == n) return e.closed;
    }
    return std::nullopt;
  };
  // The n-th connection: how the server names it.
  const auto connect = [&](std::size_t n) -> std::optional<EndPointAddress> {
    client->call([&] {
      client->backend->open_active_endpoint(
          listen, sender_params(client->traits, SendMode::BUFFERED, {}, BUF_SIZE, BUF_SIZE));
    });
    if (!client->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == n; }) ||
        !server->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == n; })) {
      return std::nullopt;
    }
    std::size_t seen = 0;
    for (const auto& e : server->rec.snapshot()) {
      if (e.kind == Kind::ESTABLISHED && ++seen == n) return e.remote;
    }
    return std::nullopt;
  };
  // The client closes.
  auto accepted = connect(1);
  ASSERT_TRUE(accepted.has_value());
  client->call([&] { client->backend->close_active_endpoint(listen); });
  const auto local = reason_of(*client, listen);
  const auto peer = reason_of(*server, *accepted);
  ASSERT_TRUE(local.has_value());
  ASSERT_TRUE(peer.has_value());
  EXPECT_EQ(local->cause, CloseCause::LOCAL) << local->message;
  EXPECT_EQ(local->message, "closed locally");
  EXPECT_EQ(peer->cause, CloseCause::PEER_CLOSED) << peer->message;
  EXPECT_EQ(peer->message, "peer closed the connection");
  // The server closes its listener: its side reads LOCAL, the client's PEER_CLOSED.
  accepted = connect(2);
  ASSERT_TRUE(accepted.has_value());
  // The client's second connection may come from the first one's source port again (the
  // kernel reuses ephemeral ports): then the server's second end for that address is this one.
  const std::size_t ends_before = server->rec.count_now(Kind::CLOSED, *accepted);
  server->call([&] { server->backend->close_listen_endpoint(listen); });
  const auto by_listener = reason_of(*server, *accepted, ends_before + 1);
  const auto seen_by_client = reason_of(*client, listen, 2);
  ASSERT_TRUE(by_listener.has_value());
  ASSERT_TRUE(seen_by_client.has_value());
  EXPECT_EQ(by_listener->cause, CloseCause::LOCAL) << by_listener->message;
  EXPECT_EQ(by_listener->message, "listen endpoint closed");
  EXPECT_EQ(seen_by_client->cause, CloseCause::PEER_CLOSED) << seen_by_client->message;
  EXPECT_EQ(to_string(CloseCause::PEER_CLOSED), "peer_closed");
  // The client's backend is destroyed with the connection open: an orderly end too (the
  // goodbye is sent from the destructor), not a lost peer.
  const auto listen2 = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0},
                                                 receiver_params(BUF_SIZE));
  });
  client->call([&] {
    client->backend->open_active_endpoint(
        listen2, sender_params(client->traits, SendMode::BUFFERED, {}, BUF_SIZE, BUF_SIZE));
  });
  ASSERT_TRUE(client->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 3; }));
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 3; }));
  std::optional<EndPointAddress> third;
  for (const auto& e : server->rec.snapshot()) {
    if (e.kind == Kind::ESTABLISHED) third = e.remote;
  }
  ASSERT_TRUE(third.has_value());
  // The client may have been given a source port of an earlier connection again: its end is
  // the next one with that address.
  const std::size_t ended_before = server->rec.count(Kind::CLOSED, *third);
  client.reset();
  const auto after_destruction = reason_of(*server, *third, ended_before + 1);
  ASSERT_TRUE(after_destruction.has_value());
  EXPECT_EQ(after_destruction->cause, CloseCause::PEER_CLOSED) << after_destruction->message;
}

INSTANTIATE_TEST_SUITE_P(Conformance, CallbackVariants, testing::ValuesIn(backends()), param_name);
INSTANTIATE_TEST_SUITE_P(Conformance, DataFrom,
                         testing::Combine(testing::ValuesIn(backends()),
                                          testing::Values(Receive::OWN, Receive::LISTENER_SHARED,
                                                          Receive::BACKEND_SHARED)),
                         DataFrom::name);

}  // namespace
}  // namespace netio3::conformance
