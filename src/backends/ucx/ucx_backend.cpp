// UCX: active messages on one UCP worker per backend, driven by the shared EpollEventLoop
// through the worker's event fd. When the fd is readable, or before the loop would sleep,
// the worker is progressed until it has nothing left, then armed (ucp_worker_arm; BUSY
// means: progress again). No thread of our own, no polling.
//
// UCX calls back only from inside ucp_worker_progress, and those callbacks only record:
// an arriving message goes into its connection's inbox, everything else into an event
// queue. The application's callbacks run afterwards, outside UCX, so they may send, close
// or destroy the backend.
//
// Messages: every message of a connection is one active message with a 16-byte UCX header
// (type, version, sequence number; ucp.hpp). The receiver delivers strictly by sequence
// number, so a small eager message that overtakes an earlier rendezvous one waits in the
// inbox. Eager data is kept by UCX (persistent data) and handed to on_data_cb from UCX's
// buffer; rendezvous data is first received into a receive-pool buffer (or, when none fits,
// a heap buffer bounded by limits.max_message_size).
//
// Connections: the client sends HELLO (its message size limit) on a new endpoint, the server
// answers HELLO_ACK; each side reports the connection established when it has the other's
// message. A local close sends BYE, flushes the endpoint for at most limits.close_timeout
// and closes it; the peer closes when BYE is delivered. After an error the endpoint is
// closed with UCP_EP_CLOSE_FLAG_FORCE. An endpoint is closed only when no rendezvous
// receive is in flight on it, and the connection is reported closed only when UCX holds no
// request of it any more, so cancelled keys never refer to memory UCX still reads.

#include "backends/ucx/ucx_backend.hpp"

#include <algorithm>
#include <array>
#include <cassert>
#include <cstring>
#include <deque>
#include <optional>
#include <poll.h>
#include <sys/epoll.h>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "backends/ucx/ucp.hpp"
#include "common/backend_facade.hpp"
#include "common/buffer_pool.hpp"
#include "common/closed_listeners.hpp"
#include "common/connection.hpp"
#include "common/endpoint_registry.hpp"
#include "common/endpoint_rules.hpp"
#include "common/log.hpp"
#include "common/notifier.hpp"
#include "common/send_ledger.hpp"
#include "common/setup_deadlines.hpp"
#include "common/sockaddr.hpp"
#include "common/thread_model.hpp"

namespace netio3::ucx {
namespace {

constexpr std::string_view NAME = "ucx";
// Data sends in flight per connection at most (UCX requests); two more for control messages.
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

enum class State { CONNECTING, ACCEPTING, OPEN, CLOSING, CLOSED };
enum class CloseKind { LOCAL, PEER, ERROR };

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
  std::array<std::uint8_t, HELLO_SIZE> hello{};
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

struct Listener : std::enable_shared_from_this<Listener> {
  Listener(std::uint64_t id_, EndPointAddress address_, const ConnectionParameters& params_)
      : id{id_}, address{std::move(address_)}, params{params_} {}
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  Listener(Listener&&) = delete;
  Listener& operator=(Listener&&) = delete;
  ~Listener() { destroy(); }
  void destroy() noexcept {
    if (handle != nullptr) ucp_listener_destroy(handle);
    handle = nullptr;
  }

  const std::uint64_t id;
  Backend* backend{nullptr};
  EndPointAddress address;
  const ConnectionParameters params;
  std::shared_ptr<RecvPool> shared_recv;  // recv_params.use_shared_receive_buffers
  ucp_listener_h handle{nullptr};
  std::atomic<bool> closed{false};
};

struct Connection : detail::ConnectionBase, std::enable_shared_from_this<Connection> {
  Connection(std::uint64_t id_, EndPointAddress remote_, const ConnectionParameters& params_,
             std::uint64_t listener_id_, bool thread_safe, State initial)
      : ConnectionBase{std::move(remote_), params_, listener_id_, thread_safe},
        id{id_},
        state{initial} {}

  const std::uint64_t id;
  Backend* backend{nullptr};  // for UCX callbacks, whose argument is the connection
  ucp_ep_h ep{nullptr};

  // Under `mutex`; `state` is written on the loop thread only.
  State state;
  std::uint64_t peer_max{0};
  std::uint64_t unsent_bytes{0};
  std::uint64_t tx_seq{0};
  std::size_t data_ops{0};  // data sends in flight
  std::size_t requests{0};  // send requests UCX holds (data and control)
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
  std::string peer_error;  // the endpoint failed; closed once the inbox is delivered
  // Closing.
  CloseKind close_kind{CloseKind::LOCAL};
  std::string close_reason;
  bool was_open{false};
  bool force_close{false};
  bool flushing{false};  // a flush request is out
  bool flushed{false};
  bool timed_out{false};  // close_timeout passed
  // The peer's first message arrived (or the endpoint failed): UCX's connection set-up is
  // over. An endpoint is not closed before that (see advance_close).
  bool wired{false};
  bool ep_close_started{false};
  bool ep_closed{false};
  bool reported{false};  // the application was told
  bool closed_at_shutdown{false};
  EventTimerHandle close_timer;
};

struct Event {
  enum class Kind : std::uint8_t {
    CONN_REQUEST,
    EP_ERROR,
    SEND_DONE,
    SENT_AT_ONCE,
    FLUSH_DONE,
    CLOSE_DONE,
    PROTOCOL_ERROR
  };
  Kind kind{};
  std::uint64_t conn_id{0};
  std::uint32_t slot{0};
  ucs_status_t status{UCS_OK};
  std::shared_ptr<Listener> listener{};
  ucp_conn_request_h request{nullptr};
  std::shared_ptr<Connection> conn{};  // SENT_AT_ONCE
  std::uint64_t key{0};
  NetworkBuffer* buffer{nullptr};
  std::string reason{};
};

class Backend : public std::enable_shared_from_this<Backend> {
 public:
  static constexpr BackendType TYPE = BackendType::UCX;
  using Registry = detail::EndpointRegistry<Connection, Listener>;

