// The UCX backend's types and its class (see ucx_backend.cpp for how it works). Its
// definitions are split by concern: ucx_backend.cpp (lifecycle, API, the worker),
// control_channel.cpp (netio3's own connection set-up and UCP endpoints), messages.cpp
// (sending, UCX's callbacks, progress and delivery), closing.cpp.

#pragma once

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
#include "backends/ucx/ucx_backend.hpp"
#include "common/admission.hpp"
#include "common/backend_facade.hpp"
#include "common/buffer_pool.hpp"
#include "common/connection.hpp"
#include "common/connection_engine.hpp"
#include "common/endpoint_registry.hpp"
#include "common/endpoint_rules.hpp"
#include "common/log.hpp"
#include "common/log_limiter.hpp"
#include "common/notifier.hpp"
#include "common/send_ledger.hpp"
#include "common/setup_deadlines.hpp"
#include "common/sockaddr.hpp"
#include "common/stream_admission.hpp"
#include "common/tcp.hpp"
#include "common/thread_model.hpp"

namespace netio3::ucx {

// Internal: not exported from the shared library, and not interposable, so that calls between
// the backend's files are bound (and inlined) as within one file.
#pragma GCC visibility push(hidden)

using namespace std::chrono_literals;

constexpr std::string_view NAME = "ucx";
// Data sends in flight per connection at most (UCX requests); two more for READY and BYE.
constexpr std::size_t MAX_SEND_DEPTH = 1024;
constexpr std::size_t CONTROL_OPS = 2;
constexpr std::size_t MAX_IOV = 16;
// Messages a connection may hold back for ordering (behind an unfinished rendezvous).
constexpr std::uint64_t MAX_REORDER = std::uint64_t{1} << 16U;
// Rendezvous bytes a connection receives at once at most (beyond one message), where the
// payload is fetched over the network. By CMA (a peer on this host) one message at a time:
// there the copy is this process's own work (process_vm_readv, one thread), so fetching more
// at once only spreads it over more receive buffers, and a copy into memory that is no
// longer in cache costs more (docs/ucx.md, "The receiver's copy").
constexpr std::size_t RECEIVE_WINDOW = std::size_t{64} << 20U;
constexpr std::size_t PAYLOAD_ALIGNMENT = 64;
// A backend's destruction: how long the endpoints' closes may take at least, after the
// sends had close_timeout to complete.
constexpr auto CLOSE_PROGRESS = std::chrono::milliseconds{500};
// Per wake-up: progress calls before the loop turns to other work, and the time they may
// take. In SAFE mode sender threads keep adding completions while the loop reports them (a
// send completed at once is an event; its callback frees what lets the next send start):
// without a time limit a loop whose callbacks are slow stays in the worker's progress and
// its timers and other descriptors wait (under TSan it kept a loop from reading its control
// channel for more than peer_timeout, and the peer closed the connection as silent). Past
// the budget the loop polls its descriptors (without sleeping) and comes back: it does not arm
// the worker before a progress call has found nothing to do (UCX's rule; arming earlier left
// accepted connections unread until something else woke the loop). NETIO3_UCX_PROGRESS_BUDGET_US
// in the environment sets another budget (0: one progress call per round; tests use it).
constexpr int PROGRESS_ROUNDS = 64;
constexpr auto PROGRESS_BUDGET = std::chrono::milliseconds{2};
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
using detail::Payload;
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
  std::size_t held{0};     // READY from eager: bytes counted in Backend::m_inbox_bytes
  std::uint64_t count{0};  // ACK: the peer's count of messages delivered
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
  bool by_cma{false};  // large messages between the two workers go by CMA (one host)
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
struct Connection : detail::ConnectionBase {
  using ConnectionBase::ConnectionBase;

  Backend* backend{nullptr};  // for UCX callbacks, whose argument is the connection

