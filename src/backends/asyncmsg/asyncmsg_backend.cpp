// asyncmsg: TCP through Boost.Asio sockets, driven by the shared EpollEventLoop.
//
// Asio provides the sockets (address parsing, open/bind/listen/accept, options, error
// codes); readiness comes from the shared epoll loop, so no io_context is ever run and no
// thread is hidden. Connect is issued with ::connect on the native handle because Asio's
// synchronous connect would block in poll() on a non-blocking socket.
//
// Threads: socket I/O, state transitions and every callback happen on the loop thread.
// Other threads only append to a connection's SendQueue under its mutex and ask the loop
// to flush it; the loop writes outside the lock (see send_queue.hpp).
//
// Lock order: Backend::m_mutex before Connection::mutex before BufferPool's mutex. No user
// callback is ever called while one of them is held.

#include "backends/asyncmsg/asyncmsg_backend.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <tuple>
#include <unordered_map>
#include <utility>  // before Asio: GCC 12 + Boost 1.74 need std::exchange declared first
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "backends/asyncmsg/send_queue.hpp"
#include "backends/asyncmsg/wire.hpp"
#include "common/backend_facade.hpp"
#include "common/buffer_pool.hpp"
#include "common/connection.hpp"
#include "common/connection_engine.hpp"
#include "common/endpoint_registry.hpp"
#include "common/endpoint_rules.hpp"
#include "common/log.hpp"
#include "common/notifier.hpp"
#include "common/send_ledger.hpp"
#include "common/setup_deadlines.hpp"
#include "common/tcp.hpp"

namespace netio3::asyncmsg {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::string_view NAME = "asyncmsg";
// One receive buffer for the whole backend: the loop thread reads one socket at a time,
// and messages that lie wholly inside a read are handed to on_data_cb from here.
constexpr std::size_t SCRATCH_SIZE = std::size_t{1} << 20U;
constexpr std::size_t MAX_IOV = 256;
constexpr std::size_t MAX_WRITE_BYTES = std::size_t{16} << 20U;
// Per readiness event, so that one busy connection cannot starve the others.
constexpr int READS_PER_EVENT = 8;
constexpr int WRITES_PER_FLUSH = 8;
constexpr int ACCEPTS_PER_EVENT = 64;
constexpr auto HOUSEKEEPING_PERIOD = 100ms;
// After a local close the socket sends FIN and keeps reading (and discarding) until the
// peer closes too, so that unread input cannot turn the close into a RST that would
// destroy data still queued in our kernel send buffer.
constexpr auto LINGER_TIMEOUT = 2s;
// Staging chunks kept for reuse by the backend's connections (8 MiB).
constexpr std::size_t CACHED_CHUNKS = 32;

std::string errno_text(int err) {
  return std::system_category().message(err);
}

struct Listener {
  Listener(std::uint64_t id_, EndPointAddress address_, const ConnectionParameters& params_,
           std::shared_ptr<asio::io_context> io_)
      : id{id_}, address{std::move(address_)}, params{params_}, io{std::move(io_)}, acceptor{*io} {}

  const std::uint64_t id;
  EndPointAddress address;  // the requested one until the OS picked the port
  const ConnectionParameters params;
  std::shared_ptr<asio::io_context> io;  // outlives the acceptor
  std::mutex mutex;                      // accept (loop) vs close (any thread)
  tcp::acceptor acceptor;
  FdHandle fd;  // guarded by `mutex`
  bool closed{false};
  Clock::time_point resume_at{};               // while in Backend::m_paused (loop thread only)
  std::optional<detail::AcceptPauses> pauses;  // loop thread only
};

using detail::CloseCause;
using detail::Phase;

struct Connection : detail::ConnectionBase {
  Connection(std::uint64_t id_, std::shared_ptr<asio::io_context> io_,
             std::shared_ptr<ChunkCache> chunks, EndPointAddress remote_,
             const ConnectionParameters& params_, std::uint64_t listener_id_, Phase initial,
             std::size_t max_message_size)
      : ConnectionBase{id_, std::move(remote_), params_, listener_id_, true, initial},
        io{std::move(io_)},
        socket{*io},
        decoder{max_message_size},
        queue{std::move(chunks)} {}

  std::shared_ptr<asio::io_context> io;
  tcp::socket socket;
  FdHandle fd;  // assigned and used under `mutex` (the loop may use it before add_fd returns)

  // Loop thread only.
  FrameDecoder decoder;
  bool epollout{false};
  bool receive_paused{false};  // waiting for receive memory: not reading
  bool large_messages{false};  // the last message was read directly: so will the next be
  std::size_t reserved{0};     // receive memory admitted for the message being assembled

