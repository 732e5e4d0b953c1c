#include "common/tcp.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <ifaddrs.h>
#include <mutex>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdexcept>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <system_error>
#include <tuple>
#include <unistd.h>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/sockaddr.hpp"

namespace netio3::detail {

std::string errno_text(int err) {
  return std::system_category().message(err);
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    m_fd = other.release();
  }
  return *this;
}

int Socket::release() noexcept {
  return std::exchange(m_fd, -1);
}

void Socket::close() noexcept {
  if (m_fd >= 0) ::close(m_fd);
  m_fd = -1;
}

namespace {

[[noreturn]] void fail(std::string_view step, int err) {
  throw std::runtime_error(fmt::format("{} failed: {}", step, errno_text(err)));
}

std::optional<EndPointAddress> socket_name(int fd, bool peer) {
  sockaddr_storage storage{};
  socklen_t len = sizeof(storage);
  auto* sa = reinterpret_cast<sockaddr*>(&storage);  // NOLINT
  if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0) return std::nullopt;
  return to_endpoint_address(&storage, len);
}

// Whether two numeric IP texts name the same address (IPv6 may be written several ways).
bool same_ip(const sockaddr* a, const std::string& ip) {
  const auto wanted = to_socket_address({ip, 0});
  if (!wanted || wanted->get()->sa_family != a->sa_family) return false;
  if (a->sa_family == AF_INET) {
    sockaddr_in x{};
    sockaddr_in y{};
    std::memcpy(&x, a, sizeof(x));
    std::memcpy(&y, wanted->get(), sizeof(y));
    return x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    sockaddr_in6 x{};
    sockaddr_in6 y{};
    std::memcpy(&x, a, sizeof(x));
    std::memcpy(&y, wanted->get(), sizeof(y));
    return std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(x.sin6_addr)) == 0;
  }
  return false;
}

}  // namespace

std::pair<Socket, EndPointAddress> listen_tcp(const EndPointAddress& address) {
  const auto sa = to_socket_address(address);
  if (!sa) throw std::runtime_error("not a numeric IP address");
  Socket socket{::socket(sa->get()->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
  if (!socket.valid()) fail("socket", errno);
  const int on = 1;
  if (::setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) != 0) {
    fail("SO_REUSEADDR", errno);
  }
  if (::bind(socket.get(), sa->get(), sa->length) != 0) fail("bind", errno);
  if (::listen(socket.get(), SOMAXCONN) != 0) fail("listen", errno);
  const auto bound = socket_name(socket.get(), false);
  if (!bound) fail("getsockname", errno);
  return {std::move(socket), EndPointAddress{address.address, bound->port}};
}

namespace {
std::mutex g_forced_mutex;
std::deque<std::uint16_t> g_forced_ports;  // under g_forced_mutex
}  // namespace

void force_source_ports(std::span<const std::uint16_t> ports) {
  const std::lock_guard lock{g_forced_mutex};
  g_forced_ports.assign(ports.begin(), ports.end());
}

std::uint16_t take_forced_source_port() {
  const std::lock_guard lock{g_forced_mutex};
  if (g_forced_ports.empty()) return 0;
  const std::uint16_t port = g_forced_ports.front();
  g_forced_ports.pop_front();
  return port;
}

int bind_source_port(int fd, int family) {
  const std::uint16_t forced = take_forced_source_port();
  if (forced != 0) {
    const int one = 1;
    if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) return errno;
  }
  SocketAddress any{};
  if (family == AF_INET) {
    sockaddr_in in{};
    in.sin_family = AF_INET;
    in.sin_port = htons(forced);
    std::memcpy(&any.storage, &in, sizeof(in));
    any.length = sizeof(in);
  } else {
    sockaddr_in6 in6{};
    in6.sin6_family = AF_INET6;
    in6.sin6_port = htons(forced);
    std::memcpy(&any.storage, &in6, sizeof(in6));
    any.length = sizeof(in6);
  }
  if (::bind(fd, any.get(), any.length) == 0) return 0;
  const int err = errno;
  if (err != EADDRINUSE) return err;
  source_port_unavailable(forced);
  return 0;
}