  // Control channel (loop thread; control_fd is published under `mutex`, because the loop
  // may dispatch its first event before add_fd returns in another thread).
  detail::Socket control;
  FdHandle control_fd;
  // Until the connection is admitted, frames of at most detail::MAX_ADMISSION_FRAME.
  detail::FrameDecoder decoder{detail::MAX_ADMISSION_FRAME, CONTROL_PROTOCOL};
  std::vector<std::uint8_t> control_out;    // the opening, while the socket would block
  std::optional<std::uint64_t> peer_total;  // the peer's CLOSE: messages it sent in all
  bool greeted{false};                      // the peer's HELLO arrived (control channel)
  bool peer_ready{false};                   // the peer's READY arrived (over UCX)
  // Admission (docs/admission.md), loop thread only: the peer's HELLO is read only once the
  // exchange admitted it (at once where neither side has a key or a hook).
  EndPointAddress listener_address;  // accepted: the listening endpoint it came in through
  std::optional<detail::AdmissionExchange> admission;  // from the opening

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
  // provision() ran: the buffers and maps below exist (a client's from connect, a server's
  // from the peer's HELLO). Loop thread, or the connecting thread before the loop sees it.
  bool provisioned{false};
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
  bool by_cma{false};  // its endpoint's: one rendezvous received at a time (RECEIVE_WINDOW)
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
                public detail::StreamAdmission<Backend, Connection>,
                public std::enable_shared_from_this<Backend> {
 public:
  static constexpr BackendType TYPE = BackendType::UCX;
  using Engine = detail::ConnectionEngine<Backend, Connection, Listener>;
  friend class detail::StreamAdmission<Backend, Connection>;
  static constexpr detail::SetupFrames SETUP_FRAMES{.backend = NAME,
                                                    .challenge = FRAME_CHALLENGE,
                                                    .proof = FRAME_PROOF,
                                                    .refusal = FRAME_REFUSAL,
                                                    .admission_minor = ADMISSION_MINOR,
                                                    .ack_minor = ACK_MINOR};

  Backend(const NetworkConfig& config, std::shared_ptr<BaseEventLoop> loop)
      : Engine{NAME, config, std::move(loop), config.thread_safety},
        m_transports{choose_transports(m_config.mode)},
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

  ~Backend() { shutdown(); }

  // Tests only: the messages to `remote` sent from now on skip `n` sequence numbers, as an
  // admitted peer that misbehaves would. Any thread.
  void skip_sequence_numbers(const EndPointAddress& remote, std::uint64_t n);
  // Tests only: the worker (its address, as a peer's HELLO carries it; the guard's state).
  [[nodiscard]] const Worker& worker() const noexcept { return *m_worker; }
  void start();

  void shutdown() noexcept;

  // ---- API ---------------------------------------------------------------------------

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                       const ConnectionParameters& params);

  void open_active_endpoint(const EndPointAddress& address, const ConnectionParameters& params);

 private:
  [[nodiscard]] bool safe() const noexcept { return m_thread.safe(); }

  // ---- the worker ----------------------------------------------------------------------

  // The UCP context and worker are made when the first endpoint is opened, because that
  // tells which network interface UCX's transports should use: the listen address's, or
  // the one that leads to the first peer. UCX's tcp transport listens on every device it
  // uses; restricted so, a server bound to 127.0.0.1 listens nowhere else. UCX_NET_DEVICES
  // in the environment wins; a wildcard listen address leaves the choice to UCX.
  void ensure_worker(const EndPointAddress& first, bool listening);

  // ",mlx5_0:1,..." for every InfiniBand / RoCE port of this host.
  static std::string rdma_ports();

  // An endpoint on an interface that UCX was not set up for: its peers may not reach this
  // process over UCX.
  void warn_if_off_devices(const EndPointAddress& address, bool listening) const;

  // ---- connections -----------------------------------------------------------------

  // Under the registry's lock (`held`): the token must stay unused until it is indexed.
  // The connection gets the shared receive pool `shared` (or none); its own buffers and
  // memory maps come from provision().
  std::shared_ptr<Connection> make_connection(const Registry::Lock& held,
                                              const EndPointAddress& remote,
                                              const ConnectionParameters& params,
                                              std::uint64_t listener_id, Phase initial,
                                              std::shared_ptr<RecvPool> shared);

  // Allocates and maps what `conn.params` asks for, once: its own receive pool (unless it
  // shares one), its send pool, the zero-copy region's map. A client calls it in connect (errors
  // reach the caller); a server only when a peer's HELLO was accepted, so that a connection
  // that never completes its set-up (a flood, a stranger) costs a socket, not buffers.
  // Throws what the allocation or UCX throws.
  void provision(Connection& conn);

  // A random connection token that no connection of this backend has: messages are routed
  // by it, and a stray or forged message must not land in another connection.
  std::uint64_t new_token(const Registry::Lock& held);

  [[nodiscard]] static EndpointCapabilities capabilities(const Connection& conn);

  // ---- the control channel ---------------------------------------------------------

  FdCallback control_callback(const std::shared_ptr<Connection>& conn) {
    return fd_callback<&Backend::on_control_event>(conn);
  }

  void close_listener_socket(Listener& listener) noexcept;