  // Under `mutex`.
  SendQueue queue;
  bool flush_pending{false};
  std::size_t max_send_message{0};  // min(own limit, peer's announced limit)
};

struct Lingering {
  std::shared_ptr<asio::io_context> io;
  tcp::socket socket;
  int native{-1};
  FdHandle fd;
  Clock::time_point deadline;
};

// Reads whatever is pending (so close() does not turn into a RST) and closes.
void drain_and_close(tcp::socket& socket) noexcept {
  if (!socket.is_open()) return;
  std::array<std::uint8_t, 4096> sink{};
  for (int i = 0; i < 16; ++i) {
    if (::recv(socket.native_handle(), sink.data(), sink.size(), MSG_DONTWAIT) <= 0) break;
  }
  boost::system::error_code ec;
  socket.close(ec);
}

// Always thread-safe: its sockets are used on the loop thread only, and other threads only
// queue sends under a connection's lock.
class Backend : public detail::ConnectionEngine<Backend, Connection, Listener>,
                public std::enable_shared_from_this<Backend> {
 public:
  static constexpr BackendType TYPE = BackendType::ASYNCMSG;
  using Engine = detail::ConnectionEngine<Backend, Connection, Listener>;

  Backend(NetworkConfig config, std::shared_ptr<BaseEventLoop> loop)
      : Engine{NAME, std::move(config), std::move(loop), ThreadSafetyModel::SAFE},
        m_io{std::make_shared<asio::io_context>(1)},
        m_chunks{std::make_shared<ChunkCache>(CACHED_CHUNKS)},
        m_max_message{std::min(m_config.limits.max_message_size, WIRE_MAX_MESSAGE_SIZE)} {
    const auto& shared_tx = m_config.shared_send_buffers;
    if (shared_tx.use_shared_send_buffers) {
      m_shared_send_pool = std::make_unique<detail::BufferPool>(
          shared_tx.num_buf, shared_tx.buf_size, FRAME_HEADER_SIZE, true);
    }
    if (m_config.thread_safety == ThreadSafetyModel::UNSAFE) {
      NETIO3_DEBUG("asyncmsg: ThreadSafetyModel::UNSAFE requested; asyncmsg is always thread-safe");
    }
  }

  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  Backend(Backend&&) = delete;
  Backend& operator=(Backend&&) = delete;
  ~Backend() = default;

  // Registrations that need a weak self-reference; called right after construction.
  void start() {
    start_engine();
    std::weak_ptr<Backend> weak = weak_from_this();
    m_flush_signal = m_loop->create_signal([weak] {
      if (auto self = weak.lock()) self->process_flush_list();
    });
    m_prepare = m_loop->add_prepare_hook([weak] {
      auto self = weak.lock();
      return !self || self->process_flush_list();
    });
    m_timer = m_loop->create_timer([weak] {
      if (auto self = weak.lock()) self->housekeeping();
    });
  }

  // Closes everything without callbacks. Runs on the loop thread, or inline when the
  // loop is not running.
  void shutdown() noexcept {
    if (!begin_shutdown()) return;
    const auto all = take_everything();
    {
      const std::lock_guard lock{m_mutex};
      m_paused.clear();
    }
    for (auto& listener : all.listeners) close_acceptor(*listener);
    for (auto& conn : all.connections) abandon(*conn);
    for (auto& lingering : m_lingering) {
      lingering.fd.close();
      drain_and_close(lingering.socket);
    }
    m_lingering.clear();
    m_flush_signal.close();
    m_prepare.close();
    m_timer.close();
    m_registry.clear_index();
    NETIO3_DEBUG("asyncmsg: backend shut down ({} listener(s), {} connection(s) dropped)",
                 all.listeners.size(), all.connections.size());
  }

  // ---- API (any thread) ------------------------------------------------------------

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                       const ConnectionParameters& params) {
    const ApiCall call = open_call(address, params, true);
    const auto ip = asio::ip::make_address(address.address);
    const auto held = m_registry.lock();
    if (address.port != 0) m_registry.check_listen_free(held, address);
    auto listener = std::make_shared<Listener>(next_id(), address, params, m_io);
    boost::system::error_code ec;
    const tcp::endpoint endpoint{ip, address.port};
    const auto fail = [&](std::string_view step) {
      throw FailedOpenListenEndpoint(
          fmt::format("asyncmsg: cannot listen on {}: {} failed: {}", address, step, ec.message()));
    };
    if (listener->acceptor.open(endpoint.protocol(), ec); ec) fail("open");
    if (listener->acceptor.set_option(tcp::acceptor::reuse_address(true), ec); ec)
      fail("SO_REUSEADDR");
    if (listener->acceptor.bind(endpoint, ec); ec) fail("bind");
    if (listener->acceptor.listen(asio::socket_base::max_listen_connections, ec); ec)
      fail("listen");
    if (listener->acceptor.non_blocking(true, ec); ec) fail("non-blocking mode");
    const auto local = listener->acceptor.local_endpoint(ec);
    if (ec) fail("getsockname");
    EndPointAddress actual{address.address, local.port()};
    m_registry.check_listen_free(held, actual);
    listener->address = actual;
    listener->pauses.emplace(NAME, actual);
    {
      // The first event may be dispatched before add_fd returns: publish the handle under
      // the listener's mutex, which the loop takes before using it.
      const std::lock_guard listener_lock{listener->mutex};
      listener->fd = m_loop->add_fd(listener->acceptor.native_handle(), EPOLLIN,
                                    fd_callback<&Backend::on_acceptable>(listener));
    }
    m_registry.add_listener(held, actual, std::move(listener));
    NETIO3_DEBUG("asyncmsg: listening on {}", actual);
    return actual;
  }

