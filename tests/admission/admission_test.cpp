// Admission (docs/admission.md) on the asyncmsg and UCX backends: the partition key's challenge
// and response, the accept hook, what a refused peer sees, and what it never gets (on_data_cb, a
// buffer, an established connection). Raw sockets play the peers a netio3 backend cannot: one
// that replays a recorded set-up, an older peer, a server that cannot prove the key.

#include "common/admission.hpp"

#ifdef NETIO3_TEST_WITH_UCX
#include <ucp/api/ucp.h>

#include "ucp_worker.hpp"
#endif

#include <atomic>
#include <condition_variable>
#include <malloc.h>
#include <memory>
#include <mutex>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <vector>

#include <gtest/gtest.h>

#include "../hostile/hostile_support.hpp"

namespace netio3::hostile {
namespace {

using netio3::AcceptDecision;
using netio3::PeerInfo;
using netio3::RefusalCause;
using netio3::test::Recorder;

constexpr std::string_view KEY = "partition ATLAS-TDAQ-run-4711";
constexpr std::string_view OTHER_KEY = "partition ATLAS-TDAQ-run-0815";
constexpr std::uint32_t KEYED = 2;
constexpr std::uint32_t VERDICT = 4;

// The two wire protocols with admission: asyncmsg 1.3 and the UCX control channel 3.3, written
// here independently of the library.
struct Wire {
  BackendType type;
  std::uint16_t major;
  std::uint8_t challenge;
  std::uint8_t proof;
  std::uint8_t refusal;
  std::uint8_t hello;  // UCX's HELLO; asyncmsg: DATA, the frame that must wait for admission
  std::string_view protocol;
};
constexpr Wire ASYNCMSG_WIRE{BackendType::ASYNCMSG, 1, 3, 4, 5, 1, "asyncmsg"};
constexpr Wire UCX_WIRE{BackendType::UCX, 3, 5, 6, 7, 2, "ucx"};
// libfabric carries admission in connection data, not frames (AdmissionLibfabric below).
constexpr Wire LIBFABRIC_WIRE{BackendType::LIBFABRIC, 0, 0, 0, 0, 0, "libfabric"};

std::string wire_name(const ::testing::TestParamInfo<Wire>& info) {
  return std::string{info.param.protocol};
}

struct Side {
  std::string key{};
  std::string identity{};
  netio3::OnAcceptCb hook{};
  std::size_t max_message_size{netio3::DEFAULT_MAX_MESSAGE_SIZE};
};

// One server backend and any number of client backends on one loop.
class Admission : public ::testing::TestWithParam<Wire> {
 protected:
  [[nodiscard]] BackendType type() const { return GetParam().type; }
  [[nodiscard]] bool ucx() const { return type() == BackendType::UCX; }
  [[nodiscard]] bool frames() const { return type() != BackendType::LIBFABRIC; }

  void SetUp() override {
    if (!netio3::Netio3Backend::is_available(type())) GTEST_SKIP() << "backend not built";
    m_server_rec.keep_data(false);
    m_server_rec.set_hook([this](const Recorder::Event& e, std::span<const std::uint8_t> data) {
      if (e.kind == Recorder::Kind::DATA) m_checker.on_message(data);
    });
  }
  void TearDown() override {
    m_server.reset();
    m_loop.stop();
  }

  [[nodiscard]] NetworkConfig config_of(Recorder& rec, const Side& side) const {
    auto config = rec.config(netio3::ThreadSafetyModel::SAFE, NetworkMode::TCP,
                             Recorder::Callbacks::WITH_SENDER_AND_REASON);
    config.partition_key = side.key;
    config.identity = side.identity;
    config.on_accept_cb = side.hook;
    config.limits = patient_limits();
    config.limits.max_message_size = side.max_message_size;
    return config;
  }

  void start_server(const Side& side) {
    m_server = netio3::Netio3Backend::create(type(), config_of(m_server_rec, side), loop());
    m_listen = m_server->open_listen_endpoint({"127.0.0.1", 0}, listen_params());
    ASSERT_NE(m_listen.port, 0);
  }

  struct Client {
    Recorder rec;
    std::unique_ptr<NetworkBackend> backend;
  };

  std::unique_ptr<Client> make_client(const Side& side) {
    auto client = std::make_unique<Client>();
    Side own = side;
    own.hook = {};
    client->backend = netio3::Netio3Backend::create(type(), config_of(client->rec, own), loop());
    return client;
  }

  // Connects `client` to `server`; the event that ended the set-up (ESTABLISHED or REFUSED).
  static Recorder::Event connect(Client& client, const EndPointAddress& server) {
    const std::size_t before = client.rec.count_now(Recorder::Kind::ESTABLISHED) +
                               client.rec.count_now(Recorder::Kind::REFUSED);
    client.backend->open_active_endpoint(server, client_params());
    EXPECT_TRUE(client.rec.wait([&](const Recorder& r) {
      return r.count(Recorder::Kind::ESTABLISHED) + r.count(Recorder::Kind::REFUSED) > before;
    }));
    const auto events = client.rec.snapshot();
    return events.empty() ? Recorder::Event{} : events.back();
  }
  Recorder::Event connect(Client& client) { return connect(client, m_listen); }

  static void expect_not_admitted(const Recorder::Event& event, std::string_view because) {
    EXPECT_EQ(event.kind, Recorder::Kind::REFUSED);
    EXPECT_EQ(event.refusal.cause, RefusalCause::NOT_ADMITTED) << event.refusal.message;
    EXPECT_NE(event.refusal.message.find(because), std::string::npos)
        << "reason: '" << event.refusal.message << "', expected it to say '" << because << "'";
  }