  void on_acceptable(const std::shared_ptr<Listener>& listener, std::uint32_t /*events*/);

  void accept_one(const std::shared_ptr<Listener>& listener, detail::Socket socket,
                  const EndPointAddress& remote);

  // What this side sends first: the greeting, then its challenge (with a key) or its HELLO
  // (unless admission holds it back).
  std::vector<std::uint8_t> opening(Connection& conn);
  [[nodiscard]] std::vector<std::uint8_t> hello_frame(Connection& conn) const;

  // ---- admission (docs/admission.md) ------------------------------------------------
  bool on_control_greeting(const std::shared_ptr<Connection>& conn,
                           const detail::Greeting& greeting);
  // The primitives of detail::StreamAdmission. admitted: a keyed client's HELLO goes now, and
  // the peer's HELLO may be read; false when the connection went meanwhile.
  bool admitted(const std::shared_ptr<Connection>& conn);
  void add_to_verdict(Connection& conn, std::vector<std::uint8_t>& frames) const;
  void refuse_and_linger(Connection& conn, std::span<const std::uint8_t> refusal);
  bool setup_protocol_error(const std::shared_ptr<Connection>& conn, std::string_view what);
  [[nodiscard]] bool setup_alive(const Connection& conn) const noexcept {
    return control_active(conn);
  }
  void write_setup(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> frames) {
    write_control(conn, frames);
  }

  // Writes control bytes; what would block waits for EPOLLOUT. Loop thread.
  void write_control(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> bytes);

  void flush_control(const std::shared_ptr<Connection>& conn);

  void on_control_event(const std::shared_ptr<Connection>& conn, std::uint32_t events);

  [[nodiscard]] bool control_active(const Connection& conn) const noexcept;

  void read_control(const std::shared_ptr<Connection>& conn);

  // The server refused `conn` because it has a connection from its source address and port:
  // connects the control channel again from a new one (at most SOURCE_PORT_RETRIES times).
  // False when it may not or could not; the caller then closes it.
  bool reconnect_from_new_source_port(const std::shared_ptr<Connection>& conn);

  // A protocol error on the control channel: that one connection goes, with the reason.
  void protocol_error_now(const std::shared_ptr<Connection>& conn, const std::string& why);

  // Returns whether to go on decoding.
  bool on_control_frame(const std::shared_ptr<Connection>& conn,
                        std::span<const std::uint8_t> frame);

  void on_hello(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> frame);

  // The control connection ended (EOF or error) while the connection is set up or open.
  void on_control_end(const std::shared_ptr<Connection>& conn, const std::string& how);

  // Closes the control socket now (the peer sees EOF, or a reset).
  void drop_control(Connection& conn) noexcept;

  // Hands the control socket to the lingering set after an orderly close: our FIN is sent,
  // what the peer still sends is read until it closes too. `awaited`: the shutdown waits for
  // the peer's end (it follows the last message the peer was told to expect).
  void linger_control(Connection& conn, bool awaited);

  // ---- endpoints ---------------------------------------------------------------------

  // The endpoint to the worker whose HELLO gave `address` (`info`, parsed): the one its
  // earlier connections use, or a new one, made without CMA where cma_refusal says so
  // (logged for `remote`). Throws UcxError.
  std::shared_ptr<Endpoint> acquire_endpoint(std::span<const std::uint8_t> address,
                                             const WorkerAddressInfo& info,
                                             const EndPointAddress& remote);

  // The connection no longer sends on its endpoint (which stays for the others).
  void release_endpoint(Connection& conn);

  // Closes an endpoint by force (UCX completes, as cancelled, what it still holds) and ends
  // the connections that use it with `why`.
  void close_endpoint(const std::shared_ptr<Endpoint>& endpoint, const std::string& why);

  void on_endpoint_closed(std::uint64_t id, ucs_status_t status);

  void on_endpoint_error(std::uint64_t id, ucs_status_t status);

  // ---- sending ---------------------------------------------------------------------

  enum class SendKind { BUFFERED, ZERO_COPY, COPY };

  NetioStatus send_message(Connection& conn, std::span<const std::uint8_t> header,
                           std::span<const iovec> payload, SendKind kind,
                           detail::PendingSend pending);

  // READY or BYE, in the reserved slots. Under no lock.
  ucs_status_t send_control(Connection& conn, MessageType type,
                            std::span<const std::uint8_t> prefix = {});

