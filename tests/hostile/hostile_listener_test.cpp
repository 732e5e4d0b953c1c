// Hostile peers against the listening port of every backend that listens on a TCP socket of
// netio3's own: asyncmsg, and UCX (its control channel) in both network modes. What any port
// scanner, misconfigured client or stray probe can send: garbage, HTTP, a crafted length
// header that made UCX's own connection manager abort the process, greetings cut short,
// resets at every stage, floods of connections that stay silent, and more connections than
// the process has descriptors for. Every test ends with HostileListener::finish(): the
// legitimate stream that ran meanwhile arrived intact and in order, the listener still
// serves a new client, and the descriptors are back to their baseline.
//
// The attacks that need the asyncmsg data frames are in hostile_asyncmsg_test.cpp, those of
// the UCX control protocol in hostile_ucx_test.cpp.

#include "hostile_support.hpp"

namespace netio3::hostile {
namespace {

struct Target {
  BackendType type;
  NetworkMode mode;
  // Admission (docs/admission.md): the server and its legitimate clients hold this key.
  std::string_view partition_key{};
  // The legitimate clients' connections have a session (docs/sessions.md; asyncmsg).
  bool session{false};
};

std::string target_name(const ::testing::TestParamInfo<Target>& info) {
  return fmt::format(
      "{}_{}{}{}", netio3::to_string(info.param.type), netio3::to_string(info.param.mode),
      info.param.partition_key.empty() ? "" : "_keyed", info.param.session ? "_session" : "");
}

class Hostile : public HostileListener, public ::testing::WithParamInterface<Target> {
 protected:
  Hostile() {
    set_target(GetParam().type, GetParam().mode);
    m_partition_key = GetParam().partition_key;
    m_session = GetParam().session;
  }

  [[nodiscard]] bool keyed() const { return !m_partition_key.empty(); }

