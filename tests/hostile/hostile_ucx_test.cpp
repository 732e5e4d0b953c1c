// Hostile peers that speak the first bytes of the UCX backend's control protocol (docs/
// ucx.md): a correct greeting, then malformed frames and HELLOs, and worker addresses that
// UCX cannot parse. UCX reads a worker address without knowing its length and asserts on
// malformed ones, so the backend checks them first; a random or mutated address aborted the
// process before it did. Both network modes (the RDMA mode's addresses carry the shared-
// memory transports too).

#include <ucs/algorithm/crc.h>

#include "backends/ucx/ucp.hpp"
#include "common/byte_order.hpp"
#include "hostile_support.hpp"

namespace netio3::hostile {
namespace {

constexpr std::uint8_t FRAME_HELLO = 2;
constexpr std::uint8_t FRAME_CLOSE = 3;
constexpr std::uint8_t FRAME_HEARTBEAT = 4;
constexpr std::size_t HELLO_FIXED = 24;

Bytes ucx_greeting() {
  return greeting(3, 0, 1U << 20U);
}

struct Hello {
  std::uint8_t backend{3};
  std::uint8_t mode{0};
  std::uint8_t reserved{0};
  std::uint64_t max_message{1U << 20U};
  std::uint64_t token{0x5EED};
  Bytes address;
};

Bytes hello_frame(const Hello& h) {
  Bytes body(HELLO_FIXED, 0);
  body[0] = h.backend;
  body[1] = h.mode;
  body[7] = h.reserved;
  for (unsigned i = 0; i < 8; ++i) {
    body[8 + i] = static_cast<std::uint8_t>(h.max_message >> (8U * i));
    body[16 + i] = static_cast<std::uint8_t>(h.token >> (8U * i));
  }
  append(body, h.address);
  Bytes frame = frame_header(static_cast<std::uint32_t>(body.size()), FRAME_HELLO);
  append(frame, body);
  return frame;
}

class HostileUcx : public HostileListener, public ::testing::WithParamInterface<NetworkMode> {
 protected:
  HostileUcx() { set_target(BackendType::UCX, GetParam()); }

  // The server's UCP worker address, from the opening it sends to every connection.
  Bytes server_worker_address() {
    RawPeer peer{m_listen};
    const auto head = peer.read_exact(GREETING_SIZE + HEADER_SIZE);
    EXPECT_TRUE(head.has_value());
    if (!head) return {};
    EXPECT_EQ((*head)[GREETING_SIZE + 4], FRAME_HELLO);
    const std::uint32_t length = get_le32(head->data() + GREETING_SIZE);
    const auto body = peer.read_exact(length);
    EXPECT_TRUE(body.has_value());
    if (!body || body->size() <= HELLO_FIXED) return {};
    peer.close();
    return {body->begin() + HELLO_FIXED, body->end()};
  }

