// UCX-specific behaviour. The conformance suite covers everything common; the hostile suite
// the control channel under attack.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>
#include <sys/resource.h>
#include <thread>
#include <ucp/api/ucp.h>
#include <ucs/algorithm/crc.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netio3/log.hpp>
#include <netio3/netio3.hpp>

#include "backends/ucx/tcp_wireup_guard.hpp"
#include "backends/ucx/ucp.hpp"
#include "backends/ucx/ucx_backend_impl.hpp"
#include "common/backend_facade.hpp"
#include "common/byte_order.hpp"
#include "common/sockaddr.hpp"
#include "proc_sockets.hpp"
#include "test_support.hpp"
#include "ucp_worker.hpp"

namespace netio3::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A thousand connections between two backends of one process (a listener each: a backend
// holds one connection per remote address), every one established on both sides, one
// message each way delivered, then all closed and the descriptors back where they were. They
// share one UCP endpoint per direction, so UCX's own limits (async handlers, descriptors per
// connection manager endpoint) do not grow with them.
TEST(UcxScale, AThousandConnectionsInOneProcess) {
  constexpr std::size_t CONNECTIONS = 1000;
  const DescriptorLimit fds{8192};
  if (fds.have() < 4 * CONNECTIONS) {
    GTEST_SKIP() << "RLIMIT_NOFILE allows " << fds.have() << " descriptors: too few for "
                 << CONNECTIONS << " connections";
  }
  for (const auto mode : {NetworkMode::TCP, NetworkMode::RDMA}) {
    SCOPED_TRACE(to_string(mode));
    Recorder server_rec;
    Recorder client_rec;
    LoopThread server_loop;
    LoopThread client_loop;
    {
      // UCX keeps some process-wide descriptors once a context of this kind was made.
      auto warm_up = Netio3Backend::create(
          BackendType::UCX, server_rec.config(ThreadSafetyModel::SAFE, mode), server_loop.loop());
      (void)warm_up->open_listen_endpoint({"127.0.0.1", 0}, {});
    }
    const std::size_t fds_before = open_fd_count();
    auto server = Netio3Backend::create(
        BackendType::UCX, server_rec.config(ThreadSafetyModel::SAFE, mode), server_loop.loop());
    auto client = Netio3Backend::create(
        BackendType::UCX, client_rec.config(ThreadSafetyModel::SAFE, mode), client_loop.loop());
    const ConnectionParameters params{.recv_params = {.buf_size = 64, .num_buf = 2},
                                      .send_buffered_params = {.buf_size = 64, .num_buf = 2}};
    std::vector<EndPointAddress> listeners;
    const auto begin = Clock::now();
    for (std::size_t i = 0; i < CONNECTIONS; ++i) {
      listeners.push_back(server->open_listen_endpoint({"127.0.0.1", 0}, params));
      client->open_active_endpoint(listeners.back(), params);
    }
    ASSERT_TRUE(client_rec.wait(
        [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == CONNECTIONS; }, 60s))
        << client_rec.count_now(Recorder::Kind::ESTABLISHED) << " established, "
        << client_rec.count_now(Recorder::Kind::REFUSED) << " refused";
    ASSERT_TRUE(server_rec.wait(
        [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == CONNECTIONS; },
        60s));
    const auto established = Clock::now();
    for (const auto& listener : listeners) {
      auto* buffer = client->get_buffer(listener);
      ASSERT_NE(buffer, nullptr);
      buffer->write(std::uint32_t{listener.port});
      ASSERT_EQ(client->send_buffer(listener, buffer), NetioStatus::OK);
    }
    for (const auto& e : server_rec.snapshot()) {
      if (e.kind != Recorder::Kind::ESTABLISHED) continue;
      auto* buffer = server->get_buffer(e.remote);
      ASSERT_NE(buffer, nullptr);
      buffer->write(std::uint32_t{e.remote.port});
      ASSERT_EQ(server->send_buffer(e.remote, buffer), NetioStatus::OK);
    }
    EXPECT_TRUE(server_rec.wait(
        [](const Recorder& r) { return r.count(Recorder::Kind::DATA) == CONNECTIONS; }, 60s));
    EXPECT_TRUE(client_rec.wait(
        [](const Recorder& r) { return r.count(Recorder::Kind::DATA) == CONNECTIONS; }, 60s));
    for (const auto& listener : listeners) client->close_active_endpoint(listener);
    EXPECT_TRUE(client_rec.wait(
        [](const Recorder& r) { return r.count(Recorder::Kind::CLOSED) == CONNECTIONS; }, 60s));
    EXPECT_TRUE(server_rec.wait(
        [](const Recorder& r) { return r.count(Recorder::Kind::CLOSED) == CONNECTIONS; }, 60s));
    EXPECT_EQ(client_rec.count_now(Recorder::Kind::REFUSED), 0U);
    const auto closed = Clock::now();
    const std::size_t fds_open = open_fd_count();
    for (const auto& listener : listeners) server->close_listen_endpoint(listener);
    client.reset();
    server.reset();
    // UCX closes the sockets of its lanes a little after its endpoints.
    const bool back = eventually([&] { return open_fd_count() <= fds_before; }, 10s);
    const auto ms = [](auto d) {
      return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
    };
    std::cout << "[ scale    ] " << to_string(mode) << ": " << CONNECTIONS
              << " connections established in " << ms(established - begin)
              << " ms, message each way and closed in " << ms(closed - established)
              << " ms; descriptors " << fds_before << " -> " << fds_open
              << " with the listeners open -> " << open_fd_count() << " after\n";
    EXPECT_TRUE(back) << "descriptors stayed behind: " << open_fd_count() << ", before "
                      << fds_before;
  }
}

// A UCP worker of this test, progressed by a thread: UCX's own listener and client, as a
// netio3 UCX backend of protocol 2 used them (UCX's connection manager on the listening port).
class RawUcp {
 public:
  RawUcp() : m_ucp{UCS_THREAD_MODE_MULTI} {
    if (m_ucp.ok()) {
      m_thread = std::jthread{[this](const std::stop_token& stop) {
        while (!stop.stop_requested()) {
          if (ucp_worker_progress(m_ucp.get()) == 0) std::this_thread::sleep_for(1ms);
        }
      }};
    }
  }
  // The progress thread stops, the listener goes; the endpoint and the worker go with m_ucp.
  ~RawUcp() {
    m_thread = {};
    if (m_listener != nullptr) ucp_listener_destroy(m_listener);
  }
  RawUcp(const RawUcp&) = delete;
  RawUcp& operator=(const RawUcp&) = delete;
  RawUcp(RawUcp&&) = delete;
  RawUcp& operator=(RawUcp&&) = delete;

  [[nodiscard]] bool ok() const { return m_ucp.ok(); }
  std::atomic<int> requests{0};
  std::atomic<int> errors{0};

  // UCX's listener on 127.0.0.1; its port, or 0.
  std::uint16_t listen() {
    const auto sa = detail::to_socket_address({"127.0.0.1", 0});
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = sa->get();
    lp.sockaddr.addrlen = sa->length;
    lp.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
      auto* self = static_cast<RawUcp*>(arg);
      ++self->requests;
      ucp_listener_reject(self->m_listener, request);
    };
    lp.conn_handler.arg = this;
    if (ucp_listener_create(m_ucp.get(), &lp, &m_listener) != UCS_OK) return 0;
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(m_listener, &attr) != UCS_OK) return 0;
    const auto bound = detail::to_endpoint_address(&attr.sockaddr, sizeof(attr.sockaddr));
    return bound ? bound->port : 0;
  }

  // A client endpoint through UCX's connection manager, with peer error handling.
  bool connect(const EndPointAddress& to) {
    const auto sa = detail::to_socket_address(to);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = sa->get();
    ep.sockaddr.addrlen = sa->length;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
      ++static_cast<RawUcp*>(arg)->errors;
    };
    ep.err_handler.arg = this;
    return ucp_ep_create(m_ucp.get(), &ep, &m_ucp.ep) == UCS_OK;
  }

 private:
  UcpWorker m_ucp;
  ucp_listener_h m_listener{nullptr};
  std::jthread m_thread;  // last: stopped first
};

