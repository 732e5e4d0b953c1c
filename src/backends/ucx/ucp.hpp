#pragma once

// UCP plumbing for the UCX backend: errors with UCX's status text, the transport choice,
// RAII for the context + worker pair and memory mappings, and netio3's UCX protocol: the
// control channel's frames and the active-message header (docs/ucx.md).

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <ucp/api/ucp.h>
#include <vector>

#include <netio3/types.hpp>

#include "common/wire.hpp"

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

// The transports a NetworkMode selects: TCP -> "tcp", RDMA -> RDMA_TRANSPORTS. UCX_TLS in the
// environment wins over both.
//
// RDMA mode is UCX's own choice less its shared-memory FIFO transports (posix, sysv, xpmem).
// A sender claims a slot of the receiving worker's FIFO by compare-and-swap on its head and
// marks it written only after copying the message into it (UCX 1.13, mm_ep.c); the receiver
// reads slots in order. A sender killed between the two (SIGKILL, OOM killer) leaves the slot
// unmarked forever, and every later message of every peer to that worker waits behind it:
// the surviving process can no longer receive over shared memory and cannot tell. Measured
// here: 1 in about 10 SIGKILLs of a same-host sender under load (tests/faults PeerKilled).
// Without them, processes of one host exchange messages over tcp (loopback) and bulk data
// by CMA (process_vm_readv, nothing shared that a death can corrupt): ucp_am_bw -E sleep
// measured 21.7 GB/s at 1 MiB with tcp,cma against 12.3 GB/s with posix,cma (10.9 and 18.6 GB/s
// at 64 KiB; 1.2 and 7.5 M messages/s at 64 B). RDMA lanes across hosts are unaffected.
inline constexpr std::string_view RDMA_TRANSPORTS = "^mm";
struct TransportChoice {
  std::string tls;  // empty: UCX decides
  bool from_environment{false};
};
[[nodiscard]] TransportChoice choose_transports(NetworkMode mode);

// One UCP context with one worker (active messages + wake-up through an event fd).
// Thread mode MULTI for ThreadSafetyModel::SAFE (any thread may post sends), SINGLE
// otherwise. `devices`, if not empty, becomes UCX_NET_DEVICES (the network devices UCX may
// use, and on which its tcp transport listens); UCX_NET_DEVICES in the environment wins.
// Throws UcxError.
class Worker {
 public:
  Worker(const TransportChoice& transports, ThreadSafetyModel model, const std::string& devices);
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  Worker(Worker&&) = delete;
  Worker& operator=(Worker&&) = delete;
  ~Worker();

  [[nodiscard]] ucp_context_h context() const noexcept { return m_context; }
  [[nodiscard]] ucp_worker_h get() const noexcept { return m_worker; }
  [[nodiscard]] int event_fd() const noexcept { return m_efd; }
  // The worker's address (what a peer's ucp_ep_create needs), packed by UCX.
  [[nodiscard]] std::span<const std::uint8_t> address() const noexcept { return m_address; }
  // Its tcp interfaces are behind the wire-up guard (tcp_wireup_guard.hpp).
  [[nodiscard]] bool tcp_guarded() const noexcept { return m_tcp_guarded; }

 private:
  ucp_context_h m_context{nullptr};
  ucp_worker_h m_worker{nullptr};
  int m_efd{-1};
  bool m_tcp_guarded{false};
  std::vector<std::uint8_t> m_address;
};

// UCX parses a worker address without knowing its length and asserts on malformed ones (a
// HELLO with a random worker address aborted the process: address.c:1051). parse_worker_address
// walks the packed address as UCX 1.13's ucp_address_unpack does for ucp_ep_create (address
// versions 1 and 2, not unified mode), checking every length against the bytes there are,
// every count against UCX's limits, and the figures UCX's lane selection computes with. On
// success it lists the worker's id and its transports' addresses.
struct WorkerAddressInfo {
  struct Transport {
    std::uint16_t name_checksum{};
    std::span<const std::uint8_t> device;
    std::span<const std::uint8_t> iface;
    std::size_t name_at{};  // where the name checksum is in the address
  };
  std::string error;  // empty: UCX can parse the address
  std::optional<std::uint64_t> uuid;
  std::vector<Transport> transports;
};
[[nodiscard]] WorkerAddressInfo parse_worker_address(std::span<const std::uint8_t> address);

// Whether `peer` names the tcp transport of `own` (the same device and listening port) under
// another worker id: a forged address that would make UCX connect to itself and keep that
// connection.
[[nodiscard]] bool impersonates(const WorkerAddressInfo& peer, const WorkerAddressInfo& own);

