// UCX: active messages on one UCP worker per backend, driven by the shared EpollEventLoop
// through the worker's event fd. When the fd is readable, or before the loop would sleep,
// the worker is progressed until it has nothing left, then armed (ucp_worker_arm; BUSY
// means: progress again). No thread of our own, no polling.
//
// Connections (protocol version 3, docs/ucx.md). netio3 sets up its connections itself; UCX's
// listener and connection manager are not used (one malformed packet made them abort the
// process). A listen endpoint is netio3's own TCP socket on the loop. The client connects to
// it and both sides send a greeting and a HELLO on this TCP connection - the control channel -
// with their limits, a connection token and their UCP worker's address, all checked before
// anything is allocated for them. Each side then makes a UCP endpoint from the other's worker
// address, so UCX chooses its lanes (shared memory between processes of one host, RDMA where
// there is some, tcp otherwise), and reports the connection established. The control channel
// stays open: a close announces on it how many messages were sent, and its end (EOF, reset)
// tells at once that the peer's process died.
//
// Endpoints. UCX pairs the endpoints of two workers by the order in which each side created
// them, not by netio3's connection. All connections between two workers therefore share one
// UCP endpoint on each side (the first each side makes: they pair), and every active message
// carries the receiver's connection token, by which it is routed. The shared endpoint stays
// until it fails or the backend goes: closing it would fail its pair on the peer, which may
// be in use. A connection's close waits for its own sends; if the peer takes nothing at all
// for limits.close_timeout, the endpoint is closed by force, which ends every connection with
// that peer (it is not reading).
//
// UCX calls back only from inside ucp_worker_progress, and those callbacks only record: an
// arriving message goes into its connection's inbox, everything else into an event queue. The
// application's callbacks run afterwards, outside UCX, so they may send, close or destroy the
// backend.
//
// Messages: the receiver delivers strictly by sequence number, so a small eager message that
// overtakes an earlier rendezvous one waits in the inbox. Eager data is kept by UCX
// (persistent data) and handed to on_data_cb from UCX's buffer; rendezvous data is first
// received into a receive-pool buffer (or, when none fits, a heap buffer bounded by
// limits.max_message_size).
//
// Closing: a local close sends BYE (the last active message) and CLOSE on the control channel,
// waits at most limits.close_timeout for its sends to complete (forcing the endpoint closed
// after that), and reports; the peer closes once it has delivered everything before the BYE.

#include "backends/ucx/ucx_backend.hpp"

#include <algorithm>
#include <array>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <deque>
#include <dirent.h>
#include <mutex>
#include <optional>
#include <poll.h>
#include <random>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "backends/ucx/ucp.hpp"
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
#include "common/sockaddr.hpp"
#include "common/tcp.hpp"
#include "common/thread_model.hpp"

namespace netio3::ucx {
namespace {

using namespace std::chrono_literals;

constexpr std::string_view NAME = "ucx";
// Data sends in flight per connection at most (UCX requests); two more for READY and BYE.
constexpr std::size_t MAX_SEND_DEPTH = 1024;
constexpr std::size_t CONTROL_OPS = 2;
constexpr std::size_t MAX_IOV = 16;
// Messages a connection may hold back for ordering (behind an unfinished rendezvous).
constexpr std::uint64_t MAX_REORDER = std::uint64_t{1} << 16U;
// Rendezvous bytes a connection receives at once at most (beyond one message).
constexpr std::size_t RECEIVE_WINDOW = std::size_t{64} << 20U;
// Per wake-up: progress calls before the loop turns to other work.
constexpr int PROGRESS_ROUNDS = 64;
// Copy sends' staging memory a connection keeps for reuse (beyond it, freed after use).
constexpr std::size_t STAGING_BUDGET = std::size_t{8} << 20U;
// Staging memory from this size on is mapped (ucp_mem_map) when allocated, so that UCX can
// send it zero-copy or by rendezvous instead of copying it once more into its own buffers.
constexpr std::size_t STAGING_MAP_MIN = std::size_t{16} << 10U;
// Control channel: accepts and reads per readiness event.
constexpr int ACCEPTS_PER_EVENT = 64;
constexpr int READS_PER_EVENT = 8;
// A server greets as soon as it accepts. A client that gets no greeting this long after its
// TCP connection is up gives up (at most limits.connect_timeout): the server is not a UCX
// backend of protocol 3 - an older netio3 UCX backend listens with UCX's connection manager,
// which waits for more bytes and never answers, and nothing but time tells it from a busy
// server. 2 s refused a client under ASan right after a flood of 1100 connections, whose
// backlog the server accepted first.
constexpr auto SERVER_GREETING_TIMEOUT = 5s;
// After a close the control socket waits this long for the peer's end (LingeringSockets).
constexpr auto LINGER_TIMEOUT = 2s;

using detail::CloseCause;
using detail::Phase;

class Backend;
struct Connection;

// Receive buffers that rendezvous messages land in: one endpoint's, or shared.
struct RecvPool {
  RecvPool(ucp_context_h context, std::size_t num_buf, std::size_t buf_size)
      : pool{num_buf, buf_size, 0, false}, map{context, pool.region()} {}
  detail::BufferPool pool;  // loop thread only
  MemoryMap map;
};

// One send in flight (or a free slot). Stable address: the request's user data.
static_assert(AM_PREFIX_MAX == MAX_HEADER_SIZE, "send_data's header_data travels as the prefix");

struct SendOp {
  Connection* conn{nullptr};
  std::uint32_t slot{0};
  bool control{false};
  detail::SendLedger::Ticket ticket{0};
  std::size_t bytes{0};
  NetworkBuffer* buffer{nullptr};                       // buffered sends
  std::array<std::uint8_t, AM_HEADER_MAX> am_header{};  // fixed part + prefix
  std::size_t am_header_len{0};
  std::array<ucp_dt_iov_t, MAX_IOV + 1> iov{};
  std::unique_ptr<std::uint8_t[]> staging;  // copy sends (not zero-filled)
  std::size_t staging_capacity{0};
  MemoryMap staging_map;  // declared after staging: unmapped before it is freed
};

// One message of a connection's inbox, by sequence number.
struct Incoming {
  enum class Stage : std::uint8_t { EMPTY, RNDV, RECEIVING, READY, FAILED, DROPPED };
  Stage stage{Stage::EMPTY};
  MessageType type{};
  ucs_status_t status{UCS_OK};
  std::size_t length{0};  // READY: the whole message; RNDV, RECEIVING: the UCX payload
  std::array<std::uint8_t, AM_PREFIX_MAX> prefix{};  // RNDV, RECEIVING: the message's start
  std::uint8_t prefix_len{0};
  void* desc{nullptr};  // RNDV: UCX's descriptor; READY from eager: data to release
  const std::uint8_t* data{nullptr};
  NetworkBuffer* buffer{nullptr};        // rendezvous into a receive-pool buffer
  std::unique_ptr<std::uint8_t[]> heap;  // rendezvous into the heap, or a copied message
  Connection* conn{nullptr};             // RECEIVING: for the completion
};

// The UCP endpoint to a peer worker (see "Endpoints" above). Loop thread only; its address is
// the error handler's argument, so it lives until UCX has closed the endpoint.
struct Endpoint {
  Endpoint(std::uint64_t id_, std::string peer_) : id{id_}, peer{std::move(peer_)} {}
  const std::uint64_t id;
  const std::string peer;  // the peer worker's address
  Backend* backend{nullptr};
  ucp_ep_h handle{nullptr};
  std::vector<std::weak_ptr<Connection>> users;         // the connections sending on it
  std::chrono::steady_clock::time_point last_progress;  // a send on it completed
  bool proven{false};  // a READY came from the peer worker: it speaks UCX with us
  bool failed{false};
  bool closing{false};
};

struct Listener {
  Listener(std::uint64_t id_, EndPointAddress address_, const ConnectionParameters& params_)
      : id{id_}, address{std::move(address_)}, params{params_} {}

  const std::uint64_t id;
  EndPointAddress address;
  const ConnectionParameters params;
  std::shared_ptr<RecvPool> shared_recv;       // recv_params.use_shared_receive_buffers
  std::mutex mutex;                            // accept (loop) vs close (any thread)
  detail::Socket socket;                       // under `mutex`
  FdHandle fd;                                 // under `mutex`
  EventTimerHandle resume;                     // under `mutex`: ends an accept pause
  bool closed{false};                          // under `mutex`
  std::optional<detail::AcceptPauses> pauses;  // loop thread only
};

// Its id is a random token: the peer addresses its messages to it (a stray or forged message
// must not land in another connection).
struct Connection : detail::ConnectionBase, std::enable_shared_from_this<Connection> {
  using ConnectionBase::ConnectionBase;

  Backend* backend{nullptr};  // for UCX callbacks, whose argument is the connection

  // Control channel (loop thread; control_fd is published under `mutex`, because the loop
  // may dispatch its first event before add_fd returns in another thread).
  detail::Socket control;
  FdHandle control_fd;
  detail::FrameDecoder decoder{MAX_CONTROL_FRAME, CONTROL_PROTOCOL};
  std::vector<std::uint8_t> control_out;    // the opening, while the socket would block
  std::optional<std::uint64_t> peer_total;  // the peer's CLOSE: messages it sent in all
  bool greeted{false};                      // the peer's HELLO arrived (control channel)
  bool peer_ready{false};                   // the peer's READY arrived (over UCX)

  // Under `mutex`.
  std::shared_ptr<Endpoint> ep;  // from the HELLO until the close releases it
  bool ep_released{false};
  bool ep_closing{false};  // the endpoint is being closed by force: no more sends on it
  // Its close completed: UCX no longer reads what the sends it still holds point to (it may
  // never complete them), so the close is reported without waiting for them; the connection
  // object stays until they complete, if ever.
  bool ep_gone{false};
  std::uint64_t peer_token{0};
  std::uint64_t peer_max{0};
  std::uint64_t unsent_bytes{0};
  std::uint64_t tx_seq{0};
  std::size_t data_ops{0};  // data sends in flight
  std::size_t requests{0};  // send requests UCX holds (data and BYE)
  // Sends that completed at once, whose SENT_AT_ONCE event is not handled yet: the close
  // is reported after their completions.
  std::size_t completions_queued{0};
  ucp_mem_h send_memh{nullptr};
  MemoryMap send_map;  // own send pool
  std::span<std::uint8_t> region;
  MemoryMap region_map;  // zero-copy
  // Grown on demand up to MAX_SEND_DEPTH + CONTROL_OPS, never shrunk: a deque keeps the
  // addresses UCX holds as request user data. An idle connection holds none.
  std::deque<SendOp> ops;
  std::vector<std::uint32_t> free_ops;
  std::size_t staging_bytes{0};  // held by ops' staging, in flight or kept

