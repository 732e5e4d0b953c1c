// netio3-raw-fabric: the raw libfabric reference that bench/compare runs next to netio3-perf.
//
// The same measurement as netio3-perf (message throughput with a window of outstanding
// sends, ping-pong round-trip latency), written directly against libfabric: FI_EP_MSG
// endpoints, FI_MSG, plain fi_send/fi_recv from registered buffers, one completion queue per
// endpoint, read by busy polling (default) or by waiting on its FI_WAIT_FD fd with
// fi_trywait + epoll the way an event-loop library does (--wait fd).
//
// Wire protocol (both processes on the same host architecture; fields in host byte order):
// every message starts with a 16-byte header {type, aux, seq}. Data messages are exactly
// --size bytes (header included). Control messages (start, ready, credit, end, report,
// refuse) are 48 bytes: the header plus four 64-bit fields.
//
//   client                                server
//   START{size, test, rx_depth, credits} ->      posts rx_depth receives of max(size, 64) B
//                                        <- READY{rx_depth posted}
//   DATA{seq 0, 1, 2, ...} ...           ->      counts, checks the order; throughput:
//                                        <- CREDIT{consumed}   reposts each buffer at
//                                                once and returns credits in batches;
//                                                latency: echoes each message (same size)
//   END{messages, bytes}                 ->
//                                        <- REPORT{messages, bytes, in_order}
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
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

namespace {

constexpr std::uint32_t API_VERSION = FI_VERSION(1, 9);

constexpr int EXIT_LOST = 1;
constexpr int EXIT_USAGE = 2;
constexpr int EXIT_FABRIC = 3;

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

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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

using Clock = std::chrono::steady_clock;

std::int64_t ns_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

double cpu_ns() {
  rusage ru{};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
  const auto tv_ns = [](const timeval& tv) {
    return static_cast<double>(tv.tv_sec) * 1e9 + static_cast<double>(tv.tv_usec) * 1e3;
  };
  return tv_ns(ru.ru_utime) + tv_ns(ru.ru_stime);
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
    "                    --duration SECONDS [--window N (2 MiB worth, 8..64)] [--rx-depth N "
    "(2*window)]\n"
    "                    [--credits on|off] [--provider tcp] [--wait spin|fd]\n"
    "                    [--progress manual|auto] [--json FILE] [--quiet]\n"
    "exit status: 0 every message arrived in order, 1 not, 2 bad options, 3 libfabric error\n";

std::uint64_t parse_u64(std::string_view name, std::string_view text) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || text.empty()) {
    throw UsageError(fmt::format("{}: '{}' is not a non-negative integer", name, text));
  }
  return v;
}

double parse_double(std::string_view name, std::string_view text) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || text.empty() || !std::isfinite(v)) {
    throw UsageError(fmt::format("{}: '{}' is not a number", name, text));
  }
  return v;
}

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