  // A free op, or a new one (data sends are bounded by MAX_SEND_DEPTH, READY and BYE by
  // CONTROL_OPS, so the deque never grows past their sum).
  static SendOp& take_op(Connection& conn);
  static void release_op(Connection& conn, SendOp& op);

  // Under conn.mutex: unmaps and frees an op's staging memory.
  static void free_staging(Connection& conn, SendOp& op);

  // Copy sends' staging memory mappings go with the connection's (the memory itself with
  // the connection object).
  static void unmap_staging(Connection& conn);

  // Under conn.mutex: staging memory for a copy send of `size` bytes, mapped if it is large
  // (unmapped if the mapping fails: UCX then copies it into its own buffers).
  void grow_staging(Connection& conn, SendOp& op, std::size_t size);

  // Under conn.mutex. UCS_INPROGRESS: the request completes later (SEND_DONE); UCS_OK: it
  // completed at once; anything else: refused. The sequence number is used only if sent.
  ucs_status_t post(Connection& conn, SendOp& op, MessageType type, const void* buffer,
                    std::size_t count, ucp_datatype_t datatype, ucp_mem_h memh,
                    std::span<const std::uint8_t> prefix = {});

  // ---- UCX callbacks: record only --------------------------------------------------

  void push_event(Event event);

  static void send_callback(void* request, ucs_status_t status, void* user_data);

  static void ep_error_callback(void* arg, ucp_ep_h /*ep*/, ucs_status_t status);

  static void ep_close_callback(void* request, ucs_status_t status, void* user_data);

  static void receive_callback(void* request, ucs_status_t status, std::size_t length,
                               void* user_data);

  static ucs_status_t am_callback(void* arg, const void* header, std::size_t header_length,
                                  void* data, std::size_t length, const ucp_am_recv_param_t* param);
  // A message on an active message id netio3 does not use: dropped (a stranger's worker).
  static ucs_status_t stranger_am_callback(void* arg, const void* header, std::size_t header_length,
                                           void* data, std::size_t length,
                                           const ucp_am_recv_param_t* param);

  // A message arrived (inside ucp_worker_progress): file it in its connection's inbox.
  ucs_status_t on_message(std::span<const std::uint8_t> header, void* data, std::size_t length,
                          const ucp_am_recv_param_t& param);

  void protocol_error(Connection& conn, const std::string& why);

  void mark_dirty(Connection& conn);

  void finish_receive(Incoming& slot, ucs_status_t status, std::size_t length);

  // ---- the loop ----------------------------------------------------------------------

  void kick() {
    if (!m_kick_pending.exchange(true)) m_kick.fire();
  }

  // Progresses the worker until it has nothing left and handles what it reported. Returns
  // whether anything happened.
  bool progress();

  [[nodiscard]] bool has_work();

  // The prepare hook: true when the worker is armed and the loop may sleep on its fd.
  bool may_sleep();

  // Handles recorded events and inboxes until none is left (a handler, or a sending thread,
  // may add more), or until `deadline`: what is left waits for the next call.
  void dispatch(std::chrono::steady_clock::time_point deadline);

  void handle(Event& event);

  void on_send_done(const std::shared_ptr<Connection>& conn, std::uint32_t slot,
                    ucs_status_t status);

  // The connection's endpoint failed or was closed by force: UCX completes its sends.
  void on_ep_error(const std::shared_ptr<Connection>& conn, const std::string& why);

  // Starts the receives of waiting rendezvous messages and delivers what is in order.
  void service_inbox(const std::shared_ptr<Connection>& conn);

  void start_receive(Connection& conn, Incoming& slot);
  // The receive of `slot`'s rendezvous payload into `target` (registered as `memh` unless
  // null, as post() takes it); its stage is set by the caller. It completes in
  // finish_receive.
  void fetch(Connection& conn, Incoming& slot, void* target, ucp_mem_h memh);

  void handle_message(const std::shared_ptr<Connection>& conn, const Incoming& message);

  // Gives back what a message holds (UCX data, a pool buffer, heap memory).
  void release(Connection& conn, Incoming& message);

  // Drops a message of a closing connection: a rendezvous one not yet fetched is fetched
  // into scratch memory (see there), a receive in flight ends as it will; either way the
  // slot is DROPPED and released when its receive completes.
  void discard(Connection& conn, Incoming& slot);
  // m_discard, allocated at the first use; false (logged) where it cannot be.
  bool discard_area() noexcept;

  // ---- closing (detail::TransportOf) ---------------------------------------------------