  // Loop thread only.
  std::shared_ptr<RecvPool> recv;
  std::deque<Incoming> inbox;  // inbox[i] has sequence number rx_next + i
  std::uint64_t rx_next{0};
  std::size_t receiving{0};
  std::size_t receiving_bytes{0};
  bool dirty{false};
  bool failed{false};      // a protocol error is being reported: ignore what follows
  std::string peer_error;  // the peer is gone; closed once what arrived is delivered
};

struct Event {
  enum class Kind : std::uint8_t { EP_ERROR, EP_CLOSED, SEND_DONE, SENT_AT_ONCE, PROTOCOL_ERROR };
  Kind kind{};
  std::uint64_t id{0};  // the connection's, or for EP_* the endpoint's
  std::uint32_t slot{0};
  ucs_status_t status{UCS_OK};
  std::shared_ptr<Connection> conn{};  // SENT_AT_ONCE
  std::uint64_t key{0};
  NetworkBuffer* buffer{nullptr};
  std::string reason{};
};

class Backend : public detail::ConnectionEngine<Backend, Connection, Listener>,
                public std::enable_shared_from_this<Backend> {
 public:
  static constexpr BackendType TYPE = BackendType::UCX;
  using Engine = detail::ConnectionEngine<Backend, Connection, Listener>;

  Backend(NetworkConfig config, std::shared_ptr<BaseEventLoop> loop)
      : Engine{NAME, config, std::move(loop), config.thread_safety},
        m_transports{choose_transports(m_config.mode)},
        m_rng{std::random_device{}()},
        m_events_mutex{m_thread.safe()} {
    const auto& shared_tx = m_config.shared_send_buffers;
    if (shared_tx.use_shared_send_buffers) {
      m_shared_send_pool =
          std::make_unique<detail::BufferPool>(shared_tx.num_buf, shared_tx.buf_size, 0, safe());
    }
    NETIO3_DEBUG("ucx: transports {}{}, thread safety {}",
                 m_transports.tls.empty() ? "chosen by UCX" : m_transports.tls,
                 m_transports.from_environment ? " (UCX_TLS)" : "", m_config.thread_safety);
  }

  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  Backend(Backend&&) = delete;
  Backend& operator=(Backend&&) = delete;
  ~Backend() { shutdown(); }

  void start() {
    start_engine();
    std::weak_ptr<Backend> weak = weak_from_this();
    m_kick = m_loop->create_signal([weak] {
      if (auto self = weak.lock()) {
        self->m_kick_pending.store(false);
        self->progress();
      }
    });
    m_greeting_deadlines.emplace(
        *m_loop, NAME,
        std::min<std::chrono::milliseconds>(m_config.limits.connect_timeout,
                                            SERVER_GREETING_TIMEOUT),
        [](const Connection& conn) { return conn.phase == Phase::HANDSHAKE && !conn.greeted; },
        [weak](const std::shared_ptr<Connection>& conn, const std::string& reason) {
          if (auto self = weak.lock()) {
            const auto why = fmt::format(
                "{}: the server did not greet (it is not a netio3 ucx backend of protocol {} or "
                "later; older ones listen with UCX's connection manager)",
                reason, PROTOCOL_VERSION);
            NETIO3_WARN("ucx: connection to {}: {}", conn->remote, why);
            self->close(conn, why, CloseCause::ERROR);
          }
        },
        "waiting for the server's greeting", false);
    m_close_deadlines.emplace(
        *m_loop, NAME, m_config.limits.close_timeout,
        [](const Connection& conn) { return conn.phase == Phase::CLOSING && !conn.ep_released; },
        [weak](const std::shared_ptr<Connection>& conn, const std::string&) {
          if (auto self = weak.lock()) self->close_timed_out(conn);
        },
        "closing", false);
    m_peer_close_deadlines.emplace(
        *m_loop, NAME, m_config.limits.close_timeout,
        [](const Connection& conn) {
          return conn.phase == Phase::HANDSHAKE || conn.phase == Phase::OPEN;
        },
        [weak](const std::shared_ptr<Connection>& conn, const std::string&) {
          if (auto self = weak.lock()) self->peer_close_timed_out(conn);
        },
        "the peer's close", false);
    m_lingering.emplace(*m_loop, LINGER_TIMEOUT);
  }

  void shutdown() noexcept {
    if (!begin_shutdown()) return;
    const auto all = take_everything();
    m_prepare.close();
    m_kick.close();
    m_efd.close();
    for (auto* deadlines : {&m_greeting_deadlines, &m_close_deadlines, &m_peer_close_deadlines}) {
      if (*deadlines) (*deadlines)->close();
    }
    for (auto& listener : all.listeners) close_listener_socket(*listener);
    // Every connection UCX may still hold something of (closed ones too: m_closing).
    std::vector<std::shared_ptr<Connection>> conns = m_registry.indexed();
    if (!m_worker) {
      // Never connected or listened: nothing of UCX's to wind down.
      for (const auto& conn : conns) drop_control(*conn);
      if (m_lingering) m_lingering->close_all();
      NETIO3_DEBUG("ucx: backend shut down");
      return;
    }
    // From here on, what UCX reports only settles request counts.
    const auto settle = [&] {
      std::vector<Event> reported;
      {
        const std::lock_guard lock{m_events_mutex};
        reported.swap(m_events);
      }
      for (const auto& event : reported) {
        if (event.kind == Event::Kind::EP_CLOSED) {
          m_endpoints.erase(event.id);
          continue;
        }
        if (event.kind != Event::Kind::SEND_DONE) continue;
        const auto it = std::find_if(conns.begin(), conns.end(),
                                     [&](const auto& c) { return c->id == event.id; });
        if (it == conns.end()) continue;
        const std::lock_guard lock{(*it)->mutex};
        --(*it)->requests;
        release_op(**it, (*it)->ops[event.slot]);
      }
    };
    settle();
    ucp_worker_h worker = m_worker->get();
    const auto deadline = std::chrono::steady_clock::now() + m_config.limits.close_timeout;
    const auto progress_until = [&](const auto& done) {
      for (settle(); !done() && std::chrono::steady_clock::now() < deadline; settle()) {
        if (ucp_worker_progress(worker) != 0 || ucp_worker_arm(worker) != UCS_OK) continue;
        pollfd fd{m_worker->event_fd(), POLLIN, 0};
        ::poll(&fd, 1, 10);
      }
    };
    // Open connections get BYE, so that their peers close at once once they have
    // delivered what came before it. No send is accepted from here on.
    std::vector<std::shared_ptr<Connection>> announced;
    for (const auto& conn : conns) {
      Phase previous{};
      {
        const std::lock_guard lock{conn->mutex};
        previous = conn->phase;
        conn->phase = Phase::CLOSED;
        conn->ledger.cancel_all();
      }
      if (previous == Phase::OPEN && conn->peer_error.empty() &&
          send_control(*conn, MessageType::BYE) == UCS_OK) {
        announced.push_back(conn);
      }
    }
    // Rendezvous receives in flight must end before their endpoints close (UCX aborts
    // otherwise), and BYE must be out before the endpoints close gracefully.
    progress_until([&] {
      return std::all_of(conns.begin(), conns.end(), [](const auto& c) {
        const std::lock_guard lock{c->mutex};
        return c->receiving == 0 && c->requests == 0;
      });
    });
    // The peers learn how many messages to expect, then the end of the control channel.
    for (const auto& conn : conns) {
      if (std::find(announced.begin(), announced.end(), conn) != announced.end() &&
          conn->control.valid()) {
        (void)detail::send_now(conn->control.get(), encode_close(conn->tx_seq));
      }
      drop_control(*conn);
    }
    if (m_lingering) m_lingering->close_all();
    // Every endpoint is closed, gracefully where nothing went wrong (a forced close can lose
    // what UCX reported sent), without callbacks.
    std::vector<void*> closing;
    for (const auto& [id, endpoint] : m_endpoints) {
      if (endpoint->closing || endpoint->handle == nullptr) continue;
      endpoint->closing = true;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = endpoint->failed ? static_cast<unsigned>(UCP_EP_CLOSE_FLAG_FORCE) : 0U;
      const ucs_status_ptr_t request = ucp_ep_close_nbx(endpoint->handle, &param);
      if (request != nullptr && !UCS_PTR_IS_ERR(request)) closing.push_back(request);
    }
    // Closes that were under way before the shutdown complete through their callbacks.
    progress_until([&] {
      return std::all_of(closing.begin(), closing.end(), [](void* request) {
        return ucp_request_check_status(request) != UCS_INPROGRESS;
      });
    });
    for (void* request : closing) {
      if (ucp_request_check_status(request) == UCS_INPROGRESS) {
        NETIO3_WARN("ucx: an endpoint did not close within {} ms",
                    m_config.limits.close_timeout.count());
      }
      ucp_request_free(request);
    }
    for (const auto& conn : conns) {
      for (auto& slot : conn->inbox) {
        if (slot.stage != Incoming::Stage::RECEIVING) release(*conn, slot);
      }
      conn->region_map = MemoryMap{};
      conn->send_map = MemoryMap{};
      unmap_staging(*conn);
      if (conn->recv) conn->recv->map = MemoryMap{};
    }
    for (const auto& listener : all.listeners) {
      if (listener->shared_recv) listener->shared_recv->map = MemoryMap{};
    }
    if (m_global_recv) m_global_recv->map = MemoryMap{};
    if (m_delivering != nullptr && m_delivering->desc != nullptr) {
      ucp_am_data_release(worker, std::exchange(m_delivering->desc, nullptr));
    }
    m_shared_send_map = MemoryMap{};
    {
      const std::lock_guard lock{m_events_mutex};
      m_events.clear();
    }
    m_dirty.clear();
    m_closing.clear();
    m_peers.clear();
    m_endpoints.clear();
    m_registry.clear_index();
    // No callback can come after this; connections that outlive us hold no UCX resource.
    m_worker.reset();
    NETIO3_DEBUG("ucx: backend shut down");
  }

  // ---- API ---------------------------------------------------------------------------

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                       const ConnectionParameters& params) {
    const ApiCall call = open_call(address, params, true);
    const auto fail = [&](std::string_view why) {
      return FailedOpenListenEndpoint(fmt::format("ucx: cannot listen on {}: {}", address, why));
    };
    if (!detail::to_socket_address(address)) throw fail("not a numeric IP address");
    try {
      ensure_worker(address, true);
    } catch (const std::runtime_error& e) {
      throw fail(e.what());
    }
    const auto held = m_registry.lock();
    if (address.port != 0) m_registry.check_listen_free(held, address);
    auto listener = std::make_shared<Listener>(next_id(), address, params);
    try {
      if (params.recv_params.use_shared_receive_buffers) {
        listener->shared_recv = std::make_shared<RecvPool>(
            m_worker->context(), params.recv_params.num_buf, params.recv_params.buf_size);
      }
      auto [socket, bound] = detail::listen_tcp(address);
      m_registry.check_listen_free(held, bound);
      listener->address = bound;
      listener->pauses.emplace(NAME, bound);
      std::weak_ptr<Listener> weak_listener = listener;
      const std::lock_guard lock{listener->mutex};
      listener->socket = std::move(socket);
      // Made now, while descriptors are to be had: it ends the pauses that descriptor
      // exhaustion causes.
      listener->resume = m_loop->create_timer([weak_listener] {
        if (auto l = weak_listener.lock()) {
          const std::lock_guard relock{l->mutex};
          if (!l->closed) l->fd.modify(EPOLLIN);
        }
      });
      listener->fd = m_loop->add_fd(listener->socket.get(), EPOLLIN,
                                    fd_callback<&Backend::on_acceptable>(listener));
    } catch (const ListenEndpointAlreadyExists&) {
      throw;
    } catch (const std::runtime_error& e) {
      throw fail(e.what());
    }
    const EndPointAddress actual = listener->address;
    warn_if_off_devices(actual, true);
    m_registry.add_listener(held, actual, std::move(listener));
    NETIO3_DEBUG("ucx: listening on {}", actual);
    return actual;
  }

