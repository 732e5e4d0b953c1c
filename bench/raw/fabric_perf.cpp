// netio3-raw-fabric: the raw libfabric reference that bench/compare runs next to netio3-perf.
//
// The same measurement as netio3-perf (message throughput with a window of outstanding
// sends over one or more connections, ping-pong round-trip latency), written directly against
// libfabric: FI_EP_MSG endpoints, FI_MSG, plain fi_send/fi_recv from registered buffers.
//
// Design (the same as netio3's libfabric backend): each process opens ONE fabric, ONE domain,
// ONE completion queue and ONE event queue, shared by all its endpoints; every buffer is
// registered in that domain. Every posted operation's context (OpCtx) names its buffer pool
// and the pool its connection, so one fi_cq_read serves all connections and each completion
// goes to the connection it belongs to; connection events (rare) are matched to their
// endpoint by its fid. The CQ is read by busy polling (default) or by waiting on its
// FI_WAIT_FD fd with fi_trywait + epoll the way an event-loop library does (--wait fd).
//
// Client: --connections N (throughput only; default 1) opens N endpoints to the server's one
// listener and drives all of them from its one thread. Each connection runs the protocol below
// on its own, with its own window and credits; a connection whose window or credits opened up
// again is queued, and the queued connections post in turn (round robin) before the CQ is read
// again. The result is the sum over the connections; the rate is total messages over the time
// from the first data message to the last REPORT; intact only if every REPORT matches what was
// sent on its connection and arrived in order. REPORT carries the server process's CPU time
// from the connection's START to its END; the maximum over the connections, per message, is
// server_cpu_ns_per_msg.
//
// Server: serves up to 1024 connections at once, from one thread. Each accepted connection is a
// session, a state machine (start, running, closing, draining) of the protocol below. The loop
// reads the CQ, hands each completion to its session, then steps the sessions that had
// completions (operations the provider could not take yet, the final message, credits). While
// sessions are open the event queue is read without blocking (new connection requests, the
// connections' FI_CONNECTED and FI_SHUTDOWN) and the sessions' timeouts are checked every 4096
// turns (--wait fd: after every wait; the event queue also on every idle turn while connections
// are being set up); with none open it blocks on the event queue. A session that ends (its
// client shut down after the REPORT) or fails (its client went away, broke the protocol, an
// error completion) is closed alone; its buffers stay until the CQ has been read empty after
// the close, since the provider flushes the endpoint's posted receives into the shared CQ. The
// server's CQ has room for all operations its sessions can have posted (SERVER_CQ_SIZE); each
// session reserves its share, and a receive depth that does not fit is cut.
//
// Wire protocol (both processes on the same host architecture; fields in host byte order):
// every message starts with a 16-byte header {type, aux, seq}. Data messages are exactly
// --size bytes (header included). Control messages (start, ready, credit, end, report,
// refuse) are 48 bytes: the header plus four 64-bit fields. Per connection:
//
//   client                                server
//   START{size, test, rx_depth, credits} ->      posts rx_depth receives of max(size, 64) B
//                                        <- READY{rx_depth posted}
//   DATA{seq 0, 1, 2, ...} ...           ->      counts, checks the order; throughput:
//                                        <- CREDIT{consumed}   reposts each buffer at
//                                                once and returns credits in batches;
//                                                latency: echoes each message (same size)
//   END{messages, bytes}                 ->
//                                        <- REPORT{messages, bytes, in_order, cpu_ns}
//
// (or <- REFUSE{reason, limit} instead of READY). cpu_ns: the server process's CPU time (user +
// system) from this connection's START to its END. The server may post fewer receives than
// asked (its provider's receive depth; room left in its completion queue).
//
// Flow control: with credits (the default) the client never has more messages in flight than
// the server has receives posted, so it works with any provider. `--credits off` leaves it to
// the provider (the tcp provider stops reading a socket while no receive is posted, so TCP's
// own flow control holds the sender back; `--rx-depth 2 --credits off` exercises that).

#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <netinet/in.h>
#include <optional>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <signal.h>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <system_error>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include "raw_common.hpp"

namespace {

using netio3::raw::Clock;
using netio3::raw::cpu_ns;
using netio3::raw::json_string;
using netio3::raw::parse_double;
using netio3::raw::parse_u64;
using netio3::raw::UsageError;

constexpr std::uint32_t API_VERSION = FI_VERSION(1, 9);

constexpr int EXIT_LOST = 1;
constexpr int EXIT_USAGE = 2;
constexpr int EXIT_FABRIC = 3;

// Connections of one client (--connections), and sessions a server serves at once.
constexpr std::uint64_t MAX_CONNECTIONS = 1024;
// The server's completion queue: room for every operation all its sessions can have posted
// (1024 sessions of up to 247 receives each). Each session reserves SESSION_OPS of it at the
// connection request (a request that finds no room is rejected) and the rest of its receive
// depth at START (the depth is cut to the room left).
constexpr std::size_t SERVER_CQ_SIZE = std::size_t{1} << 18;
constexpr std::size_t SESSION_OPS = 1 + 8 + 1;  // the START receive, 8 control sends, 1 receive

// ---------------------------------------------------------------------------------------
// Wire format

constexpr std::uint32_t MSG_DATA = 0xFAB10001;
constexpr std::uint32_t MSG_START = 0xFAB10002;
constexpr std::uint32_t MSG_READY = 0xFAB10003;
constexpr std::uint32_t MSG_CREDIT = 0xFAB10004;
constexpr std::uint32_t MSG_END = 0xFAB10005;
constexpr std::uint32_t MSG_REPORT = 0xFAB10006;
constexpr std::uint32_t MSG_REFUSE = 0xFAB10007;

struct Header {
  std::uint32_t type;
  std::uint32_t aux;
  std::uint64_t seq;
};
static_assert(sizeof(Header) == 16);

struct Ctrl {
  Header h;
  std::uint64_t a;
  std::uint64_t b;
  std::uint64_t c;
  std::uint64_t d;
};
static_assert(sizeof(Ctrl) == 48);

constexpr std::size_t HEADER_SIZE = sizeof(Header);
constexpr std::size_t CTRL_SLOT = 64;  // slot size of the control buffers (>= sizeof(Ctrl))

constexpr std::uint64_t TEST_THROUGHPUT = 1;
constexpr std::uint64_t TEST_LATENCY = 2;

constexpr std::uint64_t REFUSE_TOO_LARGE = 1;
constexpr std::uint64_t REFUSE_TOO_SMALL = 2;
constexpr std::uint64_t REFUSE_BAD_TEST = 3;

Header load_header(const std::uint8_t* p) {
  Header h{};
  std::memcpy(&h, p, sizeof h);
  return h;
}

Ctrl load_ctrl(const std::uint8_t* p, std::size_t len) {
  Ctrl c{};
  std::memcpy(&c, p, std::min(len, sizeof c));
  return c;
}

// ---------------------------------------------------------------------------------------
// Errors

// A libfabric call that failed: exit 3.
struct FabricError : std::runtime_error {
  FabricError(std::string_view call, long rc)
      : std::runtime_error(fmt::format("{} failed: {} ({})", call,
                                       fi_strerror(static_cast<int>(rc < 0 ? -rc : rc)), rc)) {}
  explicit FabricError(const std::string& text) : std::runtime_error(text) {}
};

// The peer broke the protocol: exit 1 (the test is not intact).
struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(std::string_view call, long rc) {
  if (rc != 0) throw FabricError(call, rc);
}

bool g_close_failed = false;
volatile sig_atomic_t g_stop = 0;

extern "C" void on_stop_signal(int /*signo*/) {
  g_stop = 1;
}

const char* fid_class_name(std::size_t fclass) {
  switch (fclass) {
    case FI_CLASS_FABRIC:
      return "fabric";
    case FI_CLASS_DOMAIN:
      return "domain";
    case FI_CLASS_EP:
      return "endpoint";
    case FI_CLASS_PEP:
      return "passive endpoint";
    case FI_CLASS_EQ:
      return "event queue";
    case FI_CLASS_CQ:
      return "completion queue";
    case FI_CLASS_MR:
      return "memory region";
    default:
      return "fid";
  }
}

template <class T>
struct FidCloser {
  void operator()(T* p) const {
    const int rc = fi_close(&p->fid);
    if (rc != 0) {
      fmt::print(stderr, "raw-libfabric: fi_close({}) failed: {} ({})\n",
                 fid_class_name(p->fid.fclass), fi_strerror(-rc), rc);
      g_close_failed = true;
    }
  }
};
template <class T>
using Fid = std::unique_ptr<T, FidCloser<T>>;

struct InfoFree {
  void operator()(fi_info* p) const { fi_freeinfo(p); }
};
using Info = std::unique_ptr<fi_info, InfoFree>;

struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::int64_t ns_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// Raises the soft limit on open files towards `want` (as far as the hard limit allows);
// returns the soft limit now in force.
rlim_t raise_fd_limit(rlim_t want) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
    rlimit raised = rl;
    raised.rlim_cur = rl.rlim_max == RLIM_INFINITY ? want : std::min(want, rl.rlim_max);
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
  }
  return rl.rlim_cur;
}

// ---------------------------------------------------------------------------------------
// Options

enum class Role { none, server, client };
enum class Test { none, throughput, latency };

