#pragma once

// What every backend's connection carries besides its transport objects, and the parts
// of the send API that do not depend on the transport.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <sys/uio.h>

#include <fmt/format.h>
#include <netio3/event_loop.hpp>
#include <netio3/exceptions.hpp>
#include <netio3/network_backend.hpp>
#include <netio3/types.hpp>

#include "common/buffer_pool.hpp"
#include "common/deadlines.hpp"
#include "common/log.hpp"
#include "common/send_failure.hpp"
#include "common/send_ledger.hpp"
#include "common/thread_model.hpp"
#include "common/wire.hpp"

namespace netio3::detail {

// The phases of every connection (docs/semantics.md). Set-up has two: the transport's
// connection is being made (CONNECTING), then netio3's own greeting or the provider's
// handshake (HANDSHAKE). CLOSING lasts until the transport holds nothing of the connection
// whose end must come before the report; CLOSED: reported (or dropped unreported).
enum class Phase : std::uint8_t { CONNECTING, HANDSHAKE, OPEN, CLOSING, CLOSED };

// Why a connection ends: the application closed it (or its listener), the peer did, an
// error (refusals, timeouts and failures included), the peer fell silent for
// limits.peer_timeout (an error too, after which nothing is waited for from the peer), or the
// peer sent what netio3 does not accept (an error too). The application sees them as
// netio3::CloseCause (public_cause).
enum class CloseCause : std::uint8_t { LOCAL, PEER, ERROR, SILENT, PROTOCOL };

[[nodiscard]] constexpr netio3::CloseCause public_cause(CloseCause cause) noexcept {
  switch (cause) {
    case CloseCause::LOCAL:
      return netio3::CloseCause::LOCAL;
    case CloseCause::PEER:
      return netio3::CloseCause::PEER_CLOSED;
    case CloseCause::SILENT:
      return netio3::CloseCause::TIMED_OUT;
    case CloseCause::PROTOCOL:
      return netio3::CloseCause::PROTOCOL_ERROR;
    case CloseCause::ERROR:
      break;
  }
  return netio3::CloseCause::PEER_LOST;
}

// The reason of a connection whose peer's stream ended without the goodbye it promised.
inline constexpr std::string_view ENDED_WITHOUT_GOODBYE =
    "the peer's end of the connection came without its goodbye (its process ended without "
    "closing or was killed, or its host closed the connection)";

// The reason a connection whose parameters ask for acknowledged sends is not set up with a peer
// that cannot acknowledge.
inline constexpr std::string_view PEER_CANNOT_ACKNOWLEDGE =
    "the peer cannot acknowledge deliveries (its netio3 is too old for "
    "DeliveryParameters::acknowledged)";

// Always owned by a shared_ptr (shared_from_this: what the engine posts keeps it).
struct ConnectionBase : std::enable_shared_from_this<ConnectionBase> {
  ConnectionBase(std::uint64_t id_, EndPointAddress remote_, const ConnectionParameters& params_,
                 std::uint64_t listener_id_, bool thread_safe, Phase initial)
      : id{id_},
        remote{std::move(remote_)},
        params{params_},
        listener_id{listener_id_},
        mutex{thread_safe},
        phase{initial} {
    // A session is the connecting side's: a listener's connections follow their clients
    // (asyncmsg's SESSION frame), whatever the listener's parameters say.
    session.enabled = params.delivery.session.enabled && active();
    session.give_up = params.delivery.session.give_up;
    if (params.delivery.acknowledged || session.enabled) {
      ledger.expect_acknowledgements();
      acknowledged_sends.store(true);
    }
  }

  [[nodiscard]] bool active() const noexcept { return listener_id == 0; }
  [[nodiscard]] bool setting_up() const noexcept { return phase < Phase::OPEN; }
  [[nodiscard]] bool ending() const noexcept { return phase >= Phase::CLOSING; }