  [[nodiscard]] const std::shared_ptr<netio3::EpollEventLoop>& loop() const {
    return m_loop.loop();
  }

  // One message from `backend` to the server: copied (asyncmsg, UCX), or written into a send
  // buffer (libfabric sends from registered memory only), waiting for one within PROMPT.
  [[nodiscard]] NetioStatus send_message(NetworkBackend& backend, const Bytes& m,
                                         std::uint64_t key) const {
    if (frames()) return backend.send_data_copy(m_listen, m, {}, key);
    netio3::NetworkBuffer* buffer = nullptr;
    if (!netio3::test::eventually(
            [&] { return (buffer = backend.get_buffer(m_listen)) != nullptr; }, PROMPT)) {
      return NetioStatus::NO_RESOURCES;
    }
    buffer->write(std::span{m});
    return backend.send_buffer(m_listen, buffer);
  }

  // Sends `n` checked messages from `client` and waits for the server to have them all.
  void exchange(Client& client, std::uint32_t stream, std::uint32_t n) {
    m_checker.expect_stream(stream);
    for (std::uint32_t seq = 0; seq < n; ++seq) {
      const Bytes m = make_message(stream, seq, PREFIX + 64 + seq);
      ASSERT_EQ(send_message(*client.backend, m, message_key(stream, seq)), NetioStatus::OK);
    }
    EXPECT_TRUE(m_checker.wait_received(stream, n, PROMPT));
  }

  bool wait_server_established(std::size_t n) {
    return m_server_rec.wait(
        [n](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == n; });
  }
  std::size_t server_count(Recorder::Kind kind) { return m_server_rec.count_now(kind); }