struct Options {
  Role role = Role::none;
  std::string bind = "127.0.0.1";
  std::string port = "0";
  std::uint64_t max_size = (1u << 20) + HEADER_SIZE;
  std::string host;
  std::string service;
  Test test = Test::none;
  std::uint64_t size = 0;
  double duration = 0;
  std::uint64_t window = 64;
  std::uint64_t rx_depth = 0;  // 0: 2 * window (throughput), 4 (latency)
  std::uint64_t connections = 1;
  bool credits = true;
  std::string provider = "tcp";
  std::string json;
  bool quiet = false;
  bool wait_fd = false;
  fi_progress progress = FI_PROGRESS_MANUAL;
};

constexpr std::string_view USAGE =
    "usage:\n"
    "  netio3-raw-fabric --server [--bind 127.0.0.1] [--port 0] [--provider tcp]\n"
    "                    [--max-size BYTES] [--wait spin|fd] [--progress manual|auto] "
    "[--quiet]\n"
    "  netio3-raw-fabric --client IP:PORT --test throughput|latency --size BYTES\n"
    "                    --duration SECONDS [--connections N (1..1024, throughput only; 1)]\n"
    "                    [--window N (2 MiB worth, 8..64; per connection)] [--rx-depth N "
    "(2*window)]\n"
    "                    [--credits on|off] [--provider tcp] [--wait spin|fd]\n"
    "                    [--progress manual|auto] [--json FILE] [--quiet]\n"
    "The server serves up to 1024 connections at once. --connections N: the client opens N\n"
    "connections to the server and sends on all of them from its one thread (fan-in); the\n"
    "result is the sum over the connections.\n"
    "exit status: 0 every message arrived in order, 1 not, 2 bad options, 3 libfabric error\n";

void split_host_port(const std::string& text, std::string& host, std::string& port) {
  std::string_view t = text;
  std::size_t colon = std::string_view::npos;
  if (!t.empty() && t.front() == '[') {
    const auto close = t.find(']');
    if (close == std::string_view::npos || close + 1 >= t.size() || t[close + 1] != ':') {
      throw UsageError(fmt::format("--client: '{}' is not [IPv6]:PORT", text));
    }
    host = std::string(t.substr(1, close - 1));
    colon = close + 1;
  } else {
    colon = t.rfind(':');
    if (colon == std::string_view::npos || colon == 0) {
      throw UsageError(fmt::format("--client: '{}' is not IP:PORT", text));
    }
    host = std::string(t.substr(0, colon));
  }
  port = std::string(t.substr(colon + 1));
  const auto p = parse_u64("--client port", port);
  if (p == 0 || p > 65535) throw UsageError(fmt::format("--client: port {} out of range", port));
}

Options parse_options(int argc, char** argv) {
  Options o;
  bool window_set = false;
  bool server_only = false;
  std::vector<std::string> client_only;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> inline_value;
    if (const auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = arg.substr(eq + 1);
      arg.resize(eq);
    }
    const auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw UsageError(fmt::format("{} needs a value", arg));
      return argv[++i];
    };
    const auto flag = [&]() {
      if (inline_value) throw UsageError(fmt::format("{} takes no value", arg));
    };
    const auto set_role = [&](Role r) {
      if (o.role != Role::none) throw UsageError("give either --server or --client, once");
      o.role = r;
    };
    if (arg == "--help" || arg == "-h") {
      fmt::print("{}", USAGE);
      std::exit(0);
    } else if (arg == "--server") {
      flag();
      set_role(Role::server);
    } else if (arg == "--client") {
      set_role(Role::client);
      split_host_port(value(), o.host, o.service);
    } else if (arg == "--bind") {
      o.bind = value();
      server_only = true;
    } else if (arg == "--port") {
      o.port = value();
      if (parse_u64("--port", o.port) > 65535) throw UsageError("--port out of range");
      server_only = true;
    } else if (arg == "--max-size") {
      o.max_size = parse_u64("--max-size", value());
      server_only = true;
    } else if (arg == "--provider") {
      o.provider = value();
      if (o.provider.empty()) throw UsageError("--provider needs a name");
    } else if (arg == "--test") {
      const auto v = value();
      if (v == "throughput") {
        o.test = Test::throughput;
      } else if (v == "latency") {
        o.test = Test::latency;
      } else {
        throw UsageError(fmt::format("--test: '{}' is neither throughput nor latency", v));
      }
      client_only.push_back(arg);
    } else if (arg == "--size") {
      o.size = parse_u64("--size", value());
      client_only.push_back(arg);
    } else if (arg == "--duration") {
      o.duration = parse_double("--duration", value());
      client_only.push_back(arg);
    } else if (arg == "--connections") {
      o.connections = parse_u64("--connections", value());
      if (o.connections == 0 || o.connections > MAX_CONNECTIONS) {
        throw UsageError(fmt::format("--connections: 1 to {}", MAX_CONNECTIONS));
      }
      client_only.push_back(arg);
    } else if (arg == "--window") {
      o.window = parse_u64("--window", value());
      window_set = true;
      client_only.push_back(arg);
    } else if (arg == "--rx-depth") {
      o.rx_depth = parse_u64("--rx-depth", value());
      if (o.rx_depth == 0) throw UsageError("--rx-depth must be at least 1");
      client_only.push_back(arg);
    } else if (arg == "--credits") {
      const auto v = value();
      if (v != "on" && v != "off") throw UsageError("--credits: give on or off");
      o.credits = v == "on";
      client_only.push_back(arg);
    } else if (arg == "--json") {
      o.json = value();
      if (o.json.empty()) throw UsageError("--json needs a file name");
      client_only.push_back(arg);
    } else if (arg == "--wait") {
      const auto v = value();
      if (v != "spin" && v != "fd") throw UsageError("--wait: give spin or fd");
      o.wait_fd = v == "fd";
    } else if (arg == "--progress") {
      const auto v = value();
      if (v == "manual") {
        o.progress = FI_PROGRESS_MANUAL;
      } else if (v == "auto") {
        o.progress = FI_PROGRESS_AUTO;
      } else {
        throw UsageError("--progress: give manual or auto");
      }
    } else if (arg == "--quiet") {
      flag();
      o.quiet = true;
    } else {
      throw UsageError(fmt::format("unknown option '{}'", arg));
    }
  }
  if (o.role == Role::none) throw UsageError("give --server or --client IP:PORT");
  if (o.role == Role::server) {
    if (!client_only.empty()) {
      throw UsageError(fmt::format("{} is a client option", client_only.front()));
    }
    if (o.max_size < CTRL_SLOT) {
      throw UsageError(fmt::format("--max-size must be at least {}", CTRL_SLOT));
    }
    return o;
  }
  if (server_only) throw UsageError("--bind, --port and --max-size are server options");
  if (o.test == Test::none) throw UsageError("--test throughput|latency is required");
  if (o.test == Test::latency && o.connections > 1) {
    throw UsageError("--connections above 1 is for the throughput test only");
  }
  if (o.size == 0) throw UsageError("--size BYTES is required");
  if (o.size < HEADER_SIZE) {
    throw UsageError(fmt::format("--size must be at least {} (the message header)", HEADER_SIZE));
  }
  if (o.size > (std::uint64_t{1} << 30)) throw UsageError("--size above 1 GiB is not supported");
  if (!(o.duration > 0)) throw UsageError("--duration SECONDS (> 0) is required");
  if (o.window == 0) throw UsageError("--window must be at least 1");
  if (o.test == Test::latency && window_set && o.window != 1) {
    // Ping-pong has exactly one message outstanding; the window does not apply.
    if (!o.quiet) fmt::print(stderr, "raw-libfabric: --window is ignored by the latency test\n");
  }
  if (!window_set) {
    // netio3-perf's default: about 2 MiB in flight, at least 8 messages (at most 64 here).
    o.window = std::clamp<std::uint64_t>((std::uint64_t{2} << 20U) / o.size, 8, 64);
  }
  if (o.rx_depth == 0) o.rx_depth = o.test == Test::throughput ? 2 * o.window : 4;
  return o;
}

// ---------------------------------------------------------------------------------------
// libfabric set-up

Info get_info(const Options& o, const char* node, const char* service, std::uint64_t flags) {
  Info hints{fi_allocinfo()};
  if (!hints) throw FabricError("fi_allocinfo returned no memory");
  hints->caps = FI_MSG;
  hints->ep_attr->type = FI_EP_MSG;
  // Every operation context starts with a struct fi_context2, so both modes are fine.
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  // Registration: every buffer is registered and its descriptor passed; keys are unique
  // where the provider does not pick them; FI_MR_ENDPOINT regions are bound and enabled.
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->data_progress = o.progress;
  hints->domain_attr->control_progress = o.progress;
  hints->fabric_attr->prov_name = ::strdup(o.provider.c_str());
  if (hints->fabric_attr->prov_name == nullptr) throw FabricError("strdup returned no memory");
  fi_info* info = nullptr;
  const int rc = fi_getinfo(API_VERSION, node, service, flags, hints.get(), &info);
  if (rc != 0 || info == nullptr) {
    throw FabricError(
        fmt::format("fi_getinfo(provider '{}', FI_EP_MSG, FI_MSG, {}:{}) failed: {} ({})",
                    o.provider, node != nullptr ? node : "-", service != nullptr ? service : "-",
                    fi_strerror(rc < 0 ? -rc : rc), rc));
  }
  return Info{info};
}

std::string describe(const fi_info& info, const Options& o) {
  return fmt::format(
      "provider {}, fabric {}, domain {}, mr_mode {:#x}, progress {}, tx depth {}, rx depth {}, "
      "wait {}",
      info.fabric_attr->prov_name ? info.fabric_attr->prov_name : "?",
      info.fabric_attr->name ? info.fabric_attr->name : "?",
      info.domain_attr->name ? info.domain_attr->name : "?", info.domain_attr->mr_mode,
      info.domain_attr->data_progress == FI_PROGRESS_AUTO ? "auto" : "manual", info.tx_attr->size,
      info.rx_attr->size, o.wait_fd ? "fd" : "spin");
}