  void open_active_endpoint(const EndPointAddress& address, const ConnectionParameters& params) {
    const ApiCall call = open_call(address, params, false);
    if (!detail::to_socket_address(address)) {
      throw InvalidEndpointAddress(fmt::format("ucx: {} is not a numeric IP address", address));
    }
    const auto fail = [&](std::string_view why) {
      return FailedOpenActiveEndpoint(fmt::format("ucx: cannot connect to {}: {}", address, why));
    };
    try {
      ensure_worker(address, false);
    } catch (const std::runtime_error& e) {
      throw fail(e.what());
    }
    warn_if_off_devices(address, false);
    std::shared_ptr<Connection> conn;
    int error = 0;
    {
      const auto held = m_registry.lock();
      m_registry.check_connection_free(held, address);
      try {
        conn = make_connection(held, address, params, 0, Phase::CONNECTING, m_global_recv);
        auto started = detail::connect_tcp(address, m_config.limits.peer_timeout);
        error = started.error;
        // Findable by its token before the loop can see the socket: the peer's first message
        // may arrive before this call returns.
        m_registry.index(conn);
        const std::lock_guard lock{conn->mutex};
        conn->control = std::move(started.socket);
        if (error == 0) {
          conn->control_fd = m_loop->add_fd(conn->control.get(), EPOLLOUT, control_callback(conn));
        }
      } catch (const InvalidConnectionParameters&) {
        if (conn) m_registry.forget(conn->id);
        throw;
      } catch (const std::runtime_error& e) {
        if (conn) m_registry.forget(conn->id);
        throw fail(e.what());
      }
      m_registry.add_connection(held, conn);
    }
    if (error != 0) {
      // Failed at once (no route, ...): reported like any refusal, from the loop.
      close_later(conn, fmt::format("connect failed: {}", detail::errno_text(error)),
                  CloseCause::ERROR);
      return;
    }
    track_setup(conn);
    NETIO3_DEBUG("ucx: connecting to {}", address);
  }

  NetioStatus send_data(const EndPointAddress& address, std::span<const iovec> iov,
                        std::span<const std::uint8_t> header, std::uint64_t key) {
    const ApiCall call{*this, "send_data"};
    const auto conn = zero_copy_target(address, iov, header);
    if (!conn) return NetioStatus::FAILED;
    return send_message(*conn, header, iov, SendKind::ZERO_COPY, detail::PendingSend{key, nullptr});
  }

  NetioStatus send_data_copy(const EndPointAddress& address, std::span<const iovec> iov,
                             std::span<const std::uint8_t> header, std::uint64_t key) {
    const ApiCall call{*this, "send_data_copy"};
    const auto conn = connection_for(address, "send_data_copy");
    if (!detail::header_ok(address, header, NAME)) return NetioStatus::FAILED;
    return send_message(*conn, header, iov, SendKind::COPY, detail::PendingSend{key, nullptr});
  }

 private:
  [[nodiscard]] bool safe() const noexcept { return m_thread.safe(); }

  // ---- the worker ----------------------------------------------------------------------

  // The UCP context and worker are made when the first endpoint is opened, because that
  // tells which network interface UCX's transports should use: the listen address's, or
  // the one that leads to the first peer. UCX's tcp transport listens on every device it
  // uses; restricted so, a server bound to 127.0.0.1 listens nowhere else. UCX_NET_DEVICES
  // in the environment wins; a wildcard listen address leaves the choice to UCX.
  void ensure_worker(const EndPointAddress& first, bool listening) {
    const std::lock_guard lock{m_worker_mutex};
    if (m_worker) return;
    std::string devices;
    if (const char* env = std::getenv("UCX_NET_DEVICES"); env == nullptr || *env == '\0') {
      const auto iface = listening ? detail::interface_holding(first.address)
                                   : detail::interface_towards(first.address);
      if (iface) {
        devices = *iface;
        m_devices_interface = *iface;
        // Shared memory is not a network device: RDMA mode keeps it, and every InfiniBand /
        // RoCE port (which open no sockets).
        if (m_config.mode == NetworkMode::RDMA) devices += rdma_ports();
      }
    }
    try {
      m_worker = std::make_unique<Worker>(m_transports, m_config.thread_safety, devices);
      ucp_am_handler_param_t handler{};
      handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                           UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      handler.id = AM_ID;
      handler.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
      handler.cb = &Backend::am_callback;
      handler.arg = this;
      check("ucp_worker_set_am_recv_handler",
            ucp_worker_set_am_recv_handler(m_worker->get(), &handler));
      m_own_address = parse_worker_address(m_worker->address());
      if (!m_own_address.error.empty()) {
        NETIO3_WARN(
            "ucx: this UCX's own worker address does not parse as netio3 expects ({}): "
            "peers' addresses will be refused",
            m_own_address.error);
      }
      if (m_shared_send_pool) {
        m_shared_send_map = MemoryMap{m_worker->context(), m_shared_send_pool->region()};
      }
      const auto& rx = m_config.shared_receive_buffers;
      if (rx.use_shared_receive_buffers) {
        m_global_recv = std::make_shared<RecvPool>(m_worker->context(), rx.num_buf, rx.buf_size);
      }
    } catch (const std::runtime_error& e) {
      m_shared_send_map = MemoryMap{};
      m_global_recv.reset();
      m_worker.reset();
      throw std::runtime_error(fmt::format("ucx: cannot start UCX: {}", e.what()));
    }
    std::weak_ptr<Backend> weak = weak_from_this();
    m_efd = m_loop->add_fd(m_worker->event_fd(), EPOLLIN, [weak](std::uint32_t) {
      if (auto self = weak.lock()) self->progress();
    });
    m_prepare = m_loop->add_polling_hook([weak] {
      auto self = weak.lock();
      return !self || self->may_sleep();
    });
    NETIO3_DEBUG("ucx: UCX started, network devices {}, worker address of {} bytes",
                 devices.empty() ? std::string{"chosen by UCX"} : devices,
                 m_worker->address().size());
  }

  // ",mlx5_0:1,..." for every InfiniBand / RoCE port of this host.
  static std::string rdma_ports() {
    std::string ports;
    const std::string root = "/sys/class/infiniband";
    DIR* devices = ::opendir(root.c_str());
    if (devices == nullptr) return ports;
    while (const dirent* device = ::readdir(devices)) {
      if (device->d_name[0] == '.') continue;
      const std::string dir = root + "/" + device->d_name + "/ports";
      DIR* list = ::opendir(dir.c_str());
      if (list == nullptr) continue;
      while (const dirent* port = ::readdir(list)) {
        if (port->d_name[0] != '.') ports += fmt::format(",{}:{}", device->d_name, port->d_name);
      }
      ::closedir(list);
    }
    ::closedir(devices);
    return ports;
  }

  // An endpoint on an interface that UCX was not set up for: its peers may not reach this
  // process over UCX.
  void warn_if_off_devices(const EndPointAddress& address, bool listening) const {
    if (m_devices_interface.empty()) return;
    const auto iface = listening ? detail::interface_holding(address.address)
                                 : detail::interface_towards(address.address);
    if (!iface || *iface == m_devices_interface) return;
    NETIO3_WARN(
        "ucx: {} {} goes through {}, but UCX's transports were set up on {} only (the "
        "interface of the backend's first endpoint); peers that cannot reach {} will fail to "
        "connect: set UCX_NET_DEVICES to the interfaces the backend needs",
        listening ? "listen endpoint" : "connection to", address, *iface, m_devices_interface,
        m_devices_interface);
  }

  // ---- connections -----------------------------------------------------------------

  // Under the registry's lock (`held`): the token must stay unused until it is indexed.
  std::shared_ptr<Connection> make_connection(const Registry::Lock& held,
                                              const EndPointAddress& remote,
                                              const ConnectionParameters& params,
                                              std::uint64_t listener_id, Phase initial,
                                              std::shared_ptr<RecvPool> shared) {
    auto conn =
        std::make_shared<Connection>(new_token(held), remote, params, listener_id, safe(), initial);
    conn->backend = this;
    if (shared) {
      conn->recv = std::move(shared);
    } else if (params.recv_params.num_buf > 0) {
      conn->recv = std::make_shared<RecvPool>(m_worker->context(), params.recv_params.num_buf,
                                              params.recv_params.buf_size);
    }
    const auto& zc = params.send_zero_copy_params;
    if (zc.mr_start != nullptr && zc.buf_size > 0) {
      conn->region = {zc.mr_start, zc.buf_size};
      conn->region_map = MemoryMap{m_worker->context(), conn->region};
    }
    detail::attach_send_pool(*conn, m_shared_send_pool.get(), 0, safe());
    if (conn->own_send_pool) {
      conn->send_map = MemoryMap{m_worker->context(), conn->own_send_pool->region()};
      conn->send_memh = conn->send_map.get();
    } else if (conn->send_pool != nullptr) {
      conn->send_memh = m_shared_send_map.get();
    }
    return conn;
  }

  // A random connection token that no connection of this backend has: messages are routed
  // by it, and a stray or forged message must not land in another connection.
  std::uint64_t new_token(const Registry::Lock& held) {
    while (true) {
      const std::uint64_t token = m_rng();
      if (token != 0 && !m_registry.id_in_use(held, token)) return token;
    }
  }

  [[nodiscard]] static EndpointCapabilities capabilities(const Connection& conn) {
    return EndpointCapabilities{.send_buffered = conn.send_pool != nullptr,
                                .send_copy = true,
                                .send_zero_copy = !conn.region.empty(),
                                .receive = true};
  }

