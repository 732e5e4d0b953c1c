#pragma once

// Value types of the netio3 public API: addresses, enums, connection parameters and the
// backend configuration with its callback table. Names and member order are part of the
// contract (docs/semantics.md and the user documentation); further members are only ever
// appended.

#include <chrono>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <netio3/export.hpp>

namespace netio3 {

/// An IP address (numeric IPv4 or IPv6; host names are not resolved because opening an
/// endpoint must never block) and a TCP/IP port. Port 0 asks the OS for a free port.
struct EndPointAddress {
  std::string address;   ///< numeric IPv4 ("10.0.0.1") or IPv6 ("::1") address
  std::uint16_t port{};  ///< TCP/IP port; 0 when opening a listen endpoint: any free port

  /// Equal when address and port are.
  friend bool operator==(const EndPointAddress&, const EndPointAddress&) = default;
  /// Ordered by address, then port (for ordered containers).
  friend std::strong_ordering operator<=>(const EndPointAddress&, const EndPointAddress&) = default;
};

/// "ip:port", or "[ip]:port" for IPv6.
[[nodiscard]] NETIO3_API std::string to_string(const EndPointAddress& address);
/// Writes to_string(address).
NETIO3_API std::ostream& operator<<(std::ostream& os, const EndPointAddress& address);

/// The transport a backend uses (Netio3Backend::create).
enum class BackendType {
  ASYNCMSG,   ///< TCP through Boost.Asio, netio3's own framing
  LIBFABRIC,  ///< libfabric: verbs (RDMA) or its tcp provider
  UCX         ///< UCX: RDMA transports, shared memory, or tcp
};
/// Which of its networks a backend uses: RDMA (verbs, UCX's RDMA and shared-memory
/// transports) or TCP. asyncmsg is always TCP.
enum class NetworkMode { RDMA, TCP };
/// SAFE: every backend member may be called from any thread. UNSAFE: only on the event-loop
/// thread, or while the loop does not run; cheaper (no locks on the send path).
enum class ThreadSafetyModel { SAFE, UNSAFE };
/// Result of a send.
enum class NetioStatus {
  OK,            ///< accepted: ends once, in on_send_completed_cb or as a cancelled key
  NO_RESOURCES,  ///< not accepted now (no buffer, window or queue space): try again later
  FAILED         ///< not accepted and will not be (no such connection, message too large)
};

/// Names are lower case: "asyncmsg", "libfabric", "ucx"; "rdma", "tcp"; "safe", "unsafe";
/// "ok", "no_resources", "failed". Parsing is case-insensitive and returns nullopt for an
/// unknown name.
[[nodiscard]] NETIO3_API std::string_view to_string(BackendType type) noexcept;
[[nodiscard]] NETIO3_API std::string_view to_string(NetworkMode mode) noexcept;
[[nodiscard]] NETIO3_API std::string_view to_string(ThreadSafetyModel model) noexcept;
[[nodiscard]] NETIO3_API std::string_view to_string(NetioStatus status) noexcept;
[[nodiscard]] NETIO3_API std::optional<BackendType> parse_backend_type(
    std::string_view name) noexcept;
[[nodiscard]] NETIO3_API std::optional<NetworkMode> parse_network_mode(
    std::string_view name) noexcept;
[[nodiscard]] NETIO3_API std::optional<ThreadSafetyModel> parse_thread_safety_model(
    std::string_view name) noexcept;

/// What a connection can do, as seen from the local side.
struct EndpointCapabilities {
  bool send_buffered{};   ///< get_buffer / send_buffer work (a send buffer pool exists)
  bool send_copy{};       ///< send_data_copy works
  bool send_zero_copy{};  ///< send_data works (a zero-copy region was given)
  bool receive{};         ///< messages from the peer are delivered (a receive pool exists)