// netio3's UCX backend up to protocol 2 listened with UCX's connection manager, which waits
// for a connection request of its own format and never greets. A client of protocol 3 gives
// up after the server-greeting deadline (5 s), not after limits.connect_timeout, with a reason;
// the old server never sees a connection request.
TEST(UcxOldProtocol, AClientGivesUpOnAServerOfProtocol2Quickly) {
  RawUcp old_server;
  ASSERT_TRUE(old_server.ok());
  const std::uint16_t port = old_server.listen();
  ASSERT_NE(port, 0);
  Recorder rec;
  LoopThread loop;
  auto config = rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP);
  config.limits.connect_timeout = 30s;
  auto client = Netio3Backend::create(BackendType::UCX, std::move(config), loop.loop());
  const EndPointAddress server{"127.0.0.1", port};
  const auto begin = Clock::now();
  client->open_active_endpoint(server, {.send_buffered_params = {.buf_size = 64, .num_buf = 2}});
  ASSERT_TRUE(
      rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::REFUSED) == 1; }, 20s));
  const auto elapsed = Clock::now() - begin;
  EXPECT_LT(elapsed, 8s);
  EXPECT_EQ(rec.count_now(Recorder::Kind::ESTABLISHED), 0U);
  EXPECT_EQ(old_server.requests.load(), 0);
  std::cout << "[ interop  ] refused by a protocol-2 server after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count() << " ms\n";
}

