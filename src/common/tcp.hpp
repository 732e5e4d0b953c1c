#pragma once

// Plain TCP sockets on the shared loop, for the backends that open their own (the UCX
// backend's control channel; asyncmsg uses Asio for the same steps): listening and
// connecting without blocking, accepting under descriptor pressure, keepalive settings, and
// closing without losing what the peer still has to read.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <sys/epoll.h>
#include <utility>

#include <netio3/event_loop.hpp>
#include <netio3/types.hpp>

namespace netio3::detail {

std::string errno_text(int err);

// A socket descriptor, closed on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) noexcept : m_fd{fd} {}
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  Socket(Socket&& other) noexcept : m_fd{other.release()} {}
  Socket& operator=(Socket&& other) noexcept;
  ~Socket() { close(); }
  [[nodiscard]] int get() const noexcept { return m_fd; }
  [[nodiscard]] bool valid() const noexcept { return m_fd >= 0; }
  int release() noexcept;
  void close() noexcept;

 private:
  int m_fd{-1};
};

// A non-blocking listening socket bound to `address` (port 0: the OS picks one), with
// SO_REUSEADDR. Returns the socket and the address it listens on; throws std::runtime_error
// with the failing step.
std::pair<Socket, EndPointAddress> listen_tcp(const EndPointAddress& address);

// Binds the socket `fd` (of `family`, AF_INET or AF_INET6) to the wildcard address and port 0,
// before it connects: the kernel then gives it a source port that no other socket uses, and
// still chooses the interface at connect as for an unbound socket. Returns 0 or the errno.
// The cost: a port bound this way is not shared with connections to other destinations, and
// the kernel gives none that a TIME_WAIT socket holds, so a client has about the ephemeral
// range (net.ipv4.ip_local_port_range, 28,232 ports by default) for its open connections and
// those it closed in the last minute, all destinations together. When none is free (bind
// fails with EADDRINUSE) the socket stays unbound and connect() picks the port, as without
// this (source_port_unavailable); 0 is returned then too.
int bind_source_port(int fd, int family);

// Says (a warning once per process, debug lines after) that a new connection goes without a
// source port of its own because none is free (`port` 0) or the port forced on it is taken:
// connect() chooses one, which connections to other destinations may share; a server that
// then sees two connections from one address refuses the second, and the client retries.
void source_port_unavailable(std::uint16_t port);

// For tests: the next calls of bind_source_port (or of libfabric's source-port reservation),
// process-wide, bind to these ports in turn, with SO_REUSEADDR, instead of taking a port of
// their own. This makes the collision a server must handle (two connections from one address
// and port; tests/conformance/source_port_tests.cpp). take_forced_source_port returns the
// next one and uses it up (0: none).
void force_source_ports(std::span<const std::uint16_t> ports);
inline void force_next_source_port(std::uint16_t port) {
  force_source_ports({&port, 1});
}
[[nodiscard]] std::uint16_t take_forced_source_port();

// Starts a non-blocking connect to `address` from a port of its own (bind_source_port; without it,
// two connections of one process to two ports of one server may share a source port, and the
// server would see two connections from one address). `error` is 0 when the connect is in
// progress or done, else the errno of a connect that failed at once. The socket gets
// configure_stream(peer_timeout). Throws std::runtime_error with the failing step when no
// socket can be made or configured.
struct ConnectStart {
  Socket socket;
  int error{0};
};
ConnectStart connect_tcp(const EndPointAddress& address, std::chrono::milliseconds peer_timeout);

// The result of a non-blocking connect once the socket is writable: 0 or the errno.
int connect_result(int fd);

// True when the connected socket `fd` is connected to itself: with nothing listening on a
// port of this host, a connect to it from that same port (the kernel may pick the
// destination port as the ephemeral source port) completes as a TCP simultaneous open. The
// connection must be treated as refused.
bool connected_to_itself(int fd);

// Why the non-blocking connect of `fd`, now writable, failed (the errno, or a connection to
// itself: nothing listens there); nullopt when it is connected.
std::optional<std::string> connect_failure(int fd);

// TCP_NODELAY, and 1.5 times limits.peer_timeout as TCP_USER_TIMEOUT plus keepalive probes
// (a backstop behind the heartbeats). Returns an error text, empty if all were set.
std::string configure_stream(int fd, std::chrono::milliseconds peer_timeout);

// The addresses of a connected socket; nullopt on error.
std::optional<EndPointAddress> local_address(int fd);
std::optional<EndPointAddress> peer_address(int fd);

// Reads whatever is pending (so that close() does not turn into a RST that could destroy
// data still queued towards the peer) and closes.
void drain_and_close(Socket& socket) noexcept;

