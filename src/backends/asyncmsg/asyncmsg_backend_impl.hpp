// The asyncmsg backend's types and its class (see asyncmsg_backend.cpp for how it works; the
// set-up of a connection - accepting, connecting, greetings, admission - is in setup.cpp).

#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <tuple>
#include <unordered_map>
#include <utility>  // before Asio: GCC 12 + Boost 1.74 need std::exchange declared first
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "backends/asyncmsg/asyncmsg_backend.hpp"
#include "backends/asyncmsg/send_queue.hpp"
#include "backends/asyncmsg/wire.hpp"
#include "common/admission.hpp"
#include "common/backend_facade.hpp"
#include "common/buffer_pool.hpp"
#include "common/connection.hpp"
#include "common/connection_engine.hpp"
#include "common/endpoint_registry.hpp"
#include "common/endpoint_rules.hpp"
#include "common/log.hpp"
#include "common/notifier.hpp"
#include "common/send_failure.hpp"
#include "common/send_ledger.hpp"
#include "common/setup_deadlines.hpp"
#include "common/stream_admission.hpp"
#include "common/tcp.hpp"

namespace netio3::asyncmsg {

// Internal: not exported from the shared library, and not interposable, so that calls between
// the backend's files are bound (and inlined) as within one file.
#pragma GCC visibility push(hidden)

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using namespace std::chrono_literals;

constexpr std::string_view NAME = "asyncmsg";
// One receive buffer for the whole backend: the loop thread reads one socket at a time,
// and messages that lie wholly inside a read are handed to on_data_cb from here.
constexpr std::size_t SCRATCH_SIZE = std::size_t{1} << 20U;
constexpr std::size_t MAX_IOV = 256;
constexpr std::size_t MAX_WRITE_BYTES = std::size_t{16} << 20U;
// Per readiness event, so that one busy connection cannot starve the others.
constexpr int READS_PER_EVENT = 8;
// While the rest of a large message body is awaited, the socket's SO_RCVLOWAT asks the
// kernel to wake the loop only when that rest (at most this much of it) has arrived: one
// wake-up per 1 MiB message instead of one per few segments, each of which cost the sending
// process a cross-CPU wake-up on loopback (docs/benchmarks.md, "Seventh step"). Never more
// than the message still needs, so nothing that has arrived waits for bytes that may not come.
constexpr std::size_t WAKE_THRESHOLD_MAX = std::size_t{1} << 20U;
constexpr int WRITES_PER_FLUSH = 8;
// What one flush may report, so that a loop whose completion callbacks are slower than the
// application's sending threads still turns to its timers and descriptors (a write of 16 MiB
// of 64-byte copy sends ended 240,000 messages, each with a callback; a flood kept a loop
// away from its timers for 12 s): messages per write, and the time after which a flush, or
// the list of connections to flush, stops and comes back on the next round of the loop.
constexpr std::size_t MESSAGES_PER_WRITE = 4096;
constexpr auto FLUSH_BUDGET = std::chrono::milliseconds{2};
constexpr int ACCEPTS_PER_EVENT = 64;
// After a local close the socket sends FIN and keeps reading (and discarding) until the
// peer closes too, so that unread input cannot turn the close into a RST that would
// destroy data still queued in our kernel send buffer.
constexpr auto LINGER_TIMEOUT = 2s;
// Staging chunks kept for reuse by the backend's connections (8 MiB).
constexpr std::size_t CACHED_CHUNKS = 32;
// Bodies of large received messages kept for reuse by the backend's connections: enough for
// 32 connections receiving at once, at most 64 MiB (and never more than
// limits.max_receive_memory).
constexpr std::size_t CACHED_BODIES = 32;
constexpr std::size_t CACHED_BODY_BYTES = std::size_t{64} << 20U;

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
  EventTimerHandle resume;                     // guarded by `mutex`: ends an accept pause
  std::optional<detail::AcceptPauses> pauses;  // loop thread only
};

using detail::CloseCause;
using detail::Payload;
using detail::Phase;