  /// Equal when every capability is.
  friend bool operator==(const EndpointCapabilities&, const EndpointCapabilities&) = default;
};

/// Receive buffers of a connection (ConnectionParameters::recv_params).
struct RecvParameters {
  std::size_t buf_size{};  ///< bytes per buffer: the largest message received
  std::size_t num_buf{};   ///< 0: receiving not requested
  /// On a listen endpoint: all connections it spawns share one receive pool.
  bool use_shared_receive_buffers{};
};

/// Send buffers of a connection, handed out by NetworkBackend::get_buffer.
struct SendBufferedParameters {
  std::size_t buf_size{};  ///< bytes per buffer: the largest buffered message
  std::size_t num_buf{};   ///< 0: buffered sending not requested
};

/// The memory region a connection sends from without copying (NetworkBackend::send_data).
struct SendZeroCopyParameters {
  std::size_t buf_size{};           ///< length of the region starting at mr_start
  std::uint8_t* mr_start{nullptr};  ///< nullptr: zero-copy sending not requested
};

/// What a send's completion means on a connection (docs/semantics.md, "Delivery").
struct DeliveryParameters {
  /// false (the default): a send completes when the message has left this process (the
  /// transport has it; what that means per backend is in docs/semantics.md). true: it
  /// completes when the peer's application was handed the message (its on_data_cb returned
  /// for it): the peer acknowledges what it delivered, cumulatively and batched (at most one
  /// acknowledgement a connection per round of its event loop). A send's buffer or zero-copy
  /// memory stays netio3's until then. Per direction: it is this side's sends that are
  /// acknowledged; the peer's are if its own parameters ask. A peer too old to acknowledge
  /// is refused at set-up (RefusalCause::SETUP_FAILED, with the reason).
  bool acknowledged{false};
  /// Acknowledged sends only: the bytes (messages' headers and payloads) accepted and not
  /// yet acknowledged beyond which a send returns NO_RESOURCES; on_ready_to_send_cb follows
  /// when acknowledgements free room. A single message larger than the window is accepted
  /// when nothing is outstanding.
  std::size_t replay_window{std::size_t{64} << 20U};
  /// Acknowledged sends only: close_active_endpoint first waits this long for what was sent
  /// before it to be acknowledged (the connection drains: its sends are FAILED, messages
  /// from the peer are no longer delivered), then closes; the closed callback lists what was
  /// not acknowledged. A second close_active_endpoint closes at once.
  std::chrono::milliseconds drain_timeout{10000};
  /// Sessions (docs/sessions.md): a connection that rides out a cut. Its sends are
  /// acknowledged (whatever `acknowledged` says), and when its transport connection breaks -
  /// an error, a reset, the peer silent for limits.peer_timeout, its end without a goodbye -
  /// the connection is not closed: on_connection_interrupted_cb reports the cut, the side
  /// that connected reconnects by itself (after first_delay, doubling up to max_delay, each
  /// delay with jitter), both sides send again exactly what the other had not delivered, and
  /// on_connection_resumed_cb reports the outage. Sends made meanwhile wait within the replay
  /// window. The connection closes only when the session is not resumed within give_up (its
  /// closed callback lists every send not acknowledged, cause PEER_LOST), when the peer no
  /// longer knows it (a restarted process: "unknown session"), or when either side closes it.
  /// Set by the side that connects; a listener's own setting is not needed (it follows its
  /// clients). asyncmsg only, for now: UCX and libfabric refuse it (NotSupported).
  struct Session {
    bool enabled{false};                        ///< resume after a cut
    std::chrono::milliseconds first_delay{50};  ///< the first reconnect's delay
    std::chrono::milliseconds max_delay{2000};  ///< the longest delay between attempts
    std::chrono::milliseconds give_up{60000};   ///< the longest outage before a close
  } session{};                                  ///< resume after a cut (Session); off by default
};

/// What a connection (open_active_endpoint) or the connections of a listen endpoint
/// (open_listen_endpoint) need: receive buffers, send buffers, a zero-copy region, and what
/// its sends' completions mean.
struct ConnectionParameters {
  RecvParameters recv_params{};                    ///< receiving
  SendBufferedParameters send_buffered_params{};   ///< buffered sending
  SendZeroCopyParameters send_zero_copy_params{};  ///< zero-copy sending
  DeliveryParameters delivery{};                   ///< what a completion means
};

/// One receive pool for every connection of the backend (NetworkConfig).
struct SharedReceiveBuffers {
  bool use_shared_receive_buffers{};  ///< false: each connection has its own pool
  std::size_t buf_size{};             ///< bytes per buffer
  std::size_t num_buf{};              ///< buffers in the pool
};

/// One send pool for every connection of the backend (NetworkConfig).
struct SharedSendBuffers {
  bool use_shared_send_buffers{};  ///< false: each connection has its own pool
  std::size_t buf_size{};          ///< bytes per buffer
  std::size_t num_buf{};           ///< buffers in the pool
};

// Callbacks. Every one is optional and runs on the event-loop thread, never under a lock
// of the library, so it may call back into the backend (send, close, even destroy it).
// An exception escaping a callback is caught and logged at error level.

/// A message arrived: `data` is valid until the callback returns. Runs on the event-loop
/// thread, never under a lock of the library; it may send, close, even destroy the
/// backend. An exception escaping any callback is caught and logged at error level.
using OnDataCb = std::function<void(std::span<const std::uint8_t> data)>;
/// A connection was set up, actively or passively; sends to `remote` may begin.
using OnConnectionEstablishedCb =
    std::function<void(const EndPointAddress& remote, EndpointCapabilities capabilities)>;
/// A connection that was established ended (closed by either side, or its peer was lost);
/// the keys of its accepted sends that did not complete are reported here, once.
using OnConnectionClosedKeysCb = std::function<void(
    const EndPointAddress& remote, const std::vector<std::uint64_t>& cancelled_keys)>;
/// An active connection could not be set up (refused, unreachable, timed out).
using OnConnectionRefusedCb = std::function<void(const EndPointAddress& remote)>;
/// A send that returned OK completed; its buffer or region may be reused.
using OnSendCompleted = std::function<void(const EndPointAddress& remote, std::uint64_t key)>;
/// A connection on which a send returned NO_RESOURCES (or get_buffer returned nullptr) can
/// take a send again: a send completed (a buffer came back, window or queue space freed), a
/// buffer came back to the shared send pool, or the connection was set up. Edge-triggered:
/// once per such episode, however many refusals it had and however many buffers came back;
/// the next refusal begins the next episode. Never for a connection that is closing or
/// closed (docs/observability.md).
using OnReadyToSendCb = std::function<void(const EndPointAddress& remote)>;

/// on_data_cb with the sender: a message arrived from `remote` (the connection's remote
/// address, as the other callbacks name it: the address connected to for an active endpoint,
/// the peer's source address for an accepted one). `data` is valid until the callback
/// returns. Optional; when set it is called instead of on_data_cb (setting both is an
/// InvalidConfiguration).
using OnDataFromCb =
    std::function<void(const EndPointAddress& remote, std::span<const std::uint8_t> data)>;

/// Why an active connection could not be set up (RefusalReason::cause).
enum class RefusalCause {
  UNREACHABLE,   ///< nothing listens at the address, or no route to it: the connect failed
  TIMED_OUT,     ///< the set-up did not finish within limits.connect_timeout
  REJECTED,      ///< the peer answered and said no (its protocol version, its source-port rule)
  SETUP_FAILED,  ///< the set-up broke off: the peer closed or sent what is not netio3's set-up,
                 ///< or a local error
  NOT_ADMITTED   ///< admission failed: the server refused this side (its partition key, its
                 ///< on_accept_cb; the message carries the server's reason), or the server did
                 ///< not prove the partition key this side holds (docs/admission.md)
};
/// "unreachable", "timed_out", "rejected", "setup_failed", "not_admitted".
[[nodiscard]] NETIO3_API std::string_view to_string(RefusalCause cause) noexcept;

/// What on_connection_refused_reason_cb reports: a cause to act on and a text to log.
struct RefusalReason {
  RefusalCause cause{RefusalCause::SETUP_FAILED};  ///< what kind of failure
  std::string message;                             ///< what happened, in words
};

/// on_connection_refused_cb with the reason: an active connection could not be set up, and
/// why. Optional; when set it is called instead of on_connection_refused_cb (setting both is
/// an InvalidConfiguration).
using OnConnectionRefusedReasonCb =
    std::function<void(const EndPointAddress& remote, const RefusalReason& reason)>;

/// Why an established connection ended (CloseReason::cause).
enum class CloseCause {
  LOCAL,          ///< this side closed it: close_active_endpoint, close_listen_endpoint
  PEER_CLOSED,    ///< the peer closed it in order
  PEER_LOST,      ///< it broke: the peer's process, host or link went away (a reset, an error
                  ///< of the transport, an end without the peer's goodbye: a killed process),
                  ///< or an operation on it failed
  TIMED_OUT,      ///< nothing came from the peer for limits.peer_timeout (its heartbeats too)
  PROTOCOL_ERROR  ///< the peer sent what netio3 does not accept (the message says what)
};
/// "local", "peer_closed", "peer_lost", "timed_out", "protocol_error".
[[nodiscard]] NETIO3_API std::string_view to_string(CloseCause cause) noexcept;

/// A connection with a session (DeliveryParameters::Session) lost its transport connection
/// and is being resumed: `reason` says why. Sends still go (and wait) within the replay
/// window; no close follows unless the session cannot be resumed.
using OnConnectionInterruptedCb =
    std::function<void(const EndPointAddress& remote, const std::string& reason)>;
/// The session of a connection that was interrupted is resumed: what was not delivered was
/// sent again, nothing twice. `outage`: from the interruption to now.
using OnConnectionResumedCb =
    std::function<void(const EndPointAddress& remote, std::chrono::milliseconds outage)>;

/// What on_connection_closed_reason_cb reports: a cause to act on and a text to log.
struct CloseReason {
  CloseCause cause{CloseCause::PEER_LOST};  ///< what kind of end
  std::string message;                      ///< what happened, in words (also logged)
};

/// on_connection_closed_cb with the reason: an established connection ended, the keys of its
/// accepted sends that did not complete, and why it ended. Optional; when set it is called
/// instead of on_connection_closed_cb (setting both is an InvalidConfiguration).
using OnConnectionClosedReasonCb = std::function<void(
    const EndPointAddress& remote, const std::vector<std::uint64_t>& cancelled_keys,
    const CloseReason& reason)>;

/// Why a send call returned NetioStatus::FAILED (SendFailure::cause).
enum class SendFailureCause {
  CLOSING,    ///< the connection is closing or closed (by either side)
  TOO_LARGE,  ///< the message exceeds what the peer accepts (its limits.max_message_size, and on
              ///< libfabric its receive buffers)
  INVALID,    ///< the call's arguments: header_data over 16 bytes, a payload outside the
              ///< zero-copy region, a buffer not lent for this connection, too many pieces
  TRANSPORT   ///< the transport refused the operation (its error in the message)
};
/// "closing", "too_large", "invalid", "transport".
[[nodiscard]] NETIO3_API std::string_view to_string(SendFailureCause cause) noexcept;

/// What last_send_failure() reports: a cause to act on and a text to log.
struct SendFailure {
  SendFailureCause cause{SendFailureCause::INVALID};  ///< what kind of failure
  std::string message;                                ///< what happened, in words
};

/// Who asks to be admitted through a listening endpoint (NetworkConfig::on_accept_cb).
struct PeerInfo {
  EndPointAddress remote;    ///< the peer's source address, as the other callbacks will name it
  EndPointAddress listener;  ///< the listening endpoint it connected to (its bound address)
  /// What the peer presented as NetworkConfig::identity; empty when it presented none. Covered
  /// by the peer's proof of the partition key, so only meaningful when key_proven is true.
  std::string identity;
  bool key_proven{false};  ///< the peer proved it holds this side's partition_key
};

/// What on_accept_cb decides for one peer.
struct AcceptDecision {
  bool admit{true};  ///< false: the peer is refused
  /// Sent to a refused netio3 peer (its on_connection_refused_reason_cb reports it with
  /// RefusalCause::NOT_ADMITTED) and logged here; at most 256 bytes of it travel.
  std::string reason;