// The transport addresses of `peer` that UCX reads: those of the transports this side uses
// too (UCX asks each of its transports whether it reaches the peer's address of the same
// name, and connects by it). UCX trusts their contents and reads them by their type, not by
// their lengths; some malformed ones crash or abort the process:
// - tcp: a device part of any length, even none (UCX passes that as a null pointer: a HELLO
//   with a mutated address crashed uct_tcp_iface_is_reachable), is read as a flags byte,
//   an address family and an address of that family; checked exactly.
// - same-host transports (shared memory, CMA, self): UCX attaches what their addresses name,
//   and asserts on some malformed ones (mm_posix.c:369, a posix segment id that names neither
//   procfs nor shm_open). Peers on one host run the same UCX build, so their addresses have
//   the same shape as ours.
// - others (InfiniBand's, whose shapes differ by link layer): no part may be missing that
//   every address of ours of that name has.
// An error text, or empty.
[[nodiscard]] std::string check_transport_addresses(const WorkerAddressInfo& peer,
                                                    const WorkerAddressInfo& own);

// Whether bulk data between this process and `peer` may go by CMA (process_vm_readv and
// process_vm_writev between the two processes, both ways: the side that receives a
// rendezvous message reads the sender's memory). Empty when it may, or when CMA is not
// among the transports both addresses name on one host (UCX would not pick it anyway);
// else why not. UCX only checks the host and the pid namespace; the kernel also asks for
// ptrace access both ways, which a process that made itself non-dumpable
// (PR_SET_DUMPABLE 0, setuid programs) or one of another user refuses, and then UCX fails
// the endpoint at the first large message. So both sides decide alike: each asks the
// kernel whether it may read the peer (process_vm_readv of the peer's page 0: the kernel
// checks access before the address, EFAULT means allowed) and works out whether the peer
// may read it by the kernel's rule (same user and group ids and this process dumpable, or
// CAP_SYS_PTRACE in the peer; from /proc/<pid>/status). Reads procfs: call it only when an
// endpoint is made.
[[nodiscard]] std::string cma_refusal(const WorkerAddressInfo& peer, const WorkerAddressInfo& own);
// Whether both addresses name CMA on one host (the same device address): UCX moves the large
// messages between them by CMA unless cma_refusal says otherwise.
[[nodiscard]] bool cma_on_one_host(const WorkerAddressInfo& peer, const WorkerAddressInfo& own);

// A copy of the worker address `address` (described by `info`) in which the transports
// with `name_checksum` carry a name no transport of `own` has: UCX ignores them when it
// selects lanes, so an endpoint made from the copy never uses them, and the endpoint's
// wire-up tells the peer only the transports it does use.
[[nodiscard]] std::vector<std::uint8_t> without_transport(std::span<const std::uint8_t> address,
                                                          const WorkerAddressInfo& info,
                                                          const WorkerAddressInfo& own,
                                                          std::uint16_t name_checksum);
[[nodiscard]] std::uint16_t cma_checksum();

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

// ---- the protocol (docs/ucx.md) ---------------------------------------------------------
//
// Protocol version 3. A connection is a TCP connection of netio3's own (the control channel)
// plus one UCP endpoint each way, made from the worker addresses the two sides exchange on
// the control channel; the data travels as active messages.
//
// Control channel: netio3's greeting and frames (common/wire.hpp) with major version
// UCX_CONTROL_MAJOR and two frame types:
//   HELLO (first frame of each side): 0 backend type (3 = ucx), 1 network mode (0 tcp,
//         1 rdma), 2..7 zero, 8..15 largest message the sender accepts, 16..23 the sender's
//         connection token, 24.. the sender's UCP worker address (1..MAX_WORKER_ADDRESS
//         bytes);
//   CLOSE: 0..7 the number of active messages the sender sent on this connection (its BYE
//         included): the peer closes once it has delivered them.
// 3.3 adds admission (docs/admission.md): the greeting flags KEYED and VERDICT and the frames
// CHALLENGE, PROOF and REFUSAL, as asyncmsg 1.3 has them (types 5, 6, 7 here). A keyed client
// sends its HELLO only once the server's PROOF verified; a server with a key or an accept
// hook sends its HELLO only once it admitted the client, and reads the client's only then.
// Every active message has id AM_ID and a 24-byte UCX header: 0 type, 1 version (3), 2 prefix
// length P (0..16, DATA only), 3..7 zero, 8..15 sequence number (per direction, from 0),
// 16..23 the receiver's connection token; then P bytes, the start of the message. READY
// (empty, message 0) is the first message each side sends once it has made its endpoint: a
// side reports the connection established when the peer's READY has arrived over UCX. DATA
// carries the application's message (send_data's header_data travels as the prefix, so the
// payload leaves as one contiguous block); BYE (empty) ends the stream.
// 3.4 adds delivery acknowledgement: the greeting flag ACKNOWLEDGE (common/wire.hpp) asks the
// peer to acknowledge; then it sends ACK messages whose 8-byte prefix is the count (little
// endian) of DATA messages it handed to its application. Sent only to a peer that asked.