  LogCapture m_logs;
  StreamChecker m_checker;
  Recorder m_server_rec;
  netio3::test::LoopThread m_loop;
  std::unique_ptr<NetworkBackend> m_server;
  EndPointAddress m_listen;
};

TEST_P(Admission, TheRightKeyConnectsAndMovesData) {
  ASSERT_NO_FATAL_FAILURE(start_server({.key = std::string{KEY}}));
  auto client = make_client({.key = std::string{KEY}});
  const auto event = connect(*client);
  ASSERT_EQ(event.kind, Recorder::Kind::ESTABLISHED) << event.refusal.message << m_logs.dump();
  ASSERT_TRUE(wait_server_established(1));
  exchange(*client, 1, 100);
  EXPECT_EQ(m_checker.errors(), std::vector<std::string>{});
}

// The set-up's frames travel whatever limits.max_message_size says (a PROOF is 33 bytes or
// more, a REFUSAL up to 256).
TEST_P(Admission, ASmallMessageLimitNeitherBlocksTheSetUpNorHidesTheRefusal) {
  ASSERT_NO_FATAL_FAILURE(
      start_server({.key = std::string{KEY}, .identity = "server", .max_message_size = 32}));
  auto client = make_client({.key = std::string{KEY}, .identity = "ros-1", .max_message_size = 32});
  ASSERT_EQ(connect(*client).kind, Recorder::Kind::ESTABLISHED) << m_logs.dump();
  auto wrong = make_client({.key = std::string{OTHER_KEY}, .max_message_size = 16});
  expect_not_admitted(connect(*wrong), "failed to prove the partition key");
}

TEST_P(Admission, AnotherKeyNoKeyAndAKeyTheServerLacksAreRefusedWithTheReason) {
  ASSERT_NO_FATAL_FAILURE(start_server({.key = std::string{KEY}}));
  auto wrong = make_client({.key = std::string{OTHER_KEY}});
  expect_not_admitted(connect(*wrong), "failed to prove the partition key");
  auto none = make_client({});
  expect_not_admitted(connect(*none), "requires a partition key");

  // And the other way round: a keyed client does not connect to a server without a key.
  Recorder open_rec;
  auto open_server = netio3::Netio3Backend::create(type(), config_of(open_rec, {}), loop());
  const auto open_listen = open_server->open_listen_endpoint({"127.0.0.1", 0}, listen_params());
  auto keyed = make_client({.key = std::string{KEY}});
  expect_not_admitted(connect(*keyed, open_listen), "holds no partition key");

  // None of them was established on a server, none delivered anything.
  EXPECT_TRUE(m_logs.wait_line(m_listen, {"refusing connection"}));
  EXPECT_EQ(server_count(Recorder::Kind::ESTABLISHED), 0U);
  EXPECT_EQ(server_count(Recorder::Kind::DATA), 0U);
  EXPECT_EQ(open_rec.count_now(Recorder::Kind::ESTABLISHED), 0U);
  for (auto* c : {wrong.get(), none.get(), keyed.get()}) {
    EXPECT_EQ(c->rec.count_now(Recorder::Kind::ESTABLISHED), 0U);
  }
  open_server.reset();
}

TEST_P(Admission, TheHookSeesThePeerAndItsProvenIdentityAndItsRefusalReachesTheClient) {
  std::mutex mutex;
  std::vector<PeerInfo> asked;
  std::atomic<bool> on_loop_thread{true};
  ASSERT_NO_FATAL_FAILURE(start_server(
      {.key = std::string{KEY}, .identity = "event-builder", .hook = [&](const PeerInfo& peer) {
         if (!loop()->in_loop_thread()) on_loop_thread = false;
         const std::lock_guard lock{mutex};
         asked.push_back(peer);
         if (peer.identity == "ros-17") return AcceptDecision::accept();
         return AcceptDecision::refuse(fmt::format("{} is not in this partition", peer.identity));
       }}));
  auto good = make_client({.key = std::string{KEY}, .identity = "ros-17"});
  ASSERT_EQ(connect(*good).kind, Recorder::Kind::ESTABLISHED) << m_logs.dump();
  auto stranger = make_client({.key = std::string{KEY}, .identity = "ros-99"});
  expect_not_admitted(connect(*stranger), "ros-99 is not in this partition");
  auto wrong_key = make_client({.key = std::string{OTHER_KEY}, .identity = "ros-17"});
  expect_not_admitted(connect(*wrong_key), "failed to prove the partition key");

  exchange(*good, 2, 50);
  ASSERT_TRUE(wait_server_established(1));
  const std::lock_guard lock{mutex};
  ASSERT_EQ(asked.size(), 2U) << "the hook is asked only about peers that proved the key";
  EXPECT_TRUE(on_loop_thread) << "the hook ran off the loop thread";
  for (const auto& peer : asked) {
    EXPECT_TRUE(peer.key_proven);
    EXPECT_EQ(peer.listener, m_listen);
    EXPECT_EQ(peer.remote.address, "127.0.0.1");
  }
  EXPECT_EQ(asked[0].identity, "ros-17");
  EXPECT_EQ(asked[1].identity, "ros-99");
  EXPECT_EQ(server_count(Recorder::Kind::ESTABLISHED), 1U);
  EXPECT_EQ(m_server_rec.snapshot().front().remote, asked[0].remote);
}

TEST_P(Admission, AHookWithoutAKeyDecidesByAddressAndAThrowingHookRefuses) {
  std::atomic<int> calls{0};
  ASSERT_NO_FATAL_FAILURE(start_server({.hook = [&](const PeerInfo& peer) -> AcceptDecision {
    const int n = ++calls;
    EXPECT_FALSE(peer.key_proven);
    EXPECT_EQ(peer.identity, "");
    if (n == 1) return AcceptDecision::accept();
    if (n == 2) return AcceptDecision::refuse("");
    throw std::runtime_error("the run-control database is down");
  }}));
  auto first = make_client({});
  ASSERT_EQ(connect(*first).kind, Recorder::Kind::ESTABLISHED) << m_logs.dump();
  auto second = make_client({});
  expect_not_admitted(connect(*second),
                      fmt::format("refused by the {} server's accept hook", GetParam().protocol));
  auto third = make_client({});
  expect_not_admitted(connect(*third), "the accept hook failed: the run-control database is down");
  exchange(*first, 3, 20);
  EXPECT_EQ(server_count(Recorder::Kind::ESTABLISHED), 1U);
}

// The application destroys the server from inside its hook: the peer is refused (it is told,
// it does not wait for its deadline), and nothing else of that server runs.
TEST_P(Admission, AServerDestroyedInsideItsHookRefusesThePeer) {
  std::atomic<int> calls{0};
  ASSERT_NO_FATAL_FAILURE(start_server({.hook = [&](const PeerInfo&) {
    ++calls;
    m_server.reset();
    return AcceptDecision::accept();
  }}));
  auto client = make_client({});
  const auto event = connect(*client);
  EXPECT_EQ(event.kind, Recorder::Kind::REFUSED) << m_logs.dump();
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(server_count(Recorder::Kind::ESTABLISHED), 0U);
}

// Reads exactly `n` bytes from a raw socket within PROMPT; empty on timeout or close.
std::optional<Bytes> read_raw(int fd, std::size_t n) {
  Bytes out(n);
  std::size_t have = 0;
  const auto deadline = Clock::now() + PROMPT;
  while (have < n) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(remaining(deadline).count())) <= 0) return {};
    const ssize_t got = ::recv(fd, out.data() + have, n - have, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) return {};
    if (got > 0) have += static_cast<std::size_t>(got);
  }
  return out;
}

// A raw client that does what a netio3 client does, recording what it sends.
struct RawKeyedClient {
  Wire wire;
  Bytes sent{};
  std::optional<Bytes> server_greeting{};
  std::optional<Bytes> server_challenge{};

  // Greeting and challenge, read the server's, then the proof for its nonce.
  bool handshake(RawPeer& peer, std::string_view key, std::string_view identity) {
    server_greeting = peer.read_exact(GREETING_SIZE);
    server_challenge = peer.read_exact(HEADER_SIZE + 16);
    if (!server_greeting || !server_challenge) return false;
    netio3::detail::AdmissionNonce own{};
    own.fill(0x5A);
    netio3::detail::AdmissionNonce theirs{};
    std::copy_n(server_challenge->begin() + HEADER_SIZE, 16, theirs.begin());
    const netio3::detail::PartitionKey k{key};
    const auto proof =
        k.prove(wire.protocol, netio3::detail::AdmissionRole::CLIENT, theirs, own, identity);
    append(sent, greeting(wire.major, 3, 1U << 20U, KEYED));
    append(sent, frame_header(16, wire.challenge));
    append(sent, own);
    const auto body = netio3::detail::encode_proof(proof, identity);
    append(sent, frame_header(static_cast<std::uint32_t>(body.size()), wire.proof));
    append(sent, body);
    return peer.send_all(sent);
  }
};

