// netio3-raw-ucx: the raw UCX reference of bench/compare's fan-in rows.
//
// The throughput measurement of netio3-perf, written directly against UCP active messages,
// with N connections from one client process to one server process: ucx_perftest's
// ucp_am_bw measures one endpoint only. Both processes use one UCP context and one worker
// (single-threaded), busy-poll it as ucx_perftest does, and run with the UCX configuration
// of the environment (bench/compare sets UCX_TLS=tcp and UCX_TCP_PUT_ENABLE as for
// ucx_perftest). Connections are set up by UCX's own client/server sockaddr protocol (one
// ucp_listener on the server), with peer error handling, as an application that must survive
// a peer's death would.
//
// --wait sleep: instead of busy polling, the worker is armed (ucp_worker_arm) and its event fd
// waited for with epoll whenever progress finds nothing to do, as an event-loop library does;
// CPU per message then means something on both sides.
//
// Messages (same host byte order on both sides): the UCX active-message header is 16 bytes
// {type, stream, seq}; a data message is --size bytes in all (that header and --size - 16
// bytes of payload, as netio3-perf counts its own header in --size). Control messages carry
// four 64-bit fields as payload.
//
//   client (connection i)                   server
//   START[i]{size} (reply flag)     ->      takes a stream slot
//                                   <-      READY[i]{slot}
//   DATA[slot]{seq 0, 1, ...}       ->      counts messages and bytes, checks the order
//   END[slot]{messages, bytes, i}   ->
//                                   <-      REPORT[i]{messages, bytes, in order, server CPU ns}
// ([x]: the header's stream field.)
//
// Each connection keeps --window sends in flight (default: 2 MiB worth, 8..1024 messages,
// as netio3-perf). The rate is the sum of every connection's messages over the time from the
// first send to the last REPORT; the server's CPU per message is the largest of the
// connections' server CPU times (START to END) over all messages, as netio3-perf reports it.
//
//   netio3-raw-ucx --server [--bind 127.0.0.1] [--port 0] [--max-size BYTES] [--wait spin|sleep]
//                  [--quiet]
//   netio3-raw-ucx --client IP:PORT --size BYTES --duration SECONDS [--connections N]
//                  [--window N] [--wait spin|sleep] [--json FILE] [--quiet]
//
// Exit status: 0 every message arrived in order, 1 not, 2 bad options, 3 a UCX error.

#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <netinet/in.h>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <thread>
#include <ucp/api/ucp.h>
#include <vector>

#include <fmt/format.h>

#include "raw_common.hpp"