  /// The peer is admitted.
  [[nodiscard]] static AcceptDecision accept() { return {}; }
  /// The peer is refused, and told `why`.
  [[nodiscard]] static AcceptDecision refuse(std::string why) {
    return {.admit = false, .reason = std::move(why)};
  }
};

/// The accept hook: decides whether a peer that reached a listening endpoint (and, with a
/// partition key, proved it) is admitted. Runs on the event-loop thread, never under a lock
/// of the library, before the connection is reported established and before any buffer is
/// given to it; an exception escaping it refuses the peer. Only connections that come in
/// through a listening endpoint are asked about.
using OnAcceptCb = std::function<AcceptDecision(const PeerInfo& peer)>;

/// Smallest NetworkConfig::partition_key accepted: 16 bytes.
inline constexpr std::size_t MIN_PARTITION_KEY_SIZE = 16;
/// Longest NetworkConfig::identity: 255 bytes.
inline constexpr std::size_t MAX_IDENTITY_SIZE = 255;

/// Default of NetworkLimits::max_message_size: 64 MiB.
inline constexpr std::size_t DEFAULT_MAX_MESSAGE_SIZE = std::size_t{64} << 20U;
/// Default of NetworkLimits::max_unsent_bytes: 8 MiB.
inline constexpr std::size_t DEFAULT_MAX_UNSENT_BYTES = std::size_t{8} << 20U;
/// Default of NetworkLimits::max_receive_memory: 1 GiB.
inline constexpr std::size_t DEFAULT_MAX_RECEIVE_MEMORY = std::size_t{1} << 30U;

/// Bounds that protect a process from its peers and from itself. Appended to NetworkConfig
/// after the members fixed by the contract.
struct NetworkLimits {
  /// Largest message (header + payload) accepted for sending or from the network. A peer
  /// announcing a bigger one is disconnected with a logged reason.
  std::size_t max_message_size{DEFAULT_MAX_MESSAGE_SIZE};
  /// Bytes a connection may hold accepted-but-unsent before sends return NO_RESOURCES.
  std::size_t max_unsent_bytes{DEFAULT_MAX_UNSENT_BYTES};
  /// Bytes the backend may hold in messages still arriving, over all its connections
  /// (asyncmsg: the bodies that do not come in one read). A connection whose next message
  /// would exceed it stops reading - TCP pushes back on its sender - until messages in
  /// progress complete. Must be at least max_message_size. libfabric receives into its
  /// fixed pools and UCX into pool buffers or per-message heap blocks, so they do not use it.
  std::size_t max_receive_memory{DEFAULT_MAX_RECEIVE_MEMORY};
  /// Connection set-up (TCP connect plus protocol greeting) must finish within this time,
  /// otherwise the active side gets on_connection_refused_cb and the passive side drops it.
  std::chrono::milliseconds connect_timeout{std::chrono::seconds{10}};
  /// A close waits at most this long for sends the transport still holds to go out (UCX
  /// flushes its endpoint); what has not completed by then is reported as cancelled.
  /// asyncmsg and libfabric close at once and do not use it.
  std::chrono::milliseconds close_timeout{std::chrono::seconds{2}};
  /// A connection from which nothing arrived for this time - a dead host, a cut link, a hung
  /// peer process - is closed (on_connection_closed_cb, every accepted key ends once), whether
  /// data is being sent or the connection is idle. Every backend sends heartbeats in its own
  /// protocol every peer_timeout / 10 to a peer whose protocol version has them; a peer that
  /// is gone is noticed between this time and 1.3 times it after it went (docs/
  /// reliability.md). Peers of older versions get no heartbeats and are watched
  /// only through TCP (keepalive and TCP_USER_TIMEOUT on the sockets netio3 owns).
  std::chrono::milliseconds peer_timeout{std::chrono::seconds{30}};
  /// Sessions (docs/sessions.md): the interrupted sessions the listening side keeps for their
  /// clients to resume, over all its listeners (each holds its connection's state, what it had
  /// not yet seen acknowledged; their deadlines share one timer descriptor). Past it, the
  /// oldest interrupted session of the client host that holds the most of them is given up
  /// (closed, PEER_LOST, with the reason): a host that opens sessions and abandons them cannot
  /// pin memory without bound, nor push out the sessions of other hosts. At least 1.
  std::size_t max_interrupted_sessions{1024};
};

/// Everything a backend is created with (Netio3Backend::create). The members up to
/// on_send_completed_cb are those of the documented contract, in its order, so aggregate
/// initialisation as in the user documentation compiles; later members are appended.
struct NetworkConfig {
  NetworkMode mode{NetworkMode::TCP};                        ///< RDMA or TCP network
  ThreadSafetyModel thread_safety{ThreadSafetyModel::SAFE};  ///< who may call the backend
  SharedReceiveBuffers shared_receive_buffers{};             ///< one receive pool for all
  SharedSendBuffers shared_send_buffers{};                   ///< one send pool for all
  OnDataCb on_data_cb{};                                     ///< a message arrived
  OnConnectionEstablishedCb on_connection_established_cb{};  ///< a connection is up
  OnConnectionClosedKeysCb on_connection_closed_cb{};        ///< a connection ended
  OnConnectionRefusedCb on_connection_refused_cb{};          ///< a connection failed
  OnSendCompleted on_send_completed_cb{};                    ///< a send completed
  NetworkLimits limits{};                                    ///< bounds against peers and overload
  /// Optional; appended after the members of the contract (see OnReadyToSendCb).
  OnReadyToSendCb on_ready_to_send_cb{};
  /// Optional, instead of on_data_cb: the message with the connection it came from.
  OnDataFromCb on_data_from_cb{};
  /// Optional, instead of on_connection_refused_cb: the refusal with its reason.
  OnConnectionRefusedReasonCb on_connection_refused_reason_cb{};
  /// Admission (docs/admission.md). Optional: decides about every peer that comes in through
  /// a listening endpoint of this backend.
  OnAcceptCb on_accept_cb{};
  /// Admission: a secret shared by the processes of one partition, at least
  /// MIN_PARTITION_KEY_SIZE bytes; empty for none. When set, both sides of every connection
  /// prove they hold it (challenge and response, HMAC-SHA-256) before it is established, and a
  /// peer with another key or none is refused. It authenticates the set-up only: data travel
  /// unencrypted and unsigned.
  std::string partition_key{};
  /// Admission: the name this side presents to its peers' on_accept_cb, covered by its proof
  /// of partition_key (so it needs one); at most MAX_IDENTITY_SIZE bytes.
  std::string identity{};
  /// Optional, instead of on_connection_closed_cb: the end of a connection with its reason.
  OnConnectionClosedReasonCb on_connection_closed_reason_cb{};
  /// Sessions: a connection's transport connection broke and is being resumed.
  OnConnectionInterruptedCb on_connection_interrupted_cb{};
  /// Sessions: an interrupted connection is resumed.
  OnConnectionResumedCb on_connection_resumed_cb{};
};

}  // namespace netio3