// Waits for one connection-management event; 0 when the timeout passed first.
std::uint32_t eq_event(fid_eq* eq, fi_eq_cm_entry& entry, int timeout_ms) {
  std::uint32_t event = 0;
  const ssize_t rd = timeout_ms == 0 ? fi_eq_read(eq, &event, &entry, sizeof entry, 0)
                                     : fi_eq_sread(eq, &event, &entry, sizeof entry, timeout_ms, 0);
  if (rd == -FI_EAGAIN || rd == -FI_ETIMEDOUT || rd == -FI_EINTR) return 0;
  if (rd == -FI_EAVAIL) {
    fi_eq_err_entry err{};
    const ssize_t er = fi_eq_readerr(eq, &err, 0);
    if (er < 0) throw FabricError("fi_eq_readerr", er);
    const char* detail = err.prov_errno != 0
                             ? fi_eq_strerror(eq, err.prov_errno, err.err_data, nullptr, 0)
                             : nullptr;
    throw FabricError(fmt::format("connection event: {} ({}){}{}", fi_strerror(err.err), -err.err,
                                  detail != nullptr ? "; provider: " : "",
                                  detail != nullptr ? detail : ""));
  }
  if (rd < 0) throw FabricError(timeout_ms == 0 ? "fi_eq_read" : "fi_eq_sread", rd);
  if (static_cast<std::size_t>(rd) < sizeof(fid_t)) {
    throw FabricError(fmt::format("fi_eq_read returned a short entry ({} bytes)", rd));
  }
  return event;
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
struct OpCtx {
  fi_context2 fctx;
  Pool* pool;
  std::uint32_t index;
};

// A registered region of `count` slots of `slot_size` bytes, with a free list.
class Pool {
 public:
  Pool(std::size_t slot_size, std::size_t count)
      : m_slot{slot_size}, m_stride{(slot_size + 63) / 64 * 64}, m_count{count}, m_ctx(count) {
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

  void register_memory(fid_domain* domain, fid_ep* ep, const fi_info& info,
                       std::uint64_t& next_key) {
    const std::uint64_t mr_mode = info.domain_attr->mr_mode;
    const std::uint64_t key = (mr_mode & FI_MR_PROV_KEY) != 0 ? 0 : next_key++;
    fid_mr* mr = nullptr;
    check("fi_mr_reg",
          fi_mr_reg(domain, m_mem.get(), m_bytes, FI_SEND | FI_RECV, 0, key, 0, &mr, nullptr));
    m_mr.reset(mr);
    if ((mr_mode & FI_MR_ENDPOINT) != 0) {
      check("fi_mr_bind(endpoint)", fi_mr_bind(mr, &ep->fid, 0));
      check("fi_mr_enable", fi_mr_enable(mr));
    }
    m_desc = fi_mr_desc(mr);
  }

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

// One connected (or connecting) endpoint with its own domain, event queue and completion
// queue. Members are closed in reverse order: endpoint, memory regions, CQ, EQ, domain.
class Conn {
 public:
  Conn(fid_fabric* fabric, fi_info& info, bool wait_fd)
      : m_fabric{fabric}, m_info{info}, m_wait_fd{wait_fd} {
    fid_domain* domain = nullptr;
    check("fi_domain", fi_domain(fabric, &info, &domain, nullptr));
    m_domain.reset(domain);

    fi_eq_attr eq_attr{};
    eq_attr.size = 16;
    eq_attr.wait_obj = FI_WAIT_UNSPEC;
    fid_eq* eq = nullptr;
    check("fi_eq_open", fi_eq_open(fabric, &eq_attr, &eq, nullptr));
    m_eq.reset(eq);

    fi_cq_attr cq_attr{};
    cq_attr.size = info.tx_attr->size + info.rx_attr->size;
    cq_attr.format = FI_CQ_FORMAT_MSG;
    cq_attr.wait_obj = wait_fd ? FI_WAIT_FD : FI_WAIT_NONE;
    fid_cq* cq = nullptr;
    check("fi_cq_open", fi_cq_open(domain, &cq_attr, &cq, nullptr));
    m_cq.reset(cq);

    fid_ep* ep = nullptr;
    check("fi_endpoint", fi_endpoint(domain, &info, &ep, nullptr));
    m_ep.reset(ep);
    check("fi_ep_bind(eq)", fi_ep_bind(ep, &eq->fid, 0));
    check("fi_ep_bind(cq)", fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
    check("fi_enable", fi_enable(ep));

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
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  fid_ep* ep() const { return m_ep.get(); }
  fid_eq* eq() const { return m_eq.get(); }

  Pool& add_pool(std::size_t slot_size, std::size_t count) {
    m_pools.push_back(std::make_unique<Pool>(slot_size, count));
    m_pools.back()->register_memory(m_domain.get(), m_ep.get(), m_info, m_next_key);
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

  // Reads up to `n` completions; 0 when there are none. An error completion throws.
  std::size_t poll(fi_cq_msg_entry* out, std::size_t n) {
    const ssize_t rd = fi_cq_read(m_cq.get(), out, n);
    if (rd > 0) return static_cast<std::size_t>(rd);
    if (rd == -FI_EAGAIN) return 0;
    if (rd == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      const ssize_t er = fi_cq_readerr(m_cq.get(), &err, 0);
      if (er < 0) throw FabricError("fi_cq_readerr", er);
      const char* detail =
          err.prov_errno != 0 ? fi_cq_strerror(m_cq.get(), err.prov_errno, err.err_data, nullptr, 0)
                              : nullptr;
      throw FabricError(fmt::format("{} completion: {} ({}){}{}",
                                    (err.flags & FI_SEND) != 0   ? "send"
                                    : (err.flags & FI_RECV) != 0 ? "receive"
                                                                 : "a",
                                    fi_strerror(err.err), -err.err,
                                    detail != nullptr ? "; provider: " : "",
                                    detail != nullptr ? detail : ""));
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

  // Waits for `want` on the endpoint's EQ (an error event throws); false on timeout/stop.
  bool wait_event(std::uint32_t want, int timeout_ms) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < deadline && g_stop == 0) {
      fi_eq_cm_entry entry{};
      const auto ev = eq_event(m_eq.get(), entry, 50);
      if (ev == 0) continue;
      if (ev == want) return true;
      throw FabricError(fmt::format("unexpected {} (event {}) while waiting for {}", event_name(ev),
                                    ev, event_name(want)));
    }
    return false;
  }

  // Non-blocking: true if the peer shut the connection down.
  bool peer_gone() {
    fi_eq_cm_entry entry{};
    const auto ev = eq_event(m_eq.get(), entry, 0);
    return ev == FI_SHUTDOWN;
  }

 private:
  fid_fabric* m_fabric;
  fi_info& m_info;
  bool m_wait_fd;
  std::uint64_t m_next_key = 1;
  std::uint64_t m_sleeps = 0;
  Fd m_epoll;
  Fid<fid_domain> m_domain;
  Fid<fid_eq> m_eq;
  Fid<fid_cq> m_cq;
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

// Serves one client; returns normally when it is done or went away.
void serve_client(fid_fabric* fabric, fid_pep* pep, fi_info& info, const Options& o) {
  std::unique_ptr<Conn> conn;
  Pool* start_rx = nullptr;
  Pool* ctrl_tx = nullptr;
  try {
    conn = std::make_unique<Conn>(fabric, info, o.wait_fd);
    start_rx = &conn->add_pool(CTRL_SLOT, 1);
    ctrl_tx = &conn->add_pool(CTRL_SLOT, 8);
    if (!conn->post_recv(*start_rx, 0)) throw FabricError("fi_recv", -FI_EAGAIN);
  } catch (...) {
    const int rc = fi_reject(pep, info.handle, nullptr, 0);
    if (rc != 0) fmt::print(stderr, "raw-libfabric: fi_reject failed: {}\n", fi_strerror(-rc));
    throw;
  }
  Conn& c = *conn;
  check("fi_accept", fi_accept(c.ep(), nullptr, 0));
  if (!c.wait_event(FI_CONNECTED, 10000)) {
    if (g_stop == 0) fmt::print(stderr, "raw-libfabric: client did not complete the connection\n");
    return;
  }
  if (!o.quiet) fmt::print(stderr, "raw-libfabric server: client connected\n");

  enum class State { start, running, closing, done } state = State::start;
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
  std::optional<std::uint32_t> final_slot;  // the REPORT/REFUSE send; done when it completes
  std::optional<Ctrl> final_msg;            // waiting for a free control slot
  std::deque<PendingOp> pending;
  std::uint64_t idle = 0;
  const auto start_time = Clock::now();

  const auto repost = [&](Pool& p, std::uint32_t i) {
    if (!pending.empty() || !c.post_recv(p, i)) {
      pending.push_back({false, &p, i, 0});
    } else if (&p == data_rx) {
      ++consumed;
    }
  };
  const auto send_ctrl = [&](const Ctrl& msg) -> std::optional<std::uint32_t> {
    if (!ctrl_tx->has_free()) return std::nullopt;
    const auto i = ctrl_tx->take();
    std::memcpy(ctrl_tx->data(i), &msg, sizeof msg);
    if (!pending.empty() || !c.post_send(*ctrl_tx, i, sizeof msg)) {
      pending.push_back({true, ctrl_tx, i, sizeof msg});
    }
    return i;
  };
  const auto finish = [&](std::uint32_t type, std::uint64_t a, std::uint64_t b, std::uint64_t cc) {
    Ctrl msg{};
    msg.h.type = type;
    msg.a = a;
    msg.b = b;
    msg.c = cc;
    final_msg = msg;
    state = State::closing;
  };

  std::vector<fi_cq_msg_entry> entries(64);
  while (state != State::done) {
    if (g_stop != 0) return;
    const std::size_t n = c.poll(entries.data(), entries.size());
    for (std::size_t k = 0; k < n; ++k) {
      const auto& e = entries[k];
      OpCtx* op = op_of(e);
      Pool& p = *op->pool;
      const std::uint32_t i = op->index;
      if ((e.flags & FI_RECV) != 0) {
        if (e.len < HEADER_SIZE) throw ProtocolError(fmt::format("{}-byte message", e.len));
        const Header h = load_header(p.data(i));
        if (h.type == MSG_DATA && state == State::running) {
          ++messages;
          bytes += e.len;
          if (h.seq != next_seq) in_order = false;
          next_seq = h.seq + 1;
          if (latency) {
            if (!pending.empty() || !c.post_send(p, i, e.len)) {
              pending.push_back({true, &p, i, e.len});
            }
          } else {
            repost(p, i);
          }
        } else if (h.type == MSG_START && state == State::start) {
          const Ctrl s = load_ctrl(p.data(i), e.len);
          size = s.a;
          latency = s.b == TEST_LATENCY;
          credits = s.d != 0 && !latency;
          if (s.b != TEST_LATENCY && s.b != TEST_THROUGHPUT) {
            finish(MSG_REFUSE, REFUSE_BAD_TEST, o.max_size, 0);
          } else if (size > o.max_size || size > info.ep_attr->max_msg_size) {
            finish(MSG_REFUSE, REFUSE_TOO_LARGE, std::min(o.max_size, info.ep_attr->max_msg_size),
                   0);
          } else if (size < HEADER_SIZE) {
            finish(MSG_REFUSE, REFUSE_TOO_SMALL, HEADER_SIZE, 0);
          } else {
            const std::uint64_t depth =
                std::max<std::uint64_t>(1, std::min<std::uint64_t>(s.c, info.rx_attr->size));
            batch = std::max<std::uint64_t>(1, depth / 4);
            data_rx = &c.add_pool(std::max<std::size_t>(size, CTRL_SLOT), depth);
            for (std::uint32_t j = 0; j < depth; ++j) {
              if (!c.post_recv(*data_rx, j)) throw FabricError("fi_recv", -FI_EAGAIN);
            }
            Ctrl ready{};
            ready.h.type = MSG_READY;
            ready.a = depth;
            ready.b = o.max_size;
            if (!send_ctrl(ready)) throw FabricError("no control buffer for READY");
            state = State::running;
            if (!o.quiet) {
              fmt::print(stderr, "raw-libfabric server: {} test, {} B, {} receives posted{}\n",
                         latency ? "latency" : "throughput", size, depth,
                         credits ? ", credits" : ", no credits");
            }
          }
        } else if (h.type == MSG_END && state == State::running) {
          const Ctrl end = load_ctrl(p.data(i), e.len);
          client_messages = end.a;
          client_bytes = end.b;
          repost(p, i);
          finish(MSG_REPORT, messages, bytes, in_order ? 1 : 0);
        } else {
          throw ProtocolError(
              fmt::format("unexpected message type {:#x} ({} bytes)", h.type, e.len));
        }
      } else if ((e.flags & FI_SEND) != 0) {
        if (&p == ctrl_tx) {
          ctrl_tx->give(i);
          if (final_slot && *final_slot == i) state = State::done;
        } else {
          repost(p, i);  // an echo went out: the buffer takes the next message
        }
      }
    }
    // Operations the provider could not take yet, in order.
    while (!pending.empty()) {
      const auto op = pending.front();
      const bool ok =
          op.send ? c.post_send(*op.pool, op.index, op.len) : c.post_recv(*op.pool, op.index);
      if (!ok) break;
      if (!op.send && op.pool == data_rx) ++consumed;
      pending.pop_front();
    }
    if (state == State::closing && final_msg && !final_slot) {
      final_slot = send_ctrl(*final_msg);
    }
    if (credits && state == State::running && consumed - credited >= batch && ctrl_tx->has_free()) {
      Ctrl credit{};
      credit.h.type = MSG_CREDIT;
      credit.a = consumed;
      send_ctrl(credit);
      credited = consumed;
    }
    if (n == 0) {
      // Nothing to do: look for a client that went away (and sleep in --wait fd).
      if (o.wait_fd) c.wait(100);
      if (o.wait_fd || (++idle & 0xFFF) == 0) {
        if (c.peer_gone()) throw ProtocolError("client disconnected during the test");
        if (state == State::start && Clock::now() - start_time > std::chrono::seconds(10)) {
          throw ProtocolError("client sent no start message within 10 s");
        }
      }
    }
  }
  if (!o.quiet) {
    if (client_messages != 0 || messages != 0) {
      fmt::print(stderr,
                 "raw-libfabric server: client done: received {} messages, {} bytes (client sent "
                 "{}, {}), {}\n",
                 messages, bytes, client_messages, client_bytes,
                 in_order ? "in order" : "OUT OF ORDER");
    } else {
      fmt::print(stderr, "raw-libfabric server: refused the client's test\n");
    }
  }
  // The client shuts down after the report; wait (a little) for that before closing.
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline && g_stop == 0) {
    try {
      if (c.poll(entries.data(), entries.size()) == 0 && c.peer_gone()) break;
    } catch (const FabricError&) {
      break;  // the connection is going away
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

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

  Info info = get_info(o, o.bind.c_str(), o.port.c_str(), FI_SOURCE);
  fid_fabric* fabric_raw = nullptr;
  check("fi_fabric", fi_fabric(info->fabric_attr, &fabric_raw, nullptr));
  Fid<fid_fabric> fabric{fabric_raw};
  if (o.wait_fd) {
    // Find out now, not at the first client, whether the provider's CQ has a wait fd.
    fid_domain* domain_raw = nullptr;
    check("fi_domain", fi_domain(fabric.get(), info.get(), &domain_raw, nullptr));
    Fid<fid_domain> domain{domain_raw};
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_MSG;
    cq_attr.wait_obj = FI_WAIT_FD;
    fid_cq* cq_raw = nullptr;
    check("fi_cq_open(FI_WAIT_FD)", fi_cq_open(domain.get(), &cq_attr, &cq_raw, nullptr));
    Fid<fid_cq> cq{cq_raw};
    int fd = -1;
    const int rc = fi_control(&cq->fid, FI_GETWAIT, &fd);
    if (rc != 0) {
      throw FabricError(fmt::format(
          "fi_control(completion queue, FI_GETWAIT) failed: {} ({}); provider '{}' has no "
          "pollable wait fd, use --wait spin",
          fi_strerror(-rc), rc, o.provider));
    }
  }
  fi_eq_attr eq_attr{};
  eq_attr.size = 64;
  eq_attr.wait_obj = FI_WAIT_UNSPEC;
  fid_eq* eq_raw = nullptr;
  check("fi_eq_open", fi_eq_open(fabric.get(), &eq_attr, &eq_raw, nullptr));
  Fid<fid_eq> eq{eq_raw};
  fid_pep* pep_raw = nullptr;
  check("fi_passive_ep", fi_passive_ep(fabric.get(), info.get(), &pep_raw, nullptr));
  Fid<fid_pep> pep{pep_raw};
  check("fi_pep_bind", fi_pep_bind(pep.get(), &eq->fid, 0));
  check("fi_listen", fi_listen(pep.get()));
  sockaddr_storage ss{};
  std::size_t len = sizeof ss;
  check("fi_getname", fi_getname(&pep->fid, &ss, &len));
  if (!o.quiet) fmt::print(stderr, "raw-libfabric server: {}\n", describe(*info, o));
  fmt::print("listening on {}\n", address_string(ss));
  std::fflush(stdout);

  while (g_stop == 0) {
    fi_eq_cm_entry entry{};
    const auto ev = eq_event(eq.get(), entry, 200);
    if (ev == 0) continue;
    if (ev != FI_CONNREQ) {
      fmt::print(stderr, "raw-libfabric server: ignoring {} on the listener\n", event_name(ev));
      continue;
    }
    Info client{entry.info};
    try {
      serve_client(fabric.get(), pep.get(), *client, o);
    } catch (const FabricError& e) {
      fmt::print(stderr, "raw-libfabric server: client session failed: {}\n", e.what());
    } catch (const ProtocolError& e) {
      fmt::print(stderr, "raw-libfabric server: client session aborted: {}\n", e.what());
    }
  }
  if (!o.quiet) fmt::print(stderr, "raw-libfabric server: stopping\n");
  return 0;
}

// ---------------------------------------------------------------------------------------
// Client

struct Result {
  std::uint64_t messages = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  double cpu_ns = 0;
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

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(ch));
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

int run_client(const Options& o) {
  signal(SIGPIPE, SIG_IGN);
  const bool throughput = o.test == Test::throughput;
  Info info = get_info(o, o.host.c_str(), o.service.c_str(), 0);
  if (o.size > info->ep_attr->max_msg_size) {
    throw UsageError(fmt::format("--size {} exceeds the provider's max_msg_size {}", o.size,
                                 info->ep_attr->max_msg_size));
  }
  if (throughput && o.window + 2 > info->tx_attr->size) {
    throw UsageError(fmt::format("--window {} exceeds the provider's transmit depth {} (max {})",
                                 o.window, info->tx_attr->size, info->tx_attr->size - 2));
  }
  fid_fabric* fabric_raw = nullptr;
  check("fi_fabric", fi_fabric(info->fabric_attr, &fabric_raw, nullptr));
  Fid<fid_fabric> fabric{fabric_raw};
  Conn c(fabric.get(), *info, o.wait_fd);
  if (!o.quiet) fmt::print(stderr, "raw-libfabric client: {}\n", describe(*info, o));

  // Throughput: only control messages come back. Latency: echoes of --size and the report.
  Pool& rx = c.add_pool(throughput ? CTRL_SLOT : std::max<std::size_t>(o.size, CTRL_SLOT),
                        throughput ? 16 : 4);
  Pool& ctrl_tx = c.add_pool(CTRL_SLOT, 2);
  Pool& data_tx = c.add_pool(o.size, throughput ? o.window : 2);
  for (std::uint32_t i = 0; i < rx.count(); ++i) {
    if (!c.post_recv(rx, i)) throw FabricError("fi_recv", -FI_EAGAIN);
  }
  check(fmt::format("fi_connect({}:{})", o.host, o.service),
        fi_connect(c.ep(), info->dest_addr, nullptr, 0));
  try {
    if (!c.wait_event(FI_CONNECTED, 10000)) throw FabricError("timed out");
  } catch (const FabricError& e) {
    throw FabricError(fmt::format("connecting to {}:{}: {}", o.host, o.service, e.what()));
  }

  std::vector<fi_cq_msg_entry> entries(64);
  std::optional<Ctrl> report;
  std::uint64_t credit_limit = 0;  // total messages (data + END) the server can take
  std::uint64_t rx_depth = 0;
  // Handles one completion that is not a data send; returns the echo header if it was one.
  const auto on_completion = [&](const fi_cq_msg_entry& e) -> std::optional<Header> {
    OpCtx* op = op_of(e);
    Pool& p = *op->pool;
    const auto i = op->index;
    if ((e.flags & FI_SEND) != 0) {
      p.give(i);
      return std::nullopt;
    }
    if (e.len < HEADER_SIZE) throw ProtocolError(fmt::format("{}-byte message", e.len));
    const Header h = load_header(p.data(i));
    std::optional<Header> echo;
    const Ctrl msg = load_ctrl(p.data(i), e.len);
    switch (h.type) {
      case MSG_READY:
        rx_depth = msg.a;
        credit_limit = rx_depth;
        break;
      case MSG_CREDIT:
        credit_limit = std::max(credit_limit, rx_depth + msg.a);
        break;
      case MSG_REPORT:
        report = msg;
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
    if (!c.post_recv(p, i)) throw FabricError("fi_recv (repost)", -FI_EAGAIN);
    return echo;
  };
  const auto send_ctrl = [&](std::uint32_t type, std::uint64_t a, std::uint64_t b, std::uint64_t cc,
                             std::uint64_t d) -> bool {
    if (!ctrl_tx.has_free()) return false;
    const auto i = ctrl_tx.take();
    write_ctrl(ctrl_tx, i, type, a, b, cc, d);
    if (!c.post_send(ctrl_tx, i, sizeof(Ctrl))) {
      ctrl_tx.give(i);
      return false;
    }
    return true;
  };
  const auto until = [&](auto done, std::chrono::seconds limit, const char* what) {
    const auto deadline = Clock::now() + limit;
    while (!done()) {
      const std::size_t n = c.poll(entries.data(), entries.size());
      for (std::size_t k = 0; k < n; ++k) {
        if (on_completion(entries[k])) throw ProtocolError("echo outside the test");
      }
      if (n == 0) {
        if (Clock::now() > deadline)
          throw FabricError(fmt::format("timed out waiting for {}", what));
        if (c.peer_gone()) throw FabricError(fmt::format("server disconnected before {}", what));
        c.wait(50);
      }
    }
  };

  while (!send_ctrl(MSG_START, o.size, throughput ? TEST_THROUGHPUT : TEST_LATENCY, o.rx_depth,
                    o.credits ? 1 : 0)) {
    until([&] { return ctrl_tx.has_free(); }, std::chrono::seconds(10), "a send completion");
  }
  until([&] { return rx_depth != 0; }, std::chrono::seconds(10), "the server's ready message");
  if (!o.quiet) {
    fmt::print(stderr, "raw-libfabric client: server posted {} receives; {} s of {} at {} B\n",
               rx_depth, o.duration, throughput ? "throughput" : "latency", o.size);
  }

  // While nothing completes: notice a server that went away or stopped answering.
  std::uint64_t idle = 0;
  std::optional<Clock::time_point> end_at;
  const auto idle_check = [&] {
    if (!o.wait_fd && (++idle & 0xFFF) != 0) return;
    if (c.peer_gone()) throw FabricError("the server disconnected during the test");
    if (end_at && Clock::now() - *end_at > std::chrono::seconds(30)) {
      throw FabricError("no report from the server within 30 s of the end of the test");
    }
  };

  Result r;
  const auto duration =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration));
  std::uint64_t seq = 0;
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
    std::uint64_t posted = 0;  // data + END, against credit_limit
    bool sending = true;
    bool end_sent = false;
    const auto has_credit = [&] { return !o.credits || posted < credit_limit; };
    while (!report) {
      if (sending) {
        while (data_tx.has_free() && has_credit()) {
          const auto i = data_tx.take();
          const Header h{MSG_DATA, 0, seq};
          std::memcpy(data_tx.data(i), &h, sizeof h);
          if (!c.post_send(data_tx, i, o.size)) {
            data_tx.give(i);
            break;
          }
          ++seq;
          ++posted;
        }
        if (Clock::now() >= deadline) sending = false;
      }
      if (!sending && !end_sent && has_credit()) {
        if (send_ctrl(MSG_END, seq, seq * o.size, 0, 0)) {
          end_sent = true;
          end_at = Clock::now();
          ++posted;
        }
      }
      const std::size_t n = c.poll(entries.data(), entries.size());
      for (std::size_t k = 0; k < n; ++k) on_completion(entries[k]);
      if (n == 0) {
        const bool blocked = !sending || !data_tx.has_free() || !has_credit();
        if (blocked) {
          c.wait(wait_ms(Clock::now()));
          idle_check();
        }
      }
    }
  } else {
    bool waiting_echo = false;
    Clock::time_point sent_at{};
    bool end_sent = false;
    r.rtt_ns.reserve(static_cast<std::size_t>(std::min(o.duration * 200000.0, 5e7)));
    while (!report) {
      if (!waiting_echo && !end_sent) {
        const auto now = Clock::now();
        if (now >= deadline) {
          if (send_ctrl(MSG_END, seq, seq * o.size, 0, 0)) {
            end_sent = true;
            end_at = now;
          }
        } else if (data_tx.has_free()) {
          const auto i = data_tx.take();
          const Header h{MSG_DATA, 0, seq};
          std::memcpy(data_tx.data(i), &h, sizeof h);
          sent_at = Clock::now();
          if (c.post_send(data_tx, i, o.size)) {
            waiting_echo = true;
          } else {
            data_tx.give(i);
          }
        }
      }
      const std::size_t n = c.poll(entries.data(), entries.size());
      for (std::size_t k = 0; k < n; ++k) {
        const auto echo = on_completion(entries[k]);
        if (!echo) continue;
        const auto now = Clock::now();
        if (!waiting_echo) throw ProtocolError("echo without a ping");
        r.rtt_ns.push_back(ns_between(sent_at, now));
        if (echo->seq != seq || echo->aux != o.size) echo_ok = false;
        waiting_echo = false;
        ++seq;
      }
      if (n == 0 && (waiting_echo || end_sent)) {
        c.wait(100);
        idle_check();
      }
    }
  }
  const auto t1 = Clock::now();
  r.cpu_ns = cpu_ns() - cpu0;
  r.seconds = static_cast<double>(ns_between(t0, t1)) / 1e9;
  r.messages = seq;
  r.bytes = seq * o.size;
  const std::uint64_t got_messages = report->a;
  const std::uint64_t got_bytes = report->b;
  const bool got_in_order = report->c == 1;
  r.intact = got_messages == r.messages && got_bytes == r.bytes && got_in_order && echo_ok;
  if (!r.intact) {
    r.problem =
        fmt::format("sent {} messages / {} bytes, server received {} / {}{}{}", r.messages, r.bytes,
                    got_messages, got_bytes, got_in_order ? "" : ", out of order at the server",
                    echo_ok ? "" : ", wrong echo (sequence or size)");
  }
  check("fi_shutdown", fi_shutdown(c.ep(), 0));

  const double msgs_per_s = static_cast<double>(r.messages) / r.seconds;
  const double bytes_per_s = static_cast<double>(r.bytes) / r.seconds;
  const double gbit = bytes_per_s * 8 / 1e9;
  const double cpu_per_msg = r.messages != 0 ? r.cpu_ns / static_cast<double>(r.messages) : NAN;
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
        "raw-libfabric {} throughput {} B: {:.0f} msg/s, {:.1f} MB/s, {:.2f} Gbit/s, cpu {:.2f} "
        "us/msg, wait {}, {} msgs in {:.3f} s, {}\n",
        prov, o.size, msgs_per_s, bytes_per_s / 1e6, gbit, cpu_per_msg / 1e3, wait_name, r.messages,
        r.seconds, r.intact ? "intact" : "NOT INTACT");
  } else {
    fmt::print(
        "raw-libfabric {} latency {} B: round trip p50 {:.2f} us, p99 {:.2f} us, p99.9 {:.2f} us, "
        "{:.0f} round trips/s, cpu {:.2f} us/msg, wait {}, {} msgs in {:.3f} s, {}\n",
        prov, o.size, p50, p99, p999, msgs_per_s, cpu_per_msg / 1e3, wait_name, r.messages,
        r.seconds, r.intact ? "intact" : "NOT INTACT");
  }
  std::fflush(stdout);
  if (!r.intact) fmt::print(stderr, "raw-libfabric client: NOT INTACT: {}\n", r.problem);
  if (!o.quiet && o.wait_fd) fmt::print(stderr, "raw-libfabric client: {} fd waits\n", c.sleeps());

  if (!o.json.empty()) {
    const std::string mode = prov == "verbs" ? "rdma" : "tcp";
    const std::string line = fmt::format(
        "{{\"tool\":\"raw-libfabric\",\"backend\":\"libfabric\",\"mode\":{},\"send\":\"raw\","
        "\"test\":\"{}\",\"size\":{},\"connections\":1,\"threads\":1,\"duration_s\":{},"
        "\"messages\":{},\"bytes\":{},\"msgs_per_s\":{},\"bytes_per_s\":{},\"gbit_per_s\":{},"
        "\"cpu_ns_per_msg\":{},\"p50_us\":{},\"p99_us\":{},\"p999_us\":{},\"intact\":{},"
        "\"wait\":\"{}\",\"provider\":{}}}\n",
        json_string(mode), throughput ? "throughput" : "latency", o.size, json_number(r.seconds, 6),
        r.messages, r.bytes, json_number(msgs_per_s, 3), json_number(bytes_per_s, 3),
        json_number(gbit, 6), json_number(cpu_per_msg, 3), json_number(p50, 3), json_number(p99, 3),
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