namespace {

using netio3::raw::Clock;
using netio3::raw::cpu_ns;
using netio3::raw::parse_double;
using netio3::raw::parse_u64;
using netio3::raw::UsageError;

constexpr int EXIT_LOST = 1;
constexpr int EXIT_USAGE = 2;
constexpr int EXIT_UCX = 3;

constexpr unsigned AM_DATA = 1;
constexpr unsigned AM_CTRL = 2;

constexpr std::uint32_t MSG_START = 1;
constexpr std::uint32_t MSG_READY = 2;
constexpr std::uint32_t MSG_END = 3;
constexpr std::uint32_t MSG_REPORT = 4;
constexpr std::uint32_t MSG_REFUSE = 5;

struct Header {
  std::uint32_t type;
  std::uint32_t stream;  // the server's stream slot (DATA, END), else the client's index
  std::uint64_t seq;
};
static_assert(sizeof(Header) == 16);
constexpr std::size_t HEADER_SIZE = sizeof(Header);

struct Body {
  std::uint64_t a;
  std::uint64_t b;
  std::uint64_t c;
  std::uint64_t d;
};

constexpr std::size_t MAX_CONNECTIONS = 1024;
constexpr std::uint32_t NO_STREAM = ~std::uint32_t{0};
constexpr auto SETUP_TIMEOUT = std::chrono::seconds(10);
constexpr auto DRAIN_TIMEOUT = std::chrono::seconds(10);

struct UcxError : std::runtime_error {
  UcxError(std::string_view call, ucs_status_t status)
      : std::runtime_error(fmt::format("{} failed: {}", call, ucs_status_string(status))) {}
  explicit UcxError(const std::string& text) : std::runtime_error(text) {}
};

void check(std::string_view call, ucs_status_t status) {
  if (status != UCS_OK) throw UcxError(call, status);
}

volatile std::sig_atomic_t g_stop = 0;
extern "C" void on_stop_signal(int /*signo*/) {
  g_stop = 1;
}

// ---------------------------------------------------------------------------------------
// Options

struct Options {
  bool server = false;
  std::string bind = "127.0.0.1";
  std::uint16_t port = 0;
  std::uint64_t max_size = (std::uint64_t{1} << 20U) + 64;
  std::string host;
  std::uint16_t server_port = 0;
  std::uint64_t size = 0;
  double duration = 0;
  std::uint64_t connections = 1;
  std::uint64_t window = 0;  // 0: 2 MiB worth, 8..1024
  std::string json;
  bool quiet = false;
  bool sleep = false;  // --wait sleep
};

constexpr std::string_view USAGE =
    "usage:\n"
    "  netio3-raw-ucx --server [--bind 127.0.0.1] [--port 0] [--max-size BYTES]\n"
    "                 [--wait spin|sleep (spin)] [--quiet]\n"
    "  netio3-raw-ucx --client IP:PORT --size BYTES --duration SECONDS [--connections N (1)]\n"
    "                 [--window N (2 MiB worth, 8..1024)] [--wait spin|sleep (spin)]\n"
    "                 [--json FILE] [--quiet]\n"
    "UCX's configuration comes from the environment (UCX_TLS, ...).\n"
    "exit status: 0 every message arrived in order, 1 not, 2 bad options, 3 UCX error\n";

Options parse_options(int argc, char** argv) {
  Options o;
  bool client = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg.erase(eq);
      has_value = true;
    }
    const auto next = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) throw UsageError(fmt::format("{} needs a value", arg));
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      fmt::print("{}", USAGE);
      std::exit(0);
    } else if (arg == "--server") {
      o.server = true;
    } else if (arg == "--client") {
      client = true;
      const std::string text = next();
      const auto colon = text.rfind(':');
      if (colon == std::string::npos || colon == 0) {
        throw UsageError(fmt::format("--client: '{}' is not IP:PORT", text));
      }
      o.host = text.substr(0, colon);
      const auto p = parse_u64("--client port", std::string_view{text}.substr(colon + 1));
      if (p == 0 || p > 65535) throw UsageError("--client: port out of range");
      o.server_port = static_cast<std::uint16_t>(p);
    } else if (arg == "--bind") {
      o.bind = next();
    } else if (arg == "--port") {
      const auto p = parse_u64("--port", next());
      if (p > 65535) throw UsageError("--port: at most 65535");
      o.port = static_cast<std::uint16_t>(p);
    } else if (arg == "--max-size") {
      o.max_size = parse_u64("--max-size", next());
    } else if (arg == "--size") {
      o.size = parse_u64("--size", next());
    } else if (arg == "--duration") {
      o.duration = parse_double("--duration", next());
      if (!(o.duration > 0 && o.duration < 1e6)) throw UsageError("--duration: seconds, above 0");
    } else if (arg == "--connections") {
      o.connections = parse_u64("--connections", next());
      if (o.connections < 1 || o.connections > MAX_CONNECTIONS) {
        throw UsageError(fmt::format("--connections: 1 to {}", MAX_CONNECTIONS));
      }
    } else if (arg == "--window") {
      o.window = parse_u64("--window", next());
      if (o.window < 1 || o.window > 65536) throw UsageError("--window: 1 to 65536");
    } else if (arg == "--test") {
      // bench/compare passes --test to every raw program: only throughput is measured here.
      if (next() != "throughput") throw UsageError("--test: netio3-raw-ucx measures throughput");
    } else if (arg == "--json") {
      o.json = next();
    } else if (arg == "--quiet") {
      o.quiet = true;
    } else if (arg == "--wait") {
      const std::string v = next();
      if (v != "spin" && v != "sleep") throw UsageError("--wait: spin or sleep");
      o.sleep = v == "sleep";
    } else {
      throw UsageError(fmt::format("unknown option '{}'", arg));
    }
  }
  if (o.server == client) throw UsageError("give --server or --client IP:PORT");
  if (client) {
    if (o.size < HEADER_SIZE) {
      throw UsageError(fmt::format("--size: at least {} bytes (the header)", HEADER_SIZE));
    }
    if (o.size > (std::uint64_t{1} << 32U)) throw UsageError("--size: at most 4 GiB");
    if (o.duration <= 0) throw UsageError("--duration is required");
    if (o.window == 0) {
      o.window = std::clamp<std::uint64_t>((std::uint64_t{2} << 20U) / o.size, 8, 1024);
    }
  }
  return o;
}