/// @cond INTERNAL
template <>
struct std::hash<netio3::EndPointAddress> {
  std::size_t operator()(const netio3::EndPointAddress& a) const noexcept {
    const std::size_t h = std::hash<std::string>{}(a.address);
    return h ^ (std::size_t{a.port} * 0x9E3779B97F4A7C15ULL + (h << 6U) + (h >> 2U));
  }
};

template <>
struct fmt::formatter<netio3::EndPointAddress> : fmt::formatter<std::string_view> {
  template <typename FormatContext>
  auto format(const netio3::EndPointAddress& a, FormatContext& ctx) const {
    return fmt::formatter<std::string_view>::format(netio3::to_string(a), ctx);
  }
};

#define NETIO3_DETAIL_ENUM_FORMATTER(Enum)                                            \
  template <>                                                                         \
  struct fmt::formatter<Enum> : fmt::formatter<std::string_view> {                    \
    template <typename FormatContext>                                                 \
    auto format(Enum value, FormatContext& ctx) const {                               \
      return fmt::formatter<std::string_view>::format(netio3::to_string(value), ctx); \
    }                                                                                 \
  };

NETIO3_DETAIL_ENUM_FORMATTER(netio3::BackendType)
NETIO3_DETAIL_ENUM_FORMATTER(netio3::NetworkMode)
NETIO3_DETAIL_ENUM_FORMATTER(netio3::ThreadSafetyModel)
NETIO3_DETAIL_ENUM_FORMATTER(netio3::NetioStatus)
NETIO3_DETAIL_ENUM_FORMATTER(netio3::RefusalCause)
NETIO3_DETAIL_ENUM_FORMATTER(netio3::CloseCause)
NETIO3_DETAIL_ENUM_FORMATTER(netio3::SendFailureCause)
#undef NETIO3_DETAIL_ENUM_FORMATTER
/// @endcond