  void open_active_endpoint(const EndPointAddress& address, const ConnectionParameters& params) {
    const ApiCall call = open_call(address, params, false);
    const auto held = m_registry.lock();
    m_registry.check_connection_free(held, address);
    auto conn = std::make_shared<Connection>(next_id(), m_io, m_chunks, address, params, 0,
                                             Phase::CONNECTING, m_max_message);
    attach_send_pool(*conn);
    int err = 0;
    try {
      err = start_connect(conn->socket, address);
    } catch (const std::runtime_error& e) {
      throw FailedOpenActiveEndpoint(
          fmt::format("asyncmsg: cannot connect to {}: {}", address, e.what()));
    }
    if (err != 0) {
      // Failed at once (e.g. no route): reported like any refusal, from the loop.
      m_registry.add_connection(held, conn);
      close_later(conn, fmt::format("connect failed: {}", errno_text(err)), CloseCause::ERROR);
      return;
    }
    // Writable = connected or failed; on_socket_event tells which from SO_ERROR. The
    // event may be dispatched before add_fd returns, so the handle is published under the
    // connection's mutex, which the loop takes before using it.
    {
      const std::lock_guard conn_lock{conn->mutex};
      conn->fd = m_loop->add_fd(conn->socket.native_handle(), EPOLLOUT, socket_callback(conn));
    }
    m_registry.add_connection(held, conn);
    track_setup(conn);
    NETIO3_DEBUG("asyncmsg: connecting to {}", address);
  }

  NetioStatus send_data(const EndPointAddress& address, std::span<const iovec> iov,
                        std::span<const std::uint8_t> header, std::uint64_t key) {
    return send_message(address, iov, header, key, Payload::REFERENCE);
  }

  NetioStatus send_data_copy(const EndPointAddress& address, std::span<const iovec> iov,
                             std::span<const std::uint8_t> header, std::uint64_t key) {
    return send_message(address, iov, header, key, Payload::COPY);
  }

 private:
  // send_data (payload referenced in place, Payload::REFERENCE) and send_data_copy
  // (payload copied, Payload::COPY). Frame header and header_data are always copied;
  // consecutive copies land back to back in staging, so they leave as one iovec.
  enum class Payload { REFERENCE, COPY };
  NetioStatus send_message(const EndPointAddress& address, std::span<const iovec> iov,
                           std::span<const std::uint8_t> header, std::uint64_t key,
                           Payload payload) {
    const std::string_view api = payload == Payload::COPY ? "send_data_copy" : "send_data";
    const ApiCall call{*this, api};
    const auto conn = connection_for(address, api);
    if (!detail::header_ok(address, header, NAME)) return NetioStatus::FAILED;
    std::size_t size = header.size();
    for (const auto& v : iov) size += v.iov_len;
    return enqueue(conn, size, detail::PendingSend{key, nullptr}, [&](SendQueue& queue) {
      std::array<std::uint8_t, FRAME_HEADER_SIZE> frame{};
      encode_frame_header(frame.data(), static_cast<std::uint32_t>(size));
      queue.append_copy(frame);
      queue.append_copy(header);
      for (const auto& v : iov) {
        const std::span<const std::uint8_t> part{static_cast<const std::uint8_t*>(v.iov_base),
                                                 v.iov_len};
        if (payload == Payload::COPY) {
          queue.append_copy(part);
        } else {
          queue.append_ref(part);
        }
      }
    });
  }