struct Connection : detail::ConnectionBase {
  Connection(std::uint64_t id_, std::shared_ptr<asio::io_context> io_,
             std::shared_ptr<ChunkCache> chunks, std::shared_ptr<detail::BodyCache> bodies,
             EndPointAddress remote_, const ConnectionParameters& params_,
             std::uint64_t listener_id_, Phase initial)
      : ConnectionBase{id_, std::move(remote_), params_, listener_id_, true, initial},
        io{std::move(io_)},
        socket{*io},
        // The set-up's frames, whatever the configured limit (admitted() sets that).
        decoder{detail::MAX_ADMISSION_FRAME},
        queue{chunks},
        replay{std::move(chunks)} {
    decoder.set_body_cache(std::move(bodies));
    // A session's send is written to the kernel before its peer can have it (a listener's
    // connection learns of its session from the SESSION frame: setup.cpp says so then).
    if (session.enabled) ledger.expect_transport_first();
  }

  std::shared_ptr<asio::io_context> io;
  tcp::socket socket;
  FdHandle fd;  // assigned and used under `mutex` (the loop may use it before add_fd returns)

  // Loop thread only.
  FrameDecoder decoder;
  bool epollout{false};
  bool receive_paused{false};  // waiting for receive memory: not reading
  bool large_messages{false};  // the last message was read directly: so will the next be
  bool reading{false};         // inside read_available() (a write from a callback sees it)
  int wake_threshold{1};       // the socket's SO_RCVLOWAT (set_wake_threshold)
  // Liveness while wake_threshold > 1: the bytes the kernel held at the last tick.
  mutable int queued_at_tick{0};
  std::size_t reserved{0};  // receive memory admitted for the message being assembled

  // Admission (docs/admission.md), loop thread only. Until the connection is established its
  // decoder takes no frame larger than detail::MAX_ADMISSION_FRAME.
  EndPointAddress listener_address;  // accepted: the listening endpoint it came in through
  std::optional<detail::AdmissionExchange> admission;  // from the first greeting sent
  bool linger_on_close{false};  // refused as a server: let what was written reach the peer

  // Sessions (docs/sessions.md), loop thread only.
  bool wants_session{false};     // server: the client's greeting asked for a session
  bool awaiting_session{false};  // set-up: the SESSION frame (server) or its answer is next
  bool awaiting_go{false};       // server, resuming: the client's GO is next
  std::uint64_t resume_from{0};  // server, resuming: the client's count of our messages

  // Under `mutex`.
  SendQueue queue;
  // A session connection's messages until acknowledged (`queue` references them): what a
  // resume sends again.
  SendQueue replay;
  bool flush_pending{false};
  std::size_t max_send_message{0};  // min(own limit, peer's announced limit)
};

// Reads whatever is pending (so close() does not turn into a RST) and closes.
inline void drain_and_close(tcp::socket& socket) noexcept {
  if (!socket.is_open()) return;
  std::array<std::uint8_t, 4096> sink{};
  for (int i = 0; i < 16; ++i) {
    if (::recv(socket.native_handle(), sink.data(), sink.size(), MSG_DONTWAIT) <= 0) break;
  }
  boost::system::error_code ec;
  socket.close(ec);
}

// A SESSION frame (docs/sessions.md; setup.cpp).
std::array<std::uint8_t, FRAME_HEADER_SIZE + detail::SESSION_BODY_SIZE> session_frame(
    const detail::ConnectionBase::SessionId& id, std::uint64_t count, std::uint64_t give_up_ms,
    std::uint8_t flags);