sockaddr_in make_sockaddr(const std::string& ip, std::uint16_t port) {
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_port = htons(port);
  if (inet_pton(AF_INET, ip.c_str(), &sin.sin_addr) != 1) {
    throw UsageError(fmt::format("'{}' is not an IPv4 address", ip));
  }
  return sin;
}

// ---------------------------------------------------------------------------------------
// UCP context and worker

class Ucp {
 public:
  explicit Ucp(bool sleep) {
    ucp_config_t* config = nullptr;
    check("ucp_config_read", ucp_config_read(nullptr, nullptr, &config));
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | (sleep ? UCP_FEATURE_WAKEUP : 0);
    const ucs_status_t status = ucp_init(&params, config, &m_context);
    ucp_config_release(config);
    check("ucp_init", status);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    const ucs_status_t ws = ucp_worker_create(m_context, &wp, &m_worker);
    if (ws != UCS_OK) {
      ucp_cleanup(m_context);
      throw UcxError("ucp_worker_create", ws);
    }
    if (sleep) {
      int fd = -1;
      check("ucp_worker_get_efd", ucp_worker_get_efd(m_worker, &fd));
      m_epoll = ::epoll_create1(EPOLL_CLOEXEC);
      epoll_event ev{};
      ev.events = EPOLLIN;
      if (m_epoll < 0 || ::epoll_ctl(m_epoll, EPOLL_CTL_ADD, fd, &ev) != 0) {
        throw UcxError(fmt::format("epoll: {}", std::strerror(errno)));
      }
    }
  }
  Ucp(const Ucp&) = delete;
  Ucp& operator=(const Ucp&) = delete;
  ~Ucp() {
    if (m_epoll >= 0) ::close(m_epoll);
    ucp_worker_destroy(m_worker);
    ucp_cleanup(m_context);
  }
  [[nodiscard]] ucp_context_h context() const { return m_context; }
  [[nodiscard]] ucp_worker_h worker() const { return m_worker; }

  void set_handler(unsigned id, ucp_am_recv_callback_t cb, void* arg) const {
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = id;
    p.cb = cb;
    p.arg = arg;
    check("ucp_worker_set_am_recv_handler", ucp_worker_set_am_recv_handler(m_worker, &p));
  }

  // With --wait sleep: sleeps until the worker has events or `timeout_ms` passed, unless
  // arming it finds events pending. Busy polling: returns at once.
  void idle(int timeout_ms) const {
    if (m_epoll < 0) return;
    if (ucp_worker_arm(m_worker) != UCS_OK) return;  // UCS_ERR_BUSY: progress again
    epoll_event ev{};
    (void)::epoll_wait(m_epoll, &ev, 1, timeout_ms);
  }

  // Progresses until `request` (from a *_nbx call) is done; returns its status.
  ucs_status_t wait(void* request) const {
    if (request == nullptr) return UCS_OK;
    if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
    ucs_status_t status = UCS_INPROGRESS;
    const auto deadline = Clock::now() + DRAIN_TIMEOUT;
    while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS &&
           Clock::now() < deadline) {
      ucp_worker_progress(m_worker);
    }
    if (status == UCS_INPROGRESS) {
      ucp_request_cancel(m_worker, request);
      while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(m_worker);
      status = UCS_ERR_TIMED_OUT;
    }
    ucp_request_free(request);
    return status;
  }

  // Closes `ep` (flushing it, or by force) and waits for the close to end.
  void close(ucp_ep_h ep, bool force) const {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    (void)wait(ucp_ep_close_nbx(ep, &p));
  }

 private:
  ucp_context_h m_context = nullptr;
  ucp_worker_h m_worker = nullptr;
  int m_epoll = -1;
};

// A control message in flight: header and body stay valid until the send completes.
struct CtrlSend {
  Header header{};
  Body body{};
};

void ctrl_done(void* request, ucs_status_t /*status*/, void* user_data) {
  delete static_cast<CtrlSend*>(user_data);  // NOLINT(cppcoreguidelines-owning-memory)
  ucp_request_free(request);
}