TEST_P(Admission, ARecordedSetUpReplayedOnANewConnectionIsRefusedAndDeliversNothing) {
  if (!frames()) GTEST_SKIP() << "libfabric's connection data: AdmissionLibfabric";
  ASSERT_NO_FATAL_FAILURE(start_server({.key = std::string{KEY}}));
  const Wire wire = GetParam();
  RawKeyedClient recorded{wire};
  {
    RawPeer first{m_listen};
    ASSERT_TRUE(recorded.handshake(first, KEY, "ros-1"));
    EXPECT_EQ(get_le32(recorded.server_greeting->data() + 12), KEYED | VERDICT);
    EXPECT_EQ((*recorded.server_challenge)[4], wire.challenge);
    // Admitted: the server's proof comes back.
    const auto answer = first.read_exact(HEADER_SIZE + 1 + 32);
    ASSERT_TRUE(answer.has_value()) << m_logs.dump();
    EXPECT_EQ((*answer)[4], wire.proof);
    if (!ucx()) {  // asyncmsg: the proof made it a connection (UCX needs its READY too)
      ASSERT_TRUE(wait_server_established(1));
    }
  }
  // The same bytes again, with a message behind them: the server's new nonce makes the
  // recorded proof worthless.
  RawPeer replay{m_listen};
  Bytes all = recorded.sent;
  m_checker.expect_stream(7);
  if (!ucx()) append(all, make_frame(7, 0, 64));
  ASSERT_TRUE(replay.read_exact(GREETING_SIZE + HEADER_SIZE + 16).has_value());
  EXPECT_TRUE(replay.send_all(all));
  const auto refusal = replay.read_exact(HEADER_SIZE);
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ((*refusal)[4], wire.refusal);
  const auto reason = replay.read_exact(get_le32(refusal->data()));
  ASSERT_TRUE(reason.has_value());
  EXPECT_NE(std::string(reason->begin(), reason->end()).find("failed to prove the partition key"),
            std::string::npos);
  EXPECT_NE(replay.wait_closed(), RawPeer::Outcome::STILL_OPEN);
  EXPECT_EQ(server_count(Recorder::Kind::ESTABLISHED), ucx() ? 0U : 1U);
  EXPECT_EQ(m_checker.received(7), 0U) << "a replayed set-up delivered data";
}

TEST_P(Admission, BeforeAdmissionOnlySmallSetUpFramesAreRead) {
  if (!frames()) GTEST_SKIP() << "libfabric's connection data: AdmissionLibfabric";
  ASSERT_NO_FATAL_FAILURE(start_server({.key = std::string{KEY}}));
  const Wire wire = GetParam();
  m_checker.expect_stream(8);
  {  // what must wait for admission (asyncmsg: DATA, UCX: the HELLO) instead of the challenge
    RawPeer peer{m_listen};
    Bytes all = greeting(wire.major, 3, 1U << 20U, KEYED);
    append(all, make_frame(8, 0, 64));
    all[GREETING_SIZE + 4] = wire.hello;
    EXPECT_TRUE(peer.send_all(all));
    EXPECT_NE(peer.wait_closed(), RawPeer::Outcome::STILL_OPEN);
    EXPECT_TRUE(m_logs.wait_line(
        peer.local(),
        {fmt::format("a {} frame before the connection was admitted", ucx() ? "HELLO" : "DATA")}))
        << m_logs.dump();
  }
  {  // a large frame is refused by its header, before any memory is reserved for it
    RawPeer peer{m_listen};
    Bytes all = greeting(wire.major, 3, 1U << 20U, KEYED);
    append(all, frame_header(1U << 20U, wire.challenge));
    EXPECT_TRUE(peer.send_all(all));
    EXPECT_NE(peer.wait_closed(), RawPeer::Outcome::STILL_OPEN);
    EXPECT_TRUE(m_logs.wait_line(peer.local(), {"frame declares a message of 1048576 bytes"}))
        << m_logs.dump();
  }
  {  // an older client greets without a key: closed after the greeting and challenge, with no
     // frame it could not parse
    RawPeer peer{m_listen};
    ASSERT_TRUE(peer.send_all(greeting(wire.major, 2, 1U << 20U)));
    ASSERT_TRUE(peer.read_exact(GREETING_SIZE + HEADER_SIZE + 16).has_value());
    EXPECT_EQ(peer.wait_closed(), RawPeer::Outcome::CLOSED);
    EXPECT_TRUE(m_logs.wait_line(peer.local(), {"the peer holds no partition key"}));
  }
  EXPECT_EQ(server_count(Recorder::Kind::ESTABLISHED), 0U);
  EXPECT_EQ(m_checker.received(8), 0U);
}