  // Greeting + HELLO with `address`: refused at once with a reason, or (an address UCX can
  // parse, of a worker that never answers) dropped when the set-up times out. Either way
  // closed, and never established.
  void expect_not_established(const Bytes& address, std::size_t& refused) {
    RawPeer peer{m_listen};
    Bytes all = ucx_greeting();
    append(all, hello_frame(Hello{.address = address}));
    (void)peer.send_all(all);
    EXPECT_NE(peer.wait_closed(PROMPT), RawPeer::Outcome::STILL_OPEN)
        << "a HELLO with a worker address of " << address.size() << " bytes was kept open"
        << m_logs.dump();
    refused += m_logs.count(fmt::format("{}: HELLO with", netio3::to_string(peer.local())));
    EXPECT_EQ(server_events(Recorder::Kind::ESTABLISHED, peer.local()), 0U);
  }
};

TEST_P(HostileUcx, MalformedControlFramesAreRefusedWithTheReason) {
  ASSERT_NO_FATAL_FAILURE(start());
  const auto attack = [&](Bytes after_greeting, const std::string& reason) {
    RawPeer peer{m_listen};
    Bytes all = ucx_greeting();
    append(all, after_greeting);
    (void)peer.send_all(all);
    expect_dropped(peer, {reason});
    EXPECT_EQ(server_events(Recorder::Kind::ESTABLISHED, peer.local()), 0U);
  };
  for (const std::uint8_t type : {0, 1, 8, 0x80, 0xFF}) {  // 1: asyncmsg's DATA
    Bytes frame = frame_header(16, type);
    append(frame, random_bytes(16, type));
    attack(frame, fmt::format("unknown frame type {}", type));
  }
  // 3.3's admission frames (5 CHALLENGE, 6 PROOF, 7 REFUSAL): a server without a key or a
  // hook admitted the peer with its greeting, so they come after the set-up.
  for (const auto& [type, name] : {std::pair{5, "CHALLENGE"}, {6, "PROOF"}, {7, "REFUSAL"}}) {
    Bytes frame = frame_header(16, static_cast<std::uint8_t>(type));
    append(frame, random_bytes(16, static_cast<std::uint32_t>(type)));
    attack(frame, fmt::format("a {} frame after the set-up", name));
  }
  Bytes heartbeat = frame_header(16, FRAME_HEARTBEAT);  // 3.2's HEARTBEAT has no body
  append(heartbeat, random_bytes(16, FRAME_HEARTBEAT));
  attack(heartbeat, "a HEARTBEAT of 16 bytes");
  attack(frame_header(8, FRAME_HELLO, {0, 1, 0}), "reserved frame header bytes are not zero");
  attack(frame_header(0x7FFF'FFFFU, FRAME_HELLO), "frame declares a message of 2147483647 bytes");
  Bytes close = frame_header(8, FRAME_CLOSE);
  append(close, Bytes(8, 0));
  attack(close, "CLOSE before HELLO");
  finish();
}

TEST_P(HostileUcx, MalformedHellosAreRefusedWithTheReason) {
  ASSERT_NO_FATAL_FAILURE(start());
  const Bytes address = server_worker_address();
  ASSERT_FALSE(address.empty());
  const auto attack = [&](const Bytes& frames, const std::string& reason) {
    RawPeer peer{m_listen};
    Bytes all = ucx_greeting();
    append(all, frames);
    (void)peer.send_all(all);
    expect_dropped(peer, {reason});
    EXPECT_EQ(server_events(Recorder::Kind::ESTABLISHED, peer.local()), 0U);
  };
  {
    Bytes short_hello = frame_header(HELLO_FIXED, FRAME_HELLO);
    append(short_hello, Bytes(HELLO_FIXED, 0));
    attack(short_hello, "HELLO of 24 bytes");
  }
  attack(hello_frame(Hello{.backend = 1, .address = address}), "backend type 1");
  attack(hello_frame(Hello{.mode = 7, .address = address}), "network mode");
  attack(hello_frame(Hello{.reserved = 1, .address = address}), "reserved");
  attack(hello_frame(Hello{.max_message = 0, .address = address}), "maximum message size of 0");
  attack(hello_frame(Hello{.token = 0, .address = address}), "token 0");
  {
    Bytes twice = hello_frame(Hello{.address = address});
    append(twice, hello_frame(Hello{.address = address}));
    attack(twice, "a second HELLO");
  }
  finish();
}

// Random and truncated addresses: refused by the backend's check before UCX sees them.
TEST_P(HostileUcx, MalformedWorkerAddressesAreRefusedBeforeUcxSeesThem) {
  ASSERT_NO_FATAL_FAILURE(start());
  const Bytes real = server_worker_address();
  ASSERT_GT(real.size(), 8U);
  std::mt19937 rng{20261124};
  std::vector<Bytes> addresses;
  for (const std::size_t n : {1, 2, 8, 50, 300, 4000}) {
    for (std::uint32_t k = 0; k < 4; ++k) addresses.push_back(random_bytes(n, rng()));
  }
  for (std::size_t cut = 1; cut < real.size(); cut += std::max<std::size_t>(1, real.size() / 40)) {
    addresses.emplace_back(real.begin(), real.begin() + static_cast<std::ptrdiff_t>(cut));
  }
  {
    Bytes longer = real;
    append(longer, random_bytes(7, 1));
    addresses.push_back(std::move(longer));
  }
  std::size_t refused = 0;
  for (std::size_t i = 0; i < addresses.size(); ++i) {
    const std::size_t before = refused;
    ASSERT_NO_FATAL_FAILURE(expect_not_established(addresses[i], refused));
    EXPECT_EQ(refused, before + 1) << "address " << i << " of " << addresses[i].size()
                                   << " bytes was not refused by the check" << m_logs.dump();
  }
  std::printf("[ info     ] %zu random or truncated worker addresses: %zu refused\n",
              addresses.size(), refused);
  finish();
}

// Mutations of a real address (1-3 bytes changed): the check refuses what UCX would assert
// on (it aborted the process within 70 such HELLOs before the check covered the transports'
// figures); what UCX can parse belongs to no worker that answers, and the set-up times out.
// UCX 1.13 keeps the sockets of lanes that failed to connect (to a mutated port) for a while
// after the endpoint is closed (measured standalone: 40-65 s; longer while the process is
// busy), so the descriptors are reported, not checked (docs/ucx.md, known problems).
TEST_P(HostileUcx, MutatedWorkerAddressesNeitherCrashNorConnect) {
  NetworkLimits limits = patient_limits();
  limits.connect_timeout = SHORT_CONNECT_TIMEOUT;
  ASSERT_NO_FATAL_FAILURE(start(limits));
  const Bytes real = server_worker_address();
  ASSERT_GT(real.size(), 8U);
  std::size_t refused = 0;
  // First, forgeries of the kind one of the random mutations below once was in CI (its
  // addresses differ per run): a tcp transport address without a device part, which UCX
  // read through a null pointer and crashed the process (here: self's address under tcp's
  // name, RDMA mode), and a tcp address whose loopback flag is turned over (the bytes after
  // its address family read as the other kind). The check refuses each at once.
  const auto parsed = ucx::parse_worker_address(real);
  ASSERT_EQ(parsed.error, "");
  const std::uint16_t tcp = ucs_crc16_string("tcp");
  for (const auto& transport : parsed.transports) {
    Bytes forged = real;
    if (transport.name_checksum == tcp) {
      forged[static_cast<std::size_t>(transport.device.data() - real.data())] ^= 1U;
    } else if (transport.name_checksum == ucs_crc16_string("self")) {
      detail::store_le16(forged.data() + transport.name_at, tcp);
    } else {
      continue;
    }
    const std::size_t before = refused;
    ASSERT_NO_FATAL_FAILURE(expect_not_established(forged, refused));
    EXPECT_EQ(refused, before + 1)
        << "a forged tcp address was not refused by the check" << m_logs.dump();
  }
  ASSERT_GT(refused, 0U);
  const std::size_t forgeries = refused;
  // The mutations leave the tcp listening ports alone: UCX connects to the port an address
  // names, and where another process listens there and speaks first (any netio3 listener
  // greets at once; CI runs tests side by side), its bytes abort UCX (tcp_ep.c:1404, a known
  // problem netio3 cannot check for: docs/ucx.md). Seen once under TSan in CI.
  std::vector<bool> port_byte(real.size(), false);
  for (const auto& transport : parsed.transports) {
    if (transport.name_checksum != tcp) continue;
    const auto at = static_cast<std::size_t>(transport.iface.data() - real.data());
    for (std::size_t k = 0; k < transport.iface.size(); ++k) port_byte[at + k] = true;
  }
  std::mt19937 rng{20261125};
  constexpr int MUTATIONS = 160;
  for (int i = 0; i < MUTATIONS; ++i) {
    Bytes mutated = real;
    const int changes = 1 + i % 3;
    for (int c = 0; c < changes; ++c) {
      std::size_t where = rng() % mutated.size();
      while (port_byte[where]) where = rng() % mutated.size();
      auto& b = mutated[where];
      b = i % 2 == 0 ? static_cast<std::uint8_t>(rng())
                     : static_cast<std::uint8_t>(b ^ (1U << (rng() % 8)));
    }
    ASSERT_NO_FATAL_FAILURE(expect_not_established(mutated, refused));
  }
  std::printf(
      "[ info     ] %d mutated worker addresses: %zu refused by the check, the rest "
      "timed out\n",
      MUTATIONS, refused - forgeries);
  expect_stream_progress(100);
  m_check_fds = false;
  m_why_fds_unchecked = "UCX keeps sockets of lanes that failed to connect";
  finish();
}

// A well-formed address of a worker that never answers over UCX (here: the server's own): the
// connection waits for the peer's READY and is dropped when the set-up times out; the UCP
// endpoint made for it does not stay behind (finish() checks the descriptors).
TEST_P(HostileUcx, APeerThatNeverAnswersOverUcxIsDroppedAfterTheSetUpTimeout) {
  NetworkLimits limits = patient_limits();
  limits.connect_timeout = SHORT_CONNECT_TIMEOUT;
  ASSERT_NO_FATAL_FAILURE(start(limits));
  const Bytes address = server_worker_address();
  ASSERT_FALSE(address.empty());
  for (int i = 0; i < 5; ++i) {
    const auto begin = Clock::now();
    RawPeer peer{m_listen};
    Bytes all = ucx_greeting();
    append(all, hello_frame(Hello{.token = 100U + static_cast<unsigned>(i), .address = address}));
    ASSERT_TRUE(peer.send_all(all));
    expect_dropped(peer, {fmt::format("timed out after {} ms", SHORT_CONNECT_TIMEOUT.count())});
    EXPECT_GE(Clock::now() - begin, SHORT_CONNECT_TIMEOUT);
    EXPECT_EQ(server_events(Recorder::Kind::ESTABLISHED, peer.local()), 0U);
  }
  finish();
}

// A connection gets its receive and send buffers (and their UCX memory maps) only when
// its peer's HELLO is accepted: connections that were greeted but never answer - a flood,
// a port scanner, a stranger - cost a socket each, not buffers. Here each would cost
// 64 MiB (a listener with 64 receive buffers of 1 MiB); 16 of them must not add 1 GiB of
// address space. Before, a flood at a low descriptor limit spent the loop allocating and
// mapping them, and a real client behind it timed out waiting for its greeting.
TEST_P(HostileUcx, ConnectionsThatNeverSayHelloHoldNoBuffers) {
  ASSERT_NO_FATAL_FAILURE(start());
  ConnectionParameters big{};
  big.recv_params = {.buf_size = 1U << 20U, .num_buf = 64, .use_shared_receive_buffers = false};
  big.send_buffered_params = {.buf_size = 1U << 20U, .num_buf = 8};
  const auto port = m_server->open_listen_endpoint({"127.0.0.1", 0}, big);
  constexpr std::size_t PEERS = 16;
  constexpr std::size_t PER_CONNECTION = (64U + 8U) << 20U;
  const std::size_t before = netio3::test::virtual_bytes();
  std::vector<std::unique_ptr<RawPeer>> peers;
  for (std::size_t i = 0; i < PEERS; ++i) {
    peers.push_back(std::make_unique<RawPeer>(port));
    // The server's opening arrives once the connection exists on its side.
    ASSERT_TRUE(peers.back()->read_exact(GREETING_SIZE + HEADER_SIZE).has_value()) << m_logs.dump();
  }
  const std::size_t after = netio3::test::virtual_bytes();
  const std::size_t grown = after - std::min(before, after);
  EXPECT_LT(grown, PEERS * PER_CONNECTION / 4)
      << PEERS << " connections without a HELLO added " << (grown >> 20U) << " MiB";
  expect_stream_progress(100);
  peers.clear();
  m_server->close_listen_endpoint(port);
  finish();
}

std::string mode_name(const ::testing::TestParamInfo<NetworkMode>& param) {
  return std::string{netio3::to_string(param.param)};
}

INSTANTIATE_TEST_SUITE_P(Modes, HostileUcx, ::testing::Values(NetworkMode::TCP, NetworkMode::RDMA),
                         mode_name);

}  // namespace
}  // namespace netio3::hostile