  // ---- the transport (detail::TransportOf) ---------------------------------------------
 public:
  NetioStatus post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer) {
    const std::size_t size = buffer->size();
    std::uint8_t* frame = detail::BufferPool::headroom_of(buffer, FRAME_HEADER_SIZE);
    return enqueue(conn, size, detail::PendingSend{buffer->id(), buffer}, [&](SendQueue& queue) {
      encode_frame_header(frame, static_cast<std::uint32_t>(size));
      queue.append_ref({frame, FRAME_HEADER_SIZE + size});
    });
  }

  void close_listener(const std::shared_ptr<Listener>& listener) { close_acceptor(*listener); }

  // Closing: nothing more is read or written; an open connection that we close sends FIN
  // and lingers (reading what still comes), anything else is closed at once.
  void close_transport(const std::shared_ptr<Connection>& conn) {
    {
      const std::lock_guard lock{conn->mutex};
      conn->receive_paused = false;
      conn->queue.clear();
      conn->flush_pending = false;
      conn->fd.close();
    }
    release_receive_memory(*conn);
    const auto& ending = conn->ending_info;
    if (ending.cause == CloseCause::LOCAL && ending.was_open) {
      linger(*conn);
    } else {
      drain_and_close(conn->socket);
    }
  }

  // The kernel owns what was written: nothing to wait for.
  [[nodiscard]] static bool quiescent(const Connection& /*conn*/) { return true; }

  // Drops a connection without callbacks (backend shutdown).
  static void abandon(Connection& conn) noexcept {
    {
      const std::lock_guard lock{conn.mutex};
      conn.fd.close();
      conn.phase = Phase::CLOSED;
      conn.ledger.cancel_all();
      conn.queue.clear();
    }
    drain_and_close(conn.socket);
  }

 private:
  // ---- helpers shared by the API ----------------------------------------------------

  // Accepts one message into the connection's queue (or says why not).
  template <typename Fill>
  NetioStatus enqueue(const std::shared_ptr<Connection>& conn, std::size_t size,
                      detail::PendingSend pending, Fill&& fill) {
    bool need_flush = false;
    {
      const std::lock_guard lock{conn->mutex};
      if (conn->close_requested.load(std::memory_order_relaxed) || conn->ending()) {
        return NetioStatus::FAILED;
      }
      if (conn->phase != Phase::OPEN) return NetioStatus::NO_RESOURCES;  // still connecting
      if (size > conn->max_send_message) {
        NETIO3_WARN("asyncmsg: send to {}: message of {} bytes exceeds the limit of {} bytes",
                    conn->remote, size, conn->max_send_message);
        return NetioStatus::FAILED;
      }
      if (conn->queue.unsent_bytes() >= m_config.limits.max_unsent_bytes) {
        return NetioStatus::NO_RESOURCES;
      }
      fill(conn->queue);
      conn->queue.mark(conn->ledger.add(pending));
      need_flush = !std::exchange(conn->flush_pending, true);
    }
    NETIO3_TRACE("asyncmsg: send to {} key={} size={}", conn->remote, pending.key, size);
    if (need_flush) request_flush(conn);
    return NetioStatus::OK;
  }

  void request_flush(const std::shared_ptr<Connection>& conn) {
    bool was_empty = false;
    {
      const std::lock_guard lock{m_flush_mutex};
      was_empty = m_flush_list.empty();
      m_flush_list.push_back(conn);
    }
    // On the loop thread the prepare hook flushes before the loop sleeps again.
    if (was_empty && !m_loop->in_loop_thread()) m_flush_signal.fire();
  }

  void attach_send_pool(Connection& conn) {
    detail::attach_send_pool(conn, m_shared_send_pool.get(), FRAME_HEADER_SIZE, true);
  }

  [[nodiscard]] static EndpointCapabilities capabilities(const Connection& conn) {
    return EndpointCapabilities{.send_buffered = conn.send_pool != nullptr,
                                .send_copy = true,
                                .send_zero_copy = true,
                                .receive = true};
  }

  FdCallback socket_callback(const std::shared_ptr<Connection>& conn) {
    return fd_callback<&Backend::on_socket_event>(conn);
  }

  void close_acceptor(Listener& listener) noexcept {
    const std::lock_guard lock{listener.mutex};
    if (listener.closed) return;
    listener.closed = true;
    listener.fd.close();
    boost::system::error_code ec;
    listener.acceptor.close(ec);
  }

  // ---- loop thread -------------------------------------------------------------------
  // Entry points below run on the loop thread only; debug builds check it.

  void assert_loop_thread() const noexcept { assert(m_loop->in_loop_thread()); }

  void on_acceptable(const std::shared_ptr<Listener>& listener, std::uint32_t /*events*/) {
    assert_loop_thread();
    for (int i = 0; i < ACCEPTS_PER_EVENT && !shut_down(); ++i) {
      tcp::socket socket{*m_io};
      tcp::endpoint peer;
      boost::system::error_code ec;
      {
        const std::lock_guard lock{listener->mutex};
        if (listener->closed) return;
        listener->acceptor.accept(socket, peer, ec);
      }
      if (ec == asio::error::would_block || ec == asio::error::try_again) return;
      if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space ||
          ec == asio::error::no_memory || ec.value() == ENFILE) {
        pause_listener(listener, fmt::format("accept failed: {}", ec.message()));
        return;
      }
      if (ec) {
        NETIO3_DEBUG("asyncmsg: accept on {} failed: {}", listener->address, ec.message());
        continue;
      }
      if (detail::descriptor_table_nearly_full(socket.native_handle())) {
        // Keep descriptors for the rest of the process (timers, other backends' transports).
        pause_listener(listener,
                       fmt::format("the descriptor table is nearly full (descriptor {} of "
                                   "RLIMIT_NOFILE); the connection is refused",
                                   socket.native_handle()));
        return;
      }
      listener->pauses->accepted();
      accept_one(listener, std::move(socket), peer);
    }
  }

  void pause_listener(const std::shared_ptr<Listener>& listener, const std::string& why) {
    listener->pauses->paused(why);
    {
      const std::lock_guard lock{listener->mutex};
      if (listener->closed) return;
      listener->fd.modify(0);
    }
    listener->resume_at = Clock::now() + detail::AcceptPauses::BACKOFF;
    const std::lock_guard lock{m_mutex};
    m_paused.push_back(listener);
    if (!m_timer_armed) {
      m_timer_armed = true;
      m_timer.start(HOUSEKEEPING_PERIOD);
    }
  }

  void accept_one(const std::shared_ptr<Listener>& listener, tcp::socket socket,
                  const tcp::endpoint& peer) {
    boost::system::error_code ec;
    socket.non_blocking(true, ec);
    std::string error =
        ec ? ec.message()
           : detail::configure_stream(socket.native_handle(), m_config.limits.peer_timeout);
    if (!error.empty()) {
      NETIO3_WARN("asyncmsg: cannot configure socket accepted on {}: {}", listener->address, error);
      return;
    }
    EndPointAddress remote{peer.address().to_string(), peer.port()};
    auto conn = std::make_shared<Connection>(next_id(), m_io, m_chunks, remote, listener->params,
                                             listener->id, Phase::HANDSHAKE, m_max_message);
    conn->socket = std::move(socket);
    Admission admission{};
    {
      const auto held = m_registry.lock();
      admission = Engine::admission(held, *listener, remote);
      if (admission == Admission::ACCEPT) {
        {
          const std::lock_guard conn_lock{conn->mutex};
          conn->fd = m_loop->add_fd(conn->socket.native_handle(), EPOLLIN, socket_callback(conn));
        }
        m_registry.add_connection(held, conn);
        track_setup(conn);
      }
    }
    if (admission == Admission::LISTENER_CLOSED) return;
    if (admission == Admission::SOURCE_PORT_COLLISION) {
      refuse_address_in_use(*conn);
      return;
    }
    NETIO3_DEBUG("asyncmsg: accepted connection from {} on {}", remote, listener->address);
    send_greeting(conn);
  }

  void on_socket_event(const std::shared_ptr<Connection>& conn, std::uint32_t events) {
    assert_loop_thread();
    if (shut_down() || conn->ending()) return;
    // A close was requested from another thread and is posted to this loop: nothing more is
    // read (a decoder stopped by the request dropped the rest of its input, so the stream
    // cannot be parsed any further) and nothing more is written.
    if (conn->close_requested.load(std::memory_order_relaxed)) return;
    if (conn->phase == Phase::CONNECTING) {
      on_connect_done(conn);
      return;
    }
    if (conn->receive_paused && (events & (EPOLLERR | EPOLLHUP)) != 0) {
      NETIO3_WARN("asyncmsg: connection with {} failed while waiting for receive memory",
                  conn->remote);
      close(conn, "connection failed while waiting for receive memory", CloseCause::ERROR);
      return;
    }
    if (!conn->receive_paused && (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) != 0) {
      on_readable(conn);
      // CONNECTING: refused, and connecting again on a new socket.
      if (shut_down() || conn->ending() || conn->phase == Phase::CONNECTING) return;
    }
    if ((events & EPOLLOUT) != 0) flush(conn);
  }

  void on_connect_done(const std::shared_ptr<Connection>& conn) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (::getsockopt(conn->socket.native_handle(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
      err = errno;
    }
    if (err != 0) {
      close(conn, fmt::format("connect failed: {}", errno_text(err)), CloseCause::ERROR);
      return;
    }
    if (detail::connected_to_itself(conn->socket.native_handle())) {
      close(conn, "connect failed: nothing listens there (the socket connected to itself)",
            CloseCause::ERROR);
      return;
    }
    {
      const std::lock_guard lock{conn->mutex};
      conn->phase = Phase::HANDSHAKE;
      conn->fd.modify(EPOLLIN);
    }
    conn->epollout = false;
    NETIO3_DEBUG("asyncmsg: TCP connection to {} up, greeting", conn->remote);
    send_greeting(conn);
  }

  // Starts a non-blocking connect to `remote` on `socket` (detail::connect_tcp: from a source
  // port of its own, stream options set). Returns the errno of a connect that failed at once,
  // or 0; throws std::runtime_error with the failing step.
  [[nodiscard]] int start_connect(tcp::socket& socket, const EndPointAddress& remote) const {
    const auto protocol = asio::ip::make_address(remote.address).is_v4() ? tcp::v4() : tcp::v6();
    auto started = detail::connect_tcp(remote, m_config.limits.peer_timeout);
    boost::system::error_code ec;
    if (socket.assign(protocol, started.socket.get(), ec); ec) {
      throw std::runtime_error("adopting the socket failed: " + ec.message());
    }
    started.socket.release();
    return started.error;
  }

  // The server refused `conn` because it has a connection from its source address and port:
  // opens it again from a new one (at most SOURCE_PORT_RETRIES times). False when it may not
  // or could not; the caller then closes it.
  bool reconnect_from_new_source_port(const std::shared_ptr<Connection>& conn) {
    if (!detail::retry_from_new_source_port(*conn, NAME)) return false;
    tcp::socket fresh{*m_io};
    std::string why;
    try {
      if (const int err = start_connect(fresh, conn->remote); err != 0) {
        why = "connect failed: " + errno_text(err);
      }
    } catch (const std::runtime_error& e) {
      why = e.what();
    }
    if (!why.empty()) {
      NETIO3_WARN("asyncmsg: connecting again to {}: {}", conn->remote, why);
      return false;
    }
    {
      const std::lock_guard lock{conn->mutex};
      conn->fd.close();
      conn->queue.clear();
      conn->flush_pending = false;
      conn->phase = Phase::CONNECTING;
    }
    drain_and_close(conn->socket);
    conn->socket = std::move(fresh);
    conn->decoder.reset();
    conn->epollout = false;
    conn->large_messages = false;
    const std::lock_guard lock{conn->mutex};
    conn->fd = m_loop->add_fd(conn->socket.native_handle(), EPOLLOUT, socket_callback(conn));
    return true;
  }

  // Another connection has the peer's address and port (docs/semantics.md): this one is
  // refused with a refusal greeting, which tells a netio3 client to try another source port.
  void refuse_address_in_use(Connection& conn) {
    const auto refusal = detail::encode_refusal_greeting(detail::ASYNCMSG_PROTOCOL);
    if (detail::send_now(conn.socket.native_handle(), refusal)) {
      linger(conn);
    } else {
      drain_and_close(conn.socket);
    }
  }

  void send_greeting(const std::shared_ptr<Connection>& conn) {
    const auto greeting = encode_greeting(Greeting{
        .minor = VERSION_MINOR, .max_message_size = static_cast<std::uint32_t>(m_max_message)});
    {
      const std::lock_guard lock{conn->mutex};
      conn->queue.append_copy(greeting);
      conn->flush_pending = true;
    }
    flush(conn);
  }

  bool on_greeting(const std::shared_ptr<Connection>& conn, const Greeting& greeting) {
    // Closed by the application during set-up: its close reports it (closed, no keys) and
    // the connection is never reported established.
    if (conn->close_requested.load(std::memory_order_relaxed)) return false;
    try {
      if (!conn->active()) attach_send_pool(*conn);
    } catch (const std::exception& e) {
      close(conn, fmt::format("cannot allocate send buffers: {}", e.what()), CloseCause::ERROR);
      return false;
    }
    {
      const std::lock_guard lock{conn->mutex};
      conn->max_send_message = std::min<std::size_t>(m_max_message, greeting.max_message_size);
    }
    NETIO3_DEBUG("asyncmsg: {} speaks protocol {}.{}, accepts messages up to {} bytes",
                 conn->remote, greeting.major, greeting.minor, greeting.max_message_size);
    return established(conn, capabilities(*conn));
  }

  bool on_message(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> message) {
    if (!still_open(*conn)) return false;
    conn->large_messages = message.size() >= FrameDecoder::DIRECT_MIN;
    return deliver(*conn, message);
  }

  void on_readable(const std::shared_ptr<Connection>& conn) {
    if (!m_scratch) m_scratch = std::make_unique_for_overwrite<std::uint8_t[]>(SCRATCH_SIZE);
    const int fd = conn->socket.native_handle();
    const auto on_greeting_cb = [&](const Greeting& g) { return on_greeting(conn, g); };
    const auto on_message_cb = [&](std::span<const std::uint8_t> message) {
      return on_message(conn, message);
    };
    const auto admit_cb = [&](std::size_t length) { return admit(*conn, length); };
    for (int i = 0; i < READS_PER_EVENT; ++i) {
      std::span<std::uint8_t> target = conn->decoder.direct_target();
      const bool direct = !target.empty();
      if (!direct) {
        // In a stream of large messages, read a frame header alone: the body then goes
        // straight into its message instead of partly through the scratch buffer (one
        // small read instead of copying what a full read brought of the body).
        const bool header_only = conn->large_messages && conn->decoder.at_frame_start();
        target = {m_scratch.get(), header_only ? FRAME_HEADER_SIZE : SCRATCH_SIZE};
      }
      const ssize_t n = ::recv(fd, target.data(), target.size(), MSG_DONTWAIT);
      if (n > 0) {
        const auto got = static_cast<std::size_t>(n);
        const auto status =
            direct ? conn->decoder.commit_direct(got, on_message_cb)
                   : conn->decoder.feed(target.first(got), on_greeting_cb, on_message_cb, admit_cb);
        if (shut_down() || conn->ending()) return;
        if (!after_decode(conn, status)) return;
        if (got < target.size()) return;  // drained for now
        continue;
      }
      if (n == 0) {
        if (conn->decoder.mid_item()) {
          // Abnormal: the peer vanished in the middle of a message; the part is dropped.
          NETIO3_WARN("asyncmsg: connection with {} closed by the peer in the middle of a message",
                      conn->remote);
          close(conn, "peer closed the connection in the middle of a message", CloseCause::PEER);
        } else {
          close(conn, "peer closed the connection", CloseCause::PEER);
        }
        return;
      }
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EINTR) continue;
      NETIO3_WARN("asyncmsg: connection with {}: receive failed: {}", conn->remote,
                  errno_text(err));
      close(conn, fmt::format("receive failed: {}", errno_text(err)), CloseCause::ERROR);
      return;
    }
  }

  // Returns true when no connection is waiting to be flushed.
  bool process_flush_list() {
    assert_loop_thread();
    {
      const std::lock_guard lock{m_flush_mutex};
      if (m_flush_list.empty()) return true;
      m_flush_work.swap(m_flush_list);
    }
    for (const auto& conn : m_flush_work) {
      if (shut_down()) break;
      flush(conn);
    }
    m_flush_work.clear();
    const std::lock_guard lock{m_flush_mutex};
    return m_flush_list.empty();
  }

  static void set_epollout(Connection& conn, bool on) {
    if (conn.epollout == on) return;
    conn.epollout = on;
    update_events(conn);
  }

  static void update_events(Connection& conn) {
    const std::uint32_t events =
        (conn.receive_paused ? 0U : std::uint32_t{EPOLLIN}) | (conn.epollout ? EPOLLOUT : 0U);
    const std::lock_guard lock{conn.mutex};
    conn.fd.modify(events);
  }

  // ---- receive memory (limits.max_receive_memory) -------------------------------------
  // A message body that does not arrive in one read holds memory until it is complete. It
  // is admitted only if the backend's total stays within the limit; otherwise its
  // connection stops reading (TCP pushes back on the sender) until memory is released.
  // Admitted messages can always complete, so honest peers never wait on each other in a
  // circle; paused connections resume in the order they paused.

  bool admit(Connection& conn, std::size_t length) {
    release_receive_memory(conn);  // a new body: the previous one is complete
    if (length > m_config.limits.max_receive_memory - m_receive_reserved) return false;
    m_receive_reserved += length;
    conn.reserved = length;
    return true;
  }

  void release_receive_memory(Connection& conn) {
    if (conn.reserved == 0) return;
    m_receive_reserved -= conn.reserved;
    conn.reserved = 0;
    if (!m_receive_waiting.empty() && !m_resume_posted) {
      m_resume_posted = true;
      std::weak_ptr<Backend> weak = weak_from_this();
      m_loop->post([weak] {
        if (auto self = weak.lock()) self->resume_waiting();
      });
    }
  }

  void pause_receiving(const std::shared_ptr<Connection>& conn) {
    NETIO3_DEBUG("asyncmsg: connection with {}: waiting for receive memory ({} of {} bytes held)",
                 conn->remote, m_receive_reserved, m_config.limits.max_receive_memory);
    conn->receive_paused = true;
    update_events(*conn);
    m_receive_waiting.push_back(conn);
  }

  void resume_waiting() {
    m_resume_posted = false;
    while (!m_receive_waiting.empty() && !shut_down()) {
      const auto conn = m_receive_waiting.front().lock();
      if (!conn || conn->ending() || !conn->receive_paused) {
        m_receive_waiting.pop_front();
        continue;
      }
      const auto status = conn->decoder.resume(
          [&](const Greeting& g) { return on_greeting(conn, g); },
          [&](std::span<const std::uint8_t> message) { return on_message(conn, message); },
          [&](std::size_t length) { return admit(*conn, length); });
      if (shut_down()) return;
      // Still first in line (perhaps with a later message of the kept bytes).
      if (status == FrameDecoder::Status::PAUSED) return;
      m_receive_waiting.pop_front();
      conn->receive_paused = false;
      if (conn->ending()) continue;
      if (after_decode(conn, status)) update_events(*conn);
    }
  }

  // Handles a decoder status on an open connection; false if the connection stopped.
  bool after_decode(const std::shared_ptr<Connection>& conn, FrameDecoder::Status status) {
    if (conn->reserved > 0 && !conn->decoder.in_body()) release_receive_memory(*conn);
    switch (status) {
      case FrameDecoder::Status::OK:
        return true;
      case FrameDecoder::Status::ERROR:
        if (conn->decoder.refused_address_in_use() && conn->phase == Phase::HANDSHAKE &&
            reconnect_from_new_source_port(conn)) {
          return false;
        }
        NETIO3_WARN("asyncmsg: closing connection with {}: {}", conn->remote,
                    conn->decoder.error());
        close(conn, conn->decoder.error(), CloseCause::ERROR);
        return false;
      case FrameDecoder::Status::STOPPED:
        return false;
      case FrameDecoder::Status::PAUSED:
        pause_receiving(conn);
        return false;
    }
    return false;
  }

  void flush(const std::shared_ptr<Connection>& conn) {
    std::array<iovec, MAX_IOV> iov{};
    std::vector<detail::SendLedger::Ticket> finished;
    std::vector<detail::PendingSend> finished_sends;
    for (int round = 0; round < WRITES_PER_FLUSH; ++round) {
      std::size_t count = 0;
      {
        const std::lock_guard lock{conn->mutex};
        if (conn->ending()) return;
        // Once the application asked to close, nothing more is handed to the kernel: what
        // was queued at that moment is reported as cancelled, deterministically.
        if (!conn->close_requested.load(std::memory_order_relaxed)) {
          count = conn->queue.gather(iov.data(), iov.size(), MAX_WRITE_BYTES);
        }
        if (count == 0) conn->flush_pending = false;
      }
      if (count == 0) {
        set_epollout(*conn, false);
        return;
      }
      msghdr msg{};
      msg.msg_iov = iov.data();
      msg.msg_iovlen = count;
      const ssize_t n = ::sendmsg(conn->socket.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) {
          set_epollout(*conn, true);
          return;
        }
        NETIO3_WARN("asyncmsg: connection with {}: send failed: {}", conn->remote, errno_text(err));
        close(conn, fmt::format("send failed: {}", errno_text(err)), CloseCause::ERROR);
        return;
      }
      finished.clear();
      finished_sends.clear();
      {
        const std::lock_guard lock{conn->mutex};
        conn->queue.consume(static_cast<std::size_t>(n), finished);
        for (const auto ticket : finished) {
          detail::PendingSend done;
          if (conn->ledger.complete(ticket, done)) finished_sends.push_back(done);
        }
      }
      for (const auto& done : finished_sends) {
        if (!completed(*conn, done)) return;
      }
    }
    // Still data after a full round: give other connections a turn, come back soon.
    request_flush(conn);
  }

  void linger(Connection& conn) {
    boost::system::error_code ec;
    conn.socket.shutdown(tcp::socket::shutdown_send, ec);
    if (ec) {
      drain_and_close(conn.socket);
      return;
    }
    const int fd = conn.socket.native_handle();
    m_lingering.push_back(
        Lingering{conn.io, std::move(conn.socket), fd, {}, Clock::now() + LINGER_TIMEOUT});
    auto it = std::prev(m_lingering.end());
    std::weak_ptr<Backend> weak = weak_from_this();
    it->fd = m_loop->add_fd(fd, EPOLLIN, [weak, fd](std::uint32_t) {
      if (auto self = weak.lock()) self->on_lingering_readable(fd);
    });
    const std::lock_guard lock{m_mutex};
    if (!m_timer_armed) {
      m_timer_armed = true;
      m_timer.start(HOUSEKEEPING_PERIOD);
    }
  }

  void on_lingering_readable(int fd) {
    assert_loop_thread();
    if (!m_scratch) m_scratch = std::make_unique_for_overwrite<std::uint8_t[]>(SCRATCH_SIZE);
    for (int i = 0; i < READS_PER_EVENT; ++i) {
      const ssize_t n = ::recv(fd, m_scratch.get(), SCRATCH_SIZE, MSG_DONTWAIT);
      if (n > 0) continue;  // discarded: the application closed this connection
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0 && errno == EINTR) continue;
      break;  // EOF or error: the peer is done
    }
    const auto it = std::find_if(m_lingering.begin(), m_lingering.end(),
                                 [fd](const Lingering& l) { return l.native == fd; });
    if (it == m_lingering.end()) return;
    it->fd.close();
    boost::system::error_code ec;
    it->socket.close(ec);
    m_lingering.erase(it);
  }

  // Lingering sockets and paused listeners.
  void housekeeping() {
    assert_loop_thread();
    if (shut_down()) return;
    const auto now = Clock::now();
    std::vector<std::shared_ptr<Listener>> resume;
    {
      const std::lock_guard lock{m_mutex};
      std::erase_if(m_paused, [&](const std::shared_ptr<Listener>& l) {
        if (now < l->resume_at) return false;
        resume.push_back(l);
        return true;
      });
    }
    for (const auto& listener : resume) {
      const std::lock_guard lock{listener->mutex};
      if (listener->closed) continue;
      listener->fd.modify(EPOLLIN);
    }
    for (auto it = m_lingering.begin(); it != m_lingering.end();) {
      if (now < it->deadline) {
        ++it;
        continue;
      }
      it->fd.close();
      drain_and_close(it->socket);
      it = m_lingering.erase(it);
    }
    const std::lock_guard lock{m_mutex};
    if (m_paused.empty() && m_lingering.empty()) {
      m_timer_armed = false;
      m_timer.stop();
    }
  }

  const std::shared_ptr<asio::io_context> m_io;  // never run: socket services only
  const std::shared_ptr<ChunkCache> m_chunks;
  const std::size_t m_max_message;
  std::unique_ptr<detail::BufferPool> m_shared_send_pool;
  std::mutex m_mutex;  // paused listeners, m_timer_armed

  std::vector<std::shared_ptr<Listener>> m_paused;
  bool m_timer_armed{false};

  std::mutex m_flush_mutex;
  std::vector<std::shared_ptr<Connection>> m_flush_list;

  // Loop thread only.
  std::vector<std::shared_ptr<Connection>> m_flush_work;
  std::unique_ptr<std::uint8_t[]> m_scratch;
  // Receive memory (loop thread only).
  std::size_t m_receive_reserved{0};
  std::deque<std::weak_ptr<Connection>> m_receive_waiting;
  bool m_resume_posted{false};
  std::list<Lingering> m_lingering;

  EventSignalHandle m_flush_signal;
  PrepareHookHandle m_prepare;
  EventTimerHandle m_timer;
};

}  // namespace

std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                               std::shared_ptr<BaseEventLoop> loop) {
  return std::make_unique<detail::BackendFacade<Backend>>(std::move(config), std::move(loop));
}

}  // namespace netio3::asyncmsg