// asyncmsg: a client of 1.2 knows no VERDICT and counts the greeting as the set-up. A server
// with a hook only still serves it (no PROOF frame it would reject), or closes it.
TEST_P(Admission, AHookOnlyServerServesAnOlderClientWithoutFramesItCannotParse) {
  if (type() != BackendType::ASYNCMSG) {
    GTEST_SKIP() << "asyncmsg's DATA frames; UCX's older clients go the same way, libfabric's: "
                    "AdmissionLibfabric";
  }
  std::atomic<int> calls{0};
  ASSERT_NO_FATAL_FAILURE(start_server({.hook = [&](const PeerInfo&) {
    return ++calls == 1 ? AcceptDecision::accept() : AcceptDecision::refuse("not you");
  }}));
  m_checker.expect_stream(11);
  {
    RawPeer old{m_listen};
    Bytes all = greeting(1, 2, 1U << 20U);
    append(all, make_frame(11, 0, 64));
    ASSERT_TRUE(old.send_all(all));
    const auto server_greeting = old.read_exact(GREETING_SIZE);
    ASSERT_TRUE(server_greeting.has_value());
    EXPECT_EQ(get_le32(server_greeting->data() + 12), VERDICT);
    EXPECT_TRUE(m_checker.wait_received(11, 1, PROMPT)) << m_logs.dump();
    // Nothing followed the greeting: once the message was delivered the server had written
    // all it would, and a 1.2 client would reject a PROOF frame.
    std::uint8_t byte = 0;
    EXPECT_EQ(::recv(old.fd(), &byte, 1, MSG_DONTWAIT), -1);
    ASSERT_TRUE(wait_server_established(1));
  }
  {
    RawPeer refused{m_listen};
    Bytes all = greeting(1, 2, 1U << 20U);
    append(all, make_frame(11, 1, 64));
    ASSERT_TRUE(refused.send_all(all));
    ASSERT_TRUE(refused.read_exact(GREETING_SIZE).has_value());
    EXPECT_EQ(refused.wait_closed(), RawPeer::Outcome::CLOSED) << "no REFUSAL frame, a close";
  }
  EXPECT_EQ(m_checker.received(11), 1U);
}

TEST_P(Admission, AServerThatCannotProveTheKeyIsRefusedByTheClient) {
  if (!frames()) GTEST_SKIP() << "libfabric's connection data: AdmissionLibfabric";
  const Wire wire = GetParam();
  netio3::test::RawListener rogue;
  auto client = make_client({.key = std::string{KEY}});
  client->backend->open_active_endpoint(rogue.address(), client_params());
  pollfd p{rogue.fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, static_cast<int>(std::chrono::milliseconds{PROMPT}.count())), 1);
  const int fd = ::accept(rogue.fd(), nullptr, nullptr);
  ASSERT_GE(fd, 0);
  Bytes answer = greeting(wire.major, 3, 1U << 20U, KEYED | VERDICT);
  append(answer, frame_header(16, wire.challenge));
  append(answer, Bytes(16, 0x11));
  ASSERT_EQ(::send(fd, answer.data(), answer.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(answer.size()));
  // The client's greeting, challenge and proof; then a proof made up of zeros.
  const auto in = read_raw(fd, GREETING_SIZE + HEADER_SIZE + 16 + HEADER_SIZE + 1 + 32);
  ASSERT_TRUE(in.has_value());
  EXPECT_EQ((*in)[GREETING_SIZE + HEADER_SIZE + 16 + 4], wire.proof);
  Bytes fake = frame_header(33, wire.proof);
  fake.push_back(1);
  append(fake, Bytes(32, 0));
  ASSERT_EQ(::send(fd, fake.data(), fake.size(), MSG_NOSIGNAL), static_cast<ssize_t>(fake.size()));
  ASSERT_TRUE(
      client->rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::REFUSED) == 1; }));
  expect_not_admitted(client->rec.snapshot().back(),
                      "the server failed to prove the partition key");
  EXPECT_EQ(client->rec.count_now(Recorder::Kind::ESTABLISHED), 0U);
  ::close(fd);
}

// A client that keeps nothing per attempt: it counts its refusals (the recorder of the other
// tests keeps every event, which would hide what the library keeps).
class CountingClient {
 public:
  CountingClient(BackendType type, const std::shared_ptr<netio3::EpollEventLoop>& loop,
                 const Side& side) {
    NetworkConfig config{};
    config.partition_key = side.key;
    config.identity = side.identity;
    config.on_connection_refused_reason_cb = [this](const EndPointAddress&,
                                                    const netio3::RefusalReason& reason) {
      {
        const std::lock_guard lock{m_mutex};
        ++m_refused;
        m_last_cause = reason.cause;
      }
      m_cv.notify_all();
    };
    config.on_connection_established_cb = [this](const EndPointAddress&,
                                                 netio3::EndpointCapabilities) {
      {
        const std::lock_guard lock{m_mutex};
        ++m_established;
      }
      m_cv.notify_all();
    };
    m_backend = netio3::Netio3Backend::create(type, std::move(config), loop);
  }
  // One attempt: true when it was refused as not admitted.
  bool refused(const EndPointAddress& server) {
    std::unique_lock lock{m_mutex};
    const std::size_t before = m_refused + m_established;
    lock.unlock();
    m_backend->open_active_endpoint(server, client_params());
    lock.lock();
    const bool ended =
        m_cv.wait_for(lock, PROMPT, [&] { return m_refused + m_established > before; });
    return ended && m_established == 0 && m_last_cause == RefusalCause::NOT_ADMITTED;
  }

 private:
  std::mutex m_mutex;
  std::condition_variable m_cv;
  std::size_t m_refused{0};
  std::size_t m_established{0};
  RefusalCause m_last_cause{};
  std::unique_ptr<NetworkBackend> m_backend;
};