// One entry of the (shared) event queue: a connection-management event, an error entry, or
// nothing (event 0, no error) when none came within the timeout.
struct EqEvent {
  std::uint32_t event = 0;
  fid_t fid = nullptr;  // the endpoint (or listener) it concerns; compared, never dereferenced
  Info info;            // FI_CONNREQ: the request
  std::string error;    // an error entry: what happened (event is 0)
};

EqEvent read_event(fid_eq* eq, int timeout_ms) {
  EqEvent out;
  fi_eq_cm_entry entry{};
  std::uint32_t event = 0;
  const ssize_t rd = timeout_ms == 0 ? fi_eq_read(eq, &event, &entry, sizeof entry, 0)
                                     : fi_eq_sread(eq, &event, &entry, sizeof entry, timeout_ms, 0);
  if (rd == -FI_EAGAIN || rd == -FI_ETIMEDOUT || rd == -FI_EINTR) return out;
  if (rd == -FI_EAVAIL) {
    fi_eq_err_entry err{};
    const ssize_t er = fi_eq_readerr(eq, &err, 0);
    if (er < 0) throw FabricError("fi_eq_readerr", er);
    const char* detail = err.prov_errno != 0
                             ? fi_eq_strerror(eq, err.prov_errno, err.err_data, nullptr, 0)
                             : nullptr;
    out.fid = err.fid;
    out.error =
        fmt::format("connection event: {} ({}){}{}", fi_strerror(err.err), -err.err,
                    detail != nullptr ? "; provider: " : "", detail != nullptr ? detail : "");
    return out;
  }
  if (rd < 0) throw FabricError(timeout_ms == 0 ? "fi_eq_read" : "fi_eq_sread", rd);
  if (static_cast<std::size_t>(rd) < sizeof(fid_t)) {
    throw FabricError(fmt::format("fi_eq_read returned a short entry ({} bytes)", rd));
  }
  out.event = event;
  out.fid = entry.fid;
  if (event == FI_CONNREQ) out.info.reset(entry.info);
  return out;
}

const char* event_name(std::uint32_t ev) {
  switch (ev) {
    case FI_CONNREQ:
      return "FI_CONNREQ";
    case FI_CONNECTED:
      return "FI_CONNECTED";
    case FI_SHUTDOWN:
      return "FI_SHUTDOWN";
    default:
      return "event";
  }
}

// The context of every posted operation; the fi_context2 comes first (FI_CONTEXT2 mode).
class Pool;
class Conn;
struct OpCtx {
  fi_context2 fctx;
  Pool* pool;
  std::uint32_t index;
};