// Always thread-safe: its sockets are used on the loop thread only, and other threads only
// queue sends under a connection's lock.
class Backend : public detail::ConnectionEngine<Backend, Connection, Listener>,
                public detail::StreamAdmission<Backend, Connection>,
                public std::enable_shared_from_this<Backend> {
 public:
  static constexpr BackendType TYPE = BackendType::ASYNCMSG;
  // Sessions (DeliveryParameters::Session): the engine's interrupt and resume.
  static constexpr bool SESSIONS = true;
  using Engine = detail::ConnectionEngine<Backend, Connection, Listener>;
  friend class detail::StreamAdmission<Backend, Connection>;
  static constexpr detail::SetupFrames SETUP_FRAMES{
      .backend = NAME,
      .challenge = detail::FRAME_CHALLENGE,
      .proof = detail::FRAME_PROOF,
      .refusal = detail::FRAME_REFUSAL,
      .admission_minor = detail::ASYNCMSG_ADMISSION_MINOR,
      .ack_minor = detail::ASYNCMSG_ACK_MINOR};

  Backend(NetworkConfig config, std::shared_ptr<BaseEventLoop> loop)
      : Engine{NAME, std::move(config), std::move(loop), ThreadSafetyModel::SAFE},
        m_io{std::make_shared<asio::io_context>(1)},
        m_chunks{std::make_shared<ChunkCache>(CACHED_CHUNKS)},
        m_bodies{std::make_shared<detail::BodyCache>(
            CACHED_BODIES, std::min(CACHED_BODY_BYTES, m_config.limits.max_receive_memory))},
        m_max_message{std::min(m_config.limits.max_message_size, WIRE_MAX_MESSAGE_SIZE)},
        m_key{m_config.partition_key} {
    const auto& shared_tx = m_config.shared_send_buffers;
    if (shared_tx.use_shared_send_buffers) {
      m_shared_send_pool = std::make_unique<detail::BufferPool>(
          shared_tx.num_buf, shared_tx.buf_size, FRAME_HEADER_SIZE, true);
    }
    if (m_config.thread_safety == ThreadSafetyModel::UNSAFE) {
      NETIO3_DEBUG("asyncmsg: ThreadSafetyModel::UNSAFE requested; asyncmsg is always thread-safe");
    }
  }

  // Registrations that need a weak self-reference; called right after construction.
  void start();

  // Closes everything without callbacks. Runs on the loop thread, or inline when the
  // loop is not running.
  void shutdown() noexcept;

  // ---- API (any thread) ------------------------------------------------------------

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                       const ConnectionParameters& params);

  void open_active_endpoint(const EndPointAddress& address, const ConnectionParameters& params);

  // Frame header and header_data are always copied; consecutive copies land back to back
  // in staging, so they leave as one iovec.
  NetioStatus post_data(const std::shared_ptr<Connection>& conn,
                        std::span<const std::uint8_t> header, std::span<const iovec> iov,
                        Payload payload, detail::PendingSend pending);

 private:
  // ---- the transport (detail::TransportOf) ---------------------------------------------
 public:
  NetioStatus post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer);

  void close_listener(const std::shared_ptr<Listener>& listener) { close_acceptor(*listener); }

  // Closing: nothing more is read or written; an open connection that we close sends FIN
  // and lingers (reading what still comes), anything else is closed at once.
  void close_transport(const std::shared_ptr<Connection>& conn);

  // The kernel owns what was written: nothing to wait for.
  [[nodiscard]] static bool quiescent(const Connection& /*conn*/) { return true; }

  // A HEARTBEAT frame (common/liveness.hpp): written at once when nothing is queued, else
  // queued between two messages.
  void send_heartbeat(const std::shared_ptr<Connection>& conn);
  bool send_ack(const std::shared_ptr<Connection>& conn, std::uint64_t count);

  // Statistics (under the connection's lock): bytes not yet written to the socket, frame
  // headers included.
  [[nodiscard]] static std::uint64_t queued_bytes(const Connection& conn) {
    return conn.queue.unsent_bytes();
  }

  // Not while the connection waits for receive memory: the peer's bytes wait in the kernel.
  // Nor while a message body's bytes trickle in below the wake threshold: the kernel holds
  // more of them than at the last tick, so the peer is heard (a peer that stopped
  // mid-message adds nothing, and is judged as silent).
  [[nodiscard]] static bool receiving(const Connection& conn);

  // Drops a connection without callbacks (backend shutdown).
  static void abandon(Connection& conn) noexcept;

  // ---- sessions (the engine's interrupt and resume; setup.cpp) --------------------------
  void detach_transport(const std::shared_ptr<Connection>& conn, CloseCause cause);
  std::shared_ptr<detail::ConnectionBase> resume_transport(const std::shared_ptr<Connection>& conn);
  void say_farewell(const std::shared_ptr<Connection>& conn) noexcept;
  // A carrier for `conn`'s session: connecting, tracked by the set-up deadline; nullptr
  // (the reason in `why`) when the connect could not start.
  std::shared_ptr<Connection> start_carrier(const std::shared_ptr<Connection>& conn,
                                            std::string& why);
  // Under the connection's lock: the peer acknowledged `count` messages.
  static void acknowledged(Connection& conn, std::uint64_t count) {
    if (conn.session.enabled) conn.replay.release_below(count);
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
        return detail::send_failed(
            SendFailureCause::CLOSING,
            fmt::format("asyncmsg: send to {}: the connection is closing", conn->remote), false);
      }
      if (conn->phase != Phase::OPEN) return NetioStatus::NO_RESOURCES;  // still connecting
      if (size > conn->max_send_message) {
        return detail::send_failed(
            SendFailureCause::TOO_LARGE,
            fmt::format("asyncmsg: send to {}: a message of {} bytes exceeds the peer's limit of "
                        "{} bytes",
                        conn->remote, size, conn->max_send_message));
      }
      if (conn->queue.unsent_bytes() >= m_config.limits.max_unsent_bytes) {
        return NetioStatus::NO_RESOURCES;
      }
      if (conn->session.enabled) [[unlikely]] {
        // Kept in the replay log until acknowledged; written from there unless interrupted.
        const std::uint64_t from = conn->replay.appended();
        fill(conn->replay);
        conn->replay.mark(conn->ledger.add(pending));
        if (conn->session.down) return NetioStatus::OK;
        conn->queue.append_refs_from(conn->replay, from);
      } else {
        fill(conn->queue);
        conn->queue.mark(conn->ledger.add(pending));
      }
      need_flush = !std::exchange(conn->flush_pending, true);
    }
    NETIO3_TRACE("asyncmsg: send to {} key={} size={}", conn->remote, pending.key, size);
    if (need_flush) request_flush(conn);
    return NetioStatus::OK;
  }

  void request_flush(const std::shared_ptr<Connection>& conn);

  void attach_send_pool(Connection& conn) {
    detail::attach_send_pool(conn, m_shared_send_pool.get(), FRAME_HEADER_SIZE, true);
  }

  [[nodiscard]] static EndpointCapabilities capabilities(const Connection& conn);

  FdCallback socket_callback(const std::shared_ptr<Connection>& conn) {
    return fd_callback<&Backend::on_socket_event>(conn);
  }

  void close_acceptor(Listener& listener) noexcept;

  // ---- loop thread -------------------------------------------------------------------

  // Entry points below run on the loop thread only; debug builds check it.
  void assert_loop_thread() const noexcept { assert(m_loop->in_loop_thread()); }

  void on_acceptable(const std::shared_ptr<Listener>& listener, std::uint32_t /*events*/);

  void accept_one(const std::shared_ptr<Listener>& listener, tcp::socket socket,
                  const tcp::endpoint& peer);

  void on_socket_event(const std::shared_ptr<Connection>& conn, std::uint32_t events);

  void on_connect_done(const std::shared_ptr<Connection>& conn);

  // Starts a non-blocking connect to `remote` on `socket` (detail::connect_tcp: from a source
  // port of its own, stream options set). Returns the errno of a connect that failed at once,
  // or 0; throws std::runtime_error with the failing step.
  [[nodiscard]] int start_connect(tcp::socket& socket, const EndPointAddress& remote) const;
  // start_connect for a connection made again (a new source port, a session's resume): "" when
  // it started, else why not.
  [[nodiscard]] std::string connect_again(tcp::socket& socket, const EndPointAddress& remote) const;
  // The per-socket state of a connection that got a new socket.
  static void reset_stream_state(Connection& conn) noexcept;

  // The server refused `conn` because it has a connection from its source address and port:
  // opens it again from a new one (at most SOURCE_PORT_RETRIES times). False when it may not
  // or could not; the caller then closes it.
  bool reconnect_from_new_source_port(const std::shared_ptr<Connection>& conn);

  // Another connection has the peer's address and port (docs/semantics.md): this one is
  // refused with a refusal greeting, which tells a netio3 client to try another source port.
  void refuse_address_in_use(Connection& conn);

  void send_greeting(const std::shared_ptr<Connection>& conn);

  bool on_greeting(const std::shared_ptr<Connection>& conn, const Greeting& greeting);

  // ---- admission (docs/admission.md): the primitives of detail::StreamAdmission ---------

  // Set-up frames queued behind the greeting and flushed.
  void write_setup(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> frames);
  [[nodiscard]] bool setup_alive(const Connection& conn) const noexcept;
  static void add_to_verdict(Connection& /*conn*/, std::vector<std::uint8_t>& /*frames*/) {}
  // The peer is admitted (or needs no admission): the connection is established.
  bool admitted(const std::shared_ptr<Connection>& conn);
  // A refused client's REFUSAL frame, written directly behind the greeting (and challenge)
  // already written; the socket lingers after the close.
  static void refuse_and_linger(Connection& conn, std::span<const std::uint8_t> refusal);
  bool setup_protocol_error(const std::shared_ptr<Connection>& conn, std::string_view what);

  bool on_message(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> message);

  // Sessions (setup.cpp): a SESSION frame; the server's answer to a client's; the client's to
  // the server's; `carrier`'s transport connection carries `conn` from now on.
  bool on_session(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> body);
  bool session_request(const std::shared_ptr<Connection>& conn,
                       const detail::ConnectionBase::SessionId& id, std::uint64_t count,
                       std::uint64_t give_up_ms, std::uint8_t flags);
  bool session_answer(const std::shared_ptr<Connection>& conn,
                      const detail::ConnectionBase::SessionId& id, std::uint64_t count,
                      std::uint8_t flags);
  void adopt(const std::shared_ptr<Connection>& conn, const std::shared_ptr<Connection>& carrier);
  // Writes what was not delivered again, behind `frame`, and takes sends again.
  void carry_on(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> frame,
                std::uint64_t peer_count);

  void on_readable(const std::shared_ptr<Connection>& conn);
  void read_available(const std::shared_ptr<Connection>& conn);
  // SO_RCVLOWAT for the decoder's state: the rest of a large body being read directly (up to
  // WAKE_THRESHOLD_MAX), 1 otherwise. Whenever the loop stops reading a connection.
  static void set_wake_threshold(Connection& conn);
  // Sets SO_RCVLOWAT and records it; false (errno set) when the kernel refused it.
  static bool apply_wake_threshold(Connection& conn, int wanted);

  // Returns true when no connection is waiting to be flushed.
  bool process_flush_list();

  static void set_epollout(Connection& conn, bool on);

  static void update_events(Connection& conn);

  // ---- receive memory (limits.max_receive_memory) -------------------------------------

  // A message body that does not arrive in one read holds memory until it is complete. It
  // is admitted only if the backend's total stays within the limit; otherwise its
  // connection stops reading (TCP pushes back on the sender) until memory is released.
  // Admitted messages can always complete, so honest peers never wait on each other in a
  // circle; paused connections resume in the order they paused.
  bool admit(Connection& conn, std::size_t length);

  void release_receive_memory(Connection& conn);

  void pause_receiving(const std::shared_ptr<Connection>& conn);

  void resume_waiting();

  // Handles a decoder status on an open connection; false if the connection stopped.
  bool after_decode(const std::shared_ptr<Connection>& conn, FrameDecoder::Status status);

  void flush(const std::shared_ptr<Connection>& conn,
             std::chrono::steady_clock::time_point deadline);

  // Hands the socket to the lingering set: our FIN is sent, what the peer still sends is
  // read and dropped until it closes too (or LINGER_TIMEOUT).
  void linger(Connection& conn);
  // Writes the GOODBYE frame (a peer of 1.4 or later, nothing queued: the stream is between
  // two frames) on a connection that was open; under the connection's mutex.
  static void say_goodbye(Connection& conn) noexcept;
  // A frame outside the application's sends (heartbeat, ACK): written at once when nothing is
  // queued, else queued behind what is (outside max_unsent_bytes). Not once the connection
  // is closing, nor (unless `closing_too`) once the application asked to close it.
  void send_control(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> frame,
                    bool closing_too);
  // A GOODBYE frame, or any frame after one: the latter and a GOODBYE with a body are protocol
  // errors. False: the connection is closing.
  bool on_goodbye(const std::shared_ptr<Connection>& conn, std::uint8_t type,
                  std::span<const std::uint8_t> message);

  const std::shared_ptr<asio::io_context> m_io;  // never run: socket services only
  const std::shared_ptr<ChunkCache> m_chunks;
  // Bodies of large received messages, kept for the next (every connection's decoder).
  const std::shared_ptr<detail::BodyCache> m_bodies;
  const std::size_t m_max_message;
  const detail::PartitionKey m_key;
  std::unique_ptr<detail::BufferPool> m_shared_send_pool;
  std::mutex m_flush_mutex;
  std::vector<std::shared_ptr<Connection>> m_flush_list;

  // Loop thread only.
  std::vector<std::shared_ptr<Connection>> m_flush_work;
  std::unique_ptr<std::uint8_t[]> m_scratch;
  // Receive memory (loop thread only).
  std::size_t m_receive_reserved{0};
  std::deque<std::weak_ptr<Connection>> m_receive_waiting;
  bool m_resume_posted{false};
  std::optional<detail::LingeringSockets> m_lingering;

  EventSignalHandle m_flush_signal;
  PrepareHookHandle m_prepare;
  // Server: the sessions of its connections, by id (loop thread only).
  std::unordered_map<std::string, std::weak_ptr<Connection>> m_sessions;
  // Client: farewells on their way (say_farewell; loop thread only).
  std::vector<std::shared_ptr<Connection>> m_farewells;
};

#pragma GCC visibility pop

}  // namespace netio3::asyncmsg