 public:
  // Closing has three steps, each waiting for the one before:
  //  1. a local or peer close of an open connection waits for its sends to complete (for at
  //     most close_timeout); after an error, or during set-up, it does not wait;
  //  2. the endpoint is released: kept for reuse after a clean close, closed by force
  //     otherwise (UCX then cancels what it still holds);
  //  3. the engine reports it once UCX holds no send request of the connection (and every
  //     send that completed at once was reported): quiescent(); the connection is freed once
  //     no rendezvous receive is in flight on it (release_if_idle).
  NetioStatus post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer);

  NetioStatus post_data(const std::shared_ptr<Connection>& conn,
                        std::span<const std::uint8_t> header, std::span<const iovec> iov,
                        Payload payload, detail::PendingSend pending);

  void close_listener(const std::shared_ptr<Listener>& listener) noexcept {
    close_listener_socket(*listener);
  }

  // The backend's shutdown winds every connection down itself.
  static void abandon(Connection& /*conn*/) noexcept {}

  void close_transport(const std::shared_ptr<Connection>& conn);

  [[nodiscard]] bool quiescent(const Connection& conn) const;

  void after_closed(const std::shared_ptr<Connection>& conn) { release_if_idle(conn); }

  // Statistics (under the connection's lock): bytes handed to UCX and not completed.
  [[nodiscard]] static std::uint64_t queued_bytes(const Connection& conn) {
    return conn.unsent_bytes;
  }

  // A HEARTBEAT frame on the control channel (common/liveness.hpp): the peer's process and
  // host are alive and its loop runs. What arrives on the control channel is counted.
  void send_heartbeat(const std::shared_ptr<Connection>& conn);
  bool send_ack(const std::shared_ptr<Connection>& conn, std::uint64_t count);

 private:
  // Messages sent on the connection so far (the count a CLOSE announces).
  static std::uint64_t sent(const Connection& conn);

  // close_timeout passed and UCX still holds sends of the closing connection. While the peer
  // takes anything on the shared endpoint it is alive and they will go: wait on. If it took
  // nothing for close_timeout, it is not reading: the endpoint is closed by force.
  void close_timed_out(const std::shared_ptr<Connection>& conn);

  void peer_close_timed_out(const std::shared_ptr<Connection>& conn);

  // A closing connection's sends or receives changed: the next step of its close.
  void advance_close(const std::shared_ptr<Connection>& conn);

  // Step 2, once its sends are done.
  void release_endpoint_if_done(const std::shared_ptr<Connection>& conn);

  // Frees a CLOSED connection once UCX holds no request of it (its user data is one of
  // conn->ops) and no receive is in flight on it.
  void release_if_idle(const std::shared_ptr<Connection>& conn);

  const TransportChoice m_transports;
  std::mutex m_worker_mutex;  // ensure_worker
  // Where discarded rendezvous messages are fetched (discard); declared before the worker,
  // so that it outlives whatever fetch the worker still holds.
  std::unique_ptr<std::uint8_t[]> m_discard;
  std::unique_ptr<Worker> m_worker;  // set once, before anything that uses it is registered
  std::string m_devices_interface;   // the interface UCX was restricted to, if any
  WorkerAddressInfo m_own_address;   // of m_worker (set with it)
  const detail::PartitionKey m_key{m_config.partition_key};
  std::unique_ptr<detail::BufferPool> m_shared_send_pool;
  MemoryMap m_shared_send_map;
  std::shared_ptr<RecvPool> m_global_recv;

  std::optional<detail::SetupDeadlines<Connection>> m_greeting_deadlines;
  std::optional<detail::SetupDeadlines<Connection>> m_close_deadlines;
  std::optional<detail::SetupDeadlines<Connection>> m_peer_close_deadlines;
  std::optional<detail::LingeringSockets> m_lingering;

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
  bool m_progress_unfinished{false};  // the last progress() stopped with UCX still busy
  std::chrono::microseconds m_progress_budget{PROGRESS_BUDGET};
  Incoming* m_delivering{nullptr};  // the message on_data_cb has now
  // Bytes of eager messages held in inboxes until their turn (those that overtook an
  // earlier message wait there): bounded by limits.max_receive_memory, a peer whose message
  // would cross it is closed. Loop thread only.
  std::size_t m_inbox_bytes{0};
  // Lines about messages that name no connection (strangers' workers): a few a second.
  detail::LogLimiter m_stranger_log;

  std::atomic<bool> m_kick_pending{false};
  FdHandle m_efd;
  EventSignalHandle m_kick;
  PrepareHookHandle m_prepare;
};

#pragma GCC visibility pop

}  // namespace netio3::ucx