void source_port_unavailable(std::uint16_t port) {
  static std::atomic<bool> warned{false};
  const auto why =
      port == 0 ? std::string{"no port of the ephemeral range is free of other sockets (TIME_WAIT "
                              "ones included)"}
                : fmt::format("port {} is taken", port);
  if (!warned.exchange(true)) {
    NETIO3_WARN(
        "no source port of its own for a new connection: {}; connect() picks one, which other "
        "connections to other destinations may share (a server that sees two connections from "
        "one address refuses the second, and the client retries). Said once per process",
        why);
  } else {
    NETIO3_DEBUG("no source port of its own for a new connection: {}", why);
  }
}

ConnectStart connect_tcp(const EndPointAddress& address, std::chrono::milliseconds peer_timeout) {
  const auto sa = to_socket_address(address);
  if (!sa) throw std::runtime_error("not a numeric IP address");
  const int family = sa->get()->sa_family;
  Socket socket{::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
  if (!socket.valid()) fail("socket", errno);
  if (const int err = bind_source_port(socket.get(), family); err != 0) {
    fail("bind to a source port", err);
  }
  if (const auto why = configure_stream(socket.get(), peer_timeout); !why.empty()) {
    throw std::runtime_error("socket options failed: " + why);
  }
  ConnectStart started{std::move(socket), 0};
  if (::connect(started.socket.get(), sa->get(), sa->length) != 0 && errno != EINPROGRESS &&
      errno != EINTR) {
    started.error = errno;
  }
  return started;
}

bool connected_to_itself(int fd) {
  const auto local = local_address(fd);
  return local && local == peer_address(fd);
}

int connect_result(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

std::optional<std::string> connect_failure(int fd) {
  if (const int err = connect_result(fd); err != 0) {
    return fmt::format("connect failed: {}", errno_text(err));
  }
  if (connected_to_itself(fd)) {
    return "connect failed: nothing listens there (the socket connected to itself)";
  }
  return std::nullopt;
}

std::string configure_stream(int fd, std::chrono::milliseconds peer_timeout) {
  // A backstop behind netio3's heartbeats (common/liveness.hpp), which end a silent
  // connection between peer_timeout and 1.3 times it, and the only watch on a peer of an
  // older protocol version: after 1.5 times peer_timeout. TCP_USER_TIMEOUT bounds how long
  // sent data may stay unacknowledged; keepalive probes (after half the time idle, then three
  // a third of it apart) find a peer that vanished while nothing was being sent.
  const auto ms = peer_timeout.count();
  const int user_timeout = static_cast<int>(std::min<std::int64_t>(ms + ms / 2, INT32_MAX));
  const int idle = static_cast<int>(std::clamp<std::int64_t>(ms / 2000, 1, 32767));
  const int interval = static_cast<int>(std::clamp<std::int64_t>(ms / 3000, 1, 32767));
  const int count = 3;
  const int on = 1;
  const std::array<std::tuple<int, int, const int*, const char*>, 6> options{{
      {IPPROTO_TCP, TCP_NODELAY, &on, "TCP_NODELAY"},
      {SOL_SOCKET, SO_KEEPALIVE, &on, "SO_KEEPALIVE"},
      {IPPROTO_TCP, TCP_KEEPIDLE, &idle, "TCP_KEEPIDLE"},
      {IPPROTO_TCP, TCP_KEEPINTVL, &interval, "TCP_KEEPINTVL"},
      {IPPROTO_TCP, TCP_KEEPCNT, &count, "TCP_KEEPCNT"},
      {IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, "TCP_USER_TIMEOUT"},
  }};
  for (const auto& [level, name, value, text] : options) {
    if (::setsockopt(fd, level, name, value, sizeof(int)) != 0) {
      return fmt::format("{}: {}", text, errno_text(errno));
    }
  }
  return {};
}

std::optional<EndPointAddress> local_address(int fd) {
  return socket_name(fd, false);
}

std::optional<EndPointAddress> peer_address(int fd) {
  return socket_name(fd, true);
}

void drain_and_close(Socket& socket) noexcept {
  if (!socket.valid()) return;
  std::array<std::uint8_t, 4096> sink{};
  for (int i = 0; i < 16; ++i) {
    if (::recv(socket.get(), sink.data(), sink.size(), MSG_DONTWAIT) <= 0) break;
  }
  socket.close();
}

bool send_now(int fd, std::span<const std::uint8_t> bytes) noexcept {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return false;
    }
  }
  return true;
}

