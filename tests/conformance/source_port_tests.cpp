// Many connections from one client to one server (issue 22): every connection a netio3 client
// opens has a source port of its own, so that a server, which knows a connection by its
// remote address, never sees two of them from one address and never refuses one for it.
//
// Linux picks an unbound socket's source port per destination: two sockets of one process
// that connect to two ports of one server may get the same one (a birthday problem over the
// ephemeral range; for 64 connections about 7% per round before the fix).

#include <arpa/inet.h>
#include <array>
#include <cstring>
#include <netinet/in.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <unistd.h>
#include <vector>

#include "common/byte_order.hpp"
#include "common/connection.hpp"
#include "common/tcp.hpp"
#include "common/wire.hpp"
#include "conformance.hpp"

namespace netio3::conformance {
namespace {

class SourcePorts : public testing::TestWithParam<BackendType> {};

TEST_P(SourcePorts, SixtyFourConnectionsToSixtyFourListenersAreNeverRefused) {
  constexpr std::size_t LISTENERS = 64;
  constexpr int ROUNDS = 50;
  Node server{GetParam(), ThreadSafetyModel::SAFE};
  Node client{GetParam(), ThreadSafetyModel::SAFE};
  std::vector<EndPointAddress> listens;
  for (std::size_t i = 0; i < LISTENERS; ++i) {
    listens.push_back(
        server.backend->open_listen_endpoint({test::test_address(), 0}, receiver_params(BUF_SIZE)));
  }
  std::vector<std::uint8_t> region;
  for (int round = 1; round <= ROUNDS; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    for (const auto& to : listens) {
      client.backend->open_active_endpoint(
          to, sender_params(client.traits, SendMode::BUFFERED, region));
    }
    const auto up = static_cast<std::size_t>(round) * LISTENERS;
    ASSERT_TRUE(client.rec.wait([&](const Recorder& r) {
      return r.count(Kind::ESTABLISHED) + r.count(Kind::REFUSED) >= up;
    })) << "connections did not finish setting up";
    ASSERT_TRUE(server.rec.wait([&](const Recorder& r) {
      return r.count(Kind::ESTABLISHED) >= up;
    })) << "the server established "
        << server.rec.count_now(Kind::ESTABLISHED) << " of " << up;
    ASSERT_EQ(client.rec.count_now(Kind::REFUSED), 0U);
    ASSERT_EQ(client.rec.count_now(Kind::ESTABLISHED), up);
    for (const auto& to : listens) client.backend->close_active_endpoint(to);
    ASSERT_TRUE(client.rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) >= up; }));
    ASSERT_TRUE(server.rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) >= up; }));
  }
}

// A plain TCP socket bound, with SO_REUSEADDR, to a port the kernel picks: the port two
// connections will share.
struct SharedPort {
  SharedPort() {
    if (!socket.error().empty()) ADD_FAILURE() << "cannot bind a socket: " << socket.error();
    port = socket.port();
  }

  // Connects (from the shared port) to `to` and returns what arrives until the server
  // closes, or nullopt when it did not close within the default timeout.
  std::optional<std::vector<std::uint8_t>> connect_and_read(const EndPointAddress& to) const {
    sockaddr_in in{};
    in.sin_family = AF_INET;
    in.sin_port = htons(to.port);
    ::inet_pton(AF_INET, to.address.c_str(), &in.sin_addr);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&in), sizeof(in)) != 0) {  // NOLINT
      ADD_FAILURE() << "connect from the shared port failed: " << std::strerror(errno);
      return std::nullopt;
    }
    std::vector<std::uint8_t> got;
    const auto deadline = std::chrono::steady_clock::now() + test::DEFAULT_TIMEOUT;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      std::array<std::uint8_t, 256> buffer{};
      const ssize_t n = ::recv(fd, buffer.data(), buffer.size(), 0);
      if (n <= 0) return got;
      got.insert(got.end(), buffer.begin(), buffer.begin() + n);
    }
    return std::nullopt;
  }

  test::BoundSocket socket{EndPointAddress{test::test_address(), 0}};
  int fd{socket.fd()};
  std::uint16_t port{0};
};