// The other way round: a client of protocol 2 (UCX's connection manager) at a listener of
// protocol 3 is refused at once (its request is not a greeting), and the listener keeps
// serving.
TEST(UcxOldProtocol, AClientOfProtocol2IsRefusedAtOnce) {
  Recorder rec;
  LoopThread loop;
  auto server = Netio3Backend::create(
      BackendType::UCX, rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP), loop.loop());
  const auto listen = server->open_listen_endpoint({"127.0.0.1", 0},
                                                   {.recv_params = {.buf_size = 64, .num_buf = 2}});
  {
    RawUcp old_client;
    ASSERT_TRUE(old_client.ok());
    const auto begin = Clock::now();
    ASSERT_TRUE(old_client.connect(listen));
    EXPECT_TRUE(eventually([&] { return old_client.errors.load() > 0; }, 5s))
        << "UCX's client was not told that the connection failed";
    std::cout << "[ interop  ] a protocol-2 client was refused after "
              << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - begin).count()
              << " ms\n";
  }
  EXPECT_EQ(rec.count_now(Recorder::Kind::ESTABLISHED), 0U);
  Recorder client_rec;
  auto client = Netio3Backend::create(
      BackendType::UCX, client_rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP), loop.loop());
  client->open_active_endpoint(listen, {.send_buffered_params = {.buf_size = 64, .num_buf = 2}});
  EXPECT_TRUE(
      client_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
}

// The check of peers' worker addresses accepts what UCX produces, in both modes, and refuses
// every truncation of it and anything after its end.
TEST(UcxAddress, OwnAddressesParseAndTruncationsAreRefused) {
  for (const auto mode : {NetworkMode::TCP, NetworkMode::RDMA}) {
    SCOPED_TRACE(to_string(mode));
    const ucx::Worker worker{ucx::choose_transports(mode), ThreadSafetyModel::SAFE, ""};
    const auto address = worker.address();
    const auto parsed = ucx::parse_worker_address(address);
    ASSERT_EQ(parsed.error, "");
    EXPECT_TRUE(parsed.uuid.has_value());
    EXPECT_FALSE(parsed.transports.empty());
    EXPECT_FALSE(ucx::impersonates(parsed, parsed)) << "an address does not impersonate itself";
    EXPECT_EQ(ucx::check_transport_addresses(parsed, parsed), "");
    for (std::size_t n = 0; n < address.size(); ++n) {
      EXPECT_NE(ucx::parse_worker_address(address.first(n)).error, "") << "first " << n << " bytes";
    }
    std::vector<std::uint8_t> longer(address.begin(), address.end());
    longer.push_back(0);
    EXPECT_NE(ucx::parse_worker_address(longer).error, "");
    // Another worker id on this worker's transports: a forgery that makes UCX connect to itself.
    auto forged = std::vector<std::uint8_t>(address.begin(), address.end());
    const std::size_t uuid_at = (forged[0] & 0x0FU) == 0 ? 1 : 2;
    forged[uuid_at] ^= 0x5A;
    const auto forged_parsed = ucx::parse_worker_address(forged);
    ASSERT_EQ(forged_parsed.error, "");
    if (mode == NetworkMode::TCP) {
      EXPECT_TRUE(ucx::impersonates(forged_parsed, parsed));
    }
    // RDMA mode leaves out UCX's shared-memory FIFO transports (a peer killed while it writes
    // into this worker's FIFO would stop it receiving from anyone: ucp.hpp) and keeps CMA.
    const auto has = [&](const char* name) {
      return std::any_of(parsed.transports.begin(), parsed.transports.end(),
                         [&](const auto& t) { return t.name_checksum == ucs_crc16_string(name); });
    };
    if (mode == NetworkMode::RDMA && std::getenv("UCX_TLS") == nullptr) {
      for (const char* fifo : {"posix", "sysv", "xpmem"}) EXPECT_FALSE(has(fifo)) << fifo;
      EXPECT_TRUE(has("cma")) << "same-host bulk data goes by CMA";
    }
    std::cout << "[ address  ] " << to_string(mode) << ": " << address.size() << " bytes, "
              << parsed.transports.size() << " transports\n";
  }
}

