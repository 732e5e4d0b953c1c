#pragma once

// UCP plumbing for the UCX backend: errors with UCX's status text, the transport choice,
// RAII for the context + worker pair, listeners and memory mappings, and the small
// protocol netio3 speaks in active messages (docs/ucx.md).

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <ucp/api/ucp.h>

#include <netio3/types.hpp>

namespace netio3::ucx {

// "UCX function failed: Destination is unreachable (UCS_ERR_UNREACHABLE)"-style messages.
[[nodiscard]] std::string status_text(ucs_status_t status);
class UcxError : public std::runtime_error {
 public:
  UcxError(std::string_view what, ucs_status_t status);
  [[nodiscard]] ucs_status_t status() const noexcept { return m_status; }

 private:
  ucs_status_t m_status;
};
inline void check(std::string_view what, ucs_status_t status) {
  if (status != UCS_OK) throw UcxError(what, status);
}

// The transports a NetworkMode selects: TCP -> "tcp", RDMA -> UCX's own choice (empty).
// UCX_TLS in the environment wins over both.
struct TransportChoice {
  std::string tls;  // empty: UCX decides
  bool from_environment{false};
};
[[nodiscard]] TransportChoice choose_transports(NetworkMode mode);

// One UCP context with one worker (active messages + wake-up through an event fd).
// Thread mode MULTI for ThreadSafetyModel::SAFE (any thread may post sends), SINGLE
// otherwise. Throws UcxError.
class Worker {
 public:
  Worker(const TransportChoice& transports, ThreadSafetyModel model);
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  Worker(Worker&&) = delete;
  Worker& operator=(Worker&&) = delete;
  ~Worker();

  [[nodiscard]] ucp_context_h context() const noexcept { return m_context; }
  [[nodiscard]] ucp_worker_h get() const noexcept { return m_worker; }
  [[nodiscard]] int event_fd() const noexcept { return m_efd; }

 private:
  ucp_context_h m_context{nullptr};
  ucp_worker_h m_worker{nullptr};
  int m_efd{-1};
};

// A memory region mapped for UCX (ucp_mem_map), unmapped on destruction.
class MemoryMap {
 public:
  MemoryMap() = default;
  MemoryMap(ucp_context_h context, std::span<std::uint8_t> region);
  MemoryMap(const MemoryMap&) = delete;
  MemoryMap& operator=(const MemoryMap&) = delete;
  MemoryMap(MemoryMap&& other) noexcept;
  MemoryMap& operator=(MemoryMap&& other) noexcept;
  ~MemoryMap();
  [[nodiscard]] ucp_mem_h get() const noexcept { return m_memh; }

 private:
  void reset() noexcept;
  ucp_context_h m_context{nullptr};
  ucp_mem_h m_memh{nullptr};
};

// ---- the active-message protocol ------------------------------------------------------
//
// Every message of a connection is one active message with id AM_ID. Its UCX header is 16
// bytes, little endian: 0 type, 1 version (2), 2 prefix length P (0..16, DATA only), 3..7
// zero, 8..15 sequence number (per direction, from 0); then P bytes: the start of the
// message. HELLO (client -> server, seq 0) and HELLO_ACK (server -> client, seq 0) carry 8
// bytes of payload: the largest message the sender accepts. DATA carries the application's
// message: send_data's header_data travels as the prefix, so that the payload leaves as one
// contiguous block (eligible for zero-copy and rendezvous); the receiver delivers prefix +
// payload as one message. BYE (empty) ends the stream: the peer closes once everything
// before it was delivered.

inline constexpr unsigned AM_ID = 7;
inline constexpr std::uint8_t PROTOCOL_VERSION = 2;
inline constexpr std::size_t AM_HEADER_SIZE = 16;
inline constexpr std::size_t AM_PREFIX_MAX = 16;
inline constexpr std::size_t AM_HEADER_MAX = AM_HEADER_SIZE + AM_PREFIX_MAX;
inline constexpr std::size_t HELLO_SIZE = 8;

enum class MessageType : std::uint8_t { HELLO = 1, HELLO_ACK = 2, DATA = 3, BYE = 4 };

struct AmHeader {
  MessageType type{};
  std::uint64_t seq{};
  std::uint8_t prefix_len{};
};
// The fixed part; the prefix_len bytes of the prefix follow it in the UCX header.
[[nodiscard]] std::array<std::uint8_t, AM_HEADER_SIZE> encode_header(const AmHeader& header);
// The whole UCX header (fixed part and prefix); nullopt (and `error` set) for one that is not
// netio3's protocol version 2.
[[nodiscard]] std::optional<AmHeader> decode_header(std::span<const std::uint8_t> bytes,
                                                    std::string& error);

[[nodiscard]] std::array<std::uint8_t, HELLO_SIZE> encode_hello(std::uint64_t max_message_size);
[[nodiscard]] std::optional<std::uint64_t> decode_hello(std::span<const std::uint8_t> bytes);

}  // namespace netio3::ucx
