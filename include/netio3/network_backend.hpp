#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <sys/uio.h>
#include <vector>

#include <netio3/event_loop.hpp>
#include <netio3/exceptions.hpp>
#include <netio3/export.hpp>
#include <netio3/network_buffer.hpp>
#include <netio3/statistics.hpp>
#include <netio3/types.hpp>

namespace netio3 {

/// The interface every transport implements. All operations are asynchronous: results
/// arrive through the callbacks of NetworkConfig, on the event-loop thread, never from
/// inside the call that started them.
///
/// Thread safety: with ThreadSafetyModel::SAFE every member may be called from any thread.
/// With UNSAFE they must be called on the event-loop thread (from a callback, a signal, a
/// timer or EventLoop::post) or while the loop is not running; debug builds check this.
/// The asyncmsg backend is always thread-safe.
///
/// Destroying a backend closes every endpoint without calling callbacks: sends still
/// outstanding are dropped, not reported. Destroying it from inside one of its own
/// callbacks is safe. From another thread while the loop runs, the destructor waits for
/// the loop thread to finish the teardown.
class NETIO3_API NetworkBackend {
 public:
  NetworkBackend() = default;
  NetworkBackend(const NetworkBackend&) = delete;
  NetworkBackend& operator=(const NetworkBackend&) = delete;
  NetworkBackend(NetworkBackend&&) = delete;
  NetworkBackend& operator=(NetworkBackend&&) = delete;
  virtual ~NetworkBackend() = default;

  /// Returns the address actually listened on (with the port the OS chose for port 0).
  /// Throws InvalidEndpointAddress, ListenEndpointAlreadyExists, FailedOpenListenEndpoint,
  /// InvalidConnectionParameters.
  virtual EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                               const ConnectionParameters& connection_params) = 0;

  /// Starts connecting; never blocks on the network. Success: on_connection_established_cb;
  /// failure: on_connection_refused_cb. Throws InvalidEndpointAddress,
  /// ActiveEndpointAlreadyExists, FailedOpenActiveEndpoint, InvalidConnectionParameters.
  virtual void open_active_endpoint(const EndPointAddress& address,
                                    const ConnectionParameters& connection_params) = 0;

  /// Closes the listener and every connection it spawned (each one reports
  /// on_connection_closed_cb). Throws InvalidEndpointAddress, UnknownListenEndpoint,
  /// FailedCloseListenEndpoint.
  virtual void close_listen_endpoint(const EndPointAddress& address) = 0;

  /// Closes an active or accepted connection; on_connection_closed_cb reports the keys of
  /// the sends that had not completed. Throws InvalidEndpointAddress,
  /// UnknownActiveEndpoint, FailedCloseActiveEndpoint.
  virtual void close_active_endpoint(const EndPointAddress& address) = 0;

  /// A free send buffer of the connection, or nullptr when all are in use (retry after a
  /// send completed). Throws UnknownActiveEndpoint, NoBuffersAllocated.
  [[nodiscard]] virtual NetworkBuffer* get_buffer(const EndPointAddress& address) = 0;

  /// Sends a buffer from get_buffer; its id() is the completion key. FAILED for a buffer
  /// that was not handed out for this connection. On NO_RESOURCES or FAILED the caller
  /// still owns the buffer. Throws UnknownActiveEndpoint.
  virtual NetioStatus send_buffer(const EndPointAddress& address, NetworkBuffer* buffer) = 0;

  /// Zero-copy: up to 16 bytes of header_data are copied and travel in front of the
  /// payload; the payload is read from the caller's memory, which must stay untouched until
  /// the key is reported. Throws InvalidEndpointAddress, UnknownActiveEndpoint, NotSupported.
  virtual NetioStatus send_data(const EndPointAddress& address, std::span<std::uint8_t> data,
                                std::span<const std::uint8_t> header_data, std::uint64_t key) = 0;
  /// Zero-copy, the payload gathered from several pieces of the registered region (as
  /// the span overload otherwise).
  virtual NetioStatus send_data(const EndPointAddress& address, std::span<const iovec> iov,
                                std::span<const std::uint8_t> header_data, std::uint64_t key) = 0;

  /// Immediate: header and payload are copied before the call returns. Throws
  /// InvalidEndpointAddress, UnknownActiveEndpoint, NotSupported.
  virtual NetioStatus send_data_copy(const EndPointAddress& address,
                                     std::span<const std::uint8_t> data,
                                     std::span<const std::uint8_t> header_data,
                                     std::uint64_t key) = 0;
  /// Immediate, the payload gathered from several pieces (as the span overload otherwise).
  virtual NetioStatus send_data_copy(const EndPointAddress& address, std::span<const iovec> iov,
                                     std::span<const std::uint8_t> header_data,
                                     std::uint64_t key) = 0;

  /// The transport of this backend.
  [[nodiscard]] virtual BackendType type() const noexcept = 0;

  // ---- statistics (netio3/statistics.hpp): any thread, any thread-safety model --------

  /// One connection's counters (open or being set up). Throws InvalidEndpointAddress,
  /// UnknownActiveEndpoint.
  [[nodiscard]] virtual ConnectionStatistics statistics(const EndPointAddress& address) const = 0;
  /// Every connection's (open or being set up), e.g. for a monitoring timer on the loop.
  [[nodiscard]] virtual std::vector<ConnectionStatistics> connection_statistics() const = 0;
  /// The backend's totals, including connections that have ended.
  [[nodiscard]] virtual BackendStatistics backend_statistics() const = 0;
};

/// Largest header_data accepted by send_data and send_data_copy.
inline constexpr std::size_t MAX_HEADER_SIZE = 16;

/// Why the last send call on this thread (send_buffer, send_data, send_data_copy, of any
/// backend) that returned NetioStatus::FAILED failed; an empty message before the first. The
/// same text is logged as a warning, except for a send on a connection that is closing.
[[nodiscard]] NETIO3_API const SendFailure& last_send_failure() noexcept;

/// The factory of backends.
class NETIO3_API Netio3Backend {
 public:
  /// Throws InvalidConfiguration for a backend that was not compiled in or a configuration
  /// that cannot work (e.g. shared buffers of size 0), and std::invalid_argument for a null
  /// event loop.
  [[nodiscard]] static std::unique_ptr<NetworkBackend> create(
      BackendType type, NetworkConfig config, std::shared_ptr<BaseEventLoop> event_loop);

  /// The backends compiled into this build, in BackendType order.
  [[nodiscard]] static std::vector<BackendType> available();
  /// Whether `type` was compiled into this build.
  [[nodiscard]] static bool is_available(BackendType type);
};

}  // namespace netio3