// Sends a control message; `reply` asks UCX to give the receiver an endpoint to answer on.
void send_ctrl(ucp_ep_h ep, std::uint32_t type, std::uint32_t stream, const Body& body,
               bool reply) {
  auto* msg =
      new CtrlSend{Header{type, stream, 0}, body};  // NOLINT(cppcoreguidelines-owning-memory)
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = ctrl_done;
  p.user_data = msg;
  if (reply) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
  }
  void* request = ucp_am_send_nbx(ep, AM_CTRL, &msg->header, sizeof msg->header, &msg->body,
                                  sizeof msg->body, &p);
  if (request == nullptr) {
    delete msg;  // NOLINT(cppcoreguidelines-owning-memory)
    return;
  }
  if (UCS_PTR_IS_ERR(request)) {
    delete msg;  // NOLINT(cppcoreguidelines-owning-memory)
    throw UcxError("ucp_am_send_nbx (control)", UCS_PTR_STATUS(request));
  }
}

// The header and body of a received control message (either arrives eagerly here: 32 B).
std::optional<std::pair<Header, Body>> read_ctrl(const void* header, std::size_t header_length,
                                                 const void* data, std::size_t length,
                                                 const ucp_am_recv_param_t* param) {
  if (header_length != sizeof(Header) || length != sizeof(Body) ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    return std::nullopt;
  }
  std::pair<Header, Body> out{};
  std::memcpy(&out.first, header, sizeof(Header));
  std::memcpy(&out.second, data, sizeof(Body));
  return out;
}

// ---------------------------------------------------------------------------------------
// Server