std::optional<std::string> interface_holding(const std::string& ip) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (const ifaddrs* i = list; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr != nullptr && i->ifa_name != nullptr && same_ip(i->ifa_addr, ip)) {
      found = i->ifa_name;
    }
  }
  ::freeifaddrs(list);
  return found;
}

std::optional<std::string> interface_towards(const std::string& ip) {
  // A connected UDP socket sends nothing, but the kernel picks its route and source address.
  const auto sa = to_socket_address({ip, 9});
  if (!sa) return std::nullopt;
  Socket probe{::socket(sa->get()->sa_family, SOCK_DGRAM | SOCK_CLOEXEC, 0)};
  if (!probe.valid() || ::connect(probe.get(), sa->get(), sa->length) != 0) return std::nullopt;
  const auto source = socket_name(probe.get(), false);
  if (!source) return std::nullopt;
  return interface_holding(source->address);
}

std::size_t raise_descriptor_limit() {
  static std::mutex mutex;
  const std::lock_guard lock{mutex};
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    const rlim_t before = limit.rlim_cur;
    limit.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &limit) == 0) {
      NETIO3_DEBUG("raised the soft descriptor limit (RLIMIT_NOFILE) from {} to {}", before,
                   limit.rlim_cur);
    } else {
      limit.rlim_cur = before;
    }
  }
  return static_cast<std::size_t>(limit.rlim_cur);
}

std::size_t descriptor_reserve(std::size_t soft_limit) {
  return std::max<std::size_t>(16, soft_limit / 16);
}

std::string descriptor_shortage() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    if (err != EMFILE && err != ENFILE) return {};
    return fmt::format("no file descriptor left ({})", errno_text(err));
  }
  const bool nearly_full = descriptor_table_nearly_full(fd);
  ::close(fd);
  if (!nearly_full) return {};
  return descriptor_table_nearly_full_text(fd);
}

std::string descriptor_table_nearly_full_text(int fd) {
  return fmt::format("the descriptor table is nearly full (descriptor {} of RLIMIT_NOFILE)", fd);
}

bool descriptor_table_nearly_full(int fd) {
  rlimit limit{};
  if (fd < 0 || ::getrlimit(RLIMIT_NOFILE, &limit) != 0) return false;
  const auto soft = static_cast<std::size_t>(limit.rlim_cur);
  const std::size_t reserve = descriptor_reserve(soft);
  return soft <= reserve || static_cast<std::size_t>(fd) >= soft - reserve;
}

void AcceptPauses::paused(std::string_view why) {
  ++m_pauses;
  if (m_since) {
    NETIO3_DEBUG("{}: accept on {} still paused: {}", m_backend, m_listener, why);
    return;
  }
  m_since = std::chrono::steady_clock::now();
  NETIO3_WARN(
      "{}: accept on {}: {}; pausing accepts (retried every {} ms, logged again when "
      "accepting works)",
      m_backend, m_listener, why, BACKOFF.count());
}

void AcceptPauses::accepted() {
  if (!m_since) return;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - *m_since);
  NETIO3_INFO("{}: accepting on {} again after {} ms ({} pauses)", m_backend, m_listener,
              ms.count(), m_pauses);
  m_since.reset();
  m_pauses = 0;
}