// UCX reads the transport addresses of a peer's worker address by their type, not their
// lengths, and passes a part of length 0 as a null pointer: a HELLO whose worker address
// named tcp for a transport without a device part crashed UCX in uct_tcp_iface_is_reachable
// (seen once in CI: one of the hostile test's mutations of a real address). The check refuses
// such tcp addresses, and tcp addresses whose flags or family do not match their length.
TEST(UcxAddress, TransportAddressesUcxWouldMisreadAreRefused) {
  const ucx::Worker worker{ucx::choose_transports(NetworkMode::RDMA), ThreadSafetyModel::SAFE, ""};
  const std::vector<std::uint8_t> address(worker.address().begin(), worker.address().end());
  const auto own = ucx::parse_worker_address(address);
  ASSERT_EQ(own.error, "");
  const std::uint16_t tcp = ucs_crc16_string("tcp");
  const auto find = [&](const char* name) {
    return std::find_if(own.transports.begin(), own.transports.end(),
                        [&](const auto& t) { return t.name_checksum == ucs_crc16_string(name); });
  };
  const auto tcp_at = find("tcp");
  if (tcp_at == own.transports.end()) GTEST_SKIP() << "UCX_TLS leaves out tcp";
  // The parsed parts are views of `address`.
  const auto offset = [&](std::span<const std::uint8_t> part) {
    return static_cast<std::size_t>(part.data() - address.data());
  };
  const auto check = [&](const std::vector<std::uint8_t>& forged) {
    const auto parsed = ucx::parse_worker_address(forged);
    EXPECT_EQ(parsed.error, "") << "the forgery keeps the address's layout";
    return ucx::check_transport_addresses(parsed, own);
  };
  EXPECT_EQ(check(address), "");
  // Another transport's address under tcp's name: no device part at all (self's has none).
  if (const auto self = find("self"); self != own.transports.end() && self->device.empty()) {
    auto forged = address;
    detail::store_le16(forged.data() + self->name_at, tcp);
    EXPECT_NE(check(forged).find("tcp transport address with a device part of 0 bytes"),
              std::string::npos)
        << check(forged);
  }
  // The loopback flag turned over: the address after the family is read as the other kind.
  {
    auto forged = address;
    forged[offset(tcp_at->device)] ^= 1U;
    EXPECT_NE(check(forged).find("tcp transport address with a device part of"), std::string::npos)
        << check(forged);
  }
  {
    auto forged = address;
    forged[offset(tcp_at->device) + 1] = 99;  // an address family UCX never packs
    EXPECT_NE(check(forged).find("address family 99"), std::string::npos) << check(forged);
  }
  {
    auto forged = address;
    forged[offset(tcp_at->device)] |= 0x80U;
    EXPECT_NE(check(forged).find("unknown flags"), std::string::npos) << check(forged);
  }
}