// A message of connection `tag`: the tag and a sequence number.
std::vector<std::uint8_t> tagged(std::uint64_t tag, std::uint64_t seq) {
  std::vector<std::uint8_t> out(16);
  detail::store_le64(out.data(), tag);
  detail::store_le64(out.data() + 8, seq);
  return out;
}

// Connections from one source address and port to listeners of one server (a
// source-port collision, docs/semantics.md). The first one keeps working; the second is
// refused with a logged reason; a netio3 client that meets the refusal connects again from a
// new source port by itself and never sees on_connection_refused_cb. The shared port is
// forced on the netio3 client (detail::force_next_source_port); a foreign client is a plain
// socket bound to the same port (asyncmsg and UCX: it reads the refusal greeting; libfabric's
// listener is the provider's, which waits for a connection request of its own protocol).
TEST_P(SourcePorts, ACollidingConnectionIsRefusedAndANetio3ClientRetriesFromANewPort) {
  constexpr std::uint64_t TAG_A = 0xA;
  constexpr std::uint64_t TAG_B = 0xB;
  constexpr std::uint64_t BATCH = 200;
  const test::LogCapture logs{LogLevel::warn};
  Node server{GetParam(), ThreadSafetyModel::SAFE};
  Node client{GetParam(), ThreadSafetyModel::SAFE};
  const auto listen_a =
      server.backend->open_listen_endpoint({test::test_address(), 0}, receiver_params(BUF_SIZE));
  const auto listen_b =
      server.backend->open_listen_endpoint({test::test_address(), 0}, receiver_params(BUF_SIZE));
  // The foreign client's connection gets a listener of its own: its 4-tuple stays in use
  // (the socket holds the shared port), so the netio3 client could not connect from that
  // port to the same listener at all.
  const auto listen_c =
      server.backend->open_listen_endpoint({test::test_address(), 0}, receiver_params(BUF_SIZE));
  const SharedPort shared;
  ASSERT_NE(shared.port, 0);
  std::vector<std::uint8_t> region;
  const auto params = sender_params(client.traits, SendMode::BUFFERED, region);

  // The first connection, from the shared port.
  detail::force_next_source_port(shared.port);
  client.backend->open_active_endpoint(listen_a, params);
  const auto remote_a = wait_connected(client, server, listen_a);
  ASSERT_TRUE(remote_a);
  ASSERT_EQ(remote_a->port, shared.port) << "the forced source port was not used";
  std::uint64_t seq_a = 0;
  const auto send_a = [&](std::uint64_t n) {
    for (std::uint64_t i = 0; i < n; ++i, ++seq_a) {
      ASSERT_EQ(send_one(client, listen_a, SendMode::BUFFERED, tagged(TAG_A, seq_a), region, seq_a),
                NetioStatus::OK);
    }
  };
  send_a(BATCH);

  // A foreign client from the same port: refused, with the refusal greeting.
  if (GetParam() != BackendType::LIBFABRIC) {
    const auto got = shared.connect_and_read(listen_c);
    ASSERT_TRUE(got) << "the server did not close the colliding connection";
    ASSERT_EQ(got->size(), detail::GREETING_SIZE) << "the server sent no refusal greeting";
    EXPECT_TRUE(std::equal(detail::MAGIC.begin(), detail::MAGIC.end(), got->begin()));
    EXPECT_EQ(detail::load_le32(got->data() + 8), 0U) << "maximum message size";
    EXPECT_EQ(detail::load_le32(got->data() + 12), detail::GREETING_REFUSED_ADDRESS_IN_USE);
    EXPECT_EQ(logs.count("source-port collision"), 1U);
  }
  send_a(BATCH);

  // The netio3 client's second connection, forced onto the same port: refused once, then
  // made from a new port without the application hearing of it.
  const std::size_t collisions_before = logs.count("source-port collision");
  detail::force_next_source_port(shared.port);
  client.backend->open_active_endpoint(listen_b, params);
  ASSERT_TRUE(client.rec.wait([&](const Recorder& r) {
    return r.count(Kind::ESTABLISHED, listen_b) + r.count(Kind::REFUSED) >= 1;
  }));
  ASSERT_EQ(client.rec.count_now(Kind::REFUSED), 0U)
      << "the retry did not happen or failed; the log:\n"
      << logs.text();
  ASSERT_TRUE(server.rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) >= 2; }));
  EXPECT_EQ(logs.count("source-port collision"), collisions_before + 1) << "server's reason";
  EXPECT_EQ(logs.count("connecting again from a new source port (retry 1 of"), 1U)
      << "client's retry";
  EndPointAddress remote_b;
  for (const auto& e : server.rec.snapshot()) {
    if (e.kind == Kind::ESTABLISHED && !(e.remote == *remote_a)) remote_b = e.remote;
  }
  EXPECT_NE(remote_b.port, shared.port) << "the second connection kept the colliding port";

  // Both carry data; the first lost nothing.
  send_a(BATCH);
  for (std::uint64_t i = 0; i < BATCH; ++i) {
    ASSERT_EQ(send_one(client, listen_b, SendMode::BUFFERED, tagged(TAG_B, i), region, i),
              NetioStatus::OK);
  }
  ASSERT_TRUE(server.rec.wait([&](const Recorder& r) {
    return r.count(Kind::DATA) >= seq_a + BATCH;
  })) << server.rec.count_now(Kind::DATA)
      << " of " << seq_a + BATCH << " messages arrived";
  std::uint64_t next_a = 0;
  std::uint64_t next_b = 0;
  for (const auto& m : server.rec.messages_snapshot()) {
    ASSERT_EQ(m.size(), 16U);
    const auto tag = detail::load_le64(m.data());
    const auto seq = detail::load_le64(m.data() + 8);
    if (tag == TAG_A) {
      ASSERT_EQ(seq, next_a++) << "connection A: lost or reordered";
    } else {
      ASSERT_EQ(tag, TAG_B);
      ASSERT_EQ(seq, next_b++) << "connection B: lost or reordered";
    }
  }
  EXPECT_EQ(next_a, seq_a);
  EXPECT_EQ(next_b, BATCH);
  EXPECT_EQ(server.rec.count_now(Kind::CLOSED), 0U) << "a connection was disturbed";
  EXPECT_EQ(client.rec.count_now(Kind::CLOSED), 0U) << "a connection was disturbed";
}