struct LingeringSockets::State {
  struct Entry {
    Socket socket;
    FdHandle handle;
    std::chrono::steady_clock::time_point deadline;
    bool awaited{false};
  };
  BaseEventLoop* loop{nullptr};
  std::chrono::milliseconds timeout{};
  std::list<Entry> entries;
  EventTimerHandle timer;
  bool armed{false};

  // Returns whether the entry is gone (the peer is done).
  bool readable(std::list<Entry>::iterator it) {
    std::array<std::uint8_t, 4096> sink{};
    for (int i = 0; i < 16; ++i) {
      const ssize_t n = ::recv(it->socket.get(), sink.data(), sink.size(), MSG_DONTWAIT);
      if (n > 0) continue;  // discarded
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
      if (n < 0 && errno == EINTR) continue;
      it->handle.close();  // EOF or error: the peer is done
      entries.erase(it);
      return true;
    }
    return false;  // still sending: read on at the next turn (or until the deadline)
  }

  void expire() {
    const auto now = std::chrono::steady_clock::now();
    for (auto it = entries.begin(); it != entries.end();) {
      if (now < it->deadline) {
        ++it;
        continue;
      }
      it->handle.close();
      drain_and_close(it->socket);
      it = entries.erase(it);
    }
    if (entries.empty() && armed) {
      armed = false;
      timer.stop();
    }
  }
};

LingeringSockets::LingeringSockets(BaseEventLoop& loop, std::chrono::milliseconds timeout)
    : m_state{std::make_shared<State>()} {
  m_state->loop = &loop;
  m_state->timeout = timeout;
  m_state->timer = loop.create_timer([weak = std::weak_ptr<State>{m_state}] {
    if (auto state = weak.lock()) state->expire();
  });
}

LingeringSockets::~LingeringSockets() {
  close_all();
}

void LingeringSockets::add(Socket socket, bool awaited) {
  if (!socket.valid()) return;
  if (::shutdown(socket.get(), SHUT_WR) != 0) {
    drain_and_close(socket);
    return;
  }
  auto& state = *m_state;
  state.entries.push_back(State::Entry{std::move(socket), {}, {}, awaited});
  auto it = std::prev(state.entries.end());
  it->deadline = std::chrono::steady_clock::now() + state.timeout;
  std::weak_ptr<State> weak = m_state;
  const int fd = it->socket.get();
  try {
    it->handle = state.loop->add_fd(fd, EPOLLIN, [weak, fd](std::uint32_t) {
      auto s = weak.lock();
      if (!s) return;
      const auto entry = std::find_if(s->entries.begin(), s->entries.end(),
                                      [fd](const State::Entry& e) { return e.socket.get() == fd; });
      if (entry != s->entries.end()) s->readable(entry);
    });
  } catch (const std::exception&) {
    drain_and_close(it->socket);
    state.entries.erase(it);
    return;
  }
  if (!state.armed) {
    state.armed = true;
    state.timer.start(std::chrono::milliseconds{100});
  }
}

std::size_t LingeringSockets::reap_awaited() noexcept {
  if (!m_state) return 0;
  std::size_t left = 0;
  auto& entries = m_state->entries;
  for (auto it = entries.begin(); it != entries.end();) {
    const auto next = std::next(it);
    if (it->awaited && !m_state->readable(it)) ++left;
    it = next;
  }
  return left;
}

void LingeringSockets::close_all() noexcept {
  if (!m_state) return;
  for (auto& entry : m_state->entries) {
    entry.handle.close();
    drain_and_close(entry.socket);
  }
  m_state->entries.clear();
  m_state->timer.close();
  m_state->armed = false;
}

std::size_t LingeringSockets::size() const noexcept {
  return m_state->entries.size();
}

}  // namespace netio3::detail