  // The greeting of the target's protocol (its major version names it); with a key, one that
  // says it holds one (asyncmsg 1.3: a CHALLENGE must follow).
  [[nodiscard]] Bytes own_greeting() const {
    if (keyed()) return greeting(m_type == BackendType::UCX ? 3 : 1, 3, 1U << 20U, 2);
    return greeting(m_type == BackendType::UCX ? 3 : 1, 0, 1U << 20U);
  }
};

// The packet that made UCX 1.13's connection manager assert and abort the process when it
// was the UCX backend's listener: an 8-byte little-endian length of 15 or 31, one zero byte,
// then 2071 bytes of anything.
Bytes crafted_length_header(std::uint64_t length) {
  // Made at its full size (growing it by resize() draws a false -Warray-bounds from GCC 12
  // at -O3).
  Bytes b(9 + 2071, 'A');
  for (unsigned i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(length >> (8U * i));
  b[8] = 0;
  return b;
}

Bytes text(std::string_view s) {
  return Bytes(s.begin(), s.end());
}

TEST_P(Hostile, GarbageHttpAndForeignProtocolsAreDroppedWithAReason) {
  ASSERT_NO_FATAL_FAILURE(start());
  std::vector<Bytes> attacks{
      crafted_length_header(15),
      crafted_length_header(31),
      text("GET / HTTP/1.1\r\nHost: readout\r\nUser-Agent: probe\r\n\r\n"),
      text("SSH-2.0-OpenSSH_9.2\r\n"),
  };
  {  // The start of a TLS ClientHello: record header, handshake header, version, random.
    Bytes tls{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03};
    append(tls, random_bytes(32, 443));
    attacks.push_back(std::move(tls));
  }
  for (std::uint32_t i = 0; i < 6; ++i) {
    Bytes garbage = random_bytes(i % 2 == 0 ? 4096 : 100 + i, i);
    garbage[0] = 0xFF;  // never the magic
    attacks.push_back(std::move(garbage));
  }
  for (const auto& attack : attacks) {
    RawPeer peer{m_listen};
    (void)peer.send_all(attack);  // may fail: the server is allowed to close early
    expect_dropped(peer, {"bad greeting"});
    EXPECT_EQ(server_events(Recorder::Kind::ESTABLISHED, peer.local()), 0U);
  }
  finish();
}

// A netio3 peer of another backend type says what it is; the listener refuses it.
TEST_P(Hostile, AGreetingOfAnotherBackendIsRefusedAndNamed) {
  ASSERT_NO_FATAL_FAILURE(start());
  const bool ucx = m_type == BackendType::UCX;
  {
    RawPeer peer{m_listen};
    ASSERT_TRUE(peer.send_all(greeting(ucx ? 1 : 3, 0, 1U << 20U)));
    expect_dropped(
        peer, {ucx ? "the peer is a netio3 asyncmsg backend" : "the peer is a netio3 ucx backend"});
  }
  for (const std::uint16_t major : {0, 2, 4, 0xFFFF}) {
    RawPeer other{m_listen};
    ASSERT_TRUE(other.send_all(greeting(major, 0, 100)));
    expect_dropped(other, {fmt::format("unsupported protocol version {}.0", major)});
  }
  finish();
}

TEST_P(Hostile, HalfGreetingsThenSilenceAreDroppedAfterTheConnectTimeout) {
  NetworkLimits limits{};
  limits.connect_timeout = SHORT_CONNECT_TIMEOUT;
  ASSERT_NO_FATAL_FAILURE(start(limits));
  const Bytes g = own_greeting();
  // UCX: a whole greeting is not enough, the HELLO must follow; nor with a key, where the
  // CHALLENGE and PROOF must. asyncmsg without a key: a whole greeting is a connection.
  std::vector<std::size_t> parts{0, 1, 4, 15};
  if (m_type == BackendType::UCX || keyed()) parts.push_back(GREETING_SIZE);
  for (const std::size_t part : parts) {
    const auto begin = Clock::now();
    RawPeer peer{m_listen};
    ASSERT_TRUE(peer.send_all(std::span{g}.first(part)));
    // The server greets at once; then it waits for (the rest of) ours.
    const auto server_greeting = peer.read_exact(GREETING_SIZE);
    ASSERT_TRUE(server_greeting.has_value());
    EXPECT_TRUE(std::equal(g.begin(), g.begin() + 4, server_greeting->begin()));
    expect_dropped(peer, {fmt::format("timed out after {} ms", SHORT_CONNECT_TIMEOUT.count())});
    const auto elapsed = Clock::now() - begin;
    EXPECT_GE(elapsed, SHORT_CONNECT_TIMEOUT) << "dropped before the set-up timeout";
    std::printf("[ info     ] %zu greeting bytes then silence: dropped after %lld ms\n", part,
                static_cast<long long>(
                    std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count()));
    EXPECT_EQ(server_events(Recorder::Kind::ESTABLISHED, peer.local()), 0U);
  }
  finish();
}

TEST_P(Hostile, ResetsAtEveryStageOfTheSetUp) {
  ASSERT_NO_FATAL_FAILURE(start());
  const Bytes g = own_greeting();
  enum Stage { UNREAD, NOTHING_SENT, HALF_GREETING, GREETING_ONLY, GREETING_AND_GARBAGE };
  for (int stage = UNREAD; stage <= GREETING_AND_GARBAGE; ++stage) {
    SCOPED_TRACE(fmt::format("stage {}", stage));
    RawPeer peer{m_listen};
    if (stage == UNREAD) {  // the server accepted (its greeting arrived), left unread
      pollfd p{peer.fd(), POLLIN, 0};
      ASSERT_EQ(::poll(&p, 1, static_cast<int>(std::chrono::milliseconds{PROMPT}.count())), 1);
    } else {
      ASSERT_TRUE(peer.read_exact(GREETING_SIZE).has_value());
    }
    Bytes all;
    if (stage == HALF_GREETING) append(all, head(g, 7));
    if (stage >= GREETING_ONLY) append(all, g);
    if (stage == GREETING_AND_GARBAGE) append(all, random_bytes(3, 5));  // half a header
    ASSERT_TRUE(peer.send_all(all));
    if (stage != UNREAD) {
      ASSERT_NO_FATAL_FAILURE(wait_consumed(peer));
    }
    peer.reset();
    const bool established = m_type == BackendType::ASYNCMSG && !keyed() && stage >= GREETING_ONLY;
    if (established) {  // asyncmsg: a whole greeting is a connection
      EXPECT_TRUE(wait_server_event(Recorder::Kind::CLOSED, peer.local())) << m_logs.dump();
    } else {
      EXPECT_TRUE(m_logs.wait_line(peer.local(), {"dropped incoming connection from"}))
          << m_logs.dump();
    }
  }
  finish();
}

TEST_P(Hostile, FloodsOfShortAndSilentConnections) {
  NetworkLimits limits{};
  limits.connect_timeout = SHORT_CONNECT_TIMEOUT;
  ASSERT_NO_FATAL_FAILURE(start(limits));
  constexpr std::size_t FLOOD = 300;

  std::vector<EndPointAddress> hit_and_run;
  for (std::size_t i = 0; i < FLOOD; ++i) {
    RawPeer peer{m_listen};
    hit_and_run.push_back(peer.local());
  }  // each closed right away
  EXPECT_TRUE(m_logs.wait_all(hit_and_run, "dropped incoming connection from", PROMPT))
      << m_logs.dump();
  expect_stream_progress(100);

  const auto begin = Clock::now();
  std::vector<std::unique_ptr<RawPeer>> silent;
  std::vector<EndPointAddress> silent_addresses;
  for (std::size_t i = 0; i < FLOOD; ++i) {
    silent.push_back(std::make_unique<RawPeer>(m_listen));
    silent_addresses.push_back(silent.back()->local());
  }
  const std::size_t fds_at_peak = netio3::test::open_fd_count();
  const auto deadline = Clock::now() + 20s;
  std::size_t dropped = 0;
  for (auto& peer : silent) {
    dropped += peer->wait_closed(remaining(deadline)) != RawPeer::Outcome::STILL_OPEN;
  }
  const auto elapsed = Clock::now() - begin;
  EXPECT_EQ(dropped, FLOOD) << "silent connections survived the set-up timeout";
  EXPECT_GE(elapsed, SHORT_CONNECT_TIMEOUT);
  EXPECT_TRUE(m_logs.wait_all(silent_addresses,
                              fmt::format("timed out after {} ms", SHORT_CONNECT_TIMEOUT.count()),
                              PROMPT))
      << m_logs.dump();
  std::printf(
      "[ info     ] %zu silent connections: fds at peak %zu (baseline %zu), all dropped "
      "after %lld ms\n",
      FLOOD, fds_at_peak, m_fd_baseline,
      static_cast<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count()));
  silent.clear();
  EXPECT_EQ(m_server_rec.snapshot().size(), 1U) << "a flood connection got established";
  finish();
}

// Silent peers beyond what the process may open: the listener pauses instead of spinning,
// keeps descriptors in reserve for the transports, says so once, the set-up timeout frees
// descriptors, accepting resumes, and in the end every silent peer is dropped. The
// legitimate stream flows throughout.
TEST_P(Hostile, FloodBeyondTheDescriptorLimit) {
  NetworkLimits limits{};
  limits.connect_timeout = SHORT_CONNECT_TIMEOUT;
  ASSERT_NO_FATAL_FAILURE(start(limits));
  constexpr int PEERS = 80;
  constexpr int SERVER_ROOM = 30;  // descriptors the server may still open
  {
    // Once without the limit: UBSan's vptr check validates a vtable it has not seen before
    // with a pipe(), which fails inside the window and would be reported as "invalid vptr".
    // Taking the drop path once here fills its cache.
    RawPeer warm_up{m_listen};
    expect_dropped(warm_up, {fmt::format("timed out after {} ms", SHORT_CONNECT_TIMEOUT.count())});
  }
  std::vector<std::unique_ptr<RawPeer>> peers;
  {
    // Our sockets exist before the limit drops, so only the server's accepts can hit it.
    for (int i = 0; i < PEERS; ++i) peers.push_back(std::make_unique<RawPeer>());
    FdLimit limit{limit_leaving_room(SERVER_ROOM)};
    ASSERT_TRUE(limit.ok());
    const auto begin = Clock::now();
    for (auto& peer : peers) peer->connect_to(m_listen);
    expect_stream_progress(100);
    const auto deadline = Clock::now() + 30s;
    int dropped = 0;
    for (auto& peer : peers) {
      dropped += peer->wait_closed(remaining(deadline)) != RawPeer::Outcome::STILL_OPEN;
    }
    const auto elapsed = Clock::now() - begin;
    limit.restore();
    EXPECT_EQ(dropped, PEERS);
    const std::size_t warnings = m_logs.count("pausing accepts");
    EXPECT_GE(warnings, 1U) << "the descriptor limit was never reached: the test did not test "
                               "anything"
                            << m_logs.dump();
    std::printf(
        "[ info     ] %d silent peers, room for %d descriptors: pause warnings %zu, all dropped "
        "after %lld ms\n",
        PEERS, SERVER_ROOM, warnings,
        static_cast<long long>(
            std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count()));
  }
  peers.clear();
  finish();
}

INSTANTIATE_TEST_SUITE_P(
    Listeners, Hostile,
    ::testing::Values(Target{BackendType::ASYNCMSG, NetworkMode::TCP},
                      Target{BackendType::ASYNCMSG, NetworkMode::TCP,
                             "hostile-suite-partition-key"},
                      Target{BackendType::ASYNCMSG, NetworkMode::TCP, "", true},
                      Target{BackendType::UCX, NetworkMode::TCP},
                      Target{BackendType::UCX, NetworkMode::TCP, "hostile-suite-partition-key"},
                      Target{BackendType::UCX, NetworkMode::RDMA}),
    target_name);

}  // namespace
}  // namespace netio3::hostile