  // ---- the control channel ---------------------------------------------------------

  FdCallback control_callback(const std::shared_ptr<Connection>& conn) {
    return fd_callback<&Backend::on_control_event>(conn);
  }

  void close_listener_socket(Listener& listener) noexcept {
    const std::lock_guard lock{listener.mutex};
    if (listener.closed) return;
    listener.closed = true;
    listener.fd.close();
    listener.resume.close();
    listener.socket.close();
  }

  void on_acceptable(const std::shared_ptr<Listener>& listener, std::uint32_t /*events*/) {
    for (int i = 0; i < ACCEPTS_PER_EVENT && !shut_down(); ++i) {
      sockaddr_storage peer{};
      socklen_t len = sizeof(peer);
      detail::Socket socket;
      {
        const std::lock_guard lock{listener->mutex};
        if (listener->closed) return;
        socket = detail::Socket{::accept4(listener->socket.get(),
                                          reinterpret_cast<sockaddr*>(&peer),  // NOLINT
                                          &len, SOCK_NONBLOCK | SOCK_CLOEXEC)};
      }
      if (!socket.valid()) {
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK) return;
        if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
          pause_listener(*listener, fmt::format("accept failed: {}", detail::errno_text(err)));
          return;
        }
        NETIO3_DEBUG("ucx: accept on {} failed: {}", listener->address, detail::errno_text(err));
        continue;
      }
      if (detail::descriptor_table_nearly_full(socket.get())) {
        // Accepting on would leave UCX (and the application) no descriptor: UCX's tcp
        // transport gives up its listener for good when its own accept fails.
        pause_listener(*listener,
                       fmt::format("the descriptor table is nearly full (descriptor {} of "
                                   "RLIMIT_NOFILE); the connection is refused",
                                   socket.get()));
        return;
      }
      listener->pauses->accepted();
      const auto remote = detail::to_endpoint_address(&peer, len);
      if (!remote) continue;
      accept_one(listener, std::move(socket), *remote);
    }
  }

  void pause_listener(Listener& listener, const std::string& why) {
    listener.pauses->paused(why);
    const std::lock_guard lock{listener.mutex};
    if (listener.closed) return;
    listener.fd.modify(0);
    listener.resume.start_once(detail::AcceptPauses::BACKOFF);
  }

  void accept_one(const std::shared_ptr<Listener>& listener, detail::Socket socket,
                  const EndPointAddress& remote) {
    if (const auto why = detail::configure_stream(socket.get(), m_config.limits.peer_timeout);
        !why.empty()) {
      NETIO3_WARN("ucx: cannot configure the connection from {} on {}: {}", remote,
                  listener->address, why);
      return;
    }
    std::shared_ptr<Connection> conn;
    {
      const auto held = m_registry.lock();
      const auto admission = Engine::admission(held, *listener, remote);
      if (admission == Admission::LISTENER_CLOSED) return;
      if (admission == Admission::SOURCE_PORT_COLLISION) {
        // The refusal greeting tells a netio3 client to connect from another port.
        if (detail::send_now(socket.get(), detail::encode_refusal_greeting(CONTROL_PROTOCOL))) {
          m_lingering->add(std::move(socket));
        }
        return;
      }
      try {
        conn = make_connection(held, remote, listener->params, listener->id, Phase::HANDSHAKE,
                               listener->shared_recv ? listener->shared_recv : m_global_recv);
        m_registry.index(conn);
        const std::lock_guard lock{conn->mutex};
        conn->control = std::move(socket);
        conn->control_fd = m_loop->add_fd(conn->control.get(), EPOLLIN, control_callback(conn));
      } catch (const std::exception& e) {
        NETIO3_WARN("ucx: refusing a connection on {} from {}: {}", listener->address, remote,
                    e.what());
        if (conn) m_registry.forget(conn->id);
        return;
      }
      m_registry.add_connection(held, conn);
    }
    track_setup(conn);
    NETIO3_DEBUG("ucx: accepted a connection from {} on {}", remote, listener->address);
    // The server greets at once; the client greets as soon as its connection is up.
    write_control(conn, opening(*conn));
  }

  std::vector<std::uint8_t> opening(const Connection& conn) const {
    return encode_opening(
        Hello{.mode = m_config.mode == NetworkMode::RDMA ? std::uint8_t{1} : std::uint8_t{0},
              .max_message_size = m_config.limits.max_message_size,
              .token = conn.id,
              .worker_address = m_worker->address()});
  }

  // Writes control bytes; what would block waits for EPOLLOUT. Loop thread.
  void write_control(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> bytes) {
    if (!conn->control.valid()) return;
    if (conn->control_out.empty()) {
      while (!bytes.empty()) {
        const ssize_t n =
            ::send(conn->control.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
          bytes = bytes.subspan(static_cast<std::size_t>(n));
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        const auto reason =
            fmt::format("sending on the control connection failed: {}", detail::errno_text(errno));
        close(conn, reason, CloseCause::ERROR);
        return;
      }
      if (bytes.empty()) return;
    }
    conn->control_out.insert(conn->control_out.end(), bytes.begin(), bytes.end());
    const std::lock_guard lock{conn->mutex};
    conn->control_fd.modify(EPOLLIN | EPOLLOUT);
  }

  void flush_control(const std::shared_ptr<Connection>& conn) {
    std::vector<std::uint8_t> pending = std::move(conn->control_out);
    conn->control_out.clear();
    {
      const std::lock_guard lock{conn->mutex};
      conn->control_fd.modify(EPOLLIN);
    }
    write_control(conn, pending);
  }

  void on_control_event(const std::shared_ptr<Connection>& conn, std::uint32_t events) {
    if (shut_down() || !conn->control.valid()) return;
    if (conn->phase == Phase::CONNECTING) {
      const int err = detail::connect_result(conn->control.get());
      if (err != 0) {
        close(conn, fmt::format("connect failed: {}", detail::errno_text(err)), CloseCause::ERROR);
        return;
      }
      if (detail::connected_to_itself(conn->control.get())) {
        close(conn, "connect failed: nothing listens there (the socket connected to itself)",
              CloseCause::ERROR);
        return;
      }
      {
        const std::lock_guard lock{conn->mutex};
        conn->phase = Phase::HANDSHAKE;
        conn->control_fd.modify(EPOLLIN);
      }
      m_greeting_deadlines->track(conn);
      write_control(conn, opening(*conn));
      return;
    }
    if ((events & EPOLLOUT) != 0 && !conn->control_out.empty()) {
      flush_control(conn);
      if (shut_down() || !conn->control.valid()) return;
    }
    if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) != 0) read_control(conn);
  }

  [[nodiscard]] bool control_active(const Connection& conn) const noexcept {
    return !shut_down() && conn.control.valid() &&
           (conn.phase == Phase::HANDSHAKE || conn.phase == Phase::OPEN);
  }

  void read_control(const std::shared_ptr<Connection>& conn) {
    std::array<std::uint8_t, 4096> buffer{};
    for (int i = 0; i < READS_PER_EVENT; ++i) {
      const ssize_t n = ::recv(conn->control.get(), buffer.data(), buffer.size(), MSG_DONTWAIT);
      if (n > 0) {
        const auto status = conn->decoder.feed(
            std::span<const std::uint8_t>{buffer.data(), static_cast<std::size_t>(n)},
            [&](const detail::Greeting&) { return true; },
            [&](std::span<const std::uint8_t> frame) { return on_control_frame(conn, frame); });
        if (!control_active(*conn)) return;
        if (status == detail::FrameDecoder::Status::ERROR) {
          if (conn->decoder.refused_address_in_use() && conn->phase == Phase::HANDSHAKE &&
              !conn->greeted && reconnect_from_new_source_port(conn)) {
            return;
          }
          protocol_error_now(conn, conn->decoder.error());
          return;
        }
        if (static_cast<std::size_t>(n) < buffer.size()) return;
        continue;
      }
      if (n == 0) {
        on_control_end(conn, "the peer closed the control connection");
        return;
      }
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EINTR) continue;
      on_control_end(conn,
                     fmt::format("the control connection failed: {}", detail::errno_text(err)));
      return;
    }
  }

  // The server refused `conn` because it has a connection from its source address and port:
  // connects the control channel again from a new one (at most SOURCE_PORT_RETRIES times).
  // False when it may not or could not; the caller then closes it.
  bool reconnect_from_new_source_port(const std::shared_ptr<Connection>& conn) {
    if (!detail::retry_from_new_source_port(*conn, NAME)) return false;
    detail::ConnectStart started;
    std::string why;
    try {
      started = detail::connect_tcp(conn->remote, m_config.limits.peer_timeout);
      if (started.error != 0) why = "connect failed: " + detail::errno_text(started.error);
    } catch (const std::runtime_error& e) {
      why = e.what();
    }
    if (!why.empty()) {
      NETIO3_WARN("ucx: connecting again to {}: {}", conn->remote, why);
      return false;
    }
    conn->control_out.clear();
    conn->decoder.reset();
    const std::lock_guard lock{conn->mutex};
    conn->control_fd.close();
    conn->control = std::move(started.socket);
    conn->phase = Phase::CONNECTING;
    conn->control_fd = m_loop->add_fd(conn->control.get(), EPOLLOUT, control_callback(conn));
    return true;
  }

  // A protocol error on the control channel: that one connection goes, with the reason.
  void protocol_error_now(const std::shared_ptr<Connection>& conn, const std::string& why) {
    NETIO3_WARN("ucx: closing connection with {}: {}", conn->remote, why);
    close(conn, why, CloseCause::ERROR);
  }

  // Returns whether to go on decoding.
  bool on_control_frame(const std::shared_ptr<Connection>& conn,
                        std::span<const std::uint8_t> frame) {
    if (conn->decoder.frame_type() == FRAME_HELLO) {
      on_hello(conn, frame);
    } else {
      const auto total = decode_close(frame);
      if (!total) {
        protocol_error_now(conn, fmt::format("a CLOSE of {} bytes", frame.size()));
      } else if (!conn->greeted) {
        protocol_error_now(conn, "CLOSE before HELLO");
      } else if (!conn->peer_total) {
        // The peer closed: deliver what it sent, up to its BYE (service_inbox), within
        // close_timeout.
        conn->peer_total = *total;
        m_peer_close_deadlines->track(conn);
        mark_dirty(*conn);
      }
    }
    return control_active(*conn);
  }

  void on_hello(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> frame) {
    if (conn->greeted || conn->phase != Phase::HANDSHAKE) {
      protocol_error_now(conn, "a second HELLO");
      return;
    }
    std::string error;
    const auto hello = decode_hello(frame, error);
    if (!hello) {
      protocol_error_now(conn, error);
      return;
    }
    const auto address = parse_worker_address(hello->worker_address);
    if (!address.error.empty()) {
      protocol_error_now(conn, fmt::format("HELLO with {}", address.error));
      return;
    }
    if (const auto bad = check_same_host_transports(address, m_own_address); !bad.empty()) {
      protocol_error_now(conn, fmt::format("HELLO with {}", bad));
      return;
    }
    if (impersonates(address, m_own_address)) {
      // UCX would connect to itself and keep that connection.
      protocol_error_now(conn,
                         "HELLO with a worker address that names this process's own UCX "
                         "transports under another worker's id");
      return;
    }
    std::shared_ptr<Endpoint> endpoint;
    try {
      endpoint = acquire_endpoint(hello->worker_address);
    } catch (const std::runtime_error& e) {
      const auto reason = fmt::format("cannot reach the peer over UCX: {}", e.what());
      NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
      close(conn, reason, CloseCause::ERROR);
      return;
    }
    endpoint->users.push_back(conn);
    conn->greeted = true;
    {
      const std::lock_guard lock{conn->mutex};
      conn->ep = std::move(endpoint);
      conn->peer_token = hello->token;
      conn->peer_max = hello->max_message_size;
    }
    NETIO3_DEBUG("ucx: {} speaks protocol {}, accepts messages up to {} bytes ({} mode)",
                 conn->remote, PROTOCOL_VERSION, hello->max_message_size,
                 hello->mode == 1 ? "rdma" : "tcp");
    // Our first message over UCX; the connection is established on each side when the
    // other's has arrived, which proves that UCX reaches the peer (service_inbox).
    const auto ready = send_control(*conn, MessageType::READY);
    if (ready != UCS_OK) {
      const auto reason = fmt::format("sending READY failed: {}", status_text(ready));
      NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
      close(conn, reason, CloseCause::ERROR);
      return;
    }
    mark_dirty(*conn);  // the peer's READY may be here already
  }

  // The control connection ended (EOF or error) while the connection is set up or open.
  void on_control_end(const std::shared_ptr<Connection>& conn, const std::string& how) {
    drop_control(*conn);
    if (conn->peer_total) return;  // after CLOSE: its messages are still arriving
    if (conn->phase != Phase::OPEN) {
      close(conn, how, CloseCause::ERROR);
      return;
    }
    // No CLOSE first, which a live netio3 peer always sends, also when it closes after an
    // error: its process ended. Its worker is gone with it, and what this side still sends
    // there would wait for UCX to notice (shared memory: its keepalive, tens of seconds).
    // The endpoint to it is closed by force at once - it was proven by this connection's
    // READY, so it is the dead process's - which ends every connection with that worker;
    // what arrived complete is delivered first (service_inbox).
    const auto why = fmt::format("{} without closing first (its process ended?)", how);
    std::shared_ptr<Endpoint> endpoint;
    {
      const std::lock_guard lock{conn->mutex};
      endpoint = conn->ep;
    }
    if (endpoint) {
      close_endpoint(endpoint, why);
    } else {
      on_ep_error(conn, why);
    }
  }

  // Closes the control socket now (the peer sees EOF, or a reset).
  void drop_control(Connection& conn) noexcept {
    {
      const std::lock_guard lock{conn.mutex};
      conn.control_fd.close();
    }
    conn.control_out.clear();
    detail::drain_and_close(conn.control);
  }

  // Hands the control socket to the lingering set after an orderly close: our FIN is sent,
  // what the peer still sends is read until it closes too.
  void linger_control(Connection& conn) {
    {
      const std::lock_guard lock{conn.mutex};
      conn.control_fd.close();
    }
    if (!conn.control_out.empty()) {
      conn.control_out.clear();
      detail::drain_and_close(conn.control);
      return;
    }
    if (conn.control.valid()) m_lingering->add(std::move(conn.control));
  }

  // ---- endpoints ---------------------------------------------------------------------

  // The endpoint to the worker at `address`: the one its earlier connections use, or a new
  // one. Throws UcxError.
  std::shared_ptr<Endpoint> acquire_endpoint(std::span<const std::uint8_t> address) {
    std::string peer{address.begin(), address.end()};
    if (const auto it = m_peers.find(peer); it != m_peers.end()) return it->second;
    auto endpoint = std::make_shared<Endpoint>(++m_endpoint_ids, peer);
    endpoint->backend = this;
    endpoint->last_progress = std::chrono::steady_clock::now();
    // UCX reads the address without knowing its length: a copy with room behind it, so that
    // a truncated address cannot make it read beyond the buffer.
    std::vector<std::uint8_t> padded(address.size() + 4096, 0);
    std::copy(address.begin(), address.end(), padded.begin());
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(padded.data());  // NOLINT
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &Backend::ep_error_callback;
    params.err_handler.arg = endpoint.get();
    check("ucp_ep_create", ucp_ep_create(m_worker->get(), &params, &endpoint->handle));
    m_endpoints.emplace(endpoint->id, endpoint);
    m_peers.emplace(std::move(peer), endpoint);
    NETIO3_DEBUG("ucx: a new endpoint to a peer worker ({} in all)", m_endpoints.size());
    return endpoint;
  }

  // The connection no longer sends on its endpoint (which stays for the others).
  void release_endpoint(Connection& conn) {
    std::shared_ptr<Endpoint> endpoint;
    {
      const std::lock_guard lock{conn.mutex};
      conn.ep_released = true;
      endpoint = std::move(conn.ep);
    }
    if (!endpoint) return;
    std::erase_if(endpoint->users, [&](const std::weak_ptr<Connection>& user) {
      const auto c = user.lock();
      return !c || c.get() == &conn;
    });
    // An endpoint to a worker that never answered over UCX (a peer that never set up a
    // connection, or one that sent a worker address of someone else) is not kept: a flood of
    // such HELLOs must not pile up endpoints.
    if (endpoint->users.empty() && !endpoint->proven) {
      close_endpoint(endpoint, "no connection through it was ever set up");
    }
  }

  // Closes an endpoint by force (UCX completes, as cancelled, what it still holds) and ends
  // the connections that use it with `why`.
  void close_endpoint(const std::shared_ptr<Endpoint>& endpoint, const std::string& why) {
    if (endpoint->closing) return;
    endpoint->closing = true;
    if (const auto it = m_peers.find(endpoint->peer);
        it != m_peers.end() && it->second == endpoint) {
      m_peers.erase(it);
    }
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &Backend::ep_close_callback;
    param.user_data = endpoint.get();
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    NETIO3_DEBUG("ucx: closing an endpoint by force ({} connection(s) on it): {}",
                 endpoint->users.size(), why);
    // Under each user's lock, which every send holds: no thread is in ucp_am_send_nbx on the
    // endpoint once this loop is done, and none starts (post()).
    for (const auto& user : endpoint->users) {
      if (auto conn = user.lock()) {
        const std::lock_guard lock{conn->mutex};
        conn->ep_closing = true;
      }
    }
    const ucs_status_ptr_t request = ucp_ep_close_nbx(endpoint->handle, &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) {
      push_event(Event{.kind = Event::Kind::EP_CLOSED, .id = endpoint->id});
    }
    const auto users = endpoint->users;
    for (const auto& user : users) {
      if (auto conn = user.lock()) on_ep_error(conn, why);
      if (shut_down()) return;
    }
  }

  void on_endpoint_closed(std::uint64_t id, ucs_status_t status) {
    const auto it = m_endpoints.find(id);
    if (it == m_endpoints.end()) return;
    const auto endpoint = it->second;
    m_endpoints.erase(it);
    NETIO3_DEBUG("ucx: an endpoint closed{} ({} left)",
                 status == UCS_OK ? std::string{} : fmt::format(": {}", status_text(status)),
                 m_endpoints.size());
    const auto users = endpoint->users;
    for (const auto& user : users) {
      const auto conn = user.lock();
      if (!conn) continue;
      {
        const std::lock_guard lock{conn->mutex};
        conn->ep_gone = true;
      }
      if (conn->phase == Phase::CLOSING) advance_close(conn);
      if (shut_down()) return;
    }
  }

  void on_endpoint_error(std::uint64_t id, ucs_status_t status) {
    const auto it = m_endpoints.find(id);
    if (it == m_endpoints.end()) return;
    const auto endpoint = it->second;
    endpoint->failed = true;
    close_endpoint(endpoint, fmt::format("connection lost: {}", status_text(status)));
  }

  // ---- sending ---------------------------------------------------------------------

  enum class SendKind { BUFFERED, ZERO_COPY, COPY };

  NetioStatus send_message(Connection& conn, std::span<const std::uint8_t> header,
                           std::span<const iovec> payload, SendKind kind,
                           detail::PendingSend pending) {
    std::size_t size = header.size();
    for (const auto& v : payload) size += v.iov_len;
    if (payload.size() > MAX_IOV) {
      NETIO3_WARN("ucx: send to {}: {} pieces exceed the limit of {}", conn.remote, payload.size(),
                  MAX_IOV);
      return NetioStatus::FAILED;
    }
    {
      const std::lock_guard lock{conn.mutex};
      if (conn.close_requested.load(std::memory_order_relaxed) || conn.ending()) {
        return NetioStatus::FAILED;
      }
      if (conn.phase != Phase::OPEN) return NetioStatus::NO_RESOURCES;  // still connecting
      if (size > conn.peer_max) {
        NETIO3_WARN("ucx: send to {}: a message of {} bytes exceeds the peer's limit of {} bytes",
                    conn.remote, size, conn.peer_max);
        return NetioStatus::FAILED;
      }
      if (conn.unsent_bytes >= m_config.limits.max_unsent_bytes ||
          conn.data_ops >= MAX_SEND_DEPTH) {
        return NetioStatus::NO_RESOURCES;
      }
      SendOp& op = take_op(conn);
      op.control = false;
      op.bytes = size;
      op.buffer = pending.buffer;
      const void* buffer = nullptr;
      std::size_t count = 0;
      ucp_mem_h memh = nullptr;
      ucp_datatype_t datatype = ucp_dt_make_contig(1);
      if (kind == SendKind::COPY) {
        if (op.staging_capacity < size) grow_staging(conn, op, size);
        memh = op.staging_map.get();
        std::uint8_t* out = op.staging.get();
        if (!header.empty()) out = std::copy(header.begin(), header.end(), out);
        for (const auto& v : payload) {
          if (v.iov_len > 0) std::memcpy(out, v.iov_base, v.iov_len);
          out += v.iov_len;
        }
        buffer = op.staging.get();
        count = size;
      } else if (payload.size() == 1) {
        // The header travels in the UCX header (the prefix): the payload is one contiguous
        // block from registered memory, so UCX may send it zero-copy / by rendezvous.
        buffer = payload[0].iov_base;
        count = payload[0].iov_len;
        memh = kind == SendKind::BUFFERED ? conn.send_memh : conn.region_map.get();
      } else if (!payload.empty()) {
        std::size_t n = 0;
        for (const auto& v : payload) op.iov.at(n++) = ucp_dt_iov_t{v.iov_base, v.iov_len};
        buffer = op.iov.data();
        count = n;
        datatype = ucp_dt_make_iov();
      }
      const auto prefix = kind == SendKind::COPY ? std::span<const std::uint8_t>{} : header;
      op.ticket = conn.ledger.add(pending);
      const ucs_status_t status =
          post(conn, op, MessageType::DATA, buffer, count, datatype, memh, prefix);
      if (status == UCS_INPROGRESS) {
        ++conn.data_ops;
        conn.unsent_bytes += size;
      } else if (status == UCS_OK) {
        // Gone at once: completed now, reported from the loop. The close is reported only
        // once every such completion has been (quiescent() waits for completions_queued).
        detail::PendingSend done;
        conn.ledger.complete(op.ticket, done);
        release_op(conn, op);
        ++conn.completions_queued;
        push_event(Event{.kind = Event::Kind::SENT_AT_ONCE,
                         .conn = conn.shared_from_this(),
                         .key = done.key,
                         .buffer = done.buffer});
      } else {
        conn.ledger.retract(op.ticket);
        release_op(conn, op);
        if (status == UCS_ERR_NO_RESOURCE) return NetioStatus::NO_RESOURCES;
        NETIO3_WARN("ucx: send to {} failed: {}", conn.remote, status_text(status));
        return NetioStatus::FAILED;
      }
    }
    NETIO3_TRACE("ucx: send to {} key={} size={}", conn.remote, pending.key, size);
    // On the loop thread the prepare hook reports it before the loop sleeps; from another
    // thread the loop must wake up (and progress the send, or report its completion).
    if (!m_loop->in_loop_thread()) kick();
    return NetioStatus::OK;
  }

  // READY or BYE, in the reserved slots. Under no lock.
  ucs_status_t send_control(Connection& conn, MessageType type) {
    const std::lock_guard lock{conn.mutex};
    if (conn.free_ops.empty() && conn.ops.size() >= MAX_SEND_DEPTH + CONTROL_OPS) {
      return UCS_ERR_NO_RESOURCE;
    }
    SendOp& op = take_op(conn);
    op.control = true;
    op.bytes = 0;
    op.buffer = nullptr;
    const ucs_status_t status = post(conn, op, type, nullptr, 0, ucp_dt_make_contig(1), nullptr);
    if (status != UCS_INPROGRESS) release_op(conn, op);
    return status == UCS_INPROGRESS ? UCS_OK : status;
  }

  // A free op, or a new one (data sends are bounded by MAX_SEND_DEPTH, READY and BYE by
  // CONTROL_OPS, so the deque never grows past their sum).
  static SendOp& take_op(Connection& conn) {
    if (conn.free_ops.empty()) {
      SendOp& op = conn.ops.emplace_back();
      op.conn = &conn;
      op.slot = static_cast<std::uint32_t>(conn.ops.size() - 1);
      return op;
    }
    const std::uint32_t slot = conn.free_ops.back();
    conn.free_ops.pop_back();
    return conn.ops[slot];
  }
  static void release_op(Connection& conn, SendOp& op) {
    if (op.staging_capacity > 0 && conn.staging_bytes > STAGING_BUDGET) free_staging(conn, op);
    conn.free_ops.push_back(op.slot);
  }

  // Under conn.mutex: unmaps and frees an op's staging memory.
  static void free_staging(Connection& conn, SendOp& op) {
    conn.staging_bytes -= op.staging_capacity;
    op.staging_map = MemoryMap{};
    op.staging.reset();
    op.staging_capacity = 0;
  }

  // Copy sends' staging memory mappings go with the connection's (the memory itself with
  // the connection object).
  static void unmap_staging(Connection& conn) {
    const std::lock_guard lock{conn.mutex};
    for (auto& op : conn.ops) op.staging_map = MemoryMap{};
  }

  // Under conn.mutex: staging memory for a copy send of `size` bytes, mapped if it is large
  // (unmapped if the mapping fails: UCX then copies it into its own buffers).
  void grow_staging(Connection& conn, SendOp& op, std::size_t size) {
    free_staging(conn, op);
    op.staging = std::make_unique_for_overwrite<std::uint8_t[]>(size);
    op.staging_capacity = size;
    conn.staging_bytes += size;
    if (size < STAGING_MAP_MIN) return;
    try {
      op.staging_map = MemoryMap{m_worker->context(), {op.staging.get(), size}};
    } catch (const std::exception& e) {
      NETIO3_DEBUG("ucx: copy sends to {}: staging memory stays unmapped: {}", conn.remote,
                   e.what());
    }
  }

  // Under conn.mutex. UCS_INPROGRESS: the request completes later (SEND_DONE); UCS_OK: it
  // completed at once; anything else: refused. The sequence number is used only if sent.
  ucs_status_t post(Connection& conn, SendOp& op, MessageType type, const void* buffer,
                    std::size_t count, ucp_datatype_t datatype, ucp_mem_h memh,
                    std::span<const std::uint8_t> prefix = {}) {
    if (conn.ep == nullptr || conn.ep_released || conn.ep_closing) return UCS_ERR_CANCELED;
    const auto fixed = encode_header(
        AmHeader{type, conn.tx_seq, static_cast<std::uint8_t>(prefix.size()), conn.peer_token});
    std::copy(fixed.begin(), fixed.end(), op.am_header.begin());
    if (!prefix.empty())
      std::copy(prefix.begin(), prefix.end(), op.am_header.begin() + AM_HEADER_SIZE);
    op.am_header_len = AM_HEADER_SIZE + prefix.size();
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    param.cb.send = &Backend::send_callback;
    param.user_data = &op;
    param.datatype = datatype;
    if (memh != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
    // The UCX header stays in the op until completion (UCX 1.13 has no
    // UCP_AM_SEND_FLAG_COPY_HEADER; with it the header could live on the stack).
    const ucs_status_ptr_t request = ucp_am_send_nbx(conn.ep->handle, AM_ID, op.am_header.data(),
                                                     op.am_header_len, buffer, count, &param);
    if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
    ++conn.tx_seq;
    if (request == nullptr) return UCS_OK;
    ++conn.requests;
    return UCS_INPROGRESS;
  }

  // ---- UCX callbacks: record only --------------------------------------------------

  void push_event(Event event) {
    const std::lock_guard lock{m_events_mutex};
    m_events.push_back(std::move(event));
  }

  static void send_callback(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<SendOp*>(user_data);
    Backend* self = op->conn->backend;
    ucp_request_free(request);
    self->push_event(Event{
        .kind = Event::Kind::SEND_DONE, .id = op->conn->id, .slot = op->slot, .status = status});
  }

  static void ep_error_callback(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* endpoint = static_cast<Endpoint*>(arg);
    endpoint->backend->push_event(
        Event{.kind = Event::Kind::EP_ERROR, .id = endpoint->id, .status = status});
  }

  static void ep_close_callback(void* request, ucs_status_t status, void* user_data) {
    auto* endpoint = static_cast<Endpoint*>(user_data);
    ucp_request_free(request);
    endpoint->backend->push_event(
        Event{.kind = Event::Kind::EP_CLOSED, .id = endpoint->id, .status = status});
  }

  static void receive_callback(void* request, ucs_status_t status, std::size_t length,
                               void* user_data) {
    auto* slot = static_cast<Incoming*>(user_data);
    ucp_request_free(request);
    slot->conn->backend->finish_receive(*slot, status, length);
  }

  static ucs_status_t am_callback(void* arg, const void* header, std::size_t header_length,
                                  void* data, std::size_t length,
                                  const ucp_am_recv_param_t* param) {
    return static_cast<Backend*>(arg)->on_message(
        {static_cast<const std::uint8_t*>(header), header_length}, data, length, *param);
  }

  // A message arrived (inside ucp_worker_progress): file it in its connection's inbox.
  ucs_status_t on_message(std::span<const std::uint8_t> header, void* data, std::size_t length,
                          const ucp_am_recv_param_t& param) {
    const bool rndv = (param.recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    const bool persistent = (param.recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
    // Dropping a rendezvous message fails the sender's send; an eager one is just freed.
    const ucs_status_t drop = rndv ? UCS_ERR_CANCELED : UCS_OK;
    if (shut_down()) return drop;
    std::string error;
    const auto decoded = decode_header(header, error);
    if (!decoded) {
      // Not addressed to a connection that can be named: nothing to close.
      NETIO3_WARN("ucx: dropping a message: {}", error);
      return drop;
    }
    const auto conn = m_registry.by_id(decoded->token);
    if (!conn) {
      NETIO3_DEBUG("ucx: dropping a message for a connection that is gone");
      return drop;
    }
    if (conn->failed || conn->ending()) return drop;
    const std::uint64_t seq = decoded->seq;
    if (seq < conn->rx_next || seq - conn->rx_next >= MAX_REORDER) {
      protocol_error(*conn, fmt::format("message number {} outside the window [{}, {})", seq,
                                        conn->rx_next, conn->rx_next + MAX_REORDER));
      return drop;
    }
    const auto index = static_cast<std::size_t>(seq - conn->rx_next);
    if (index >= conn->inbox.size()) conn->inbox.resize(index + 1);
    Incoming& slot = conn->inbox[index];
    if (slot.stage != Incoming::Stage::EMPTY) {
      protocol_error(*conn, fmt::format("message number {} arrived twice", seq));
      return drop;
    }
    const std::size_t limit =
        decoded->type == MessageType::DATA ? m_config.limits.max_message_size : 0;
    const std::span<const std::uint8_t> prefix = header.subspan(AM_HEADER_SIZE);
    if (length > limit || prefix.size() > limit - length) {
      protocol_error(*conn, fmt::format("a message of {} bytes exceeds the limit of {} bytes",
                                        prefix.size() + length, limit));
      return rndv ? UCS_ERR_MESSAGE_TRUNCATED : UCS_OK;
    }
    slot.type = decoded->type;
    mark_dirty(*conn);
    if (rndv) {
      // The payload is fetched later (start_receive) behind a copy of the prefix.
      slot.stage = Incoming::Stage::RNDV;
      slot.length = length;
      std::copy(prefix.begin(), prefix.end(), slot.prefix.begin());
      slot.prefix_len = static_cast<std::uint8_t>(prefix.size());
      slot.desc = data;
      return UCS_INPROGRESS;
    }
    slot.stage = Incoming::Stage::READY;
    slot.length = prefix.size() + length;
    if (persistent && prefix.empty()) {
      slot.desc = data;
      slot.data = static_cast<const std::uint8_t*>(data);
      return UCS_INPROGRESS;
    }
    if (slot.length > 0) {
      // Eager data UCX takes back on return, or prefix and payload joined: one copy, into
      // a receive-pool buffer when one is free (no allocation per message), else the heap.
      std::uint8_t* target = nullptr;
      if (conn->recv && slot.length <= conn->recv->pool.buf_size()) {
        slot.buffer = conn->recv->pool.acquire();
        if (slot.buffer != nullptr) target = slot.buffer->data();
      }
      if (target == nullptr) {
        slot.heap = std::make_unique_for_overwrite<std::uint8_t[]>(slot.length);
        target = slot.heap.get();
      }
      if (!prefix.empty()) std::memcpy(target, prefix.data(), prefix.size());
      if (length > 0) std::memcpy(target + prefix.size(), data, length);
      slot.data = target;
    }
    return UCS_OK;
  }

  void protocol_error(Connection& conn, const std::string& why) {
    conn.failed = true;
    NETIO3_WARN("ucx: connection with {}: {}", conn.remote, why);
    push_event(Event{.kind = Event::Kind::PROTOCOL_ERROR, .id = conn.id, .reason = why});
  }

  void mark_dirty(Connection& conn) {
    if (conn.dirty) return;
    conn.dirty = true;
    m_dirty.push_back(conn.shared_from_this());
  }

  void finish_receive(Incoming& slot, ucs_status_t status, std::size_t length) {
    Connection& conn = *slot.conn;
    --conn.receiving;
    conn.receiving_bytes -= std::min(conn.receiving_bytes, slot.length);
    if (slot.stage == Incoming::Stage::DROPPED) {
      release(conn, slot);  // its connection closed meanwhile
    } else if (status == UCS_OK) {
      slot.stage = Incoming::Stage::READY;
      slot.length = slot.prefix_len + std::min(length, slot.length);
      slot.prefix_len = 0;
    } else {
      slot.stage = Incoming::Stage::FAILED;
      slot.status = status;
    }
    mark_dirty(conn);
  }

  // ---- the loop ----------------------------------------------------------------------

  void kick() {
    if (!m_kick_pending.exchange(true)) m_kick.fire();
  }

  // Progresses the worker until it has nothing left and handles what it reported. Returns
  // whether anything happened.
  bool progress() {
    if (m_progressing || shut_down() || !m_worker) return false;
    m_progressing = true;
    bool active = false;
    for (int round = 0; round < PROGRESS_ROUNDS; ++round) {
      const unsigned n = ucp_worker_progress(m_worker->get());
      const bool work = has_work();
      active = active || n != 0 || work;
      dispatch();
      if (shut_down()) return active;  // the backend is going: leave the flag set
      if (n == 0 && !has_work()) break;
    }
    m_progressing = false;
    return active;
  }

  [[nodiscard]] bool has_work() {
    {
      const std::lock_guard lock{m_events_mutex};
      if (!m_events.empty()) return true;
    }
    return !m_dirty.empty();
  }

  // The prepare hook: true when the worker is armed and the loop may sleep on its fd.
  bool may_sleep() {
    if (shut_down()) return true;
    const bool active = progress();
    if (shut_down()) return true;
    if (has_work()) return false;
    // Busy-polling (EpollEventLoop::Options::busy_poll): the loop will not sleep this
    // round, so arming would be wasted; say whether there was work to keep it polling.
    if (m_loop->polling()) return !active;
    const ucs_status_t status = ucp_worker_arm(m_worker->get());
    if (status == UCS_ERR_BUSY) return false;
    if (status != UCS_OK) {
      NETIO3_ERROR("ucx: ucp_worker_arm failed: {}", status_text(status));
      return false;
    }
    return true;
  }

  // Handles recorded events and inboxes until none is left (a handler may add more).
  void dispatch() {
    for (int guard = 0; guard < 1024 && !shut_down(); ++guard) {
      // The spare vectors keep their capacity from round to round: recording an event
      // does not allocate once the queues have grown (a nested dispatch, from a callback
      // that progresses, finds them taken and starts empty ones).
      std::vector<Event> events = std::move(m_spare_events);
      {
        const std::lock_guard lock{m_events_mutex};
        events.swap(m_events);
      }
      std::vector<std::shared_ptr<Connection>> dirty = std::move(m_spare_dirty);
      dirty.swap(m_dirty);
      if (events.empty() && dirty.empty()) {
        m_spare_events = std::move(events);
        m_spare_dirty = std::move(dirty);
        return;
      }
      for (auto& event : events) {
        handle(event);
        if (shut_down()) return;
      }
      for (const auto& conn : dirty) {
        service_inbox(conn);
        if (shut_down()) return;
      }
      events.clear();
      dirty.clear();
      m_spare_events = std::move(events);
      m_spare_dirty = std::move(dirty);
    }
  }

  void handle(Event& event) {
    switch (event.kind) {
      case Event::Kind::SENT_AT_ONCE: {
        const auto& conn = event.conn;
        {
          const std::lock_guard lock{conn->mutex};
          --conn->completions_queued;
        }
        if (!completed(*conn, detail::PendingSend{event.key, event.buffer})) return;
        if (conn->phase == Phase::CLOSING) advance_close(conn);
        return;
      }
      case Event::Kind::EP_ERROR:
        on_endpoint_error(event.id, event.status);
        return;
      case Event::Kind::EP_CLOSED:
        on_endpoint_closed(event.id, event.status);
        return;
      default:
        break;
    }
    const auto conn = m_registry.by_id(event.id);
    if (!conn) return;
    if (event.kind == Event::Kind::SEND_DONE) {
      on_send_done(conn, event.slot, event.status);
    } else {
      close(conn, event.reason, CloseCause::ERROR);
    }
  }

  void on_send_done(const std::shared_ptr<Connection>& conn, std::uint32_t slot,
                    ucs_status_t status) {
    detail::PendingSend done;
    bool done_now = false;
    {
      const std::lock_guard lock{conn->mutex};
      SendOp& op = conn->ops[slot];
      --conn->requests;
      if (status == UCS_OK && conn->ep) conn->ep->last_progress = std::chrono::steady_clock::now();
      if (!op.control) {
        --conn->data_ops;
        conn->unsent_bytes -= std::min<std::uint64_t>(conn->unsent_bytes, op.bytes);
        if (status == UCS_OK) done_now = conn->ledger.complete(op.ticket, done);
      }
      release_op(*conn, op);
    }
    if (status != UCS_OK) {
      // The key is reported with the connection's cancelled keys.
      if (!conn->ending()) {
        NETIO3_WARN("ucx: connection with {}: send failed: {}", conn->remote, status_text(status));
        close(conn, fmt::format("send failed: {}", status_text(status)), CloseCause::ERROR);
      }
    } else if (done_now && !completed(*conn, done)) {
      return;
    }
    // CLOSED: a request that outlived the report of the close (on_endpoint_closed); the
    // connection may be freed now.
    if (conn->ending()) advance_close(conn);
  }

  // The connection's endpoint failed or was closed by force: UCX completes its sends.
  void on_ep_error(const std::shared_ptr<Connection>& conn, const std::string& why) {
    if (conn->ending()) return;
    // What arrived complete before the error is still delivered (a BYE among it makes this
    // an orderly close); service_inbox closes once nothing more can come.
    conn->peer_error = why;
    NETIO3_DEBUG("ucx: connection with {}: {}", conn->remote, conn->peer_error);
    mark_dirty(*conn);
  }

  // Starts the receives of waiting rendezvous messages and delivers what is in order.
  void service_inbox(const std::shared_ptr<Connection>& conn) {
    conn->dirty = false;
    if (conn->ending()) {
      advance_close(conn);
      return;
    }
    if (conn->phase == Phase::HANDSHAKE) {
      // Set-up: message 0 must be the peer's READY; what follows it waits until the HELLO is
      // in too (nothing is received for a connection that is not set up).
      if (!conn->peer_ready && !conn->inbox.empty() &&
          conn->inbox.front().stage == Incoming::Stage::READY) {
        Incoming message = std::move(conn->inbox.front());
        conn->inbox.pop_front();
        ++conn->rx_next;
        release(*conn, message);
        if (message.type != MessageType::READY) {
          protocol_error_now(conn, "the peer's first message is not READY");
          return;
        }
        conn->peer_ready = true;
        const std::lock_guard lock{conn->mutex};
        if (conn->ep) conn->ep->proven = true;
      }
      if (!conn->peer_error.empty()) {
        close(conn, conn->peer_error, CloseCause::ERROR);
        return;
      }
      if (!conn->peer_ready || !conn->greeted) return;
      // Both HELLO and the peer's READY are in.
      if (!established(conn, capabilities(*conn))) return;
    }
    if (conn->phase != Phase::OPEN) return;
    for (auto& slot : conn->inbox) {
      if (slot.stage != Incoming::Stage::RNDV) continue;
      if (conn->receiving > 0 && conn->receiving_bytes + slot.length > RECEIVE_WINDOW) break;
      start_receive(*conn, slot);
    }
    while (!conn->inbox.empty()) {
      Incoming& front = conn->inbox.front();
      if (front.stage != Incoming::Stage::READY && front.stage != Incoming::Stage::FAILED) break;
      Incoming message = std::move(front);
      conn->inbox.pop_front();
      ++conn->rx_next;
      m_delivering = &message;  // a callback that destroys the backend leaves it to shutdown
      handle_message(conn, message);
      m_delivering = nullptr;
      release(*conn, message);
      if (shut_down()) return;
      if (conn->ending()) {
        advance_close(conn);
        return;
      }
    }
    if (conn->peer_total && conn->rx_next >= *conn->peer_total) {
      close(conn, "peer closed the connection", CloseCause::PEER);
    } else if (!conn->peer_error.empty()) {
      // The peer is gone: what is still on its way (a rendezvous in flight) cannot complete.
      NETIO3_INFO("ucx: connection with {}: {}", conn->remote, conn->peer_error);
      close(conn, conn->peer_error, CloseCause::ERROR);
    }
  }

  void start_receive(Connection& conn, Incoming& slot) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_RECV_INFO;
    NetworkBuffer* buffer = nullptr;
    const std::size_t total = slot.prefix_len + slot.length;
    if (conn.recv && total <= conn.recv->pool.buf_size()) buffer = conn.recv->pool.acquire();
    std::uint8_t* start = nullptr;
    if (buffer != nullptr) {
      slot.buffer = buffer;
      start = buffer->data();
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = conn.recv->map.get();
    } else {
      slot.heap = std::make_unique_for_overwrite<std::uint8_t[]>(std::max<std::size_t>(total, 1));
      start = slot.heap.get();
    }
    if (slot.prefix_len > 0) std::memcpy(start, slot.prefix.data(), slot.prefix_len);
    void* target = start + slot.prefix_len;
    std::size_t received = 0;
    param.cb.recv_am = &Backend::receive_callback;
    param.user_data = &slot;
    param.datatype = ucp_dt_make_contig(1);
    param.recv_info.length = &received;
    slot.stage = Incoming::Stage::RECEIVING;
    slot.conn = &conn;
    slot.data = start;
    void* desc = std::exchange(slot.desc, nullptr);
    ++conn.receiving;
    conn.receiving_bytes += slot.length;
    const ucs_status_ptr_t request =
        ucp_am_recv_data_nbx(m_worker->get(), desc, target, slot.length, &param);
    if (request == nullptr) {
      finish_receive(slot, UCS_OK, received);
    } else if (UCS_PTR_IS_ERR(request)) {
      finish_receive(slot, UCS_PTR_STATUS(request), 0);
    }
  }

  void handle_message(const std::shared_ptr<Connection>& conn, const Incoming& message) {
    if (message.stage == Incoming::Stage::FAILED) {
      const auto reason = fmt::format("receiving a message of {} bytes failed: {}", message.length,
                                      status_text(message.status));
      NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
      close(conn, reason, CloseCause::ERROR);
      return;
    }
    if (message.type == MessageType::BYE) {
      close(conn, "peer closed the connection", CloseCause::PEER);
      return;
    }
    if (message.type == MessageType::READY) {
      protocol_error_now(conn, "a second READY");
      return;
    }
    (void)deliver(*conn, std::span<const std::uint8_t>{message.data, message.length});
  }

  // Gives back what a message holds (UCX data, a pool buffer, heap memory).
  void release(Connection& conn, Incoming& message) {
    // After a shutdown (a callback destroyed the backend) the worker and its data are gone.
    if (message.desc != nullptr && m_worker) ucp_am_data_release(m_worker->get(), message.desc);
    message.desc = nullptr;
    if (message.buffer != nullptr && conn.recv) conn.recv->pool.release(message.buffer);
    message.buffer = nullptr;
    message.heap.reset();
    message.data = nullptr;
  }

  // ---- closing (detail::TransportOf) ---------------------------------------------------
  // Closing has three steps, each waiting for the one before:
  //  1. a local or peer close of an open connection waits for its sends to complete (for at
  //     most close_timeout); after an error, or during set-up, it does not wait;
  //  2. the endpoint is released: kept for reuse after a clean close, closed by force
  //     otherwise (UCX then cancels what it still holds);
  //  3. the engine reports it once UCX holds no send request of the connection (and every
  //     send that completed at once was reported): quiescent(); the connection is freed once
  //     no rendezvous receive is in flight on it (release_if_idle).

 public:
  NetioStatus post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer) {
    const iovec iov{buffer->data(), buffer->size()};
    return send_message(*conn, {}, std::span{&iov, 1}, SendKind::BUFFERED,
                        detail::PendingSend{buffer->id(), buffer});
  }

  void close_listener(const std::shared_ptr<Listener>& listener) noexcept {
    close_listener_socket(*listener);
  }

  // The backend's shutdown winds every connection down itself.
  static void abandon(Connection& /*conn*/) noexcept {}

  void close_transport(const std::shared_ptr<Connection>& conn) {
    m_closing.emplace(conn->id, conn);  // kept until UCX is done with it
    const auto& ending = conn->ending_info;
    // What arrived but was not delivered is dropped; receives in flight finish first.
    for (auto& slot : conn->inbox) {
      if (slot.stage != Incoming::Stage::RECEIVING) release(*conn, slot);
      slot.stage = Incoming::Stage::DROPPED;
    }
    if (ending.cause == CloseCause::LOCAL && ending.was_open) {
      // BYE ends the stream on UCX; CLOSE on the control channel says how many messages
      // to expect, which also covers a BYE that could not be sent.
      const auto bye = send_control(*conn, MessageType::BYE);
      if (bye != UCS_OK) {
        NETIO3_DEBUG("ucx: connection with {}: BYE not sent: {}", conn->remote, status_text(bye));
      }
      if (conn->control.valid() && conn->control_out.empty() &&
          !detail::send_now(conn->control.get(), encode_close(sent(*conn)))) {
        drop_control(*conn);
      }
    }
    if (ending.cause == CloseCause::ERROR) {
      // A CLOSE all the same, so that the peer does not take the end of the control channel
      // for the death of this process (on_control_end), which would end its other connections.
      if (conn->control.valid() && conn->control_out.empty() && ending.was_open) {
        (void)detail::send_now(conn->control.get(), encode_close(sent(*conn)));
      }
      drop_control(*conn);
    } else {
      linger_control(*conn);
    }
    NETIO3_DEBUG("ucx: closing connection with {} ({})", conn->remote, ending.reason);
    m_close_deadlines->track(conn);
    release_endpoint_if_done(conn);
  }

  [[nodiscard]] bool quiescent(const Connection& conn) const {
    if (!conn.ep_released) return false;
    const std::lock_guard lock{conn.mutex};
    return (conn.requests == 0 || conn.ep_gone) && conn.completions_queued == 0;
  }

  void after_closed(const std::shared_ptr<Connection>& conn) { release_if_idle(conn); }

 private:
  // Messages sent on the connection so far (the count a CLOSE announces).
  static std::uint64_t sent(const Connection& conn) {
    const std::lock_guard lock{conn.mutex};
    return conn.tx_seq;
  }

  // close_timeout passed and UCX still holds sends of the closing connection. While the peer
  // takes anything on the shared endpoint it is alive and they will go: wait on. If it took
  // nothing for close_timeout, it is not reading: the endpoint is closed by force.
  void close_timed_out(const std::shared_ptr<Connection>& conn) {
    if (conn->phase != Phase::CLOSING || conn->ep_released) return;
    std::shared_ptr<Endpoint> endpoint;
    {
      const std::lock_guard lock{conn->mutex};
      endpoint = conn->ep;
      NETIO3_DEBUG(
          "ucx: connection with {}: closing for {} ms, {} send request(s) held by UCX, "
          "{} completion(s) to report",
          conn->remote, m_config.limits.close_timeout.count(), conn->requests,
          conn->completions_queued);
    }
    if (!endpoint) return;
    const auto idle = std::chrono::steady_clock::now() - endpoint->last_progress;
    if (idle < m_config.limits.close_timeout) {
      NETIO3_DEBUG(
          "ucx: connection with {}: sends still in flight after {} ms; the peer is "
          "taking data, waiting on",
          conn->remote, m_config.limits.close_timeout.count());
      m_close_deadlines->track(conn);
      return;
    }
    const auto why =
        fmt::format("the peer took no data for {} ms",
                    std::chrono::duration_cast<std::chrono::milliseconds>(idle).count());
    NETIO3_WARN(
        "ucx: connection with {}: {}; closing the endpoint to it by force, which ends "
        "every connection with that peer",
        conn->remote, why);
    close_endpoint(endpoint, why);
  }

  void peer_close_timed_out(const std::shared_ptr<Connection>& conn) {
    if ((conn->phase != Phase::HANDSHAKE && conn->phase != Phase::OPEN) || !conn->peer_total) {
      return;
    }
    const auto reason =
        fmt::format("the peer closed after sending {} messages, {} of them arrived within {} ms",
                    *conn->peer_total, conn->rx_next, m_config.limits.close_timeout.count());
    NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
    close(conn, reason, CloseCause::ERROR);
  }

  // A closing connection's sends or receives changed: the next step of its close.
  void advance_close(const std::shared_ptr<Connection>& conn) {
    release_endpoint_if_done(conn);
    if (!finish(conn)) return;
    release_if_idle(conn);
  }

  // Step 2, once its sends are done.
  void release_endpoint_if_done(const std::shared_ptr<Connection>& conn) {
    if (conn->phase != Phase::CLOSING || conn->ep_released) return;
    {
      const std::lock_guard lock{conn->mutex};
      if ((conn->requests > 0 && !conn->ep_gone) || conn->completions_queued > 0) return;
    }
    release_endpoint(*conn);
  }

  // Frees a CLOSED connection once UCX holds no request of it (its user data is one of
  // conn->ops) and no receive is in flight on it.
  void release_if_idle(const std::shared_ptr<Connection>& conn) {
    if (conn->phase != Phase::CLOSED) return;
    {
      const std::lock_guard lock{conn->mutex};
      if (conn->requests > 0) return;
    }
    if (conn->receiving > 0 || !m_closing.contains(conn->id)) return;
    m_registry.forget(conn->id);
    m_closing.erase(conn->id);
    for (auto& slot : conn->inbox) release(*conn, slot);
    conn->inbox.clear();
    conn->region_map = MemoryMap{};
    conn->send_map = MemoryMap{};
    unmap_staging(*conn);
  }

  const TransportChoice m_transports;
  std::mutex m_worker_mutex;         // ensure_worker
  std::unique_ptr<Worker> m_worker;  // set once, before anything that uses it is registered
  std::string m_devices_interface;   // the interface UCX was restricted to, if any
  WorkerAddressInfo m_own_address;   // of m_worker (set with it)
  std::unique_ptr<detail::BufferPool> m_shared_send_pool;
  MemoryMap m_shared_send_map;
  std::shared_ptr<RecvPool> m_global_recv;

  std::optional<detail::SetupDeadlines<Connection>> m_greeting_deadlines;
  std::optional<detail::SetupDeadlines<Connection>> m_close_deadlines;
  std::optional<detail::SetupDeadlines<Connection>> m_peer_close_deadlines;
  std::optional<detail::LingeringSockets> m_lingering;

  std::mt19937_64 m_rng;  // under the registry's lock (new_token)

  detail::OptionalMutex m_events_mutex;
  std::vector<Event> m_events;
  std::vector<Event> m_spare_events;  // loop thread only (dispatch)
  // Loop thread only.
  std::unordered_map<std::uint64_t, std::shared_ptr<Connection>> m_closing;
  std::unordered_map<std::uint64_t, std::shared_ptr<Endpoint>> m_endpoints;
  std::uint64_t m_endpoint_ids{0};
  std::unordered_map<std::string, std::shared_ptr<Endpoint>> m_peers;  // by worker address
  std::vector<std::shared_ptr<Connection>> m_dirty;
  std::vector<std::shared_ptr<Connection>> m_spare_dirty;  // loop thread only (dispatch)
  bool m_progressing{false};
  Incoming* m_delivering{nullptr};  // the message on_data_cb has now

  std::atomic<bool> m_kick_pending{false};
  FdHandle m_efd;
  EventSignalHandle m_kick;
  PrepareHookHandle m_prepare;
};

}  // namespace

std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                               std::shared_ptr<BaseEventLoop> loop) {
  return std::make_unique<detail::BackendFacade<Backend>>(std::move(config), std::move(loop));
}

}  // namespace netio3::ucx