// A client whose every new source port collides again gives up after SOURCE_PORT_RETRIES
// retries: one on_connection_refused_cb, the reason logged, the existing connections
// unharmed. Each attempt gets a port from which the server has a connection already.
TEST_P(SourcePorts, RetriesFromNewSourcePortsAreBounded) {
  constexpr auto ATTEMPTS = static_cast<std::size_t>(detail::SOURCE_PORT_RETRIES + 1);
  const test::LogCapture logs{LogLevel::warn};
  Node server{GetParam(), ThreadSafetyModel::SAFE};
  Node client{GetParam(), ThreadSafetyModel::SAFE};
  std::vector<std::uint8_t> region;
  const auto params = sender_params(client.traits, SendMode::BUFFERED, region);
  std::vector<std::unique_ptr<SharedPort>> shared;
  std::vector<std::uint16_t> ports;
  std::vector<EndPointAddress> existing;
  for (std::size_t i = 0; i < ATTEMPTS; ++i) {
    shared.push_back(std::make_unique<SharedPort>());
    ASSERT_NE(shared.back()->port, 0);
    ports.push_back(shared.back()->port);
    existing.push_back(
        server.backend->open_listen_endpoint({test::test_address(), 0}, receiver_params(BUF_SIZE)));
    detail::force_next_source_port(ports.back());
    client.backend->open_active_endpoint(existing.back(), params);
    ASSERT_TRUE(client.rec.wait(
        [&](const Recorder& r) { return r.count(Kind::ESTABLISHED, existing.back()) == 1; }));
  }
  ASSERT_TRUE(
      server.rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == ATTEMPTS; }));

  const auto listen_b =
      server.backend->open_listen_endpoint({test::test_address(), 0}, receiver_params(BUF_SIZE));
  detail::force_source_ports(ports);
  client.backend->open_active_endpoint(listen_b, params);
  ASSERT_TRUE(client.rec.wait([&](const Recorder& r) { return r.count(Kind::REFUSED) == 1; }))
      << logs.text();
  EXPECT_EQ(detail::take_forced_source_port(), 0) << "not every attempt bound a source port";
  EXPECT_EQ(logs.count("source-port collision"), ATTEMPTS) << logs.text();
  EXPECT_EQ(logs.count("connecting again from a new source port"),
            static_cast<std::size_t>(detail::SOURCE_PORT_RETRIES))
      << logs.text();
  EXPECT_EQ(logs.count("giving up"), 1U) << logs.text();
  EXPECT_EQ(client.rec.count_now(Kind::ESTABLISHED), ATTEMPTS);

  for (std::size_t i = 0; i < ATTEMPTS; ++i) {
    ASSERT_EQ(send_one(client, existing[i], SendMode::BUFFERED, tagged(i, 0), region, i),
              NetioStatus::OK);
  }
  ASSERT_TRUE(server.rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == ATTEMPTS; }));
  EXPECT_EQ(server.rec.count_now(Kind::CLOSED), 0U);
  EXPECT_EQ(client.rec.count_now(Kind::CLOSED), 0U);
}