class Server {
 public:
  explicit Server(const Options& o) : m_options{o}, m_ucp{o.sleep} {
    m_ucp.set_handler(AM_DATA, &Server::on_data, this);
    m_ucp.set_handler(AM_CTRL, &Server::on_ctrl, this);
    const sockaddr_in sin = make_sockaddr(o.bind, o.port);
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sin);  // NOLINT
    lp.sockaddr.addrlen = sizeof sin;
    lp.conn_handler.cb = &Server::on_conn_request;
    lp.conn_handler.arg = this;
    check("ucp_listener_create", ucp_listener_create(m_ucp.worker(), &lp, &m_listener));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    check("ucp_listener_query", ucp_listener_query(m_listener, &attr));
    sockaddr_in bound{};
    std::memcpy(&bound, &attr.sockaddr, sizeof bound);
    m_port = ntohs(bound.sin_port);
  }
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  ~Server() {
    for (auto& peer : m_peers) m_ucp.close(peer.ep, true);
    ucp_listener_destroy(m_listener);
  }

  [[nodiscard]] std::uint16_t port() const { return m_port; }

  void run() {
    while (g_stop == 0) {
      const unsigned n = ucp_worker_progress(m_ucp.worker());
      start_rendezvous();
      send_replies();
      close_failed_peers();
      if (n != 0 || !m_replies.empty() || !m_rendezvous.empty()) continue;
      if (m_options.sleep) {
        m_ucp.idle(100);
      } else if (m_peers.empty()) {
        // Busy polling while clients are connected; otherwise only the listener is waited
        // for, so an idle server does not take a core.
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

 private:
  struct Peer {
    ucp_ep_h ep;
    bool failed = false;
  };
  struct Stream {
    bool active = false;
    std::uint64_t next_seq = 0;
    std::uint64_t messages = 0;
    std::uint64_t bytes = 0;
    bool in_order = true;
    double cpu_start = 0;
  };
  struct Reply {
    ucp_ep_h ep;
    std::uint32_t type;
    std::uint32_t conn;  // the client's index of the connection
    Body body;
  };
  struct Rendezvous {
    void* desc;
    std::size_t length;
  };
  struct RecvBuffer {
    Server* server;
    std::unique_ptr<std::uint8_t[]> data;
  };

  static void on_conn_request(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<Server*>(arg);
    self->m_peers.push_back(Peer{nullptr});
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.conn_request = request;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Server::on_ep_error;
    ep.err_handler.arg = self;
    ucp_ep_h handle = nullptr;
    const ucs_status_t status = ucp_ep_create(self->m_ucp.worker(), &ep, &handle);
    if (status != UCS_OK) {
      self->m_peers.pop_back();
      fmt::print(stderr, "raw-ucx server: ucp_ep_create: {}\n", ucs_status_string(status));
      return;
    }
    self->m_peers.back().ep = handle;
  }

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t /*status*/) {
    auto* self = static_cast<Server*>(arg);
    for (auto& peer : self->m_peers) {
      if (peer.ep == ep) peer.failed = true;
    }
    self->m_any_failed = true;
  }

  // A client went away: its endpoints go; streams it left open are freed at its next START.
  void close_failed_peers() {
    if (!m_any_failed) return;
    m_any_failed = false;
    std::vector<Peer> keep;
    for (auto& peer : m_peers) {
      if (peer.failed) {
        m_replies.erase(std::remove_if(m_replies.begin(), m_replies.end(),
                                       [&](const Reply& r) { return r.ep == peer.ep; }),
                        m_replies.end());
        m_ucp.close(peer.ep, true);
      } else {
        keep.push_back(peer);
      }
    }
    m_peers.swap(keep);
    if (m_peers.empty()) {
      // No client left: every stream is free again.
      m_streams.clear();
      m_free.clear();
    }
  }

  static ucs_status_t on_data(void* arg, const void* header, std::size_t header_length, void* data,
                              std::size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Server*>(arg);
    Header h{};
    if (header_length != sizeof h) return UCS_OK;
    std::memcpy(&h, header, sizeof h);
    if (h.stream < self->m_streams.size() && self->m_streams[h.stream].active) {
      Stream& s = self->m_streams[h.stream];
      if (h.seq != s.next_seq) s.in_order = false;
      s.next_seq = h.seq + 1;
      ++s.messages;
      s.bytes += HEADER_SIZE + length;
    }
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
      // Counted above; the payload is fetched after progress returns (start_rendezvous).
      self->m_rendezvous.push_back(Rendezvous{data, length});
      return UCS_INPROGRESS;
    }
    return UCS_OK;
  }

  static void rendezvous_done(void* request, ucs_status_t /*status*/, std::size_t /*length*/,
                              void* user_data) {
    auto* buffer = static_cast<RecvBuffer*>(user_data);
    buffer->server->m_buffers.push_back(buffer);
    ucp_request_free(request);
  }

  void start_rendezvous() {
    while (!m_rendezvous.empty()) {
      const Rendezvous r = m_rendezvous.front();
      m_rendezvous.pop_front();
      if (r.length > m_options.max_size) {
        ucp_am_data_release(m_ucp.worker(), r.desc);
        continue;
      }
      if (m_buffers.empty()) {
        m_owned.push_back(std::make_unique<RecvBuffer>(
            RecvBuffer{this, std::make_unique<std::uint8_t[]>(m_options.max_size)}));
        m_buffers.push_back(m_owned.back().get());
      }
      RecvBuffer* buffer = m_buffers.back();
      m_buffers.pop_back();
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.recv_am = &Server::rendezvous_done;
      p.user_data = buffer;
      void* request =
          ucp_am_recv_data_nbx(m_ucp.worker(), r.desc, buffer->data.get(), r.length, &p);
      if (request == nullptr || UCS_PTR_IS_ERR(request)) m_buffers.push_back(buffer);
    }
  }

  static ucs_status_t on_ctrl(void* arg, const void* header, std::size_t header_length, void* data,
                              std::size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Server*>(arg);
    const auto msg = read_ctrl(header, header_length, data, length, param);
    if (!msg || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
      fmt::print(stderr, "raw-ucx server: a malformed control message\n");
      return UCS_OK;
    }
    const auto& [h, body] = *msg;
    ucp_ep_h ep = param->reply_ep;
    if (h.type == MSG_START) {
      if (body.a > self->m_options.max_size || body.a < HEADER_SIZE) {
        self->m_replies.push_back(
            Reply{ep, MSG_REFUSE, h.stream, Body{self->m_options.max_size, 0, 0, 0}});
        return UCS_OK;
      }
      std::uint32_t slot = 0;
      if (!self->m_free.empty()) {
        slot = self->m_free.back();
        self->m_free.pop_back();
      } else {
        slot = static_cast<std::uint32_t>(self->m_streams.size());
        self->m_streams.emplace_back();
      }
      self->m_streams[slot] = Stream{.active = true, .cpu_start = cpu_ns()};
      self->m_replies.push_back(Reply{ep, MSG_READY, h.stream, Body{slot, 0, 0, 0}});
    } else if (h.type == MSG_END && h.stream < self->m_streams.size() &&
               self->m_streams[h.stream].active) {
      Stream& s = self->m_streams[h.stream];
      const auto cpu = static_cast<std::uint64_t>(cpu_ns() - s.cpu_start);
      self->m_replies.push_back(Reply{ep, MSG_REPORT, static_cast<std::uint32_t>(body.c),
                                      Body{s.messages, s.bytes, s.in_order ? 1U : 0U, cpu}});
      s.active = false;
      self->m_free.push_back(h.stream);
      if (!self->m_options.quiet && self->m_free.size() == self->m_streams.size()) {
        fmt::print(stderr, "raw-ucx server: every stream of the client ended\n");
      }
    } else {
      fmt::print(stderr, "raw-ucx server: an unexpected control message (type {})\n", h.type);
    }
    return UCS_OK;
  }

  // Replies go out after progress returns, not from inside UCX's callback.
  void send_replies() {
    for (const auto& r : m_replies) send_ctrl(r.ep, r.type, r.conn, r.body, false);
    m_replies.clear();
  }

  const Options& m_options;
  Ucp m_ucp;
  ucp_listener_h m_listener = nullptr;
  std::uint16_t m_port = 0;
  std::vector<Peer> m_peers;
  bool m_any_failed = false;
  std::vector<Stream> m_streams;
  std::vector<std::uint32_t> m_free;
  std::vector<Reply> m_replies;
  std::deque<Rendezvous> m_rendezvous;
  std::vector<std::unique_ptr<RecvBuffer>> m_owned;
  std::vector<RecvBuffer*> m_buffers;
};