inline constexpr unsigned AM_ID = 7;
// Active message ids below this get a handler that drops what arrives on them (all but AM_ID):
// a power of two, see Backend::ensure_worker.
inline constexpr unsigned STRANGER_AM_IDS = 256;
inline constexpr std::uint8_t PROTOCOL_VERSION = 3;
inline constexpr std::size_t AM_HEADER_SIZE = 24;
inline constexpr std::size_t AM_PREFIX_MAX = 16;
inline constexpr std::size_t AM_HEADER_MAX = AM_HEADER_SIZE + AM_PREFIX_MAX;

enum class MessageType : std::uint8_t { DATA = 3, BYE = 4, READY = 5, ACK = 6 };
inline constexpr std::size_t ACK_PREFIX_SIZE = 8;

struct AmHeader {
  MessageType type{};
  std::uint64_t seq{};
  std::uint8_t prefix_len{};
  std::uint64_t token{};
};
// The fixed part; the prefix_len bytes of the prefix follow it in the UCX header.
[[nodiscard]] std::array<std::uint8_t, AM_HEADER_SIZE> encode_header(const AmHeader& header);
// The whole UCX header (fixed part and prefix); nullopt (and `error` set) for one that is not
// netio3's protocol version 3.
[[nodiscard]] std::optional<AmHeader> decode_header(std::span<const std::uint8_t> bytes,
                                                    std::string& error);

inline constexpr std::uint8_t FRAME_HELLO = 2;
inline constexpr std::uint8_t FRAME_CLOSE = 3;
// No body; sent by 3.2 to a 3.2 peer (common/liveness.hpp).
inline constexpr std::uint8_t FRAME_HEARTBEAT = 4;
inline constexpr std::uint16_t HEARTBEAT_MINOR = 2;
inline constexpr std::uint8_t FRAME_CHALLENGE = 5;
inline constexpr std::uint8_t FRAME_PROOF = 6;
inline constexpr std::uint8_t FRAME_REFUSAL = 7;
inline constexpr std::uint16_t ADMISSION_MINOR = 3;
inline constexpr std::uint16_t ACK_MINOR = 4;
inline constexpr std::uint8_t BACKEND_UCX = 3;
inline constexpr std::size_t HELLO_FIXED_SIZE = 24;
inline constexpr std::size_t CLOSE_SIZE = 8;
// A worker address longer than this is refused before anything is allocated for it (UCX's
// are a few hundred bytes; one with many devices a few KiB).
inline constexpr std::size_t MAX_WORKER_ADDRESS = std::size_t{64} << 10U;
inline constexpr std::size_t MAX_CONTROL_FRAME = HELLO_FIXED_SIZE + MAX_WORKER_ADDRESS;
// 3.1: the refusal greeting; 3.2: HEARTBEAT frames, sent only to a 3.2 peer; 3.3: admission;
// 3.4: delivery acknowledgement (the ACKNOWLEDGE flag, ACK messages).
inline constexpr detail::FrameProtocol CONTROL_PROTOCOL{
    "ucx", detail::UCX_CONTROL_MAJOR, ACK_MINOR,
    (1U << FRAME_HELLO) | (1U << FRAME_CLOSE) | (1U << FRAME_HEARTBEAT) | (1U << FRAME_CHALLENGE) |
        (1U << FRAME_PROOF) | (1U << FRAME_REFUSAL)};

struct Hello {
  std::uint8_t mode{};  // 0 tcp, 1 rdma
  std::uint64_t max_message_size{};
  std::uint64_t token{};
  std::span<const std::uint8_t> worker_address;
};
// Greeting, then the HELLO frame: what each side sends first on the control channel.
[[nodiscard]] std::vector<std::uint8_t> encode_opening(const Hello& hello);
// The greeting alone (with admission's flags), and the HELLO frame alone.
[[nodiscard]] detail::Greeting control_greeting(std::uint64_t max_message_size,
                                                std::uint32_t flags = 0);
[[nodiscard]] std::vector<std::uint8_t> encode_control_greeting(std::uint64_t max_message_size,
                                                                std::uint32_t flags);
[[nodiscard]] std::vector<std::uint8_t> encode_hello_frame(const Hello& hello);
// A HELLO frame's message; nullopt (and `error` set) for one that is malformed.
[[nodiscard]] std::optional<Hello> decode_hello(std::span<const std::uint8_t> bytes,
                                                std::string& error);
[[nodiscard]] std::array<std::uint8_t, detail::FRAME_HEADER_SIZE + CLOSE_SIZE> encode_close(
    std::uint64_t sent);
[[nodiscard]] std::optional<std::uint64_t> decode_close(std::span<const std::uint8_t> bytes);

}  // namespace netio3::ucx