  Backend(NetworkConfig config, std::shared_ptr<BaseEventLoop> loop)
      : m_config{std::move(config)},
        m_loop{std::move(loop)},
        m_notifier{NAME, m_config},
        m_thread{m_config.thread_safety, *m_loop},
        m_transports{choose_transports(m_config.mode)},
        m_ids_mutex{m_thread.safe()},
        m_events_mutex{m_thread.safe()} {
    try {
      m_worker = std::make_unique<Worker>(m_transports, m_config.thread_safety);
      const auto& shared_tx = m_config.shared_send_buffers;
      if (shared_tx.use_shared_send_buffers) {
        m_shared_send_pool =
            std::make_unique<detail::BufferPool>(shared_tx.num_buf, shared_tx.buf_size, 0, safe());
        m_shared_send_map = MemoryMap{m_worker->context(), m_shared_send_pool->region()};
      }
      const auto& rx = m_config.shared_receive_buffers;
      if (rx.use_shared_receive_buffers) {
        m_global_recv = std::make_shared<RecvPool>(m_worker->context(), rx.num_buf, rx.buf_size);
      }
    } catch (const std::runtime_error& e) {
      m_shared_send_map = MemoryMap{};
      m_global_recv.reset();
      throw InvalidConfiguration(fmt::format("ucx: cannot start: {}", e.what()));
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
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                         UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = AM_ID;
    handler.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    handler.cb = &Backend::am_callback;
    handler.arg = this;
    check("ucp_worker_set_am_recv_handler",
          ucp_worker_set_am_recv_handler(m_worker->get(), &handler));
    std::weak_ptr<Backend> weak = weak_from_this();
    m_efd = m_loop->add_fd(m_worker->event_fd(), EPOLLIN, [weak](std::uint32_t) {
      if (auto self = weak.lock()) self->progress();
    });
    m_prepare = m_loop->add_polling_hook([weak] {
      auto self = weak.lock();
      return !self || self->may_sleep();
    });
    m_kick = m_loop->create_signal([weak] {
      if (auto self = weak.lock()) {
        self->m_kick_pending.store(false);
        self->progress();
      }
    });
    m_closed_listeners.emplace(*m_loop, m_config.limits.connect_timeout,
                               [](Listener& listener) { listener.destroy(); });
    m_deadlines.emplace(
        *m_loop, NAME, m_config.limits.connect_timeout,
        [](const Connection& conn) {
          return conn.state == State::CONNECTING || conn.state == State::ACCEPTING;
        },
        [weak](const std::shared_ptr<Connection>& conn, const std::string& reason) {
          if (auto self = weak.lock()) self->close_connection(conn, reason, CloseKind::ERROR);
        });
  }

  void shutdown() noexcept {
    if (m_shut_down.exchange(true)) return;
    Registry::Contents all;
    {
      const auto held = m_registry.lock();
      all = m_registry.take_all(held);
    }
    m_prepare.close();
    m_kick.close();
    m_efd.close();
    if (m_deadlines) m_deadlines->close();
    if (m_closed_listeners) m_closed_listeners->release_all();
    std::vector<std::shared_ptr<Connection>> conns;
    {
      const std::lock_guard lock{m_ids_mutex};
      for (const auto& [id, weak] : m_conn_ids) {
        if (auto conn = weak.lock()) conns.push_back(std::move(conn));
      }
    }
    // From here on, what UCX reports only settles request counts; connection requests
    // still queued are refused.
    const auto settle = [&] {
      std::vector<Event> reported;
      {
        const std::lock_guard lock{m_events_mutex};
        reported.swap(m_events);
      }
      for (const auto& event : reported) {
        if (event.kind == Event::Kind::CONN_REQUEST && event.listener->handle != nullptr) {
          ucp_listener_reject(event.listener->handle, event.request);
        }
        if (event.kind != Event::Kind::SEND_DONE && event.kind != Event::Kind::CLOSE_DONE) continue;
        const auto it = std::find_if(conns.begin(), conns.end(),
                                     [&](const auto& c) { return c->id == event.conn_id; });
        if (it == conns.end()) continue;
        if (event.kind == Event::Kind::CLOSE_DONE) {
          (*it)->ep_closed = true;
          continue;
        }
        const std::lock_guard lock{(*it)->mutex};
        --(*it)->requests;
        release_op(**it, (*it)->ops[event.slot]);
      }
    };
    settle();
    for (auto& listener : all.listeners) {
      listener->closed.store(true);
      listener->destroy();
    }
    ucp_worker_h worker = m_worker->get();
    const auto deadline = std::chrono::steady_clock::now() + m_config.limits.close_timeout;
    const auto progress_until = [&](const auto& done) {
      for (settle(); !done() && std::chrono::steady_clock::now() < deadline; settle()) {
        if (ucp_worker_progress(worker) != 0 || ucp_worker_arm(worker) != UCS_OK) continue;
        pollfd fd{m_worker->event_fd(), POLLIN, 0};
        ::poll(&fd, 1, 10);
      }
    };
    // Open connections get BYE, so that their peers close at once (UCX's own detection
    // of a vanished peer is not always quick). No send is accepted from here on.
    std::vector<std::shared_ptr<Connection>> graceful;
    for (const auto& conn : conns) {
      State previous{};
      {
        const std::lock_guard lock{conn->mutex};
        previous = conn->state;
        conn->state = State::CLOSED;
        conn->ledger.cancel_all();
      }
      conn->close_timer.close();
      if (previous == State::OPEN && conn->peer_error.empty()) {
        if (send_control(*conn, MessageType::BYE) == UCS_OK) graceful.push_back(conn);
      }
    }
    // Rendezvous receives in flight must end before their endpoints close (UCX aborts
    // otherwise), and BYE must be out before a graceful close; then every endpoint is
    // closed (gracefully where BYE went out: a forced close can lose it), without callbacks.
    progress_until([&] {
      return std::all_of(conns.begin(), conns.end(), [](const auto& c) {
        const std::lock_guard lock{c->mutex};
        return c->receiving == 0 && c->requests == 0;
      });
    });
    std::vector<void*> closing;
    for (const auto& conn : conns) {
      if (conn->ep == nullptr || conn->ep_close_started) continue;
      conn->ep_close_started = true;
      conn->closed_at_shutdown = true;
      const bool polite = std::find(graceful.begin(), graceful.end(), conn) != graceful.end();
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = polite ? 0U : static_cast<unsigned>(UCP_EP_CLOSE_FLAG_FORCE);
      const ucs_status_ptr_t request = ucp_ep_close_nbx(conn->ep, &param);
      if (request != nullptr && !UCS_PTR_IS_ERR(request)) closing.push_back(request);
    }
    // Closes that were under way before the shutdown complete through their callbacks.
    progress_until([&] {
      return std::all_of(closing.begin(), closing.end(),
                         [](void* request) {
                           return ucp_request_check_status(request) != UCS_INPROGRESS;
                         }) &&
             std::all_of(conns.begin(), conns.end(), [&](const auto& c) {
               return c->ep_closed || c->closed_at_shutdown || !c->ep_close_started;
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
    {
      const std::lock_guard lock{m_ids_mutex};
      m_conn_ids.clear();
      m_by_ep.clear();
    }
    // No callback can come after this; connections that outlive us hold no UCX resource.
    m_worker.reset();
    NETIO3_DEBUG("ucx: backend shut down");
  }

  // ---- API ---------------------------------------------------------------------------

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                       const ConnectionParameters& params) {
    m_thread.check_caller("open_listen_endpoint");
    detail::check_address(address, "open_listen_endpoint");
    detail::check_connection_parameters(params, m_config, true);
    const auto fail = [&](std::string_view why) {
      return FailedOpenListenEndpoint(fmt::format("ucx: cannot listen on {}: {}", address, why));
    };
    const auto sockaddr = detail::to_socket_address(address);
    if (!sockaddr) throw fail("not a numeric IP address");
    // A closed listener may still hold the port: this listen endpoint replaces it.
    if (address.port != 0) m_closed_listeners->release_port(address.port);
    const auto held = m_registry.lock();
    if (address.port != 0) m_registry.check_listen_free(held, address);
    auto listener = std::make_shared<Listener>(next_id(), address, params);
    listener->backend = this;
    try {
      if (params.recv_params.use_shared_receive_buffers) {
        listener->shared_recv = std::make_shared<RecvPool>(
            m_worker->context(), params.recv_params.num_buf, params.recv_params.buf_size);
      }
      ucp_listener_params_t lp{};
      lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
      lp.sockaddr.addr = sockaddr->get();
      lp.sockaddr.addrlen = sockaddr->length;
      lp.conn_handler.cb = &Backend::conn_request_callback;
      lp.conn_handler.arg = listener.get();
      check("ucp_listener_create", ucp_listener_create(m_worker->get(), &lp, &listener->handle));
      ucp_listener_attr_t attr{};
      attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
      check("ucp_listener_query", ucp_listener_query(listener->handle, &attr));
      const auto bound = detail::to_endpoint_address(&attr.sockaddr, sizeof(attr.sockaddr));
      if (!bound) throw std::runtime_error("ucp_listener_query returned no IP address");
      listener->address = EndPointAddress{address.address, bound->port};
    } catch (const std::runtime_error& e) {
      throw fail(e.what());
    }
    const EndPointAddress actual = listener->address;
    m_registry.add_listener(held, actual, std::move(listener));
    NETIO3_DEBUG("ucx: listening on {}", actual);
    return actual;
  }

  void open_active_endpoint(const EndPointAddress& address, const ConnectionParameters& params) {
    m_thread.check_caller("open_active_endpoint");
    detail::check_address(address, "open_active_endpoint");
    detail::check_connection_parameters(params, m_config, false);
    const auto sockaddr = detail::to_socket_address(address);
    if (!sockaddr) {
      throw InvalidEndpointAddress(fmt::format("ucx: {} is not a numeric IP address", address));
    }
    std::shared_ptr<Connection> conn;
    {
      const auto held = m_registry.lock();
      m_registry.check_connection_free(held, address);
      try {
        conn = make_connection(address, params, 0, State::CONNECTING, m_global_recv);
        ucp_ep_params_t ep_params{};
        ep_params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                               UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                               UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        ep_params.sockaddr.addr = sockaddr->get();
        ep_params.sockaddr.addrlen = sockaddr->length;
        ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        ep_params.err_handler.cb = &Backend::ep_error_callback;
        ep_params.err_handler.arg = conn.get();
        check("ucp_ep_create", ucp_ep_create(m_worker->get(), &ep_params, &conn->ep));
      } catch (const InvalidConnectionParameters&) {
        throw;
      } catch (const std::runtime_error& e) {
        throw FailedOpenActiveEndpoint(
            fmt::format("ucx: cannot connect to {}: {}", address, e.what()));
      }
      remember(conn);
      m_registry.add_connection(held, conn);
    }
    m_deadlines->track(conn);
    const auto hello = send_control(*conn, MessageType::HELLO);
    if (hello != UCS_OK) {
      // Reported like a refusal, from the loop (never from inside this call).
      post_close(conn, fmt::format("sending HELLO failed: {}", status_text(hello)),
                 CloseKind::ERROR);
    }
    kick();
    NETIO3_DEBUG("ucx: connecting to {}", address);
  }

  void close_listen_endpoint(const EndPointAddress& address) {
    m_thread.check_caller("close_listen_endpoint");
    std::shared_ptr<Listener> listener;
    std::vector<std::shared_ptr<Connection>> children;
    {
      const auto held = m_registry.lock();
      std::tie(listener, children) = m_registry.take_listener(held, address);
    }
    // Requests already queued or still arriving are refused; the UCX listener is destroyed
    // after a grace period (common/closed_listeners.hpp).
    listener->closed.store(true);
    m_closed_listeners->retire(listener);
    NETIO3_DEBUG("ucx: stopped listening on {} ({} connection(s) to close)", address,
                 children.size());
    for (const auto& child : children) close_requested(child, "listen endpoint closed");
  }

  void close_active_endpoint(const EndPointAddress& address) {
    m_thread.check_caller("close_active_endpoint");
    std::shared_ptr<Connection> conn;
    {
      const auto held = m_registry.lock();
      conn = m_registry.take_for_close(held, address);
    }
    close_requested(conn, "closed locally");
  }

  NetworkBuffer* get_buffer(const EndPointAddress& address) {
    m_thread.check_caller("get_buffer");
    return detail::acquire_send_buffer(*m_registry.get(address, "get_buffer"), NAME);
  }

  NetioStatus send_buffer(const EndPointAddress& address, NetworkBuffer* buffer) {
    m_thread.check_caller("send_buffer");
    const auto conn = m_registry.get(address, "send_buffer");
    detail::BufferPool* pool = detail::claim_send_buffer(*conn, buffer, NAME);
    if (pool == nullptr) return NetioStatus::FAILED;
    const iovec iov{buffer->data(), buffer->size()};
    const auto status = send_message(*conn, {}, std::span{&iov, 1}, SendKind::BUFFERED,
                                     detail::PendingSend{buffer->id(), buffer});
    if (status != NetioStatus::OK) pool->abort_send(buffer);
    return status;
  }

  NetioStatus send_data(const EndPointAddress& address, std::span<const iovec> iov,
                        std::span<const std::uint8_t> header, std::uint64_t key) {
    m_thread.check_caller("send_data");
    const auto conn = m_registry.get(address, "send_data");
    if (!detail::header_ok(address, header, NAME)) return NetioStatus::FAILED;
    std::span<std::uint8_t> region;
    {
      const std::lock_guard lock{conn->mutex};
      region = conn->region;
    }
    if (region.empty()) {
      throw NotSupported(
          fmt::format("ucx: send_data to {}: the endpoint was opened without a zero-copy region "
                      "(send_zero_copy_params.mr_start)",
                      address));
    }
    for (const auto& v : iov) {
      const auto* p = static_cast<const std::uint8_t*>(v.iov_base);
      if (v.iov_len > 0 &&
          (p < region.data() || v.iov_len > region.size() ||
           p - region.data() > static_cast<std::ptrdiff_t>(region.size() - v.iov_len))) {
        NETIO3_WARN("ucx: send_data to {}: {} bytes at {} lie outside the mapped region [{}, +{})",
                    address, v.iov_len, static_cast<const void*>(p),
                    static_cast<const void*>(region.data()), region.size());
        return NetioStatus::FAILED;
      }
    }
    return send_message(*conn, header, iov, SendKind::ZERO_COPY, detail::PendingSend{key, nullptr});
  }

  NetioStatus send_data_copy(const EndPointAddress& address, std::span<const iovec> iov,
                             std::span<const std::uint8_t> header, std::uint64_t key) {
    m_thread.check_caller("send_data_copy");
    const auto conn = m_registry.get(address, "send_data_copy");
    if (!detail::header_ok(address, header, NAME)) return NetioStatus::FAILED;
    return send_message(*conn, header, iov, SendKind::COPY, detail::PendingSend{key, nullptr});
  }

 private:
  [[nodiscard]] bool safe() const noexcept { return m_thread.safe(); }
  std::uint64_t next_id() { return m_next_id.fetch_add(1); }

  // ---- connections -----------------------------------------------------------------

  std::shared_ptr<Connection> make_connection(const EndPointAddress& remote,
                                              const ConnectionParameters& params,
                                              std::uint64_t listener_id, State initial,
                                              std::shared_ptr<RecvPool> shared) {
    auto conn =
        std::make_shared<Connection>(next_id(), remote, params, listener_id, safe(), initial);
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

  [[nodiscard]] static EndpointCapabilities capabilities(const Connection& conn) {
    return EndpointCapabilities{.send_buffered = conn.send_pool != nullptr,
                                .send_copy = true,
                                .send_zero_copy = !conn.region.empty(),
                                .receive = true};
  }

  void remember(const std::shared_ptr<Connection>& conn) {
    const std::lock_guard lock{m_ids_mutex};
    m_conn_ids.emplace(conn->id, conn);
    // UCX reuses the memory of closed endpoints: a new one may have an old one's handle.
    m_by_ep.insert_or_assign(conn->ep, conn);
  }
  // The endpoint is being closed: messages from it are no longer looked up.
  void forget_endpoint(const Connection& conn) {
    const std::lock_guard lock{m_ids_mutex};
    const auto it = m_by_ep.find(conn.ep);
    if (it != m_by_ep.end() && it->second.lock().get() == &conn) m_by_ep.erase(it);
  }
  void forget(const Connection& conn) {
    forget_endpoint(conn);
    const std::lock_guard lock{m_ids_mutex};
    m_conn_ids.erase(conn.id);
  }
  std::shared_ptr<Connection> connection_by_id(std::uint64_t id) {
    const std::lock_guard lock{m_ids_mutex};
    const auto it = m_conn_ids.find(id);
    return it == m_conn_ids.end() ? nullptr : it->second.lock();
  }
  std::shared_ptr<Connection> connection_by_ep(ucp_ep_h ep) {
    const std::lock_guard lock{m_ids_mutex};
    const auto it = m_by_ep.find(ep);
    return it == m_by_ep.end() ? nullptr : it->second.lock();
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
      if (conn.close_requested.load(std::memory_order_relaxed) || conn.state == State::CLOSING ||
          conn.state == State::CLOSED) {
        return NetioStatus::FAILED;
      }
      if (conn.state != State::OPEN) return NetioStatus::NO_RESOURCES;  // still connecting
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
        // once every such completion has been (maybe_finish waits for completions_queued).
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

  // Control messages (HELLO, HELLO_ACK, BYE) use the reserved slots. Under no lock.
  ucs_status_t send_control(Connection& conn, MessageType type) {
    const std::lock_guard lock{conn.mutex};
    if (conn.free_ops.empty() && conn.ops.size() >= MAX_SEND_DEPTH + CONTROL_OPS) {
      return UCS_ERR_NO_RESOURCE;
    }
    SendOp& op = take_op(conn);
    op.control = true;
    op.bytes = 0;
    op.buffer = nullptr;
    const void* buffer = nullptr;
    std::size_t count = 0;
    if (type == MessageType::HELLO || type == MessageType::HELLO_ACK) {
      op.hello = encode_hello(m_config.limits.max_message_size);
      buffer = op.hello.data();
      count = op.hello.size();
    }
    const ucs_status_t status = post(conn, op, type, buffer, count, ucp_dt_make_contig(1), nullptr);
    if (status != UCS_INPROGRESS) release_op(conn, op);
    return status == UCS_INPROGRESS ? UCS_OK : status;
  }

  // A free op, or a new one (data sends are bounded by MAX_SEND_DEPTH, control messages by
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

  // Copy sends' staging memory mappings go with the endpoint's (the memory itself with the
  // connection object).
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
    const auto fixed =
        encode_header(AmHeader{type, conn.tx_seq, static_cast<std::uint8_t>(prefix.size())});
    std::copy(fixed.begin(), fixed.end(), op.am_header.begin());
    if (!prefix.empty())
      std::copy(prefix.begin(), prefix.end(), op.am_header.begin() + AM_HEADER_SIZE);
    op.am_header_len = AM_HEADER_SIZE + prefix.size();
    if (conn.ep_close_started) return UCS_ERR_CANCELED;  // the endpoint is being closed
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
    param.cb.send = &Backend::send_callback;
    param.user_data = &op;
    // The UCX header stays in the op until completion (UCX 1.13 has no
    // UCP_AM_SEND_FLAG_COPY_HEADER; with it the header could live on the stack).
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    param.datatype = datatype;
    if (memh != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
    const ucs_status_ptr_t request = ucp_am_send_nbx(conn.ep, AM_ID, op.am_header.data(),
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
    self->push_event(Event{.kind = Event::Kind::SEND_DONE,
                           .conn_id = op->conn->id,
                           .slot = op->slot,
                           .status = status});
  }

  static void ep_error_callback(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* conn = static_cast<Connection*>(arg);
    conn->backend->push_event(
        Event{.kind = Event::Kind::EP_ERROR, .conn_id = conn->id, .status = status});
  }

  static void flush_callback(void* request, ucs_status_t status, void* user_data) {
    auto* conn = static_cast<Connection*>(user_data);
    ucp_request_free(request);
    conn->backend->push_event(
        Event{.kind = Event::Kind::FLUSH_DONE, .conn_id = conn->id, .status = status});
  }

  static void close_callback(void* request, ucs_status_t status, void* user_data) {
    auto* conn = static_cast<Connection*>(user_data);
    ucp_request_free(request);
    conn->backend->push_event(
        Event{.kind = Event::Kind::CLOSE_DONE, .conn_id = conn->id, .status = status});
  }

  static void conn_request_callback(ucp_conn_request_h request, void* arg) {
    auto* listener = static_cast<Listener*>(arg);
    if (listener->closed.load()) {
      ucp_listener_reject(listener->handle, request);
      return;
    }
    listener->backend->push_event(Event{.kind = Event::Kind::CONN_REQUEST,
                                        .listener = listener->shared_from_this(),
                                        .request = request});
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
    if (m_shut_down) return drop;
    if ((param.recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
      NETIO3_WARN("ucx: dropping a message without its sender's endpoint");
      return drop;
    }
    const auto conn = connection_by_ep(param.reply_ep);
    if (!conn) {
      NETIO3_DEBUG("ucx: dropping a message from an endpoint that is gone");
      return drop;
    }
    if (!conn->wired) {
      conn->wired = true;
      mark_dirty(*conn);  // a close waiting for the set-up to end goes on (service_inbox)
    }
    if (conn->failed || conn->state == State::CLOSING || conn->state == State::CLOSED) return drop;
    std::string error;
    const auto decoded = decode_header(header, error);
    if (!decoded) {
      protocol_error(*conn, error);
      return drop;
    }
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
    std::size_t limit = 0;
    switch (decoded->type) {
      case MessageType::HELLO:
      case MessageType::HELLO_ACK:
        limit = HELLO_SIZE;
        break;
      case MessageType::DATA:
        limit = m_config.limits.max_message_size;
        break;
      case MessageType::BYE:
        limit = 0;
        break;
    }
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
    push_event(Event{.kind = Event::Kind::PROTOCOL_ERROR, .conn_id = conn.id, .reason = why});
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
    if (m_progressing || m_shut_down) return false;
    m_progressing = true;
    bool active = false;
    for (int round = 0; round < PROGRESS_ROUNDS; ++round) {
      const unsigned n = ucp_worker_progress(m_worker->get());
      const bool work = has_work();
      active = active || n != 0 || work;
      dispatch();
      if (m_shut_down) return active;  // the backend is going: leave the flag set
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
    if (m_shut_down) return true;
    const bool active = progress();
    if (m_shut_down) return true;
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
    for (int guard = 0; guard < 1024 && !m_shut_down; ++guard) {
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
        if (m_shut_down) return;
      }
      for (const auto& conn : dirty) {
        service_inbox(conn);
        if (m_shut_down) return;
      }
      events.clear();
      dirty.clear();
      m_spare_events = std::move(events);
      m_spare_dirty = std::move(dirty);
    }
  }

  void handle(Event& event) {
    switch (event.kind) {
      case Event::Kind::CONN_REQUEST:
        on_connection_request(event.listener, event.request);
        return;
      case Event::Kind::SENT_AT_ONCE: {
        const auto& conn = event.conn;
        {
          const std::lock_guard lock{conn->mutex};
          --conn->completions_queued;
        }
        if (event.buffer != nullptr) conn->send_pool->release(event.buffer);
        m_notifier.send_completed(conn->remote, event.key);
        if (conn->state == State::CLOSING) maybe_finish(conn);
        return;
      }
      default:
        break;
    }
    const auto conn = connection_by_id(event.conn_id);
    if (!conn) return;
    switch (event.kind) {
      case Event::Kind::SEND_DONE:
        on_send_done(conn, event.slot, event.status);
        break;
      case Event::Kind::EP_ERROR:
        on_ep_error(conn, event.status);
        break;
      case Event::Kind::FLUSH_DONE:
        conn->flushing = false;
        conn->flushed = true;
        if (event.status != UCS_OK) conn->force_close = true;
        advance_close(conn);
        break;
      case Event::Kind::CLOSE_DONE:
        conn->ep_closed = true;
        if (event.status != UCS_OK) {
          NETIO3_DEBUG("ucx: closing the endpoint to {}: {}", conn->remote,
                       status_text(event.status));
        }
        maybe_finish(conn);
        break;
      case Event::Kind::PROTOCOL_ERROR:
        close_connection(conn, event.reason, CloseKind::ERROR);
        break;
      default:
        break;
    }
  }

  void on_send_done(const std::shared_ptr<Connection>& conn, std::uint32_t slot,
                    ucs_status_t status) {
    detail::PendingSend done;
    bool completed = false;
    bool control = false;
    State state{};
    {
      const std::lock_guard lock{conn->mutex};
      SendOp& op = conn->ops[slot];
      control = op.control;
      --conn->requests;
      if (!control) {
        --conn->data_ops;
        conn->unsent_bytes -= std::min<std::uint64_t>(conn->unsent_bytes, op.bytes);
        if (status == UCS_OK) completed = conn->ledger.complete(op.ticket, done);
      }
      release_op(*conn, op);
      state = conn->state;
    }
    if (status != UCS_OK) {
      // The key is reported with the connection's cancelled keys.
      if (state != State::CLOSING && state != State::CLOSED) {
        NETIO3_WARN("ucx: connection with {}: send failed: {}", conn->remote, status_text(status));
        close_connection(conn, fmt::format("send failed: {}", status_text(status)),
                         CloseKind::ERROR);
      }
    } else if (completed) {
      if (done.buffer != nullptr) conn->send_pool->release(done.buffer);
      m_notifier.send_completed(conn->remote, done.key);
    }
    if (conn->state == State::CLOSING) maybe_finish(conn);
  }

  void on_ep_error(const std::shared_ptr<Connection>& conn, ucs_status_t status) {
    conn->wired = true;  // set-up over, if it was not
    if (conn->state == State::CLOSING || conn->state == State::CLOSED) {
      // A flush in progress ends with an error of its own; the close is forced.
      conn->force_close = true;
      advance_close(conn);
      return;
    }
    const bool refused = conn->state == State::CONNECTING;
    const auto reason = refused ? fmt::format("connection failed: {}", status_text(status))
                                : fmt::format("connection lost: {}", status_text(status));
    if (conn->state == State::OPEN) {
      // What arrived complete before the error is still delivered (a BYE among it makes
      // this an orderly close); service_inbox closes once nothing more can come.
      NETIO3_DEBUG("ucx: connection with {}: {}", conn->remote, reason);
      conn->peer_error = reason;
      mark_dirty(*conn);
      return;
    }
    NETIO3_DEBUG("ucx: connection with {}: {}", conn->remote, reason);
    close_connection(conn, reason, CloseKind::ERROR);
  }

  void on_connection_request(const std::shared_ptr<Listener>& listener,
                             ucp_conn_request_h request) {
    const auto reject = [&](std::string_view why) {
      NETIO3_INFO("ucx: refusing a connection on {}: {}", listener->address, why);
      ucp_listener_reject(listener->handle, request);
    };
    if (listener->closed.load() || m_shut_down) {
      reject("the listen endpoint is closed");
      return;
    }
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    const ucs_status_t queried = ucp_conn_request_query(request, &attr);
    const auto remote = queried == UCS_OK ? detail::to_endpoint_address(&attr.client_address,
                                                                        sizeof(attr.client_address))
                                          : std::nullopt;
    if (!remote) {
      reject(fmt::format("the request carries no IP address ({})", status_text(queried)));
      return;
    }
    std::shared_ptr<Connection> conn;
    {
      const auto held = m_registry.lock();
      if (!m_registry.has_listener(held, listener->address)) {
        reject("the listen endpoint is closed");
        return;
      }
      if (m_registry.find(held, *remote)) {
        reject(fmt::format("a connection with {} exists", *remote));
        return;
      }
      try {
        conn = make_connection(*remote, listener->params, listener->id, State::ACCEPTING,
                               listener->shared_recv ? listener->shared_recv : m_global_recv);
      } catch (const std::exception& e) {
        reject(e.what());
        return;
      }
      ucp_ep_params_t ep_params{};
      ep_params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                             UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep_params.conn_request = request;
      ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep_params.err_handler.cb = &Backend::ep_error_callback;
      ep_params.err_handler.arg = conn.get();
      const ucs_status_t created = ucp_ep_create(m_worker->get(), &ep_params, &conn->ep);
      if (created != UCS_OK) {
        NETIO3_WARN("ucx: accepting a connection from {} on {}: ucp_ep_create failed: {}", *remote,
                    listener->address, status_text(created));
        return;
      }
      remember(conn);
      m_registry.add_connection(held, conn);
    }
    m_deadlines->track(conn);
    NETIO3_DEBUG("ucx: accepting connection from {} on {}", *remote, listener->address);
  }

  // Starts the receives of waiting rendezvous messages and delivers what is in order.
  void service_inbox(const std::shared_ptr<Connection>& conn) {
    conn->dirty = false;
    if (conn->state == State::CLOSING || conn->state == State::CLOSED) {
      advance_close(conn);
      return;
    }
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
      deliver(conn, message);
      m_delivering = nullptr;
      release(*conn, message);
      if (m_shut_down) return;
      if (conn->state == State::CLOSING || conn->state == State::CLOSED) {
        advance_close(conn);
        return;
      }
    }
    if (!conn->peer_error.empty() && conn->receiving == 0) {
      NETIO3_INFO("ucx: connection with {}: {}", conn->remote, conn->peer_error);
      close_connection(conn, conn->peer_error, CloseKind::ERROR);
    }
  }

  void start_receive(Connection& conn, Incoming& slot) {
    void* target = nullptr;
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
    target = start + slot.prefix_len;
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

  void deliver(const std::shared_ptr<Connection>& conn, const Incoming& message) {
    if (message.stage == Incoming::Stage::FAILED) {
      const auto reason = fmt::format("receiving a message of {} bytes failed: {}", message.length,
                                      status_text(message.status));
      NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
      close_connection(conn, reason, CloseKind::ERROR);
      return;
    }
    const std::span<const std::uint8_t> bytes{message.data, message.length};
    switch (message.type) {
      case MessageType::DATA:
        if (conn->state != State::OPEN) {
          close_connection(conn, "data before the connection was established", CloseKind::ERROR);
          return;
        }
        m_notifier.data(conn->remote, bytes);
        return;
      case MessageType::HELLO:
      case MessageType::HELLO_ACK: {
        const State expected =
            message.type == MessageType::HELLO ? State::ACCEPTING : State::CONNECTING;
        const auto peer_max = decode_hello(bytes);
        if (conn->state != expected || !peer_max) {
          const auto reason = fmt::format(
              "unexpected {} message", message.type == MessageType::HELLO ? "HELLO" : "HELLO_ACK");
          NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
          close_connection(conn, reason, CloseKind::ERROR);
          return;
        }
        if (message.type == MessageType::HELLO) {
          const auto status = send_control(*conn, MessageType::HELLO_ACK);
          if (status != UCS_OK) {
            close_connection(conn, fmt::format("sending HELLO_ACK failed: {}", status_text(status)),
                             CloseKind::ERROR);
            return;
          }
        }
        established(conn, *peer_max);
        return;
      }
      case MessageType::BYE:
        close_connection(conn, "peer closed the connection", CloseKind::PEER);
        return;
    }
  }

  void established(const std::shared_ptr<Connection>& conn, std::uint64_t peer_max) {
    // Closed by the application during set-up: the close reports it.
    if (conn->close_requested.load()) return;
    {
      const std::lock_guard lock{conn->mutex};
      conn->peer_max = peer_max;
      conn->state = State::OPEN;
    }
    m_notifier.established(conn->remote, capabilities(*conn));
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

  // ---- closing -----------------------------------------------------------------------

  void post_close(const std::shared_ptr<Connection>& conn, std::string reason, CloseKind kind) {
    std::weak_ptr<Backend> weak = weak_from_this();
    m_loop->post([weak, conn, reason = std::move(reason), kind] {
      if (auto self = weak.lock()) self->close_connection(conn, reason, kind);
    });
  }

  // The application closed `conn`: on the loop thread the close starts at once (no send is
  // accepted from now on); from another thread it is posted to the loop.
  void close_requested(const std::shared_ptr<Connection>& conn, std::string_view reason) {
    if (m_loop->in_loop_thread()) {
      close_connection(conn, reason, CloseKind::LOCAL);
    } else {
      post_close(conn, std::string{reason}, CloseKind::LOCAL);
    }
  }

  // Closing has three steps, each waiting for the one before:
  //  1. flush: a local or peer close of an open connection sends what is queued (for at
  //     most close_timeout); after an error, or during set-up, nothing is flushed;
  //  2. the endpoint closes once no rendezvous receive is in flight on it (or
  //     close_timeout passed): gracefully after a complete flush (a forced close can lose
  //     data that UCX reported sent), by force otherwise;
  //  3. the application hears of it once UCX holds no send request of the connection;
  //     the connection is freed when the endpoint's close has completed as well.
  void close_connection(const std::shared_ptr<Connection>& conn, std::string_view reason,
                        CloseKind kind) {
    if (m_shut_down) return;
    State previous{};
    {
      const std::lock_guard lock{conn->mutex};
      previous = conn->state;
      if (previous == State::CLOSING || previous == State::CLOSED) return;
      conn->state = State::CLOSING;
    }
    {
      const auto held = m_registry.lock();
      m_registry.remove(held, conn);
    }
    m_closing.emplace(conn->id, conn);  // kept until UCX is done with it
    conn->close_kind = kind;
    conn->close_reason = std::string{reason};
    conn->was_open = previous == State::OPEN;
    // What arrived but was not delivered is dropped; receives in flight finish first.
    for (auto& slot : conn->inbox) {
      if (slot.stage != Incoming::Stage::RECEIVING) release(*conn, slot);
      slot.stage = Incoming::Stage::DROPPED;
    }
    conn->force_close = kind == CloseKind::ERROR || previous != State::OPEN;
    if (kind == CloseKind::LOCAL && previous == State::OPEN) {
      const auto bye = send_control(*conn, MessageType::BYE);
      if (bye != UCS_OK) {
        NETIO3_DEBUG("ucx: connection with {}: BYE not sent: {}", conn->remote, status_text(bye));
      }
    }
    std::weak_ptr<Backend> weak = weak_from_this();
    std::weak_ptr<Connection> weak_conn = conn;
    conn->close_timer = m_loop->create_timer([weak, weak_conn] {
      auto self = weak.lock();
      auto c = weak_conn.lock();
      if (self && c && !self->m_shut_down) self->close_timed_out(c);
    });
    conn->close_timer.start_once(m_config.limits.close_timeout);
    NETIO3_DEBUG("ucx: closing connection with {} ({}){}", conn->remote, reason,
                 conn->force_close ? "" : ", flushing first");
    if (!conn->force_close) start_flush(conn);
    advance_close(conn);
  }

  void start_flush(const std::shared_ptr<Connection>& conn) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &Backend::flush_callback;
    param.user_data = conn.get();
    const ucs_status_ptr_t request = ucp_ep_flush_nbx(conn->ep, &param);
    if (request == nullptr) {
      conn->flushed = true;
    } else if (UCS_PTR_IS_ERR(request)) {
      conn->flushed = true;
      conn->force_close = true;
    } else {
      conn->flushing = true;
    }
  }

  void close_timed_out(const std::shared_ptr<Connection>& conn) {
    if (conn->state != State::CLOSING || conn->ep_close_started) return;
    NETIO3_INFO(
        "ucx: connection with {}: {} after {} ms; closing the endpoint by force", conn->remote,
        conn->flushed ? fmt::format("{} rendezvous receive(s) still in flight", conn->receiving)
                      : std::string{"sends still in flight"},
        m_config.limits.close_timeout.count());
    conn->force_close = true;
    conn->timed_out = true;
    advance_close(conn);
  }

  void advance_close(const std::shared_ptr<Connection>& conn) {
    if (conn->state == State::CLOSING && !conn->ep_close_started) {
      const bool flush_over =
          conn->flushed || (conn->force_close && !conn->flushing) || conn->timed_out;
      if (!flush_over) return;
      if (conn->receiving > 0 && !conn->timed_out) return;  // finish_receive comes back here
      // UCX 1.13's tcp sockcm asserts (tcp_sockcm_ep.c:416, async.c:643) or crashes when an
      // endpoint is closed while its connection is still being set up. A connection closed
      // during set-up is therefore closed once the peer's first message or an error shows
      // that the set-up is over, or after close_timeout; on_message and on_ep_error come
      // back here.
      if (!conn->wired && !conn->timed_out) return;
      {
        // Under the lock every post() holds: no thread sends on the endpoint once its close
        // starts (an application thread may be posting the HELLO of open_active_endpoint
        // while an endpoint error closes the connection here).
        const std::lock_guard lock{conn->mutex};
        conn->ep_close_started = true;
      }
      forget_endpoint(*conn);
      ucp_request_param_t param{};
      param.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
      param.cb.send = &Backend::close_callback;
      param.user_data = conn.get();
      param.flags = conn->force_close ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      NETIO3_DEBUG("ucx: closing the endpoint to {}{}", conn->remote,
                   conn->force_close ? " by force" : "");
      const ucs_status_ptr_t request = ucp_ep_close_nbx(conn->ep, &param);
      if (request == nullptr || UCS_PTR_IS_ERR(request)) {
        push_event(Event{.kind = Event::Kind::CLOSE_DONE,
                         .conn_id = conn->id,
                         .status = request == nullptr ? UCS_OK : UCS_PTR_STATUS(request)});
      }
    }
    maybe_finish(conn);
  }

  // Reports the close once the endpoint's close has started, UCX holds no send request of
  // the connection and every send that completed at once was reported; frees it once the
  // endpoint is closed and no receive is in flight.
  void maybe_finish(const std::shared_ptr<Connection>& conn) {
    if (!conn->ep_close_started) return;
    if (!conn->reported) {
      std::vector<std::uint64_t> keys;
      {
        const std::lock_guard lock{conn->mutex};
        if (conn->requests > 0 || conn->completions_queued > 0) return;
        conn->state = State::CLOSED;
        keys = detail::cancel_all_sends(conn->ledger, conn->send_pool);
      }
      conn->reported = true;
      conn->close_timer.close();
      m_notifier.connection_ended(conn->remote, conn->was_open, conn->active(),
                                  conn->close_kind == CloseKind::LOCAL, keys, conn->close_reason);
      if (m_shut_down) return;
    }
    if (!conn->ep_closed || conn->receiving > 0) return;
    forget(*conn);
    m_closing.erase(conn->id);
    for (auto& slot : conn->inbox) release(*conn, slot);
    conn->inbox.clear();
    conn->region_map = MemoryMap{};
    conn->send_map = MemoryMap{};
    unmap_staging(*conn);
  }

 public:
  // Connections and listeners find their backend through this (callback arguments).
  const NetworkConfig m_config;
  const std::shared_ptr<BaseEventLoop> m_loop;
  const detail::Notifier m_notifier;
  const detail::ThreadModel m_thread;
  const TransportChoice m_transports;
  std::unique_ptr<Worker> m_worker;
  std::unique_ptr<detail::BufferPool> m_shared_send_pool;
  MemoryMap m_shared_send_map;
  std::shared_ptr<RecvPool> m_global_recv;
  std::atomic<bool> m_shut_down{false};
  std::atomic<std::uint64_t> m_next_id{1};

  Registry m_registry{NAME};
  std::optional<detail::SetupDeadlines<Connection>> m_deadlines;
  std::optional<detail::ClosedListeners<Listener>> m_closed_listeners;

  detail::OptionalMutex m_ids_mutex;
  std::unordered_map<std::uint64_t, std::weak_ptr<Connection>> m_conn_ids;
  std::unordered_map<ucp_ep_h, std::weak_ptr<Connection>> m_by_ep;

  detail::OptionalMutex m_events_mutex;
  std::vector<Event> m_events;
  std::vector<Event> m_spare_events;  // loop thread only (dispatch)
  // Loop thread only.
  std::unordered_map<std::uint64_t, std::shared_ptr<Connection>> m_closing;
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