int run_server(const Options& o) {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  Server server{o};
  fmt::print("listening on {}:{}\n", o.bind, server.port());
  std::fflush(stdout);
  server.run();
  return 0;
}

// ---------------------------------------------------------------------------------------
// Client

struct Conn;

// One send slot: the data message's UCX header lives here until the send completes.
struct Slot {
  Conn* conn;
  std::uint32_t index;
  Header header;
};

struct Conn {
  ucp_ep_h ep = nullptr;
  bool* any_failed = nullptr;  // the client's
  bool failed = false;
  bool ready = false;
  std::uint32_t stream = NO_STREAM;  // READY's slot
  bool refused = false;
  std::optional<Body> report;
  std::uint64_t seq = 0;  // data messages sent
  std::vector<Slot> slots;
  std::vector<std::uint32_t> free;
  std::uint8_t* payload = nullptr;  // window slots of size - HEADER_SIZE bytes
};

class Client {
 public:
  explicit Client(const Options& o)
      : m_options{o},
        m_payload_size{o.size - HEADER_SIZE},
        m_stride{std::max<std::size_t>((m_payload_size + 63) / 64 * 64, 64)},
        m_ucp{o.sleep},
        m_conns(o.connections) {
    m_ucp.set_handler(AM_CTRL, &Client::on_ctrl, this);
    // One region for every connection's window, mapped once (netio3's buffered sends also
    // come from mapped pools).
    m_region_bytes = (m_stride * o.window * o.connections + 4095) / 4096 * 4096;
    m_region.reset(static_cast<std::uint8_t*>(std::aligned_alloc(4096, m_region_bytes)));
    if (!m_region) throw std::bad_alloc{};
    std::memset(m_region.get(), 0x5a, m_region_bytes);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = m_region.get();
    mp.length = m_region_bytes;
    check("ucp_mem_map", ucp_mem_map(m_ucp.context(), &mp, &m_memh));
    const sockaddr_in sin = make_sockaddr(o.host, o.server_port);
    for (std::size_t i = 0; i < m_conns.size(); ++i) {
      Conn& c = m_conns[i];
      c.any_failed = &m_failed;
      c.payload = m_region.get() + i * m_stride * o.window;
      c.slots.resize(o.window);
      for (std::uint32_t s = 0; s < o.window; ++s) {
        c.slots[s] = Slot{&c, s, Header{}};
        c.free.push_back(static_cast<std::uint32_t>(o.window - 1 - s));
      }
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sin);  // NOLINT
      ep.sockaddr.addrlen = sizeof sin;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &Client::on_ep_error;
      ep.err_handler.arg = &c;
      check("ucp_ep_create", ucp_ep_create(m_ucp.worker(), &ep, &c.ep));
    }
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client() {
    for (auto& c : m_conns) {
      if (c.ep != nullptr) m_ucp.close(c.ep, c.failed);
    }
    if (m_memh != nullptr) ucp_mem_unmap(m_ucp.context(), m_memh);
  }