// A rendezvous message is fetched into its receive buffer so that the payload behind its
// header starts on a 64-byte boundary where the buffer has room for that: the kernel's copy
// (CMA on one host) runs faster into aligned memory (1 MiB zero-copy with a 16-byte header,
// two processes: 26.2 against 24.5 GB/s). Without the room, the message starts at the
// buffer's start as before. Either way it arrives whole.
TEST(UcxReceive, ARendezvousPayloadLandsAlignedBehindItsHeaderWhereTheBufferHasRoom) {
  constexpr std::size_t PAYLOAD = 256U << 10U;
  constexpr std::size_t HEADER = 16;
  constexpr int MESSAGES = 4;
  for (const auto mode : {NetworkMode::TCP, NetworkMode::RDMA}) {
    for (const bool room : {true, false}) {
      SCOPED_TRACE(fmt::format("{}, {}", to_string(mode), room ? "room" : "no room"));
      Recorder server_rec;
      Recorder client_rec;
      std::atomic<int> aligned{0};
      std::atomic<int> intact{0};
      server_rec.set_hook([&](const Recorder::Event& event, std::span<const std::uint8_t> data) {
        if (event.kind != Recorder::Kind::DATA || data.size() != HEADER + PAYLOAD) return;
        const auto at = reinterpret_cast<std::uintptr_t>(data.data() + HEADER);  // NOLINT
        if (at % 64 == 0) ++aligned;
        bool ok = true;
        for (std::size_t i = 0; i < HEADER; ++i) ok = ok && data[i] == 0xA0 + i;
        for (std::size_t i = 0; i < PAYLOAD; i += 4093) {
          ok = ok && data[HEADER + i] == static_cast<std::uint8_t>(i * 7);
        }
        if (ok && data.back() == static_cast<std::uint8_t>((PAYLOAD - 1) * 7)) ++intact;
      });
      LoopThread loop;
      auto server = Netio3Backend::create(
          BackendType::UCX, server_rec.config(ThreadSafetyModel::SAFE, mode), loop.loop());
      auto client = Netio3Backend::create(
          BackendType::UCX, client_rec.config(ThreadSafetyModel::SAFE, mode), loop.loop());
      const std::size_t buf_size = HEADER + PAYLOAD + (room ? 64 : 0);
      const auto listen = server->open_listen_endpoint(
          {"127.0.0.1", 0}, {.recv_params = {.buf_size = buf_size, .num_buf = MESSAGES}});
      std::vector<std::uint8_t> region(PAYLOAD);
      for (std::size_t i = 0; i < PAYLOAD; ++i) region[i] = static_cast<std::uint8_t>(i * 7);
      client->open_active_endpoint(
          listen, {.send_zero_copy_params = {.buf_size = PAYLOAD, .mr_start = region.data()}});
      ASSERT_TRUE(client_rec.wait(
          [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
      std::array<std::uint8_t, HEADER> header{};
      for (std::size_t i = 0; i < HEADER; ++i) header[i] = static_cast<std::uint8_t>(0xA0 + i);
      for (int k = 0; k < MESSAGES; ++k) {
        ASSERT_EQ(client->send_data(listen, region, header, static_cast<std::uint64_t>(k)),
                  NetioStatus::OK);
        // One at a time: the region is the payload of every message.
        ASSERT_TRUE(client_rec.wait(
            [&](const Recorder& r) { return r.count(Recorder::Kind::COMPLETED) == k + 1U; }));
      }
      // The hook runs after the message is recorded: wait for the hook's count itself.
      EXPECT_TRUE(eventually([&] { return intact.load() == MESSAGES; }, DEFAULT_TIMEOUT))
          << intact.load() << " of " << MESSAGES << " messages arrived whole";
      if (room) {
        EXPECT_EQ(aligned.load(), MESSAGES) << "payloads not on a 64-byte boundary";
      }
      client.reset();
      server.reset();
    }
  }
}

// An admitted peer that skips two sequence numbers and then floods: everything it sends waits
// in the server's inbox for the missing messages. Those bytes count against
// limits.max_receive_memory, and the message that would cross it closes the connection with
// the reason; the server's memory stays within the limit (it grew by the whole flood, ~50 MiB
// for 200 x 256 KiB, and kept it after the close).
TEST(UcxReceive, APeerWhoseMessagesWaitForAMissingOneIsClosedAtTheReceiveMemoryLimit) {
  constexpr std::size_t LIMIT = std::size_t{8} << 20U;
  constexpr std::size_t SIZE = 4096;                     // eager: held as a copy until its turn
  constexpr std::size_t FLOOD = std::size_t{96} << 20U;  // 12 times the limit
  LogCapture log{LogLevel::warn};
  Recorder server_rec;
  Recorder client_rec;
  LoopThread loop;
  auto server_config = server_rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP,
                                         Recorder::Callbacks::WITH_SENDER_AND_REASON);
  server_config.limits.max_receive_memory = LIMIT;
  server_config.limits.max_message_size = SIZE * 2;
  auto server = Netio3Backend::create(BackendType::UCX, server_config, loop.loop());
  auto client = Netio3Backend::create(
      BackendType::UCX, client_rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP), loop.loop());
  auto* misbehaving = dynamic_cast<detail::BackendFacade<ucx::Backend>*>(client.get());
  ASSERT_NE(misbehaving, nullptr);
  const auto listen = server->open_listen_endpoint(
      {"127.0.0.1", 0}, {.recv_params = {.buf_size = SIZE, .num_buf = 16}});
  client->open_active_endpoint(listen, {.send_buffered_params = {.buf_size = SIZE, .num_buf = 64}});
  ASSERT_TRUE(
      client_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
  ASSERT_TRUE(
      server_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
  const std::size_t rss_before = rss_bytes();
  misbehaving->impl().skip_sequence_numbers(listen, 2);
  std::size_t sent = 0;
  while (sent < FLOOD && client_rec.count_now(Recorder::Kind::CLOSED) == 0) {
    // Counted before asking for a buffer: every completion after a refusal is seen (counted
    // after it, a burst that gave back every buffer in between would be waited for again).
    const auto completed = client_rec.count_now(Recorder::Kind::COMPLETED);
    NetworkBuffer* buffer = nullptr;
    try {
      buffer = client->get_buffer(listen);
    } catch (const UnknownActiveEndpoint&) {
      break;  // closed meanwhile
    }
    if (buffer == nullptr) {
      // Every buffer in flight: wait for one back (or the close).
      ASSERT_TRUE(client_rec.wait([&](const Recorder& r) {
        return r.count(Recorder::Kind::COMPLETED) > completed ||
               r.count(Recorder::Kind::CLOSED) > 0;
      }));
      continue;
    }
    buffer->resize(SIZE);
    try {
      if (client->send_buffer(listen, buffer) != NetioStatus::OK) break;
    } catch (const UnknownActiveEndpoint&) {
      break;  // closed, and reported, since get_buffer
    }
    sent += SIZE;
  }
  ASSERT_TRUE(server_rec.wait([](const Recorder& r) {
    return r.count(Recorder::Kind::CLOSED) == 1;
  })) << "the server kept the flooding peer ("
      << sent << " bytes sent)";
  EXPECT_EQ(server_rec.count_now(Recorder::Kind::DATA), 0U) << "nothing is in order";
  EXPECT_GE(log.count("would exceed limits.max_receive_memory"), 1U);
  for (const auto& e : server_rec.snapshot()) {
    if (e.kind != Recorder::Kind::CLOSED) continue;
    EXPECT_EQ(e.closed.cause, CloseCause::PROTOCOL_ERROR) << e.closed.message;
    EXPECT_THAT(e.closed.message, ::testing::HasSubstr("limits.max_receive_memory"));
  }
  EXPECT_LT(sent, FLOOD) << "the flood ran to its end before the close";
  // The flood's bytes are not kept: at most the limit, and the allocator's slack, on top
  // (TSan's shadow and allocator add tens of MiB: 67 MiB seen; without the bound the flood's
  // 96 MiB stayed, several times that under a sanitizer).
  const std::size_t slack = SANITIZED ? std::size_t{128} << 20U : std::size_t{24} << 20U;
  const std::size_t rss_after = rss_bytes();
  EXPECT_LT(rss_after, rss_before + LIMIT + slack) << "RSS " << rss_before << " -> " << rss_after;
  ASSERT_TRUE(
      client_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::CLOSED) == 1; }));
  client.reset();
  server.reset();
}