// Refused peers, over and over, while an admitted connection streams: the stream is intact,
// and descriptors (and, without a sanitizer, heap in use) come back to where they were.
TEST_P(Admission, AThousandRefusedAttemptsLeaveTheStreamIntactAndResourcesAtBaseline) {
  ASSERT_NO_FATAL_FAILURE(start_server({.key = std::string{KEY}, .hook = [](const PeerInfo& peer) {
                                          return peer.identity == "refuse-me"
                                                     ? AcceptDecision::refuse("go away")
                                                     : AcceptDecision::accept();
                                        }}));
  auto good = make_client({.key = std::string{KEY}});
  ASSERT_EQ(connect(*good).kind, Recorder::Kind::ESTABLISHED);
  good->rec.keep_data(false);
  CountingClient wrong{type(), loop(), {.key = std::string{OTHER_KEY}}};
  CountingClient none{type(), loop(), {}};
  CountingClient hooked{type(), loop(), {.key = std::string{KEY}, .identity = "refuse-me"}};
  // The log lines of a thousand refusals are counted, not kept (LogCapture would keep them).
  std::atomic<std::size_t> server_refusals{0};
  netio3::set_log_sink([&server_refusals](netio3::LogLevel level, std::string_view line) {
    if (level >= netio3::LogLevel::warn && line.find("refusing connection") != line.npos) {
      ++server_refusals;
    }
  });
  // Warm-up: each kind once, so that lazily made things (buffers, caches) exist.
  for (auto* c : {&wrong, &none, &hooked}) EXPECT_TRUE(c->refused(m_listen));
  exchange(*good, 9, 10);
  const std::size_t fds = netio3::test::open_fd_count();
  const std::size_t heap = mallinfo2().uordblks;
  const std::size_t logged_before = server_refusals.load();

  m_checker.expect_stream(10);
  std::uint32_t seq = 0;
  for (int i = 0; i < 1000; ++i) {
    auto& c = i % 3 == 0 ? wrong : i % 3 == 1 ? none : hooked;
    ASSERT_TRUE(c.refused(m_listen)) << "attempt " << i;
    if (i % 10 != 0) continue;
    const Bytes m = make_message(10, seq, PREFIX + 32);
    if (send_message(*good->backend, m, message_key(10, seq)) == NetioStatus::OK) {
      ++seq;
    }
  }
  EXPECT_TRUE(m_checker.wait_received(10, seq, PROMPT));
  EXPECT_GT(seq, 90U);
  EXPECT_EQ(m_checker.errors(), std::vector<std::string>{});
  EXPECT_EQ(server_count(Recorder::Kind::ESTABLISHED), 1U);
  EXPECT_EQ(server_count(Recorder::Kind::CLOSED), 0U);
  EXPECT_EQ(server_refusals.load() - logged_before, 1000U)
      << "the server logs every refusal with its reason, once";
  const bool fds_back =
      netio3::test::eventually([&] { return netio3::test::open_fd_count() <= fds; }, PROMPT);
  EXPECT_TRUE(fds_back) << "descriptors: " << netio3::test::open_fd_count() << ", before " << fds;
  // Connections that ended are let go by the set-up deadline's next check (100 ms), which
  // holds them weakly until then: heap in use comes back, it is not there at once.
  const std::size_t allowance = std::size_t{256} << 10U;
  const bool heap_back =
      netio3::test::eventually([&] { return mallinfo2().uordblks < heap + allowance; }, PROMPT);
  const std::size_t heap_after = mallinfo2().uordblks;
  std::printf("[ info     ] 1000 refused set-ups: descriptors %zu -> %zu, heap in use %zu -> %zu\n",
              fds, netio3::test::open_fd_count(), heap, heap_after);
  if constexpr (!netio3::test::SANITIZED) {
    // The good client's recorder keeps an event per completed send (100 of them, a few
    // hundred bytes each). A connection the library kept would cost more than 256 bytes each.
    EXPECT_TRUE(heap_back) << "heap in use grew by " << heap_after - heap
                           << " bytes over 1000 refused set-ups";
  }
  netio3::set_log_sink({});
}

INSTANTIATE_TEST_SUITE_P(Backends, Admission,
                         ::testing::Values(ASYNCMSG_WIRE, UCX_WIRE, LIBFABRIC_WIRE), wire_name);

#ifdef NETIO3_TEST_WITH_UCX
// A UCP worker of a stranger: it has the server's worker address (leaked out of band - here
// from a set-up of its own, with the key) and its own connection's token, and sends netio3
// DATA messages straight to the server's worker over an endpoint of its own, addressed to
// tokens it guesses. None may reach on_data_cb.
class StrangerUcp {
 public:
  explicit StrangerUcp(std::span<const std::uint8_t> server_address) {
    // UCX reads the address without its length: a copy with room behind it.
    m_address.assign(server_address.begin(), server_address.end());
    m_address.resize(m_address.size() + 256, 0);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(m_address.data());  // NOLINT
    m_ok = m_ucp.ok() && ucp_ep_create(m_ucp.get(), &ep, &m_ucp.ep) == UCS_OK;
  }

  [[nodiscard]] bool ok() const { return m_ok; }

  // A netio3 DATA message (protocol 3: type 3, version 3, no prefix, sequence number, the
  // receiver's token) with `payload`; true once UCX completed the send.
  bool send(std::uint64_t token, std::uint64_t seq, std::span<const std::uint8_t> payload) {
    std::array<std::uint8_t, 24> header{};
    header[0] = 3;
    header[1] = 3;
    for (unsigned i = 0; i < 8; ++i) {
      header[8 + i] = static_cast<std::uint8_t>(seq >> (8U * i));
      header[16 + i] = static_cast<std::uint8_t>(token >> (8U * i));
    }
    ucp_request_param_t param{};
    return m_ucp.wait(ucp_am_send_nbx(m_ucp.ep, 7, header.data(), header.size(), payload.data(),
                                      payload.size(), &param),
                      PROMPT);
  }