// Sends all of `bytes` without blocking; false if the socket would block or failed.
bool send_now(int fd, std::span<const std::uint8_t> bytes) noexcept;

// Network interfaces. The name of the interface that holds the numeric IP `ip`, or that
// the kernel would send from towards `ip` (its route); nullopt if there is none or `ip` is
// a wildcard address.
std::optional<std::string> interface_holding(const std::string& ip);
std::optional<std::string> interface_towards(const std::string& ip);

// Descriptor pressure. A process that runs out of descriptors cannot accept, connect, or
// create a timer, and UCX's own listener gives up for good when its accept fails (docs/
// ucx.md); so a listener stops accepting while the descriptor table is nearly full.
//
// Raises the soft RLIMIT_NOFILE to the hard limit, once per process (as Go's runtime does).
// Returns the soft limit now in force.
std::size_t raise_descriptor_limit();
// True when `fd`, the descriptor accept() just returned, leaves fewer than the reserve free:
// the kernel gives the lowest free number, so every number below `fd` is in use.
bool descriptor_table_nearly_full(int fd);
// The reason logged for it.
std::string descriptor_table_nearly_full_text(int fd);
// Descriptors kept free under the soft limit (for the transports and the rest of the
// process): 1/16 of the limit, at least 16.
std::size_t descriptor_reserve(std::size_t soft_limit);
// Why the process is short of descriptors now: none can be made (EMFILE, or ENFILE: the
// system's table), or the table is nearly full (descriptor_table_nearly_full); empty when
// it is not. Probes with a socket that it closes again.
std::string descriptor_shortage();

// A listener's accept pauses: one warning when they begin (with the reason), debug lines
// while they go on, one line when accepting works again. Loop thread only.
class AcceptPauses {
 public:
  static constexpr std::chrono::milliseconds BACKOFF{100};
  AcceptPauses(std::string_view backend, EndPointAddress listener)
      : m_backend{backend}, m_listener{std::move(listener)} {}
  // Accepting stops for BACKOFF because of `why`.
  void paused(std::string_view why);
  // A connection was accepted.
  void accepted();

 private:
  std::string_view m_backend;
  EndPointAddress m_listener;
  std::optional<std::chrono::steady_clock::time_point> m_since;
  std::size_t m_pauses{0};
};

// The timer that ends a listener's accept pause: it puts the listener's fd back into the
// loop. Made when the listener is, while descriptors are to be had (a timerfd is one).
// L has `mutex`, `closed`, `fd` (FdHandle) and `resume` (this timer), as pause_accepting.
template <typename L>
EventTimerHandle make_resume_timer(BaseEventLoop& loop, const std::shared_ptr<L>& listener) {
  return loop.create_timer([weak = std::weak_ptr<L>{listener}] {
    if (auto l = weak.lock()) {
      const std::lock_guard lock{l->mutex};
      if (!l->closed) l->fd.modify(EPOLLIN);
    }
  });
}

// Stops accepting on `listener` for AcceptPauses::BACKOFF because of `why` (logged through
// its `pauses`, an AcceptPauses). Loop thread.
template <typename L>
void pause_accepting(L& listener, const std::string& why) {
  listener.pauses->paused(why);
  const std::lock_guard lock{listener.mutex};
  if (listener.closed) return;
  listener.fd.modify(0);
  listener.resume.start_once(AcceptPauses::BACKOFF);
}

// Sockets of closed connections that wait for the peer to finish: shutdown(SHUT_WR) was
// called (our FIN is out), and what the peer still sends is read and discarded until it
// closes too or `timeout` passes. Without this, unread input would make close() send a RST
// that can destroy data still queued towards the peer. Loop thread only.
class LingeringSockets {
 public:
  LingeringSockets(BaseEventLoop& loop, std::chrono::milliseconds timeout);
  LingeringSockets(const LingeringSockets&) = delete;
  LingeringSockets& operator=(const LingeringSockets&) = delete;
  LingeringSockets(LingeringSockets&&) = delete;
  LingeringSockets& operator=(LingeringSockets&&) = delete;
  ~LingeringSockets();

  // Half-closes `socket` and keeps it until the peer closes; a socket that cannot be
  // half-closed is closed at once. An `awaited` one is one whose end the backend's shutdown
  // waits for (reap_awaited).
  void add(Socket socket, bool awaited = false);
  // Reads what the awaited sockets hold, without the event loop, and closes those whose peer
  // has closed; returns how many awaited ones are left.
  std::size_t reap_awaited() noexcept;
  // Closes them all (backend shutdown).
  void close_all() noexcept;
  [[nodiscard]] std::size_t size() const noexcept;

 private:
  struct State;
  std::shared_ptr<State> m_state;
};

}  // namespace netio3::detail