// A connect to a port nothing listens on, from that same port (the kernel may pick the
// destination port as the source port: examples_test saw it under ASan), completes as a TCP
// simultaneous open, the socket connected to itself; without a check asyncmsg read its own
// greeting and reported the connection established. It is refused.
TEST_P(SourcePorts, ASocketConnectedToItselfIsRefused) {
  Node client{GetParam(), ThreadSafetyModel::SAFE};
  const std::uint16_t unused = test::unused_port();
  std::vector<std::uint8_t> region;
  detail::force_next_source_port(unused);
  client.backend->open_active_endpoint({test::test_address(), unused},
                                       sender_params(client.traits, SendMode::BUFFERED, region));
  ASSERT_TRUE(client.rec.wait(
      [](const Recorder& r) { return r.count(Kind::REFUSED) + r.count(Kind::ESTABLISHED) >= 1; }));
  EXPECT_EQ(client.rec.count_now(Kind::ESTABLISHED), 0U);
  EXPECT_EQ(client.rec.count_now(Kind::REFUSED), 1U);
}

// When a new connection cannot get a source port of its own (none is free - a client that
// closed tens of thousands of connections within a minute holds the ephemeral range in
// TIME_WAIT - or, as here, the port forced on it is taken by a listener), it still connects:
// from a port connect() picks, with one line that says why.
TEST_P(SourcePorts, WithoutAPortOfItsOwnAConnectionIsStillMade) {
  const test::LogCapture logs{LogLevel::debug};  // a warning the first time, debug after
  Node server{GetParam(), ThreadSafetyModel::SAFE};
  Node client{GetParam(), ThreadSafetyModel::SAFE};
  const auto listen =
      server.backend->open_listen_endpoint({test::test_address(), 0}, receiver_params(BUF_SIZE));
  const test::RawListener taken;  // listening: nobody else can bind its port
  std::vector<std::uint8_t> region;
  detail::force_next_source_port(taken.address().port);
  client.backend->open_active_endpoint(listen,
                                       sender_params(client.traits, SendMode::BUFFERED, region));
  const auto remote = wait_connected(client, server, listen);
  ASSERT_TRUE(remote) << logs.text();
  EXPECT_NE(remote->port, taken.address().port);
  EXPECT_EQ(client.rec.count_now(Kind::REFUSED), 0U);
  EXPECT_EQ(logs.count("no source port of its own"), 1U) << logs.text();
  ASSERT_EQ(send_one(client, listen, SendMode::BUFFERED, tagged(1, 0), region, 0), NetioStatus::OK);
  ASSERT_TRUE(server.rec.wait([](const Recorder& r) { return r.count(Kind::DATA) == 1; }));
}

std::vector<BackendType> fixed_backends() {
  std::vector<BackendType> out;
  for (const auto type : backends()) {
    out.push_back(type);
  }
  return out;
}

std::string backend_name(const testing::TestParamInfo<BackendType>& param_info) {
  return std::string{netio3::to_string(param_info.param)};
}

INSTANTIATE_TEST_SUITE_P(Conformance, SourcePorts, testing::ValuesIn(fixed_backends()),
                         backend_name);

}  // namespace
}  // namespace netio3::conformance