// One fabric domain and what all endpoints of the process share: ONE completion queue (with
// its wait fd in --wait fd), ONE event queue, the registration keys. Closed in this order: CQ,
// domain, EQ (every endpoint and memory region must be closed before).
class Domain {
 public:
  Domain(fid_fabric* fabric, fi_info& info, bool wait_fd, std::size_t cq_size, std::size_t eq_size)
      : m_fabric{fabric},
        m_wait_fd{wait_fd},
        m_mr_mode{static_cast<std::uint64_t>(info.domain_attr->mr_mode)} {
    fi_eq_attr eq_attr{};
    eq_attr.size = eq_size;
    eq_attr.wait_obj = FI_WAIT_UNSPEC;
    fid_eq* eq = nullptr;
    check("fi_eq_open", fi_eq_open(fabric, &eq_attr, &eq, nullptr));
    m_eq.reset(eq);

    fid_domain* domain = nullptr;
    check("fi_domain", fi_domain(fabric, &info, &domain, nullptr));
    m_domain.reset(domain);

    fi_cq_attr cq_attr{};
    cq_attr.size = cq_size;
    cq_attr.format = FI_CQ_FORMAT_MSG;
    cq_attr.wait_obj = wait_fd ? FI_WAIT_FD : FI_WAIT_NONE;
    fid_cq* cq = nullptr;
    check("fi_cq_open", fi_cq_open(domain, &cq_attr, &cq, nullptr));
    m_cq.reset(cq);

    if (wait_fd) {
      int fd = -1;
      const int rc = fi_control(&cq->fid, FI_GETWAIT, &fd);
      if (rc != 0) {
        throw FabricError(fmt::format(
            "fi_control(completion queue, FI_GETWAIT) failed: {} ({}); provider '{}' has no "
            "pollable wait fd, use --wait spin",
            fi_strerror(-rc), rc, info.fabric_attr->prov_name));
      }
      m_epoll.fd = ::epoll_create1(EPOLL_CLOEXEC);
      if (m_epoll.fd < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1");
      epoll_event ev{};
      ev.events = EPOLLIN;
      if (::epoll_ctl(m_epoll.fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        throw std::system_error(errno, std::generic_category(), "epoll_ctl");
      }
    }
  }
  Domain(const Domain&) = delete;
  Domain& operator=(const Domain&) = delete;

  fid_domain* get() const { return m_domain.get(); }
  fid_cq* cq() const { return m_cq.get(); }
  fid_eq* eq() const { return m_eq.get(); }
  std::uint64_t mr_mode() const { return m_mr_mode; }
  std::uint64_t next_key() { return m_next_key++; }  // unique within the domain

  // An error completion: the operation it concerns (its context) and what happened.
  struct Error {
    OpCtx* op = nullptr;
    std::string text;
  };

  // Reads up to `n` completions; 0 when there are none. An error completion is read into
  // `error` (and 0 returned): which connection it concerns (error->op) is the caller's to judge.
  std::size_t poll(fi_cq_msg_entry* out, std::size_t n, std::optional<Error>& error) {
    const ssize_t rd = fi_cq_read(m_cq.get(), out, n);
    if (rd > 0) return static_cast<std::size_t>(rd);
    if (rd == -FI_EAGAIN) return 0;
    if (rd == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      const ssize_t er = fi_cq_readerr(m_cq.get(), &err, 0);
      if (er == -FI_EAGAIN) return 0;
      if (er < 0) throw FabricError("fi_cq_readerr", er);
      const char* detail =
          err.prov_errno != 0 ? fi_cq_strerror(m_cq.get(), err.prov_errno, err.err_data, nullptr, 0)
                              : nullptr;
      error =
          Error{static_cast<OpCtx*>(err.op_context),
                fmt::format("{} completion: {} ({}){}{}",
                            (err.flags & FI_SEND) != 0   ? "send"
                            : (err.flags & FI_RECV) != 0 ? "receive"
                                                         : "a",
                            fi_strerror(err.err), -err.err, detail != nullptr ? "; provider: " : "",
                            detail != nullptr ? detail : "")};
      return 0;
    }
    throw FabricError("fi_cq_read", rd);
  }

  // --wait fd: sleeps until the CQ's fd is readable or `timeout_ms` passed, unless
  // fi_trywait says there is something to read. --wait spin: returns at once.
  void wait(int timeout_ms) {
    if (!m_wait_fd) return;
    fid* fids[1] = {&m_cq->fid};
    const int rc = fi_trywait(m_fabric, fids, 1);
    if (rc == -FI_EAGAIN) return;
    if (rc != 0) throw FabricError("fi_trywait", rc);
    epoll_event ev[4];
    const int n = ::epoll_wait(m_epoll.fd, ev, 4, timeout_ms);
    if (n < 0 && errno != EINTR) throw std::system_error(errno, std::generic_category(), "epoll");
    ++m_sleeps;
  }
  std::uint64_t sleeps() const { return m_sleeps; }

 private:
  fid_fabric* m_fabric;
  bool m_wait_fd;
  std::uint64_t m_mr_mode;
  std::uint64_t m_next_key = 1;
  std::uint64_t m_sleeps = 0;
  Fd m_epoll;
  Fid<fid_eq> m_eq;
  Fid<fid_domain> m_domain;
  Fid<fid_cq> m_cq;
};

// A registered region of `count` slots of `slot_size` bytes, with a free list; it belongs to
// one connection (the owner of every completion of its slots).
class Pool {
 public:
  Pool(Conn& conn, std::size_t slot_size, std::size_t count)
      : m_conn{&conn},
        m_slot{slot_size},
        m_stride{(slot_size + 63) / 64 * 64},
        m_count{count},
        m_ctx(count) {
    const std::size_t bytes = (m_stride * count + 4095) / 4096 * 4096;
    m_mem.reset(static_cast<std::uint8_t*>(std::aligned_alloc(4096, bytes)));
    if (!m_mem) throw std::runtime_error(fmt::format("cannot allocate {} bytes", bytes));
    std::memset(m_mem.get(), 0, bytes);  // touch every page before the measurement
    m_bytes = bytes;
    for (std::size_t i = 0; i < count; ++i) {
      m_ctx[i].pool = this;
      m_ctx[i].index = static_cast<std::uint32_t>(i);
      m_free.push_back(static_cast<std::uint32_t>(count - 1 - i));
    }
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  void register_memory(Domain& domain, fid_ep* ep) {
    const std::uint64_t mr_mode = domain.mr_mode();
    const std::uint64_t key = (mr_mode & FI_MR_PROV_KEY) != 0 ? 0 : domain.next_key();
    fid_mr* mr = nullptr;
    check("fi_mr_reg", fi_mr_reg(domain.get(), m_mem.get(), m_bytes, FI_SEND | FI_RECV, 0, key, 0,
                                 &mr, nullptr));
    m_mr.reset(mr);
    if ((mr_mode & FI_MR_ENDPOINT) != 0) {
      check("fi_mr_bind(endpoint)", fi_mr_bind(mr, &ep->fid, 0));
      check("fi_mr_enable", fi_mr_enable(mr));
    }
    m_desc = fi_mr_desc(mr);
  }

  Conn& conn() const { return *m_conn; }
  std::uint8_t* data(std::uint32_t i) { return m_mem.get() + std::size_t{i} * m_stride; }
  OpCtx* ctx(std::uint32_t i) { return &m_ctx[i]; }
  void* desc() const { return m_desc; }
  std::size_t slot_size() const { return m_slot; }
  std::size_t count() const { return m_count; }
  bool has_free() const { return !m_free.empty(); }
  std::uint32_t take() {
    const auto i = m_free.back();
    m_free.pop_back();
    return i;
  }
  void give(std::uint32_t i) { m_free.push_back(i); }

 private:
  struct Free {
    void operator()(std::uint8_t* p) const { std::free(p); }
  };
  Conn* m_conn;
  std::size_t m_slot;
  std::size_t m_stride;
  std::size_t m_count;
  std::size_t m_bytes = 0;
  std::unique_ptr<std::uint8_t, Free> m_mem;
  Fid<fid_mr> m_mr;  // declared after the memory: closed before it is freed
  void* m_desc = nullptr;
  std::vector<OpCtx> m_ctx;
  std::vector<std::uint32_t> m_free;
};

// One endpoint in the shared domain, bound to the domain's EQ and CQ, with its buffer pools.
// close() closes the endpoint alone: the pools (and the contexts in them) stay until the
// object goes, since the CQ may still hold completions of them. Members are closed in reverse
// order: endpoint, then memory regions.
class Conn {
 public:
  Conn(Domain& domain, fi_info& info) : m_domain{domain} {
    fid_ep* ep = nullptr;
    check("fi_endpoint", fi_endpoint(domain.get(), &info, &ep, nullptr));
    m_ep.reset(ep);
    check("fi_ep_bind(eq)", fi_ep_bind(ep, &domain.eq()->fid, 0));
    check("fi_ep_bind(cq)", fi_ep_bind(ep, &domain.cq()->fid, FI_TRANSMIT | FI_RECV));
    check("fi_enable", fi_enable(ep));
  }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  fid_ep* ep() const { return m_ep.get(); }
  bool closed() const { return !m_ep; }
  // The endpoint's fid while it is open, to match connection events with.
  bool is(fid_t fid) const { return m_ep && fid == &m_ep->fid; }
  void close() { m_ep.reset(); }

  Pool& add_pool(std::size_t slot_size, std::size_t count) {
    m_pools.push_back(std::make_unique<Pool>(*this, slot_size, count));
    m_pools.back()->register_memory(m_domain, m_ep.get());
    return *m_pools.back();
  }

  // false: the provider answered -FI_EAGAIN; post again after reading the CQ.
  bool post_recv(Pool& pool, std::uint32_t i) {
    const ssize_t rc =
        fi_recv(m_ep.get(), pool.data(i), pool.slot_size(), pool.desc(), 0, pool.ctx(i));
    if (rc == -FI_EAGAIN) return false;
    if (rc != 0) throw FabricError("fi_recv", rc);
    return true;
  }
  bool post_send(Pool& pool, std::uint32_t i, std::size_t len) {
    const ssize_t rc = fi_send(m_ep.get(), pool.data(i), len, pool.desc(), 0, pool.ctx(i));
    if (rc == -FI_EAGAIN) return false;
    if (rc != 0) throw FabricError("fi_send", rc);
    return true;
  }

 private:
  Domain& m_domain;
  std::vector<std::unique_ptr<Pool>> m_pools;
  Fid<fid_ep> m_ep;
};

OpCtx* op_of(const fi_cq_msg_entry& e) {
  return static_cast<OpCtx*>(e.op_context);
}

void write_ctrl(Pool& pool, std::uint32_t i, std::uint32_t type, std::uint64_t a,
                std::uint64_t b = 0, std::uint64_t c = 0, std::uint64_t d = 0) {
  Ctrl msg{};
  msg.h.type = type;
  msg.a = a;
  msg.b = b;
  msg.c = c;
  msg.d = d;
  std::memcpy(pool.data(i), &msg, sizeof msg);
}

// ---------------------------------------------------------------------------------------
// Server

struct PendingOp {
  bool send;
  Pool* pool;
  std::uint32_t index;
  std::size_t len;
};

// One client connection: the protocol's state machine on the server side.
//   start:    accepted, waiting for START (10 s); a START read from the CQ before the
//             endpoint's FI_CONNECTED was read from the EQ is answered once it is
//   running:  READY sent; data, credits (throughput) or echoes (latency), until END
//   closing:  the REPORT (or REFUSE) waits for a control slot or its send completion
//   draining: the final message went out; waiting (5 s) for the client to shut down
struct Session : Conn {
  enum class State { start, running, closing, draining };

  Session(Domain& domain, fi_info& info, std::uint64_t session_id)
      : Conn(domain, info),
        id{session_id},
        max_msg_size{info.ep_attr->max_msg_size},
        rx_size{info.rx_attr->size} {}

  std::uint64_t id;
  std::uint64_t max_msg_size;
  std::uint64_t rx_size;
  State state = State::start;
  Clock::time_point since = Clock::now();  // when start or draining began (timeouts)
  bool connected = false;                  // FI_CONNECTED seen
  bool dirty = false;                      // queued to be stepped
  std::size_t cq_reserved = 0;             // its share of the server's CQ
  std::uint64_t closed_as = 0;             // the how-manieth close it was (0: open)

  Pool* start_rx = nullptr;
  Pool* ctrl_tx = nullptr;
  Pool* data_rx = nullptr;
  bool latency = false;
  bool credits = false;
  std::uint64_t size = 0;
  std::uint64_t batch = 1;
  std::uint64_t consumed = 0;  // data buffers reposted (credits)
  std::uint64_t credited = 0;  // last credit sent
  std::uint64_t messages = 0;
  std::uint64_t bytes = 0;
  std::uint64_t next_seq = 0;
  bool in_order = true;
  std::uint64_t client_messages = 0;
  std::uint64_t client_bytes = 0;
  std::optional<Ctrl> early_start;          // START before FI_CONNECTED was read: taken then
  double cpu_at_start = 0;                  // the process's CPU time at START
  std::optional<std::uint32_t> final_slot;  // the REPORT/REFUSE send; draining when it completes
  std::optional<Ctrl> final_msg;            // waiting for a free control slot
  std::deque<PendingOp> pending;            // operations the provider could not take yet

  void repost(Pool& p, std::uint32_t i) {
    if (!pending.empty() || !post_recv(p, i)) {
      pending.push_back({false, &p, i, 0});
    } else if (&p == data_rx) {
      ++consumed;
    }
  }
  std::optional<std::uint32_t> send_ctrl(const Ctrl& msg) {
    if (!ctrl_tx->has_free()) return std::nullopt;
    const auto i = ctrl_tx->take();
    std::memcpy(ctrl_tx->data(i), &msg, sizeof msg);
    if (!pending.empty() || !post_send(*ctrl_tx, i, sizeof msg)) {
      pending.push_back({true, ctrl_tx, i, sizeof msg});
    }
    return i;
  }
  void finish(std::uint32_t type, std::uint64_t a, std::uint64_t b, std::uint64_t c,
              std::uint64_t d) {
    Ctrl msg{};
    msg.h.type = type;
    msg.a = a;
    msg.b = b;
    msg.c = c;
    msg.d = d;
    final_msg = msg;
    state = State::closing;
  }
};

class Server {
 public:
  Server(const Options& o, fid_fabric* fabric, fi_info& info)
      : m_o{o},
        m_domain{fabric, info, o.wait_fd,
                 std::max<std::size_t>(SERVER_CQ_SIZE, info.tx_attr->size + info.rx_attr->size),
                 4096},
        m_cq_free{std::max<std::size_t>(SERVER_CQ_SIZE, info.tx_attr->size + info.rx_attr->size)},
        m_entries(64) {
    fid_pep* pep = nullptr;
    check("fi_passive_ep", fi_passive_ep(fabric, &info, &pep, nullptr));
    m_pep.reset(pep);
    check("fi_pep_bind", fi_pep_bind(pep, &m_domain.eq()->fid, 0));
    check("fi_listen", fi_listen(pep));
    m_sessions.reserve(MAX_CONNECTIONS);
    m_dirty.reserve(MAX_CONNECTIONS);
    m_turn.reserve(MAX_CONNECTIONS);
  }

  fid_pep* pep() const { return m_pep.get(); }

  void run() {
    while (g_stop == 0) {
      if (m_sessions.empty()) {
        // Nothing to serve: wait for the next connection request.
        on_event(read_event(m_domain.eq(), 200));
        continue;
      }
      const std::uint64_t closes_before = m_closes;
      std::optional<Domain::Error> error;
      const std::size_t n = m_domain.poll(m_entries.data(), m_entries.size(), error);
      for (std::size_t k = 0; k < n; ++k) dispatch(m_entries[k]);
      if (error) on_cq_error(*error);
      if (!m_dirty.empty()) step_dirty();
      const bool idle = n == 0 && !error;
      if (idle) {
        // The CQ is empty: it holds nothing more of the sessions closed before this read.
        if (m_closed != 0) sweep(closes_before);
        if (m_o.wait_fd && m_open != 0) m_domain.wait(100);
      }
      if ((++m_turns & 0xFFF) == 0 || (m_o.wait_fd && idle)) {
        housekeeping();
      } else if (idle && m_connecting != 0) {
        read_events();  // connections being set up: answer them at once
      }
    }
  }

 private:
  void mark_dirty(Session& s) {
    if (!s.dirty) {
      s.dirty = true;
      m_dirty.push_back(&s);
    }
  }

  Session* find(fid_t fid) {
    for (auto& s : m_sessions) {
      if (s->is(fid)) return s.get();
    }
    return nullptr;
  }

  // Closes the session's endpoint; the session (its buffers) stays until sweep().
  void close(Session& s) {
    if (s.closed()) return;
    s.close();  // the provider may flush its posted operations into the CQ now
    s.closed_as = ++m_closes;
    s.pending.clear();
    if (!s.connected) --m_connecting;
    --m_open;
    ++m_closed;
  }

  void fail(Session& s, std::string_view how, std::string_view why) {
    if (s.closed()) return;
    fmt::print(stderr, "raw-libfabric server: client session {} {}: {}\n", s.id, how, why);
    close(s);
  }

  // Frees the sessions closed up to the `closes`th close (the CQ was read empty after it), and
  // gives their share of the CQ back.
  void sweep(std::uint64_t closes) {
    std::erase_if(m_sessions, [&](const std::unique_ptr<Session>& s) {
      if (!s->closed() || s->closed_as > closes || s->dirty) return false;
      m_cq_free += s->cq_reserved;
      return true;
    });
    m_closed = static_cast<std::size_t>(std::count_if(m_sessions.begin(), m_sessions.end(),
                                                      [](const auto& s) { return s->closed(); }));
  }

  void on_event(EqEvent ev) {
    if (!ev.error.empty()) {
      Session* s = find(ev.fid);
      if (s == nullptr) {
        fmt::print(stderr, "raw-libfabric server: {} (listener)\n", ev.error);
      } else if (s->state == Session::State::draining) {
        close(*s);
      } else {
        fail(*s, "failed", ev.error);
      }
      return;
    }
    switch (ev.event) {
      case 0:
        return;
      case FI_CONNREQ:
        accept(std::move(ev.info));
        return;
      case FI_CONNECTED:
        if (Session* s = find(ev.fid); s != nullptr && !s->connected) {
          s->connected = true;
          --m_connecting;
          if (!m_o.quiet) {
            fmt::print(stderr, "raw-libfabric server: client session {} connected\n", s->id);
          }
          if (s->early_start) {
            try {
              start(*s, *s->early_start);
            } catch (const std::exception& ex) {
              fail(*s, "failed", ex.what());
              return;
            }
            mark_dirty(*s);
          }
        }
        return;
      case FI_SHUTDOWN:
        if (Session* s = find(ev.fid)) {
          if (s->state == Session::State::draining) {
            close(*s);  // the client shut down after the report: done
          } else {
            fail(*s, "aborted", "client disconnected during the test");
          }
        }
        return;
      default:
        fmt::print(stderr, "raw-libfabric server: ignoring {} ({})\n", event_name(ev.event),
                   ev.event);
    }
  }

  void reject(const fi_info& request) {
    const int rc = fi_reject(m_pep.get(), request.handle, nullptr, 0);
    if (rc != 0) fmt::print(stderr, "raw-libfabric: fi_reject failed: {}\n", fi_strerror(-rc));
  }

  void accept(Info request) {
    if (!request) return;
    if (m_open >= MAX_CONNECTIONS || m_cq_free < SESSION_OPS) {
      fmt::print(stderr,
                 "raw-libfabric server: rejecting a connection: {} sessions open, room for {} "
                 "operations left in the completion queue\n",
                 m_open, m_cq_free);
      reject(*request);
      return;
    }
    Session* s = nullptr;
    try {
      auto owned = std::make_unique<Session>(m_domain, *request, m_next_id++);
      owned->start_rx = &owned->add_pool(CTRL_SLOT, 1);
      owned->ctrl_tx = &owned->add_pool(CTRL_SLOT, 8);
      // From the first posted operation on, the CQ may refer to the session: it is freed by
      // sweep() only.
      m_sessions.push_back(std::move(owned));
      s = m_sessions.back().get();
      ++m_open;
      ++m_connecting;
      s->cq_reserved = SESSION_OPS;
      m_cq_free -= SESSION_OPS;
      if (!s->post_recv(*s->start_rx, 0)) throw FabricError("fi_recv", -FI_EAGAIN);
    } catch (const std::exception& e) {
      fmt::print(stderr, "raw-libfabric server: cannot set up a client session: {}\n", e.what());
      reject(*request);
      if (s != nullptr) close(*s);
      return;
    }
    const int rc = fi_accept(s->ep(), nullptr, 0);
    if (rc != 0) fail(*s, "failed", FabricError("fi_accept", rc).what());
  }

  // The connection events queued so far, without blocking.
  void read_events() {
    for (;;) {
      EqEvent ev = read_event(m_domain.eq(), 0);
      if (ev.event == 0 && ev.error.empty()) break;
      on_event(std::move(ev));
    }
  }

  // Everything but the CQ, every 4096 turns (--wait fd: after every wait): the connection
  // events and the sessions' timeouts.
  void housekeeping() {
    read_events();
    const auto now = Clock::now();
    for (std::size_t k = 0; k < m_sessions.size(); ++k) {
      Session& s = *m_sessions[k];
      if (s.closed()) continue;
      if (s.state == Session::State::start && now - s.since > std::chrono::seconds(10)) {
        fail(s, "aborted",
             s.connected ? "client sent no start message within 10 s"
                         : "client did not complete the connection within 10 s");
      } else if (s.state == Session::State::draining && now - s.since > std::chrono::seconds(5)) {
        close(s);  // the client did not shut down: close anyway
      }
    }
  }

  void dispatch(const fi_cq_msg_entry& e) {
    OpCtx* op = op_of(e);
    Session& s = static_cast<Session&>(op->pool->conn());
    if (s.closed()) return;  // flushed operations of a closed session
    try {
      on_completion(s, e, *op->pool, op->index);
    } catch (const ProtocolError& ex) {
      fail(s, "aborted", ex.what());
      return;
    } catch (const std::exception& ex) {  // FabricError, or no memory for the buffers
      fail(s, "failed", ex.what());
      return;
    }
    mark_dirty(s);
  }

  void on_cq_error(const Domain::Error& error) {
    if (error.op == nullptr) {
      fmt::print(stderr, "raw-libfabric server: {} (no context)\n", error.text);
      return;
    }
    Session& s = static_cast<Session&>(error.op->pool->conn());
    if (s.closed()) return;
    if (s.state == Session::State::draining) {
      close(s);  // the client shut down after the report: its receives are flushed
    } else {
      fail(s, "failed", error.text);
    }
  }

  void on_completion(Session& s, const fi_cq_msg_entry& e, Pool& p, std::uint32_t i) {
    using State = Session::State;
    if (s.state == State::draining) return;  // done: nothing more to do
    if ((e.flags & FI_RECV) != 0) {
      if (e.len < HEADER_SIZE) throw ProtocolError(fmt::format("{}-byte message", e.len));
      const Header h = load_header(p.data(i));
      if (h.type == MSG_DATA && s.state == State::running) {
        ++s.messages;
        s.bytes += e.len;
        if (h.seq != s.next_seq) s.in_order = false;
        s.next_seq = h.seq + 1;
        if (s.latency) {
          if (!s.pending.empty() || !s.post_send(p, i, e.len)) {
            s.pending.push_back({true, &p, i, e.len});
          }
        } else {
          s.repost(p, i);
        }
      } else if (h.type == MSG_START && s.state == State::start && !s.early_start) {
        if (s.connected) {
          start(s, load_ctrl(p.data(i), e.len));
        } else {
          s.early_start = load_ctrl(p.data(i), e.len);  // answered once connected
        }
      } else if (h.type == MSG_END && s.state == State::running) {
        const double cpu = cpu_ns() - s.cpu_at_start;
        const Ctrl end = load_ctrl(p.data(i), e.len);
        s.client_messages = end.a;
        s.client_bytes = end.b;
        s.repost(p, i);
        s.finish(MSG_REPORT, s.messages, s.bytes, s.in_order ? 1 : 0,
                 cpu > 0 ? static_cast<std::uint64_t>(cpu) : 0);
      } else {
        throw ProtocolError(fmt::format("unexpected message type {:#x} ({} bytes)", h.type, e.len));
      }
    } else if ((e.flags & FI_SEND) != 0) {
      if (&p == s.ctrl_tx) {
        s.ctrl_tx->give(i);
        if (s.final_slot && *s.final_slot == i) drained(s);
      } else {
        s.repost(p, i);  // an echo went out: the buffer takes the next message
      }
    }
  }

  void start(Session& s, const Ctrl& msg) {
    s.cpu_at_start = cpu_ns();
    s.size = msg.a;
    s.latency = msg.b == TEST_LATENCY;
    s.credits = msg.d != 0 && !s.latency;
    if (msg.b != TEST_LATENCY && msg.b != TEST_THROUGHPUT) {
      s.finish(MSG_REFUSE, REFUSE_BAD_TEST, m_o.max_size, 0, 0);
      return;
    }
    if (s.size > m_o.max_size || s.size > s.max_msg_size) {
      s.finish(MSG_REFUSE, REFUSE_TOO_LARGE, std::min(m_o.max_size, s.max_msg_size), 0, 0);
      return;
    }
    if (s.size < HEADER_SIZE) {
      s.finish(MSG_REFUSE, REFUSE_TOO_SMALL, HEADER_SIZE, 0, 0);
      return;
    }
    // As many receives as asked, as far as the provider's depth and the CQ allow (the first
    // one is reserved already).
    const std::uint64_t depth = std::max<std::uint64_t>(
        1, std::min<std::uint64_t>({msg.c, s.rx_size, 1 + std::uint64_t{m_cq_free}}));
    s.batch = std::max<std::uint64_t>(1, depth / 4);
    s.data_rx = &s.add_pool(std::max<std::size_t>(s.size, CTRL_SLOT), depth);
    s.cq_reserved += depth - 1;
    m_cq_free -= depth - 1;
    for (std::uint32_t j = 0; j < depth; ++j) {
      if (!s.post_recv(*s.data_rx, j)) throw FabricError("fi_recv", -FI_EAGAIN);
    }
    Ctrl ready{};
    ready.h.type = MSG_READY;
    ready.a = depth;
    ready.b = m_o.max_size;
    if (!s.send_ctrl(ready)) throw FabricError("no control buffer for READY");
    s.state = Session::State::running;
    if (!m_o.quiet) {
      fmt::print(stderr,
                 "raw-libfabric server: client session {}: {} test, {} B, {} receives posted{}\n",
                 s.id, s.latency ? "latency" : "throughput", s.size, depth,
                 s.credits ? ", credits" : ", no credits");
    }
  }

  // The final message went out: the session is done; the client shuts down next.
  void drained(Session& s) {
    s.state = Session::State::draining;
    s.since = Clock::now();
    if (m_o.quiet) return;
    if (s.final_msg && s.final_msg->h.type == MSG_REPORT) {
      fmt::print(stderr,
                 "raw-libfabric server: client session {} done: received {} messages, {} bytes "
                 "(client sent {}, {}), {}\n",
                 s.id, s.messages, s.bytes, s.client_messages, s.client_bytes,
                 s.in_order ? "in order" : "OUT OF ORDER");
    } else {
      fmt::print(stderr, "raw-libfabric server: refused client session {}'s test\n", s.id);
    }
  }

  // After a batch of completions: what the sessions that had some can do now.
  void step_dirty() {
    m_turn.swap(m_dirty);
    for (Session* sp : m_turn) {
      Session& s = *sp;
      s.dirty = false;
      if (s.closed()) continue;
      try {
        step(s);
      } catch (const ProtocolError& ex) {
        fail(s, "aborted", ex.what());
      } catch (const std::exception& ex) {
        fail(s, "failed", ex.what());
      }
    }
    m_turn.clear();
  }

  void step(Session& s) {
    // Operations the provider could not take yet, in order.
    while (!s.pending.empty()) {
      const auto op = s.pending.front();
      const bool ok =
          op.send ? s.post_send(*op.pool, op.index, op.len) : s.post_recv(*op.pool, op.index);
      if (!ok) break;
      if (!op.send && op.pool == s.data_rx) ++s.consumed;
      s.pending.pop_front();
    }
    if (s.state == Session::State::closing && s.final_msg && !s.final_slot) {
      s.final_slot = s.send_ctrl(*s.final_msg);  // none free: a control send completion retries
    }
    if (s.credits && s.state == Session::State::running && s.consumed - s.credited >= s.batch &&
        s.ctrl_tx->has_free()) {
      Ctrl credit{};
      credit.h.type = MSG_CREDIT;
      credit.a = s.consumed;
      s.send_ctrl(credit);
      s.credited = s.consumed;
    }
    if (!s.pending.empty()) mark_dirty(s);  // the provider was full: again next turn
  }

  const Options& m_o;
  Domain m_domain;
  Fid<fid_pep> m_pep;  // closed before the domain's EQ it is bound to
  std::size_t m_cq_free;
  std::uint64_t m_next_id = 1;
  std::uint64_t m_turns = 0;
  std::size_t m_open = 0;        // sessions with an open endpoint
  std::size_t m_connecting = 0;  // of them, FI_CONNECTED not read yet
  std::size_t m_closed = 0;      // closed sessions not yet swept
  std::uint64_t m_closes = 0;    // sessions closed so far
  std::vector<fi_cq_msg_entry> m_entries;
  std::vector<Session*> m_dirty;  // sessions to step after this batch
  std::vector<Session*> m_turn;
  // Declared last: closed first (endpoints and registrations before the domain).
  std::vector<std::unique_ptr<Session>> m_sessions;
};

std::string address_string(const sockaddr_storage& ss) {
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    sockaddr_in sin{};
    std::memcpy(&sin, &ss, sizeof sin);
    if (inet_ntop(AF_INET, &sin.sin_addr, text, sizeof text) == nullptr) return "?";
    return fmt::format("{}:{}", text, ntohs(sin.sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    sockaddr_in6 sin6{};
    std::memcpy(&sin6, &ss, sizeof sin6);
    if (inet_ntop(AF_INET6, &sin6.sin6_addr, text, sizeof text) == nullptr) return "?";
    return fmt::format("[{}]:{}", text, ntohs(sin6.sin6_port));
  }
  throw FabricError(fmt::format("fi_getname: address family {} is not IPv4/IPv6", ss.ss_family));
}

int run_server(const Options& o) {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: waits return early
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // One socket per session, and a few of the provider's own.
  const rlim_t want_fds = MAX_CONNECTIONS + 256;
  if (const rlim_t fds = raise_fd_limit(want_fds); fds < want_fds && !o.quiet) {
    fmt::print(stderr,
               "raw-libfabric server: the open-file limit is {}: fewer than {} connections at "
               "once\n",
               fds, MAX_CONNECTIONS);
  }

  Info info = get_info(o, o.bind.c_str(), o.port.c_str(), FI_SOURCE);
  fid_fabric* fabric_raw = nullptr;
  check("fi_fabric", fi_fabric(info->fabric_attr, &fabric_raw, nullptr));
  Fid<fid_fabric> fabric{fabric_raw};
  Server server(o, fabric.get(), *info);
  sockaddr_storage ss{};
  std::size_t len = sizeof ss;
  check("fi_getname", fi_getname(&server.pep()->fid, &ss, &len));
  if (!o.quiet) fmt::print(stderr, "raw-libfabric server: {}\n", describe(*info, o));
  fmt::print("listening on {}\n", address_string(ss));
  std::fflush(stdout);

  server.run();
  if (!o.quiet) fmt::print(stderr, "raw-libfabric server: stopping\n");
  return 0;
}

// ---------------------------------------------------------------------------------------
// Client

// One of the client's connections and its side of the protocol.
struct Link : Conn {
  Link(Domain& domain, fi_info& info, std::size_t link_index)
      : Conn(domain, info), index{link_index} {}

  std::size_t index;
  Pool* rx = nullptr;
  Pool* ctrl_tx = nullptr;
  Pool* data_tx = nullptr;
  std::uint64_t seq = 0;           // data messages posted
  std::uint64_t posted = 0;        // data + END, against credit_limit
  std::uint64_t credit_limit = 0;  // total messages (data + END) the server can take
  std::uint64_t rx_depth = 0;      // from READY
  bool connected = false;
  bool end_sent = false;
  bool queued = false;  // in the ready queue
  std::optional<Ctrl> report;
};

struct Result {
  std::uint64_t messages = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  double cpu_ns = 0;
  std::uint64_t server_cpu_ns = 0;  // the maximum over the connections' reports
  std::vector<std::int64_t> rtt_ns;
  bool intact = false;
  std::string problem;
};

double percentile_us(std::vector<std::int64_t>& v, double q) {
  if (v.empty()) return NAN;
  const auto n = v.size();
  auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(n)));
  rank = std::clamp<std::size_t>(rank, 1, n);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(rank - 1), v.end());
  return static_cast<double>(v[rank - 1]) / 1e3;
}

std::string json_number(double v, int decimals) {
  if (!std::isfinite(v)) return "null";
  return fmt::format("{:.{}f}", v, decimals);
}

int run_client(const Options& o) {
  signal(SIGPIPE, SIG_IGN);
  const bool throughput = o.test == Test::throughput;
  const std::size_t nconn = o.connections;
  if (nconn > 1) {
    const rlim_t want_fds = nconn + 256;  // one socket per connection, a few of the provider's
    if (const rlim_t fds = raise_fd_limit(want_fds); fds < want_fds) {
      throw UsageError(
          fmt::format("--connections {} needs about {} open files; the limit is {} (ulimit -n)",
                      nconn, want_fds, fds));
    }
  }
  Info info = get_info(o, o.host.c_str(), o.service.c_str(), 0);
  if (o.size > info->ep_attr->max_msg_size) {
    throw UsageError(fmt::format("--size {} exceeds the provider's max_msg_size {}", o.size,
                                 info->ep_attr->max_msg_size));
  }
  if (throughput && o.window + 2 > info->tx_attr->size) {
    throw UsageError(fmt::format("--window {} exceeds the provider's transmit depth {} (max {})",
                                 o.window, info->tx_attr->size, info->tx_attr->size - 2));
  }
  if (info->domain_attr->ep_cnt != 0 && nconn > info->domain_attr->ep_cnt) {
    throw UsageError(fmt::format("--connections {} exceeds the provider's endpoint count {}", nconn,
                                 info->domain_attr->ep_cnt));
  }
  fid_fabric* fabric_raw = nullptr;
  check("fi_fabric", fi_fabric(info->fabric_attr, &fabric_raw, nullptr));
  Fid<fid_fabric> fabric{fabric_raw};

  // Throughput: only control messages come back. Latency: echoes of --size and the report.
  const std::size_t rx_slot = throughput ? CTRL_SLOT : std::max<std::size_t>(o.size, CTRL_SLOT);
  const std::size_t rx_count = throughput ? 16 : 4;
  const std::size_t ctrl_count = 2;
  const std::size_t data_count = throughput ? o.window : 2;
  // One CQ for all connections: room for every operation they can have outstanding.
  const std::size_t cq_size = std::max<std::size_t>(info->tx_attr->size + info->rx_attr->size,
                                                    nconn * (rx_count + ctrl_count + data_count));
  Domain domain(fabric.get(), *info, o.wait_fd, cq_size, 2 * nconn + 16);
  if (!o.quiet) {
    fmt::print(stderr, "raw-libfabric client: {}{}\n", describe(*info, o),
               nconn > 1 ? fmt::format(", {} connections", nconn) : std::string{});
  }

  // Declared after the domain: closed before it.
  std::vector<std::unique_ptr<Link>> links;
  links.reserve(nconn);
  for (std::size_t k = 0; k < nconn; ++k) {
    auto l = std::make_unique<Link>(domain, *info, k);
    l->rx = &l->add_pool(rx_slot, rx_count);
    l->ctrl_tx = &l->add_pool(CTRL_SLOT, ctrl_count);
    l->data_tx = &l->add_pool(o.size, data_count);
    for (std::uint32_t i = 0; i < l->rx->count(); ++i) {
      if (!l->post_recv(*l->rx, i)) throw FabricError("fi_recv", -FI_EAGAIN);
    }
    check(fmt::format("fi_connect({}:{})", o.host, o.service),
          fi_connect(l->ep(), info->dest_addr, nullptr, 0));
    links.push_back(std::move(l));
  }
  const auto link_of = [&](fid_t fid) -> Link* {
    for (auto& l : links) {
      if (l->is(fid)) return l.get();
    }
    return nullptr;
  };
  {
    std::size_t up = 0;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (up < nconn) {
      if (Clock::now() > deadline) {
        throw FabricError(fmt::format(
            "connecting to {}:{}: timed out{}", o.host, o.service,
            nconn > 1 ? fmt::format(" ({} of {} connections up)", up, nconn) : std::string{}));
      }
      const EqEvent ev = read_event(domain.eq(), 50);
      if (!ev.error.empty()) {
        throw FabricError(fmt::format("connecting to {}:{}: {}", o.host, o.service, ev.error));
      }
      if (ev.event == 0) continue;
      Link* l = link_of(ev.fid);
      if (ev.event != FI_CONNECTED || l == nullptr || l->connected) {
        throw FabricError(fmt::format("connecting to {}:{}: unexpected {} (event {})", o.host,
                                      o.service, event_name(ev.event), ev.event));
      }
      l->connected = true;
      ++up;
    }
  }

  std::vector<fi_cq_msg_entry> entries(64);
  std::size_t ready_links = 0;  // READY received
  std::size_t reports = 0;      // REPORT received
  // Connections that may be able to post now (a slot or credits came back), each at most once.
  std::vector<Link*> ready;
  std::vector<Link*> turn;
  ready.reserve(nconn);
  turn.reserve(nconn);
  const auto enqueue = [&](Link& l) {
    if (!l.queued) {
      l.queued = true;
      ready.push_back(&l);
    }
  };
  // Handles one completion that is not a data send; returns the echo header if it was one.
  const auto on_completion = [&](const fi_cq_msg_entry& e) -> std::optional<Header> {
    OpCtx* op = op_of(e);
    Pool& p = *op->pool;
    Link& l = static_cast<Link&>(p.conn());
    const auto i = op->index;
    if ((e.flags & FI_SEND) != 0) {
      p.give(i);
      enqueue(l);
      return std::nullopt;
    }
    if (e.len < HEADER_SIZE) throw ProtocolError(fmt::format("{}-byte message", e.len));
    const Header h = load_header(p.data(i));
    std::optional<Header> echo;
    const Ctrl msg = load_ctrl(p.data(i), e.len);
    switch (h.type) {
      case MSG_READY:
        if (l.rx_depth != 0) throw ProtocolError("a second ready message");
        if (msg.a == 0) throw ProtocolError("ready with no receives posted");
        l.rx_depth = msg.a;
        l.credit_limit = l.rx_depth;
        ++ready_links;
        enqueue(l);
        break;
      case MSG_CREDIT:
        l.credit_limit = std::max(l.credit_limit, l.rx_depth + msg.a);
        enqueue(l);
        break;
      case MSG_REPORT:
        if (l.report) throw ProtocolError("a second report");
        l.report = msg;
        ++reports;
        break;
      case MSG_REFUSE:
        if (msg.a == REFUSE_TOO_LARGE) {
          throw UsageError(
              fmt::format("the server refuses --size {}: its limit is {} bytes", o.size, msg.b));
        }
        throw UsageError(fmt::format("the server refuses the test (reason {})", msg.a));
      case MSG_DATA:
        if (throughput) throw ProtocolError("data message from the server in a throughput test");
        echo = h;
        echo->aux = static_cast<std::uint32_t>(e.len);  // the length, for the check
        break;
      default:
        throw ProtocolError(fmt::format("unexpected message type {:#x}", h.type));
    }
    if (!l.post_recv(p, i)) throw FabricError("fi_recv (repost)", -FI_EAGAIN);
    return echo;
  };
  // Reads the CQ; an error completion throws (it names the connection when there are several).
  const auto poll = [&]() -> std::size_t {
    std::optional<Domain::Error> error;
    const std::size_t n = domain.poll(entries.data(), entries.size(), error);
    if (error) {
      if (nconn > 1 && error->op != nullptr) {
        throw FabricError(fmt::format(
            "connection {}: {}", static_cast<Link&>(error->op->pool->conn()).index, error->text));
      }
      throw FabricError(error->text);
    }
    return n;
  };
  const auto send_ctrl = [&](Link& l, std::uint32_t type, std::uint64_t a, std::uint64_t b,
                             std::uint64_t cc, std::uint64_t d) -> bool {
    if (!l.ctrl_tx->has_free()) return false;
    const auto i = l.ctrl_tx->take();
    write_ctrl(*l.ctrl_tx, i, type, a, b, cc, d);
    if (!l.post_send(*l.ctrl_tx, i, sizeof(Ctrl))) {
      l.ctrl_tx->give(i);
      return false;
    }
    return true;
  };
  // Non-blocking: true if the server shut a connection down; an error event throws.
  const auto server_gone = [&]() -> bool {
    const EqEvent ev = read_event(domain.eq(), 0);
    if (!ev.error.empty()) throw FabricError(ev.error);
    return ev.event == FI_SHUTDOWN;
  };
  const auto until = [&](auto done, std::chrono::seconds limit, const char* what) {
    const auto deadline = Clock::now() + limit;
    while (!done()) {
      const std::size_t n = poll();
      for (std::size_t k = 0; k < n; ++k) {
        if (on_completion(entries[k])) throw ProtocolError("echo outside the test");
      }
      if (n == 0) {
        if (Clock::now() > deadline)
          throw FabricError(fmt::format("timed out waiting for {}", what));
        if (server_gone()) throw FabricError(fmt::format("server disconnected before {}", what));
        domain.wait(50);
      }
    }
  };

  for (auto& l : links) {
    while (!send_ctrl(*l, MSG_START, o.size, throughput ? TEST_THROUGHPUT : TEST_LATENCY,
                      o.rx_depth, o.credits ? 1 : 0)) {
      until([&] { return l->ctrl_tx->has_free(); }, std::chrono::seconds(10), "a send completion");
    }
  }
  until([&] { return ready_links == nconn; }, std::chrono::seconds(10),
        "the server's ready message");
  if (!o.quiet) {
    std::uint64_t lo = links.front()->rx_depth;
    std::uint64_t hi = lo;
    for (const auto& l : links) {
      lo = std::min(lo, l->rx_depth);
      hi = std::max(hi, l->rx_depth);
    }
    fmt::print(stderr, "raw-libfabric client: server posted {} receives{}; {} s of {} at {} B\n",
               lo == hi ? fmt::format("{}", lo) : fmt::format("{} to {}", lo, hi),
               nconn > 1 ? fmt::format(" per connection, {} connections", nconn) : std::string{},
               o.duration, throughput ? "throughput" : "latency", o.size);
  }

  // While nothing completes: notice a server that went away or stopped answering.
  std::uint64_t idle = 0;
  std::optional<Clock::time_point> end_at;
  const auto idle_check = [&] {
    if (!o.wait_fd && (++idle & 0xFFF) != 0) return;
    if (server_gone()) throw FabricError("the server disconnected during the test");
    if (end_at && Clock::now() - *end_at > std::chrono::seconds(30)) {
      throw FabricError("no report from the server within 30 s of the end of the test");
    }
  };

  Result r;
  const auto duration =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration));
  bool echo_ok = true;
  const double cpu0 = cpu_ns();
  const auto t0 = Clock::now();
  const auto deadline = t0 + duration;
  const auto wait_ms = [&](Clock::time_point now) {
    if (now >= deadline) return 50;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
    return static_cast<int>(std::min<std::int64_t>(left, 100));
  };

  if (throughput) {
    bool sending = true;
    const auto has_credit = [&](const Link& l) { return !o.credits || l.posted < l.credit_limit; };
    for (auto& l : links) enqueue(*l);
    while (reports < nconn) {
      // Round robin over the connections that can post: each posts while its window and
      // credits allow (after the deadline: its END).
      if (!ready.empty()) {
        turn.swap(ready);
        for (Link* lp : turn) {
          Link& l = *lp;
          l.queued = false;
          if (sending) {
            while (l.data_tx->has_free() && has_credit(l)) {
              const auto i = l.data_tx->take();
              const Header h{MSG_DATA, 0, l.seq};
              std::memcpy(l.data_tx->data(i), &h, sizeof h);
              if (!l.post_send(*l.data_tx, i, o.size)) {
                l.data_tx->give(i);
                enqueue(l);  // the provider is full: again next turn
                break;
              }
              ++l.seq;
              ++l.posted;
            }
          } else if (!l.end_sent && has_credit(l)) {
            if (send_ctrl(l, MSG_END, l.seq, l.seq * o.size, 0, 0)) {
              l.end_sent = true;
              ++l.posted;
            } else if (l.ctrl_tx->has_free()) {
              enqueue(l);  // the provider is full (else a control send completion queues it)
            }
          }
        }
        turn.clear();
      }
      if (sending && Clock::now() >= deadline) {
        sending = false;
        end_at = Clock::now();
        for (auto& l : links) enqueue(*l);  // time for END
      }
      const std::size_t n = poll();
      for (std::size_t k = 0; k < n; ++k) on_completion(entries[k]);
      if (n == 0 && ready.empty()) {
        // Every connection waits for a completion (slots, credits, the report).
        domain.wait(wait_ms(Clock::now()));
        idle_check();
      }
    }
  } else {
    Link& l = *links.front();
    bool waiting_echo = false;
    Clock::time_point sent_at{};
    r.rtt_ns.reserve(static_cast<std::size_t>(std::min(o.duration * 200000.0, 5e7)));
    while (reports == 0) {
      if (!waiting_echo && !l.end_sent) {
        const auto now = Clock::now();
        if (now >= deadline) {
          if (send_ctrl(l, MSG_END, l.seq, l.seq * o.size, 0, 0)) {
            l.end_sent = true;
            end_at = now;
          }
        } else if (l.data_tx->has_free()) {
          const auto i = l.data_tx->take();
          const Header h{MSG_DATA, 0, l.seq};
          std::memcpy(l.data_tx->data(i), &h, sizeof h);
          sent_at = Clock::now();
          if (l.post_send(*l.data_tx, i, o.size)) {
            waiting_echo = true;
          } else {
            l.data_tx->give(i);
          }
        }
      }
      const std::size_t n = poll();
      for (std::size_t k = 0; k < n; ++k) {
        const auto echo = on_completion(entries[k]);
        if (!echo) continue;
        const auto now = Clock::now();
        if (!waiting_echo) throw ProtocolError("echo without a ping");
        r.rtt_ns.push_back(ns_between(sent_at, now));
        if (echo->seq != l.seq || echo->aux != o.size) echo_ok = false;
        waiting_echo = false;
        ++l.seq;
      }
      if (n == 0 && (waiting_echo || l.end_sent)) {
        domain.wait(100);
        idle_check();
      }
    }
  }
  const auto t1 = Clock::now();
  r.cpu_ns = cpu_ns() - cpu0;
  r.seconds = static_cast<double>(ns_between(t0, t1)) / 1e9;
  r.intact = echo_ok;
  std::size_t bad = 0;
  for (const auto& l : links) {
    const std::uint64_t sent_bytes = l->seq * o.size;
    r.messages += l->seq;
    r.bytes += sent_bytes;
    const Ctrl& rep = *l->report;
    r.server_cpu_ns = std::max(r.server_cpu_ns, rep.d);
    const bool in_order = rep.c == 1;
    if (rep.a == l->seq && rep.b == sent_bytes && in_order) continue;
    r.intact = false;
    if (++bad > 4) continue;
    r.problem += fmt::format(
        "{}{}sent {} messages / {} bytes, server received {} / {}{}", r.problem.empty() ? "" : "; ",
        nconn > 1 ? fmt::format("connection {}: ", l->index) : std::string{}, l->seq, sent_bytes,
        rep.a, rep.b, in_order ? "" : ", out of order at the server");
  }
  if (bad > 4) r.problem += fmt::format("; {} more connections", bad - 4);
  if (!echo_ok) {
    r.problem += fmt::format("{}wrong echo (sequence or size)", r.problem.empty() ? "" : ", ");
  }
  for (const auto& l : links) check("fi_shutdown", fi_shutdown(l->ep(), 0));

  const double msgs_per_s = static_cast<double>(r.messages) / r.seconds;
  const double bytes_per_s = static_cast<double>(r.bytes) / r.seconds;
  const double gbit = bytes_per_s * 8 / 1e9;
  const double cpu_per_msg = r.messages != 0 ? r.cpu_ns / static_cast<double>(r.messages) : NAN;
  const double server_cpu_per_msg =
      r.messages != 0 ? static_cast<double>(r.server_cpu_ns) / static_cast<double>(r.messages)
                      : NAN;
  double p50 = NAN;
  double p99 = NAN;
  double p999 = NAN;
  if (!throughput) {
    p50 = percentile_us(r.rtt_ns, 0.50);
    p99 = percentile_us(r.rtt_ns, 0.99);
    p999 = percentile_us(r.rtt_ns, 0.999);
  }
  const std::string prov = info->fabric_attr->prov_name;
  const char* wait_name = o.wait_fd ? "fd" : "spin";
  if (throughput) {
    fmt::print(
        "raw-libfabric {} throughput {} B{}: {:.0f} msg/s, {:.1f} MB/s, {:.2f} Gbit/s, cpu {:.2f} "
        "us/msg, server cpu {:.2f} us/msg, wait {}, {} msgs in {:.3f} s, {}\n",
        prov, o.size, nconn > 1 ? fmt::format(", {} connections", nconn) : std::string{},
        msgs_per_s, bytes_per_s / 1e6, gbit, cpu_per_msg / 1e3, server_cpu_per_msg / 1e3, wait_name,
        r.messages, r.seconds, r.intact ? "intact" : "NOT INTACT");
  } else {
    fmt::print(
        "raw-libfabric {} latency {} B: round trip p50 {:.2f} us, p99 {:.2f} us, p99.9 {:.2f} us, "
        "{:.0f} round trips/s, cpu {:.2f} us/msg, server cpu {:.2f} us/msg, wait {}, {} msgs in "
        "{:.3f} s, {}\n",
        prov, o.size, p50, p99, p999, msgs_per_s, cpu_per_msg / 1e3, server_cpu_per_msg / 1e3,
        wait_name, r.messages, r.seconds, r.intact ? "intact" : "NOT INTACT");
  }
  std::fflush(stdout);
  if (!r.intact) fmt::print(stderr, "raw-libfabric client: NOT INTACT: {}\n", r.problem);
  if (!o.quiet && o.wait_fd) {
    fmt::print(stderr, "raw-libfabric client: {} fd waits\n", domain.sleeps());
  }

  if (!o.json.empty()) {
    const std::string mode = prov == "verbs" ? "rdma" : "tcp";
    const std::string line = fmt::format(
        "{{\"tool\":\"raw-libfabric\",\"backend\":\"libfabric\",\"mode\":{},\"send\":\"raw\","
        "\"test\":\"{}\",\"size\":{},\"connections\":{},\"threads\":1,\"duration_s\":{},"
        "\"messages\":{},\"bytes\":{},\"msgs_per_s\":{},\"bytes_per_s\":{},\"gbit_per_s\":{},"
        "\"cpu_ns_per_msg\":{},\"server_cpu_ns_per_msg\":{},\"p50_us\":{},\"p99_us\":{},"
        "\"p999_us\":{},\"intact\":{},\"wait\":\"{}\",\"provider\":{}}}\n",
        json_string(mode), throughput ? "throughput" : "latency", o.size, nconn,
        json_number(r.seconds, 6), r.messages, r.bytes, json_number(msgs_per_s, 3),
        json_number(bytes_per_s, 3), json_number(gbit, 6), json_number(cpu_per_msg, 3),
        json_number(server_cpu_per_msg, 3), json_number(p50, 3), json_number(p99, 3),
        json_number(p999, 3), r.intact ? "true" : "false", wait_name, json_string(prov));
    std::FILE* f = std::fopen(o.json.c_str(), "a");
    if (f == nullptr) {
      fmt::print(stderr, "raw-libfabric client: cannot open {}: {}\n", o.json,
                 std::strerror(errno));
      return EXIT_FABRIC;
    }
    const bool ok = std::fputs(line.c_str(), f) >= 0;
    if (std::fclose(f) != 0 || !ok) {
      fmt::print(stderr, "raw-libfabric client: cannot write {}\n", o.json);
      return EXIT_FABRIC;
    }
  }
  return r.intact ? 0 : EXIT_LOST;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse_options(argc, argv);
  } catch (const UsageError& e) {
    fmt::print(stderr, "netio3-raw-fabric: {}\n{}", e.what(), USAGE);
    return EXIT_USAGE;
  }
  int rc = 0;
  try {
    rc = o.role == Role::server ? run_server(o) : run_client(o);
  } catch (const UsageError& e) {
    fmt::print(stderr, "netio3-raw-fabric: {}\n", e.what());
    return EXIT_USAGE;
  } catch (const ProtocolError& e) {
    fmt::print(stderr, "netio3-raw-fabric: protocol error: {}\n", e.what());
    return EXIT_LOST;
  } catch (const FabricError& e) {
    fmt::print(stderr, "netio3-raw-fabric: {}\n", e.what());
    return EXIT_FABRIC;
  } catch (const std::exception& e) {
    fmt::print(stderr, "netio3-raw-fabric: {}\n", e.what());
    return EXIT_FABRIC;
  }
  if (g_close_failed && rc == 0) rc = EXIT_FABRIC;
  return rc;
}