  const std::uint64_t id;  // the backend's by-id index (unique among its connections)
  const EndPointAddress remote;
  const ConnectionParameters params;
  const std::uint64_t listener_id;  // 0: opened by open_active_endpoint
  // Set when the application closed the connection (or its listener); sends fail from then.
  std::atomic<bool> close_requested{false};
  // Times this connection was opened again from a new source port (loop thread).
  int source_port_retries{0};
  // Liveness (limits.peer_timeout, common/liveness.hpp), loop thread only. The transport
  // counts what arrives from the peer in `arrivals`, and sets before established() what the
  // peer's protocol version says: it sends heartbeats (then the connection is closed when
  // nothing arrives for peer_timeout), it accepts them (then it is sent heartbeats).
  std::uint64_t arrivals{0};
  bool peer_sends_heartbeats{false};
  bool peer_takes_heartbeats{false};
  // The goodbye (asyncmsg's GOODBYE frame, libfabric's goodbye message; UCX has its BYE): a
  // side that closes in order sends it last, to a peer that said it knows it. Then an end of
  // the peer's stream without it reads as a lost peer (a process that died or was killed, whose
  // kernel closed its sockets in order), not as a close. Loop thread only, set before
  // established(); `peer_says_goodbye`: this side takes and sends goodbyes on the connection.
  bool peer_says_goodbye{false};
  bool goodbye_received{false};
  // Delivery acknowledgement (DeliveryParameters; docs/semantics.md): this side's sends are
  // acknowledged when params.delivery says so (the ledger waits for the peer's counts); the
  // peer's are when its set-up asked (`peer_wants_acks`, set before established()). Then
  // `delivered` counts the messages handed to on_data_cb, `acked` what the last
  // acknowledgement sent said, and `ack_due` that the engine will send one (the end of the
  // loop's round, or at once past ACK_AT_ONCE_BYTES). Loop thread only.
  struct Acks {
    bool peer_wants_acks{false};
    bool ack_due{false};
    std::uint64_t delivered{0};
    std::uint64_t acked{0};
    std::uint64_t bytes_unacked{0};  // handed over since the last acknowledgement
  };
  mutable Acks acks;
  // close_active_endpoint on an acknowledged connection with sends outstanding: it stays open
  // until they are acknowledged or delivery.drain_timeout passes (ConnectionEngine::drain).
  // Set under the registry's lock by any thread; the timer is the loop thread's.
  std::atomic<bool> draining{false};
  Deadline drain_timer;  // the engine's Deadlines
  // This side's sends are acknowledged (params.delivery asks, or a session: a server's
  // connection becomes one at its client's SESSION frame, before it is established).
  std::atomic<bool> acknowledged_sends{false};

  // Guards what follows (and the backend's own per-connection state).
  mutable OptionalMutex mutex;
  // Written on the loop thread only (under `mutex`): the loop reads it without the lock.
  Phase phase;
  SendLedger ledger;
  std::unique_ptr<BufferPool> own_send_pool;

  // Shared or own_send_pool; null: no buffered sending. Set once, when the connection's
  // parameters are known (at creation, or for an accepted asyncmsg connection after the
  // peer's greeting), after own_send_pool: an atomic, so that get_buffer and send_buffer read
  // it from any thread without taking `mutex`.
  std::atomic<BufferPool*> send_pool{nullptr};

  // Statistics beside the ledger's counts (ConnectionStatistics), relaxed atomics: the
  // send calls' refusals (any thread), what was delivered (written on the loop thread only).
  struct Counters {
    std::atomic<std::uint64_t> no_resources{0};
    std::atomic<std::uint64_t> failed{0};
    std::atomic<std::uint64_t> messages_received{0};
    std::atomic<std::uint64_t> bytes_received{0};
  };
  mutable Counters counters;
  // The refusals of the current ready-to-send episode (SendWait bits; 0: none), set by
  // the refusing call on any thread and cleared on the loop thread when the episode ends
  // (on_ready_to_send_cb, ConnectionEngine::ready_again); READY_POSTED: its end is posted.
  // Unused without the callback.
  enum SendWait : std::uint8_t { WAIT_TRANSPORT = 1, WAIT_BUFFER = 2, READY_POSTED = 4 };
  static constexpr std::uint8_t WAITING = WAIT_TRANSPORT | WAIT_BUFFER;
  mutable std::atomic<std::uint8_t> send_waits{0};
  std::chrono::steady_clock::time_point established_at{};  // under `mutex`
  // What on_connection_refused_reason_cb says if an active connection ends before it was
  // established (loop thread only; ConnectionEngine::refuse sets it).
  RefusalCause refusal{RefusalCause::SETUP_FAILED};

  // How it ends, from the moment it is CLOSING (loop thread only).
  struct Ending {
    CloseCause cause{CloseCause::LOCAL};
    std::string reason;
    bool was_open{false};
    bool report{true};  // false: replaced under its address, the application never hears
  } ending_info;