  int run() {
    const auto& o = m_options;
    // START on every connection, then every READY.
    for (std::size_t i = 0; i < m_conns.size(); ++i) {
      send_ctrl(m_conns[i].ep, MSG_START, static_cast<std::uint32_t>(i), Body{o.size, 0, 0, 0},
                true);
    }
    progress_until([&] { return m_ready == m_conns.size(); }, SETUP_TIMEOUT,
                   "READY from the server");
    for (const auto& c : m_conns) {
      if (c.refused) throw UcxError(fmt::format("the server refused {} B messages", o.size));
    }

    // The run: each connection keeps its window full, round robin.
    const double cpu0 = cpu_ns();
    const auto t0 = Clock::now();
    const auto deadline =
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration));
    while (g_stop == 0 && Clock::now() < deadline) {
      // At most a window per connection and round: sends UCX completes at once give their
      // slot back at once.
      bool posted = false;
      for (auto& c : m_conns) {
        for (std::uint64_t n = 0; n < o.window && !c.free.empty() && !c.failed; ++n) {
          post_data(c);
          posted = true;
        }
      }
      if (ucp_worker_progress(m_ucp.worker()) == 0 && !posted) m_ucp.idle(10);
      if (m_failed) throw UcxError("a connection failed during the run");
    }
    progress_until(
        [&] {
          return std::all_of(m_conns.begin(), m_conns.end(),
                             [&](const Conn& c) { return c.free.size() == o.window; });
        },
        DRAIN_TIMEOUT, "the sends in flight");
    for (auto& c : m_conns) {
      send_ctrl(c.ep, MSG_END, c.stream, Body{c.seq, c.seq * o.size, index_of(c), 0}, true);
    }
    progress_until([&] { return m_reports == m_conns.size(); }, DRAIN_TIMEOUT,
                   "REPORT from the server");
    const auto t1 = Clock::now();
    const double cpu1 = cpu_ns();

    // Results.
    std::uint64_t messages = 0;
    std::uint64_t server_cpu = 0;
    bool intact = true;
    std::string problem;
    for (std::size_t i = 0; i < m_conns.size(); ++i) {
      const Conn& c = m_conns[i];
      messages += c.seq;
      server_cpu = std::max(server_cpu, c.report->d);
      if (c.report->a != c.seq || c.report->b != c.seq * o.size || c.report->c != 1) {
        intact = false;
        problem +=
            fmt::format("connection {}: sent {}, the server received {} ({} B){}; ", i, c.seq,
                        c.report->a, c.report->b, c.report->c == 1 ? "" : ", out of order");
      }
    }
    const double seconds = std::chrono::duration<double>(t1 - t0).count();
    const double msgs = static_cast<double>(std::max<std::uint64_t>(messages, 1));
    const double msgs_per_s = static_cast<double>(messages) / seconds;
    const double bytes_per_s = msgs_per_s * static_cast<double>(o.size);
    const double cpu_per_msg = (cpu1 - cpu0) / msgs;
    const double server_cpu_per_msg = static_cast<double>(server_cpu) / msgs;
    fmt::print(
        "raw-ucx throughput {} B x{} conn: {:.0f} msg/s, {:.1f} MB/s, {:.3f} Gbit/s, cpu {:.0f} "
        "ns/msg (server {:.0f}), window {}, {} msgs in {:.3f} s, {}\n",
        o.size, o.connections, msgs_per_s, bytes_per_s / 1e6, bytes_per_s * 8 / 1e9, cpu_per_msg,
        server_cpu_per_msg, o.window, messages, seconds, intact ? "intact" : "NOT INTACT");
    std::fflush(stdout);
    if (!intact) fmt::print(stderr, "raw-ucx client: NOT INTACT: {}\n", problem);
    if (!o.json.empty()) {
      const std::string line = fmt::format(
          "{{\"tool\":\"raw-ucx\",\"backend\":\"ucx\",\"mode\":\"tcp\",\"send\":\"raw\","
          "\"test\":\"throughput\",\"size\":{},\"connections\":{},\"threads\":1,"
          "\"window\":{},\"duration_s\":{:.6f},\"messages\":{},\"bytes\":{},\"msgs_per_s\":{:.3f},"
          "\"bytes_per_s\":{:.3f},\"gbit_per_s\":{:.6f},\"cpu_ns_per_msg\":{:.3f},"
          "\"server_cpu_ns_per_msg\":{:.3f},\"p50_us\":null,\"p99_us\":null,\"p999_us\":null,"
          "\"intact\":{}}}\n",
          o.size, o.connections, o.window, seconds, messages, messages * o.size, msgs_per_s,
          bytes_per_s, bytes_per_s * 8 / 1e9, cpu_per_msg, server_cpu_per_msg,
          intact ? "true" : "false");
      std::FILE* f = std::fopen(o.json.c_str(), "a");
      const bool ok = f != nullptr && std::fputs(line.c_str(), f) >= 0;
      if (f == nullptr || std::fclose(f) != 0 || !ok) {
        fmt::print(stderr, "raw-ucx client: cannot write {}\n", o.json);
        return EXIT_UCX;
      }
    }
    return intact ? 0 : EXIT_LOST;
  }

 private:
  struct Free {
    void operator()(std::uint8_t* p) const { std::free(p); }
  };

  void post_data(Conn& c) {
    const std::uint32_t index = c.free.back();
    c.free.pop_back();
    Slot& slot = c.slots[index];
    slot.header = Header{0, c.stream, c.seq};
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    p.cb.send = &Client::data_done;
    p.user_data = &slot;
    p.memh = m_memh;
    void* request = ucp_am_send_nbx(c.ep, AM_DATA, &slot.header, sizeof slot.header,
                                    c.payload + index * m_stride, m_payload_size, &p);
    ++c.seq;
    if (request == nullptr) {
      c.free.push_back(index);
    } else if (UCS_PTR_IS_ERR(request)) {
      throw UcxError("ucp_am_send_nbx", UCS_PTR_STATUS(request));
    }
  }

  static void data_done(void* request, ucs_status_t status, void* user_data) {
    auto* slot = static_cast<Slot*>(user_data);
    if (status != UCS_OK) {
      slot->conn->failed = true;
      *slot->conn->any_failed = true;
    }
    slot->conn->free.push_back(slot->index);
    ucp_request_free(request);
  }

  static void on_ep_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* c = static_cast<Conn*>(arg);
    c->failed = true;
    *c->any_failed = true;
    fmt::print(stderr, "raw-ucx client: a connection failed: {}\n", ucs_status_string(status));
  }

  static ucs_status_t on_ctrl(void* arg, const void* header, std::size_t header_length, void* data,
                              std::size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Client*>(arg);
    const auto msg = read_ctrl(header, header_length, data, length, param);
    if (!msg) return UCS_OK;
    const auto& [h, body] = *msg;
    if (h.stream >= self->m_conns.size()) return UCS_OK;
    Conn& c = self->m_conns[h.stream];
    if ((h.type == MSG_READY || h.type == MSG_REFUSE) && !c.ready) {
      c.ready = true;
      c.refused = h.type == MSG_REFUSE;
      c.stream = static_cast<std::uint32_t>(body.a);
      ++self->m_ready;
    } else if (h.type == MSG_REPORT && !c.report) {
      c.report = body;
      ++self->m_reports;
    }
    return UCS_OK;
  }

  [[nodiscard]] std::uint64_t index_of(const Conn& c) const {
    return static_cast<std::uint64_t>(&c - m_conns.data());
  }

  template <typename Done>
  void progress_until(Done done, std::chrono::seconds limit, const char* what) {
    const auto deadline = Clock::now() + limit;
    while (!done()) {
      if (ucp_worker_progress(m_ucp.worker()) == 0) m_ucp.idle(10);
      if (m_failed) throw UcxError(fmt::format("a connection failed waiting for {}", what));
      if (g_stop != 0 || Clock::now() >= deadline) {
        throw UcxError(fmt::format("no {} within {} s", what, limit.count()));
      }
    }
  }

  const Options& m_options;
  const std::size_t m_payload_size;
  const std::size_t m_stride;
  Ucp m_ucp;
  std::unique_ptr<std::uint8_t, Free> m_region;
  std::size_t m_region_bytes = 0;
  ucp_mem_h m_memh = nullptr;
  std::vector<Conn> m_conns;
  std::size_t m_ready = 0;
  std::size_t m_reports = 0;
  bool m_failed = false;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse_options(argc, argv);
  } catch (const UsageError& e) {
    fmt::print(stderr, "netio3-raw-ucx: {}\n{}", e.what(), USAGE);
    return EXIT_USAGE;
  }
  try {
    if (o.server) return run_server(o);
    Client client{o};
    return client.run();
  } catch (const UsageError& e) {
    fmt::print(stderr, "netio3-raw-ucx: {}\n", e.what());
    return EXIT_USAGE;
  } catch (const std::exception& e) {
    fmt::print(stderr, "netio3-raw-ucx: {}\n", e.what());
    return EXIT_UCX;
  }
}