 private:
  netio3::test::UcpWorker m_ucp;  // its endpoint closed by force when it goes
  bool m_ok{false};
  std::vector<std::uint8_t> m_address;
};

TEST(AdmissionUcx, AStrangerWithTheWorkerAddressAndATokenOfItsOwnDeliversNothing) {
  if (!netio3::Netio3Backend::is_available(BackendType::UCX)) GTEST_SKIP() << "no UCX backend";
  LogCapture logs;
  StreamChecker checker;
  Recorder server_rec;
  server_rec.keep_data(false);
  server_rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t> data) {
    if (e.kind == Recorder::Kind::DATA) checker.on_message(data);
  });
  netio3::test::LoopThread loop;
  auto config = server_rec.config(netio3::ThreadSafetyModel::SAFE, NetworkMode::TCP);
  config.partition_key = std::string{KEY};
  config.limits = patient_limits();
  auto server = netio3::Netio3Backend::create(BackendType::UCX, std::move(config), loop.loop());
  const auto listen = server->open_listen_endpoint({"127.0.0.1", 0}, listen_params());
  // A legitimate client streams throughout.
  checker.expect_stream(LEGIT_STREAM);
  LegitClient legit{loop.loop(), listen, BackendType::UCX, NetworkMode::TCP, std::string{KEY}};
  ASSERT_TRUE(legit.connect()) << logs.dump();
  for (std::uint32_t seq = 0; seq < 10; ++seq) {
    ASSERT_EQ(legit.send(LEGIT_STREAM, seq, PREFIX + 100), NetioStatus::OK);
  }
  ASSERT_TRUE(checker.wait_received(LEGIT_STREAM, 10, PROMPT)) << logs.dump();

  // The stranger's own set-up (it holds the key, so it is admitted) hands it the server's
  // worker address and the token of its own connection.
  RawPeer own{listen};
  RawKeyedClient raw{UCX_WIRE};
  ASSERT_TRUE(raw.handshake(own, KEY, "stranger"));
  ASSERT_TRUE(own.read_exact(HEADER_SIZE + 1 + 32).has_value());  // the server's PROOF
  const auto hello_header = own.read_exact(HEADER_SIZE);
  ASSERT_TRUE(hello_header.has_value());
  ASSERT_EQ((*hello_header)[4], 2) << "the server's HELLO follows its PROOF";
  const auto hello = own.read_exact(get_le32(hello_header->data()));
  ASSERT_TRUE(hello.has_value());
  std::uint64_t own_token = 0;
  for (unsigned i = 0; i < 8; ++i) own_token |= std::uint64_t{(*hello)[16 + i]} << (8U * i);
  StrangerUcp stranger{std::span{*hello}.subspan(24)};
  ASSERT_TRUE(stranger.ok());

  // Tokens near its own (a counter would be found there), small ones, and its own (that
  // connection never sent its HELLO, so it has no UCP endpoint and takes nothing).
  std::vector<std::uint64_t> guesses{own_token};
  for (std::uint64_t d = 1; d <= 300; ++d) {
    guesses.push_back(own_token + d);
    guesses.push_back(own_token - d);
    guesses.push_back(d);
  }
  const Bytes payload = make_message(99, 0, 64);
  std::size_t sent = 0;
  for (const auto token : guesses) sent += stranger.send(token, 0, payload) ? 1 : 0;
  EXPECT_EQ(sent, guesses.size()) << "UCX did not carry the stranger's messages";
  // Each one reached the server and was dropped (a debug line each).
  EXPECT_TRUE(netio3::test::eventually(
      [&] {
        return logs.count("dropping a message") + logs.count("first message is not READY") >= sent;
      },
      PROMPT))
      << logs.dump();
  for (std::uint32_t seq = 10; seq < 20; ++seq) {
    ASSERT_EQ(legit.send(LEGIT_STREAM, seq, PREFIX + 100), NetioStatus::OK);
  }
  EXPECT_TRUE(checker.wait_received(LEGIT_STREAM, 20, PROMPT));
  EXPECT_EQ(checker.errors(), std::vector<std::string>{}) << "a stranger's message was delivered";
  EXPECT_EQ(server_rec.count_now(Recorder::Kind::ESTABLISHED), 1U);
  own.close();
  server.reset();
}
#endif

TEST(AdmissionConfig, BadKeysAndIdentitiesAndBackendsWithoutAdmissionAreRefused) {
  netio3::test::LoopThread loop;
  const auto create = [&](BackendType type, std::string key, std::string identity, bool hook) {
    NetworkConfig config{};
    config.partition_key = std::move(key);
    config.identity = std::move(identity);
    if (hook) config.on_accept_cb = [](const PeerInfo&) { return AcceptDecision::accept(); };
    return netio3::Netio3Backend::create(type, std::move(config), loop.loop());
  };
  EXPECT_THROW((void)create(BackendType::ASYNCMSG, "short", "", false),
               netio3::InvalidConfiguration);
  EXPECT_THROW((void)create(BackendType::ASYNCMSG, "", "ros-1", false),
               netio3::InvalidConfiguration);
  EXPECT_THROW((void)create(BackendType::ASYNCMSG, std::string{KEY}, std::string(256, 'x'), false),
               netio3::InvalidConfiguration);
  EXPECT_NO_THROW((void)create(BackendType::ASYNCMSG, std::string{KEY}, "ros-1", true));
  for (const auto type : {BackendType::UCX, BackendType::LIBFABRIC}) {
    if (!netio3::Netio3Backend::is_available(type)) continue;
    EXPECT_NO_THROW((void)create(type, std::string{KEY}, "ros-1", true));
    EXPECT_THROW((void)create(type, "", "ros-1", false), netio3::InvalidConfiguration);
  }
}

}  // namespace
}  // namespace netio3::hostile