  // Sessions (DeliveryParameters::Session; docs/sessions.md; last: the members above are
  // the send path's, kept together). A session connection whose
  // transport breaks is interrupted, not closed: `down` (written under `mutex`) until a new
  // transport connection carries it again. The active side makes those (carriers: connections
  // of the transport that the application never sees, `resumes` naming the session they would
  // resume); the passive side waits. Loop thread only, but for `down`.
  using SessionId = detail::SessionId;
  struct Session {
    bool enabled{false};
    bool down{false};       // interrupted: no transport connection (under `mutex`)
    bool giving_up{false};  // its next close is final (not an interruption)
    SessionId id{};
    std::chrono::milliseconds give_up{};
    std::chrono::steady_clock::time_point down_since{};
    int attempts{0};
    std::string reason;    // why it was interrupted (and the last attempt's failure)
    Deadline retry_timer;  // the engine's Deadlines (no descriptor of their own)
    Deadline give_up_timer;
    std::shared_ptr<ConnectionBase> carrier;  // the attempt in progress (active side)
    std::weak_ptr<ConnectionBase> resumes;    // a carrier: the connection it would resume
    // A carrier that only tells the peer that the session ended (its application closed it
    // while it was interrupted): never reported, one attempt.
    bool farewell{false};
    std::uint64_t farewell_count{0};  // a farewell: the peer's messages delivered here
  } session;
};

// A connection the server refused because it has one from the same source address and port
// already (another socket of this host shares the port, or the server still holds the
// connection of a process that had it before; docs/semantics.md) is opened again from a new
// source port, at most this often, before on_connection_refused_cb.
inline constexpr int SOURCE_PORT_RETRIES = 3;

// After such a refusal: true, logged and counted, when `conn` may open again from a new
// source port; false (logged when the retries are spent) when it is refused for good.
inline bool retry_from_new_source_port(ConnectionBase& conn, std::string_view backend) {
  if (!conn.active() || conn.close_requested.load()) return false;
  if (conn.source_port_retries >= SOURCE_PORT_RETRIES) {
    NETIO3_WARN(
        "{}: connection to {} refused again: the server has a connection from each of "
        "{} source ports tried; giving up",
        backend, conn.remote, SOURCE_PORT_RETRIES + 1);
    return false;
  }
  ++conn.source_port_retries;
  NETIO3_WARN(
      "{}: connection to {} refused: the server has a connection from this source "
      "address and port already; connecting again from a new source port (retry {} of {})",
      backend, conn.remote, conn.source_port_retries, SOURCE_PORT_RETRIES);
  return true;
}

// Gives `conn` its send buffers: `shared` if there is one, else its own pool when
// send_buffered_params asks for buffers (allocated before taking the connection's lock:
// get_buffer reads the pointer from any thread). `headroom` bytes in front of each buffer
// are the transport's.
inline void attach_send_pool(ConnectionBase& conn, BufferPool* shared, std::size_t headroom,
                             bool thread_safe) {
  std::unique_ptr<BufferPool> own;
  const auto& tx = conn.params.send_buffered_params;
  if (shared == nullptr && tx.num_buf > 0) {
    own = std::make_unique<BufferPool>(tx.num_buf, tx.buf_size, headroom, thread_safe);
  }
  BufferPool* const pool = shared != nullptr ? shared : own.get();
  {
    const std::lock_guard lock{conn.mutex};
    conn.own_send_pool = std::move(own);
  }
  conn.send_pool.store(pool, std::memory_order_release);
}

// get_buffer: a free buffer of the connection's pool, nullptr when all are in use, or
// NoBuffersAllocated.
inline NetworkBuffer* acquire_send_buffer(ConnectionBase& conn, std::string_view backend) {
  BufferPool* const pool = conn.send_pool.load(std::memory_order_acquire);
  if (pool == nullptr) {
    throw NoBuffersAllocated(
        fmt::format("{}: connection with {} has no send buffers (send_buffered_params.num_buf "
                    "was 0, zero-copy was requested, or shared send buffers are off)",
                    backend, conn.remote));
  }
  return pool->acquire();
}

// send_buffer, first half: the pool that lent `buffer` to this connection, with the
// buffer marked in flight; nullptr (logged) for a buffer that is not ours to send. Undo
// with pool->abort_send(buffer) if the send is then refused.
inline BufferPool* claim_send_buffer(ConnectionBase& conn, NetworkBuffer* buffer,
                                     std::string_view backend) {
  BufferPool* const pool = conn.send_pool.load(std::memory_order_acquire);
  if (pool == nullptr || !pool->begin_send(buffer)) {
    (void)send_failed(SendFailureCause::INVALID,
                      fmt::format("{}: send_buffer to {}: not a buffer handed out by get_buffer "
                                  "for this connection (or already sent)",
                                  backend, conn.remote));
    return nullptr;
  }
  return pool;
}

// header_data may have at most MAX_HEADER_SIZE bytes; false (logged) otherwise.
inline bool header_ok(const EndPointAddress& remote, std::span<const std::uint8_t> header,
                      std::string_view backend) {
  if (header.size() <= MAX_HEADER_SIZE) return true;
  (void)send_failed(SendFailureCause::INVALID,
                    fmt::format("{}: send to {}: header_data of {} bytes exceeds the limit of {}",
                                backend, remote, header.size(), MAX_HEADER_SIZE));
  return false;
}

// send_data: true when every piece of `iov` lies inside the zero-copy region; false (logged)
// otherwise. Compares addresses as integers and never forms a pointer past the region.
inline bool inside_region(const EndPointAddress& remote, std::span<const iovec> iov,
                          std::span<const std::uint8_t> region, std::string_view backend) {
  const auto start = reinterpret_cast<std::uintptr_t>(region.data());  // NOLINT
  for (const auto& v : iov) {
    if (v.iov_len == 0) continue;
    const auto at = reinterpret_cast<std::uintptr_t>(v.iov_base);  // NOLINT
    if (at >= start && v.iov_len <= region.size() && at - start <= region.size() - v.iov_len) {
      continue;
    }
    (void)send_failed(
        SendFailureCause::INVALID,
        fmt::format("{}: send_data to {}: {} bytes at {} lie outside the zero-copy region [{}, "
                    "+{}) (send_zero_copy_params): FAILED",
                    backend, remote, v.iov_len, v.iov_base, static_cast<const void*>(region.data()),
                    region.size()));
    return false;
  }
  return true;
}

}  // namespace netio3::detail