std::set<std::uint16_t> own_listening_ports() {
  return listening_ports("self");
}

// A stranger: a UCP worker of its own (tcp), an endpoint with peer error handling (its
// keepalive then asks the server about endpoint ids the server does not know) to `address`,
// active messages on every id, then it goes (a forced close and its worker destroyed).
class Stranger {
 public:
  [[nodiscard]] bool ok() const { return m_ucp.ok(); }
  [[nodiscard]] std::vector<std::uint8_t> address() const { return m_ucp.address(); }

  // Connects to `address` and sends a message on each active message id; how many UCX took.
  int visit(std::vector<std::uint8_t> address) {
    address.resize(address.size() + 256, 0);  // UCX reads the address without its length
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());  // NOLINT
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
    if (ucp_ep_create(m_ucp.get(), &ep, &m_ucp.ep) != UCS_OK) return 0;
    std::array<std::uint8_t, 24> header{};
    std::vector<std::uint8_t> payload(300, 0x5A);
    int sent = 0;
    for (unsigned id = 0; id < 16; ++id) {
      header[0] = static_cast<std::uint8_t>(id);
      ucp_request_param_t param{};
      sent += m_ucp.wait(ucp_am_send_nbx(m_ucp.ep, id, header.data(), header.size(), payload.data(),
                                         payload.size(), &param),
                         200ms)
                  ? 1
                  : 0;
    }
    return sent;
  }

 private:
  UcpWorker m_ucp;  // its endpoint closed by force when it goes
};