namespace netio3::detail {
namespace {

TEST(AdmissionProof, ChecksEverythingItCovers) {
  const PartitionKey key{"partition ATLAS-TDAQ-run-4711"};
  const PartitionKey other{"partition ATLAS-TDAQ-run-0815"};
  AdmissionNonce verifier{};
  verifier.fill(1);
  AdmissionNonce prover{};
  prover.fill(2);
  const auto proof = key.prove("asyncmsg", AdmissionRole::CLIENT, verifier, prover, "ros-1");
  EXPECT_TRUE(key.verify("asyncmsg", AdmissionRole::CLIENT, verifier, prover, "ros-1", proof));
  EXPECT_FALSE(other.verify("asyncmsg", AdmissionRole::CLIENT, verifier, prover, "ros-1", proof));
  EXPECT_FALSE(key.verify("ucx", AdmissionRole::CLIENT, verifier, prover, "ros-1", proof));
  EXPECT_FALSE(key.verify("asyncmsg", AdmissionRole::SERVER, verifier, prover, "ros-1", proof))
      << "a client's proof reflected as a server's";
  EXPECT_FALSE(key.verify("asyncmsg", AdmissionRole::CLIENT, prover, verifier, "ros-1", proof));
  EXPECT_FALSE(key.verify("asyncmsg", AdmissionRole::CLIENT, verifier, prover, "ros-2", proof));
  AdmissionNonce fresh = verifier;
  fresh[15] ^= 1U;
  EXPECT_FALSE(key.verify("asyncmsg", AdmissionRole::CLIENT, fresh, prover, "ros-1", proof))
      << "a proof for another connection's nonce (a replay)";
  for (std::size_t bit = 0; bit < proof.size() * 8; bit += 7) {
    auto flipped = proof;
    flipped[bit / 8] ^= static_cast<std::uint8_t>(1U << (bit % 8));
    EXPECT_FALSE(key.verify("asyncmsg", AdmissionRole::CLIENT, verifier, prover, "ros-1", flipped));
  }
  // Its first 16 bytes (libfabric's connection data) verify; other lengths do not.
  const auto full = key.prove("libfabric", AdmissionRole::CLIENT, verifier, prover, "ros-1");
  EXPECT_TRUE(key.verify("libfabric", AdmissionRole::CLIENT, verifier, prover, "ros-1",
                         std::span{full}.first(16)));
  for (const std::size_t n : {0, 1, 15, 17, 31}) {
    EXPECT_FALSE(key.verify("asyncmsg", AdmissionRole::CLIENT, verifier, prover, "ros-1",
                            std::span{proof}.first(n)))
        << n << " bytes of a proof";
  }
  auto short_flipped = proof;
  short_flipped[15] ^= 0x80U;
  EXPECT_FALSE(key.verify("asyncmsg", AdmissionRole::CLIENT, verifier, prover, "ros-1",
                          std::span{short_flipped}.first(16)));
  EXPECT_FALSE(
      PartitionKey{}.verify("asyncmsg", AdmissionRole::CLIENT, verifier, prover, "ros-1", proof))
      << "no key proves nothing";
  EXPECT_NE(make_nonce(), make_nonce());
}

TEST(AdmissionFrames, MalformedBodiesAreRefusedWithAReason) {
  std::string error;
  EXPECT_FALSE(decode_proof({}, error).has_value());
  EXPECT_NE(error.find("empty"), std::string::npos);
  const std::vector<std::uint8_t> bad_flag{7, 1, 2};
  EXPECT_FALSE(decode_proof(bad_flag, error).has_value());
  EXPECT_NE(error.find("flags"), std::string::npos);
  const std::vector<std::uint8_t> short_proof(1 + 31, 1);
  EXPECT_FALSE(decode_proof(short_proof, error).has_value());
  std::vector<std::uint8_t> long_identity(1 + 256, 'x');
  long_identity[0] = 0;
  EXPECT_FALSE(decode_proof(long_identity, error).has_value());
  EXPECT_NE(error.find("identity of 256 bytes"), std::string::npos) << error;
  AdmissionProof proof{};
  proof.fill(9);
  const auto decoded = decode_proof(encode_proof(proof, "ros-1"), error);
  ASSERT_TRUE(decoded.has_value());
  EXPECT_EQ(decoded->proof, proof);
  EXPECT_EQ(decoded->identity, "ros-1");
  EXPECT_FALSE(decode_challenge(std::vector<std::uint8_t>(15)).has_value());
  EXPECT_FALSE(decode_challenge(std::vector<std::uint8_t>(17)).has_value());
  const std::vector<std::uint8_t> hostile{'n', 'o', '\n', '\x1b', '[', '2', 'J', 0xFF};
  EXPECT_EQ(decode_refusal(hostile), "no??[2J?") << "control bytes do not reach the log";
  EXPECT_EQ(decode_refusal(std::vector<std::uint8_t>(1000, 'a')).size(), MAX_REFUSAL_REASON);
  EXPECT_EQ(encode_refusal(std::string(1000, 'a')).size(), MAX_REFUSAL_REASON);
}

}  // namespace
}  // namespace netio3::detail