// Strangers with UCP workers of their own reach a keyed UCX server's worker and come and go:
// workers of this process with the server's worker address, sending on every active message
// id (UCX 1.13 called uninitialised memory for an id below its handler table's size that had no
// handler: the first of them crashed the server), and processes that forge an address from the
// port of the server's UCX tcp listener, which a port scan finds, with peer error handling (UCX
// 1.13's tcp transport crashed, SIGSEGV at 0xfffffffffffffff8, when UCP's wire-up made an
// endpoint to such a process inside its receive loop). The server keeps serving its admitted
// client, delivers nothing of theirs, and goes cleanly (docs/ucx.md).
TEST(UcxStrangers, FiftyStrangersWithWorkersOfTheirOwnDoNotStopAServer) {
  if (!ucx::tcp_wireup_guard_wanted()) GTEST_SKIP() << "not UCX 1.13, or the guard turned off";
  constexpr int STRANGERS = 50;
  const int runs = SANITIZED ? 2 : 10;
  for (int run = 0; run < runs; ++run) {
    SCOPED_TRACE(fmt::format("run {} of {}", run + 1, runs));
    Recorder server_rec;
    Recorder client_rec;
    LoopThread loop;
    auto server_config = server_rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP);
    server_config.partition_key = "partition for the strangers test";
    server_config.on_accept_cb = [](const PeerInfo&) { return AcceptDecision::accept(); };
    const auto before = own_listening_ports();
    auto server = Netio3Backend::create(BackendType::UCX, server_config, loop.loop());
    auto* facade = dynamic_cast<detail::BackendFacade<ucx::Backend>*>(server.get());
    ASSERT_NE(facade, nullptr);
    const auto listen = server->open_listen_endpoint(
        {"127.0.0.1", 0}, {.recv_params = {.buf_size = 4096, .num_buf = 16}});
    EXPECT_TRUE(facade->impl().worker().tcp_guarded()) << "the guard did not take";
    std::vector<std::uint16_t> ucx_ports;
    for (const auto port : own_listening_ports()) {
      if (!before.contains(port) && port != listen.port) ucx_ports.push_back(port);
    }
    ASSERT_FALSE(ucx_ports.empty()) << "UCX's own tcp listener not found";
    const auto real = facade->impl().worker().address();
    const std::vector<std::uint8_t> server_address(real.begin(), real.end());

    auto client_config = client_rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP);
    client_config.partition_key = server_config.partition_key;
    auto client = Netio3Backend::create(BackendType::UCX, client_config, loop.loop());
    client->open_active_endpoint(listen, {.send_buffered_params = {.buf_size = 64, .num_buf = 8}});
    ASSERT_TRUE(client_rec.wait(
        [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
    std::size_t expected = 0;
    const auto send_one = [&] {
      NetworkBuffer* buffer = nullptr;
      ASSERT_TRUE(client_rec.wait([&](const Recorder&) {
        buffer = client->get_buffer(listen);
        return buffer != nullptr;
      }));
      buffer->write(static_cast<std::uint64_t>(expected));
      ASSERT_EQ(client->send_buffer(listen, buffer), NetioStatus::OK);
      ++expected;
    };
    int forged = 0;
    for (int i = 0; i < STRANGERS; ++i) {
      if (i % 2 == 0) {
        // A worker of this process with the server's worker address, on every id.
        Stranger stranger;
        ASSERT_TRUE(stranger.ok());
        (void)stranger.visit(server_address);
      } else {
        // Another process that forges an address from the port of UCX's tcp listener.
        ChildProcess forger{{NETIO3_UCX_STRANGER, std::to_string(ucx_ports.front())}};
        const auto status = forger.wait(Clock::now() + 30s);
        ASSERT_TRUE(status.has_value()) << forger.describe();
        if (*status == 0) ++forged;
      }
      ASSERT_NO_FATAL_FAILURE(send_one());  // the admitted client keeps going meanwhile
    }
    EXPECT_GT(forged, 0) << "no stranger process got as far as sending";
    ASSERT_TRUE(server_rec.wait([&](const Recorder& r) {
      return r.count(Recorder::Kind::DATA) == expected;
    })) << server_rec.count_now(Recorder::Kind::DATA)
        << " of " << expected;
    // Nothing but the client's 8-byte messages was delivered.
    for (const auto& message : server_rec.messages_snapshot()) EXPECT_EQ(message.size(), 8U);
    client.reset();
    server.reset();
  }
}

#ifdef EXAMPLE_RECEIVER
// The strangers of the test above, the forging kind, against a receiver in a process of its own
// (example_receiver on UCX over tcp): UCX 1.13's tcp wire-up crash took it down at the first
// to tenth of ten such processes (3 of 3 runs) without the guard. It keeps serving: a sender
// then streams to it, and it exits cleanly when the sender closes.
TEST(UcxStrangers, StrangerProcessesDoNotStopAReceiverProcess) {
  if (!ucx::tcp_wireup_guard_wanted()) GTEST_SKIP() << "not UCX 1.13, or the guard turned off";
  const char* previous = std::getenv("UCX_TLS");
  const std::string saved = previous != nullptr ? previous : "";
  ::setenv("UCX_TLS", "tcp", 1);  // for the receiver and the sender, which inherit it
  struct Restore {
    bool had;
    std::string value;
    ~Restore() {
      if (had) {
        ::setenv("UCX_TLS", value.c_str(), 1);
      } else {
        ::unsetenv("UCX_TLS");
      }
    }
  } restore{previous != nullptr, saved};
  const int runs = SANITIZED ? 1 : 3;
  for (int run = 0; run < runs; ++run) {
    SCOPED_TRACE(fmt::format("run {} of {}", run + 1, runs));
    ChildProcess receiver{
        {EXAMPLE_RECEIVER, "--backend", "ucx", "--messages", "0", "--timeout", "120"}};
    std::string port;
    ASSERT_TRUE(receiver.read_until(
        [&](const std::string& out) {
          const auto at = out.find("listening on 127.0.0.1:");
          if (at == std::string::npos) return false;
          const auto end = out.find_first_not_of("0123456789", at + 23);
          if (end == std::string::npos) return false;
          port = out.substr(at + 23, end - at - 23);
          return true;
        },
        Clock::now() + 60s))
        << receiver.describe();
    std::vector<std::uint16_t> ucx_ports;
    for (const auto p : listening_ports(std::to_string(receiver.pid()))) {
      if (std::to_string(p) != port) ucx_ports.push_back(p);
    }
    ASSERT_FALSE(ucx_ports.empty()) << "the receiver's UCX tcp listener not found";
    int sent = 0;
    for (int i = 0; i < 10; ++i) {
      ChildProcess forger{{NETIO3_UCX_STRANGER, std::to_string(ucx_ports.front())}};
      const auto status = forger.wait(Clock::now() + 30s);
      ASSERT_TRUE(status.has_value()) << forger.describe();
      if (*status == 0) ++sent;
      ASSERT_FALSE(receiver.exited()) << "the receiver died: " << receiver.describe();
    }
    EXPECT_GT(sent, 0) << "no stranger got as far as sending";
    ChildProcess sender{{EXAMPLE_SENDER, "--backend", "ucx", "--port", port, "--messages", "20"}};
    EXPECT_EQ(sender.wait(Clock::now() + 60s), 0) << sender.describe();
    EXPECT_EQ(receiver.wait(Clock::now() + 60s), 0) << receiver.describe();
  }
}
#endif  // EXAMPLE_RECEIVER

}  // namespace
}  // namespace netio3::test
